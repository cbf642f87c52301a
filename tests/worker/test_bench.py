"""``kvbridge bench`` in quick form: rows with both ratios, a chart, bytes verified."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.transfer.engine import mooncake_available

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="needs the Mooncake transfer engine")


def test_quick_bench_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [sys.executable, "-m", "kvbridge.cli.main", "bench", "--quick", "--tokens", "1K,8K", "--cp", "1,2",
            "--layers", "2", "--reps", "2",
            "--alloc", "contiguous,random", "--json", str(out), "--plot", str(png), "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["layers"] == 2 and len(data["rows"]) == 8
    for row in (r for r in data["rows"] if r["alloc"] == "contiguous"):
        assert row["ratio_vs_raw"] > 0 and row["ratio_vs_memcpy"] > 0
        # what kvbridge posted: one run per CP rank (lane-major decode pages) per layer and pool, + the aux row
        assert row["kvbridge_slices"] == row["ideal_slices"] == row["slices"] + 1
    for row in data["rows"]:
        assert row["bytes_verified"] == row["bytes"] and not row["verify_errors"] and not row["kvbridge_failures"]
    for row in data["rows"]:  # the staged method on the same pages: checked, wire pieces counted
        assert row["staged_gbps"] > 0 and row["staged_vs_raw"] > 0 and row["staged_vs_kvbridge"] > 0
        assert 0 < row["staged_slices"] and row["staged_vs_contiguous"] > 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "vs raw" in done.stdout
