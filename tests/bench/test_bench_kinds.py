"""``kvbridge bench --preset deepseek-v4``: the plans of a V4 room move exactly the bytes decode
needs at every length (full size, descriptor-only buffers), a fraction of V3.2's; the speed
rows run through a real engine pair and move what the plans say."""

from __future__ import annotations

import pytest

from kvbridge.bench.kinds import byte_rows, format_bytes, format_speed, speed_rows


def test_v4_rooms_move_what_decode_needs_at_full_size():
    rows = byte_rows([1000, 1024, 8191, 131072])
    for r in rows:
        assert r["v4_moved"] == r["v4_needed"] == r["v4_window"] + r["v4_compressed"] + r["v4_state"]
        assert r["v32_moved"] == r["v32_needed"]
        assert r["v4_fp8_moved"] == r["v4_fp8_needed"] < r["v4_needed"]  # fp8: padded pages, padding not moved
    assert rows[-1]["ratio"] < 0.1 and rows[-1]["ratio_fp8"] < 0.1
    assert "131072" in format_bytes(rows)


@pytest.mark.parametrize("engine", ["local"])
def test_speed_rows_write_the_planned_bytes(engine):
    rows = speed_rows(engine, [300], layers=2, reps=1)
    assert [r["model"] for r in rows] == ["deepseek-v4", "deepseek-v3.2"]
    assert all(r["bytes"] > 0 and r["gbps"] > 0 for r in rows)
    assert "deepseek-v4" in format_speed(rows, engine)


def test_room_rows_move_what_decode_needs_through_the_rooms(daemon):
    """``kvbridge bench --preset deepseek-v4``'s GB/s rows: real room endpoints (local engines here),
    each room's posted bytes checked against what decode needs, V4's GB/s over V3.2's."""
    from kvbridge.bench.kinds import format_rooms, room_rows

    rows = room_rows("local", [300], layers=1, reps=1, url=daemon.url)
    assert [r["model"] for r in rows] == ["deepseek-v4", "deepseek-v3.2-fp8"]
    assert all(r["bytes_equal"] and r["bytes"] == r["needed"] > 0 and r["gbps"] > 0 for r in rows)
    assert rows[0]["per_byte"] == round(rows[0]["gbps"] / rows[1]["gbps"], 3)
    assert "deepseek-v4" in format_rooms(rows, "local")


def test_the_1m_row_comes_from_the_layout():
    from kvbridge.bench.kinds import byte_rows, layout_row

    one_m = layout_row(1 << 20)
    assert one_m["ratio"] == one_m["v4_needed"] / one_m["v32_needed"] < 0.1
    planned = byte_rows([8192])[0]  # the layout's figure is the plans' at a length both can do
    row = layout_row(8192)
    assert row["v4_needed"] == planned["v4_moved"] and row["v32_needed"] == planned["v32_moved"]
    assert row["v4_fp8_needed"] == planned["v4_fp8_moved"] and row["v32_fp8_needed"] == planned["v32_fp8_needed"]


def test_split_rooms_run_decode_in_its_own_process(daemon):
    """``--split`` (the layout ``--device cuda:N`` runs, here in host memory): decode's endpoints in a
    process of their own over real Mooncake (TCP, loopback); every room's bytes equal what decode
    needs, decode's own room time beside prefill's, and its process gone afterwards."""
    import os

    from kvbridge.bench.kinds import format_rooms, room_rows

    rows = room_rows("mooncake", [300], layers=1, reps=1, url=daemon.url, split=True)
    assert [r["model"] for r in rows] == ["deepseek-v4", "deepseek-v3.2-fp8"]
    assert all(r["bytes_equal"] and r["bytes"] == r["needed"] > 0 and r["split"] for r in rows)
    pid = rows[0]["decode_pid"]
    assert pid == rows[1]["decode_pid"] != os.getpid()
    assert all(r["decode_ms"] > 0 and r["decode_gbps"] > 0 for r in rows)
    assert rows[0]["decode_per_byte"] == round(rows[0]["decode_gbps"] / rows[1]["decode_gbps"], 3)
    assert f"decode ran in process {pid}" in format_rooms(rows, "mooncake")
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)


@pytest.mark.parametrize(("argv", "named"), [
    (["--device", "cuda:0", "--no-split"], "--no-split"),  # one process cannot read its own GPU memory
    (["--device", "cuda:0"], "no CUDA device here"),  # the GPU form on a host without CUDA
    (["--engine", "ipc"], "--engine ipc"),  # IPC moves GPU memory only
])
def test_v4_bench_refuses_what_cannot_run_by_name(argv, named, monkeypatch, capsys):
    import torch

    from kvbridge.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--preset", "deepseek-v4", "--tokens", "300", *argv]) == 2
    assert named in capsys.readouterr().err
