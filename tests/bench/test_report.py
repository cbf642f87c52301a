"""``kvbridge bench``'s table: a figure not measured for a row (the engine alone on Mooncake, whose
raw run is the engine alone; memcpy on a GPU) prints '-', never nan, and the columns stay aligned."""

from __future__ import annotations

from kvbridge.bench.report import COLUMNS, format_table

META = {"preset": "deepseek-v3.2-fp8", "layers": 4, "draft_layers": 1, "page_size": 64, "engine": "mooncake",
        "reps": 5}


def row(**over):
    r = {"engine": "mooncake", "cp": 1, "alloc": "contiguous", "tokens": 8192, "bytes": 25_000_000,
         "kvbridge_slices": 11, "ideal_slices": 11, "plan_ms": 0.2, "kvbridge_gbps": 1.5, "staged_gbps": 1.1,
         "staged_slices": 4, "raw_gbps": 1.6, "engine_gbps": None, "memcpy_gbps": 9.0, "kvbridge_p50_ms": 16.0,
         "raw_p50_ms": 15.0, "kvbridge_p99_ms": 20.0, "ratio_vs_raw": 0.94, "staged_vs_raw": 0.7,
         "staged_vs_contiguous": None, "ratio_vs_memcpy": 0.17, "verify_errors": [], "kvbridge_failures": []}
    r.update(over)
    return r


def test_a_figure_not_measured_prints_a_dash_not_nan():
    lines = format_table([row(), row(engine="nixl", engine_gbps=1.4, memcpy_gbps=None)], META).splitlines()
    header, body = lines[2], lines[3:5]
    assert "nan" not in "\n".join(lines).lower()
    col = [t for t, _, _ in COLUMNS].index("engine GB/s")
    cells = [b.split() for b in body]
    assert cells[0][col] == "-" and cells[1][col] == "1.400"
    assert all(len(b) == len(header) for b in body)  # '-' padded to the column's width
    assert "raw GB/s is the engine alone" in lines[0]
