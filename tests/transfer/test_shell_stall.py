"""``KVBRIDGE_STALL_DUMP``: a loop turn that runs past the given seconds has every thread's stack
dumped while it still runs, then a warning with the turn's wall and CPU time (a CI diagnostic for a
process that stood still); unset, the loop arms nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvbridge.transfer.shell import STALL_DUMP_ENV, EndpointShell, stall_dump_s


def loop(steps) -> EndpointShell:  # noqa: ANN001
    """A shell with only what ``_run`` reads: a stop flag, a name and the turns ``steps`` gives."""
    sh = object.__new__(EndpointShell)
    sh._stop, sh._loop_name = threading.Event(), "test loop"
    turns = iter(steps)

    def step() -> None:
        turn = next(turns, None)
        if turn is None:
            sh._stop.set()
        else:
            turn()

    sh._step = step
    return sh


def waits_in_a_named_frame() -> None:
    time.sleep(0.6)


def test_a_turn_past_the_bound_dumps_every_threads_stack_and_warns_with_its_cpu_time():
    """In a fresh interpreter: faulthandler dumps at most 100 threads, and a test process may hold
    more (the suite's leftover engine threads), which would leave the loop's own stack out."""
    code = f"""
import logging, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from test_shell_stall import loop, waits_in_a_named_frame
loop([lambda: None, waits_in_a_named_frame, lambda: None])._run()
"""
    env = {**os.environ, STALL_DUMP_ENV: "0.2", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Timeout (0:00:00.200000)!" in done.stderr and "waits_in_a_named_frame" in done.stderr  # while it slept
    warnings = [line for line in done.stdout.splitlines() if "a loop turn took" in line]  # (a loaded host: maybe more)
    assert any(re.fullmatch(rf"test loop: a loop turn took \d+\.\ds, in which the process used \d+\.\ds of CPU "
                            rf"\({STALL_DUMP_ENV} set: every thread's stack is above\)", w) for w in warnings), warnings


def test_unset_or_bad_values_arm_nothing(monkeypatch, capfd):
    for value in (None, "", "0", "-1", "soon"):
        if value is None:
            monkeypatch.delenv(STALL_DUMP_ENV, raising=False)
        else:
            monkeypatch.setenv(STALL_DUMP_ENV, value)
        assert stall_dump_s() is None
    monkeypatch.setenv(STALL_DUMP_ENV, "2.5")
    assert stall_dump_s() == pytest.approx(2.5)
    monkeypatch.delenv(STALL_DUMP_ENV)
    loop([waits_in_a_named_frame])._run()  # (no bound: no dump, however long the turn)
    assert "Timeout" not in capfd.readouterr().err
