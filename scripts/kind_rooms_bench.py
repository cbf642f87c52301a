"""Rooms of DeepSeek-V4's pools (window, compressed, state) against rooms of V3.2's paged pools,
the GB/s half of ``kvbridge bench --preset deepseek-v4`` on its own (``kvbridge.bench.kinds.
room_rows``): a prefill and a decode endpoint in one process, two transfer engines, a bootstrap
daemon; per length ``--reps`` timed rooms of each model (after one warm-up room), one chunk,
prefill pages ascending, decode pages (and entry pages) shuffled. Reports the bytes each room
posted beside ``needed_bytes`` and the GB/s from the first write posted to the room's success on
prefill (``KVSender.stats``), median, and V4's GB/s over V3.2's.

    .venv/bin/python scripts/kind_rooms_bench.py [--tokens 1K,8K] [--layers 4] [--reps 5] [--engine mooncake]

Host memory; ``--layers`` target layers of each model (V4 + 1 draft window layer, V3.2 fp8
+ its index K + 1 draft layer), page size 64.
"""

from __future__ import annotations

import argparse
import os

import kvbridge as kvb
from kvbridge.bench.kinds import format_rooms, room_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1K,8K")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", default="mooncake")
    args = ap.parse_args()
    lengths = [int(t[:-1]) * 1024 if t.upper().endswith("K") else int(t) for t in args.tokens.split(",")]
    with kvb.start_bootstrap() as (url, token):
        rows = room_rows(args.engine, lengths, args.layers, args.reps, url, token)
    print(format_rooms(rows, args.engine))
    print("load average (1/5/15 min):", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0 if all(r["bytes_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
