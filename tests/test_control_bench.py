"""scripts/control_bench.py (the README's figure for the control path in one process) runs
and reports rooms that reached Success; scripts/zmq_rtt.py (the README's figure for one
control hop) runs against its echo process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_control_bench_runs_rooms_to_success():
    done = subprocess.run([sys.executable, str(SCRIPTS / "control_bench.py"), "--cp", "2", "--pages", "3", "--rooms",
                           "5", "--gap-ms", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cp 2, 3 pages" in done.stdout and "1 ms idle before each" in done.stdout
    assert "receiver() -> Success p50" in done.stdout


def test_zmq_rtt_reports_both_round_trips():
    done = subprocess.run([sys.executable, str(SCRIPTS / "zmq_rtt.py"), "--rounds", "100", "--idle-ms", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and "back to back: p50" in lines[0] and "after 1 ms idle: p50" in lines[1]
    assert "(100 round trips)" in lines[0] and "(50 round trips)" in lines[1]
