"""``kvbridge bench`` in quick form: rows with both ratios, a chart, bytes verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _timing import scaled

from kvbridge.transfer.engine import mooncake_available, nixl_available

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="needs the Mooncake transfer engine")


def test_quick_bench_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = [sys.executable, "-m", "kvbridge.cli.main", "bench", "--quick", "--tokens", "1K", "--cp", "1,2",
            "--layers", "2", "--reps", "2",
            "--alloc", "contiguous,random", "--json", str(out), "--plot", str(png), "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["layers"] == 2 and len(data["rows"]) == 4  # 1K x CP 1, 2 x contiguous, random
    for row in (r for r in data["rows"] if r["alloc"] == "contiguous"):
        assert row["ratio_vs_raw"] > 0 and row["ratio_vs_memcpy"] > 0
        # what kvbridge posted: one run per CP rank (lane-major decode pages) per layer and pool, the plan's
        # slices exactly (decode takes the aux row in the report: no slice of it; ``--aux-written``: + 1)
        assert row["kvbridge_slices"] == row["ideal_slices"] == row["slices"]
    for row in data["rows"]:
        assert row["bytes_verified"] == row["bytes"] and not row["verify_errors"] and not row["kvbridge_failures"]
    for row in data["rows"]:  # the staged method on the same pages: checked, wire pieces counted
        assert row["staged_gbps"] > 0 and row["staged_vs_raw"] > 0 and row["staged_vs_kvbridge"] > 0
        assert 0 < row["staged_slices"] and row["staged_vs_contiguous"] > 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "vs raw" in done.stdout


@pytest.mark.nixl
@pytest.mark.skipif(not nixl_available() and os.environ.get("CI") != "true", reason="NIXL not importable")
def test_bench_rows_of_both_engines_side_by_side(tmp_path):
    """``--engine mooncake,nixl``: one row per engine on the same pages, each with its own raw engine
    (the Mooncake binding; the NIXL agent) beside kvbridge, every room's bytes checked (staged rooms
    over NIXL: tests/transfer/test_staged_rooms.py)."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "kvbridge.cli.main", "bench", "--engine", "mooncake,nixl", "--tokens", "1K",
            "--cp", "1", "--layers", "2", "--reps", "1", "--alloc", "random", "--no-staged", "--json", str(out), "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["engine"] for r in rows] == ["mooncake", "nixl"]
    assert rows[0]["slices"] == rows[1]["slices"] and rows[0]["bytes"] == rows[1]["bytes"]  # the same pages
    for row in rows:
        assert row["raw_gbps"] > 0 and row["ratio_vs_raw"] > 0
        assert row["bytes_verified"] == row["bytes"] and not row["verify_errors"] and not row["kvbridge_failures"]
    assert rows[1]["engine_gbps"] > 0  # kvbridge's NIXL adapter alone on the slices
    table = done.stdout.splitlines()
    assert any(line.split()[:2] == ["nixl", "1"] for line in table), done.stdout  # the engine column


def test_bench_with_the_aux_row_written_posts_one_slice_more(tmp_path):
    """``--aux-written``: decode takes the aux row as a write into its rows (DecodeConfig(aux_inline=
    False)), so kvbridge posts the plan's slices and the row's one; every byte still checked."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "kvbridge.cli.main", "bench", "--tokens", "1K", "--cp", "1", "--layers", "2",
            "--reps", "2", "--alloc", "contiguous", "--no-staged", "--aux-written", "--json", str(out), "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kvbridge_slices"] == row["ideal_slices"] == row["slices"] + 1
    assert row["bytes_verified"] == row["bytes"] and not row["verify_errors"] and not row["kvbridge_failures"]


def test_bench_rooms_in_flight_moves_rooms_at_once_between_processes(tmp_path):
    """``--rooms-in-flight 3``: every rank its own process on Mooncake TCP, CP 2, random pages: beside
    the rooms one at a time, three at once, direct and staged, every room of every turn byte-checked on
    its own decode pages; the table shows the load columns and says how they were timed."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "kvbridge.cli.main", "bench", "--tokens", "1K", "--cp", "2", "--layers", "2",
            "--reps", "1", "--alloc", "random", "--rooms-in-flight", "3", "--verify-every", "--json", str(out),
            "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert data["meta"]["rooms_in_flight"] == 3 and row["rooms_in_flight"] == 3
    assert not row["verify_errors"] and not row["kvbridge_failures"] and row["bytes_verified"] == row["bytes"]
    assert row["rooms_verified"] == 2 * 2 + 2 * 2 * 3  # (warm-up + 1) one at a time, and x 3 at once, per path
    for m in ("kvbridge", "staged"):
        assert row[f"{m}_load_gbps"] > 0 and row[f"{m}_load_room_p50_ms"] > 0
        # every rank alone in its process: its named threads and the whole process, each a share of the load's time
        busy = row[f"{m}_load_busy"]
        assert set(busy) == {"decode", "prefill cp0", "prefill cp1"}, busy
        for rank, threads in busy.items():
            assert {"loop", "commands", "pump", "process", "other"} <= set(threads), (rank, threads)
            assert min(threads.values()) >= 0 and threads["process"] >= max(threads.values()) - 0.002, (rank, threads)
        assert busy["decode"]["loop"] > 0 and busy["prefill cp0"]["commands"] > 0  # decode's loop, prefill's send()
        assert row[f"{m}_load_busiest"].split()[0] in ("decode", "prefill"), row[f"{m}_load_busiest"]
    assert "kvb load GB/s" in done.stdout and "load: 3 rooms at once" in done.stdout
    assert "stg load busiest" in done.stdout


def test_bench_refuses_rooms_in_flight_below_one():
    argv = [sys.executable, "-m", "kvbridge.cli.main", "bench", "--tokens", "1K", "--rooms-in-flight", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 2 and "--rooms-in-flight 0: K must be at least 1" in done.stderr, done.stderr[-2000:]
