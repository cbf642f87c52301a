"""scripts/control_bench.py (the README's figure for the control path in one process) runs
and reports rooms that reached Success; scripts/control_rtt.py (the README's figures for one
control hop, kvbridge's channel and ZMQ) runs against its echo processes."""

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


def test_control_rtt_reports_both_round_trips_of_both_channels():
    """ZMQ is an optional comparison (kvbridge does not depend on pyzmq): without it the script
    says it skipped it."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "control_rtt.py"), "--rounds", "100", "--idle-ms", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    try:
        import zmq  # noqa: F401
    except ImportError:
        assert len(lines) == 3 and lines[2].startswith("ZMQ round trip: skipped (pyzmq is not installed")
        pairs = [("kvbridge channel", lines[0], lines[1])]
    else:
        assert len(lines) == 4
        pairs = [("kvbridge channel", lines[0], lines[1]), ("ZMQ", lines[2], lines[3])]
    for name, hot, idle in pairs:
        assert hot.startswith(name) and idle.startswith(name)
        assert "back to back: p50" in hot and "after 1 ms idle: p50" in idle
        assert "(100 round trips)" in hot and "(50 round trips)" in idle
