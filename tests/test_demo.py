"""``kvbridge demo`` end to end: real processes on loopback, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.transfer.engine import mooncake_available

needs_mooncake = pytest.mark.skipif(not mooncake_available(), reason="needs the Mooncake transfer engine")


@needs_mooncake
def test_demo_json_cp2_decode_tp2():
    argv = [sys.executable, "-m", "kvbridge.cli.main", "demo", "--json", "--no-progress", "--requests", "6",
            "--tokens", "100,700,1500", "--layers", "2", "--cp", "2", "--decode-ranks", "2", "--chunk-tokens", "512"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    summary = json.loads(done.stdout)
    assert summary["requests"] == 6 and summary["rooms_ok"] == 6 and summary["rooms_failed"] == 0
    assert summary["bytes_verified"] == summary["bytes_moved"] > 0
    # two decode ranks each receive the full KV of every room: target + index (2 layers) + draft (1 layer)
    per_token = 2 * (656 + 132) + 656
    assert summary["bytes_moved"] == 2 * per_token * 2 * (100 + 700 + 1500)
    for key in ("gbps", "p50_ms", "p99_ms"):
        assert summary[key] > 0
    codes = summary["exit_codes"]
    assert len(codes) == 5 and set(codes.values()) == {0}, codes  # every process drains cleanly on SIGTERM


def test_demo_local_engine_runs_ranks_as_threads():
    argv = [sys.executable, "-m", "kvbridge.cli.main", "demo", "--json", "--no-progress", "--engine", "local",
            "--requests", "4", "--tokens", "64,65,1000", "--layers", "1", "--preset", "deepseek-v3.2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    summary = json.loads(done.stdout)
    assert summary["rooms_ok"] == 4 and summary["bytes_verified"] == summary["bytes_moved"] > 0
