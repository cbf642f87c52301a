"""scripts/control_bench.py (the README's figure for the control path in one process) runs
and reports rooms that reached Success."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "control_bench.py"


def test_control_bench_runs_rooms_to_success():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cp", "2", "--pages", "3", "--rooms", "5"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cp 2, 3 pages" in done.stdout and "receiver() -> Success p50" in done.stdout
