"""scripts/freeze_watch.py, the vLLM suite's host-stall watcher: a real watcher process stopped
(SIGSTOP) for a while reports one gap of about that long with the kernel's counters over it, ends
on its stdin's EOF, and its lines are read back by the span they overlap."""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "freeze_watch.py"


def _module():
    spec = importlib.util.spec_from_file_location("freeze_watch_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wait_for(path: Path, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = path.read_text() if path.exists() else ""
        if text in body:
            return body
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} within {timeout}s: {body!r}")


def test_a_stopped_watcher_reports_the_gap_and_ends_on_eof(tmp_path):
    out = tmp_path / "watch.log"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--every", "0.1", "--gap", "0.8", "--out", str(out)],
                            stdin=subprocess.PIPE)
    try:
        _wait_for(out, "waking every 0.1 s")
        before = time.time()
        os.kill(proc.pid, signal.SIGSTOP)  # this process alone stands still: the host does not
        time.sleep(2.0)
        os.kill(proc.pid, signal.SIGCONT)
        body = _wait_for(out, "gap ")
        proc.stdin.close()
        assert proc.wait(15) == 0  # EOF ends it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # (a loaded host may delay a wake-up past 0.8 s now and then: the stop's gap is the one over 1.5 s)
    (line,) = [x for x in body.splitlines() if x.startswith("gap ") and float(x.split()[1]) > 1.5]
    words = line.split()
    assert 1.9 <= float(words[1]) < 30, line
    ended = dt.datetime.fromisoformat(words[4]).timestamp()
    assert before + 1.5 <= ended <= time.time(), line
    if Path("/proc/stat").exists():
        assert " steal " in line and " iowait " in line, line
    if Path("/proc/pressure/cpu").exists():
        assert "psi-some cpu " in line, line
    mod = _module()
    assert line in mod.gaps(out)
    assert line in mod.gaps(out, before, before + 0.5)  # overlaps: the gap began before before + 0.5
    assert line not in mod.gaps(out, ended + 1, ended + 60)  # after it
    assert line not in mod.gaps(out, 0, before - 10)  # before it
    assert mod.gaps(tmp_path / "missing.log") == []


def test_lines_that_are_not_gaps_are_skipped(tmp_path):
    log = tmp_path / "watch.log"
    log.write_text("freeze_watch: pid 1, waking every 0.25 s, reporting gaps over 3 s\n"
                   "gap x s ending nowhere\n"
                   "gap 4.00 s ending 2026-12-07T00:00:10.000 steal 0.00\n")
    mod = _module()
    assert mod.gaps(log) == ["gap 4.00 s ending 2026-12-07T00:00:10.000 steal 0.00"]


@pytest.mark.parametrize("args", [["--every", "0"], ["--every", "1", "--gap", "0.5"]])
def test_values_that_cannot_watch_are_refused(args):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--gap larger than --every" in proc.stderr
