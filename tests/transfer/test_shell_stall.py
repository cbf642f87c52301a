"""``KVBRIDGE_STALL_DUMP``: a loop turn that runs past the given seconds has every thread's stack
dumped while it still runs, then a warning with the turn's wall and CPU time (a CI diagnostic for a
process that stood still); unset, the loop arms nothing."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvbridge.transfer import shell
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


def test_a_turn_past_the_bound_dumps_every_threads_stack_and_warns_with_its_cpu_time(monkeypatch, capfd, caplog):
    monkeypatch.setenv(STALL_DUMP_ENV, "0.2")
    with caplog.at_level(logging.WARNING, logger=shell.__name__):
        loop([lambda: None, waits_in_a_named_frame, lambda: None])._run()
    err = capfd.readouterr().err
    assert "Timeout (0:00:00.200000)!" in err and "waits_in_a_named_frame" in err  # dumped while it slept
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("test loop: a loop turn took 0.") and "s of CPU" in warning and STALL_DUMP_ENV in warning


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
