"""Micro-benchmark of plan_transfer: one 131,072-token request of the
DeepSeek V3.2 fp8 preset (61 target + 61 index-K + 1 draft layer, page size 64),
planned per CP rank, with contiguous and randomly scattered destination pages.

    .venv/bin/python scripts/plan_bench.py [--tokens N] [--repeat R]

"ideal" is the fewest slices any plan can have: runs of pages consecutive on
both sides x layers, summed over pools.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvbridge.layout import BufferDesc, OwnerLanes, plan_transfer, preset_pools
from kvbridge.layout.pairing import pair_buffers


def buffers(specs: dict, capacity: int, region: int) -> list[BufferDesc]:
    out = []
    for spec in specs.values():
        for lid in spec.layer_ids:
            out.append(BufferDesc(spec.name, lid, region << 40, capacity, spec.bytes_per_page))
            region += 1
    return out


def ideal_slices(src: np.ndarray, dst: np.ndarray, num_layers: int) -> int:
    runs = 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1))) if len(src) else 0
    return runs * num_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131_072)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    specs = preset_pools("deepseek-v3.2-fp8")
    page_size = specs["target"].page_size
    num_pages = -(-args.tokens // page_size)
    num_layers = sum(s.num_layers for s in specs.values())
    capacity = num_pages + 64
    rng = np.random.default_rng(0)
    dst_tables = {"contiguous": 32 + np.arange(num_pages), "scattered": rng.permutation(capacity)[:num_pages]}
    src_bufs, dst_bufs = buffers(specs, capacity, 1), buffers(specs, capacity, 1000)
    # a prefill rank pairs its buffers with a decode peer's once (per peer) and plans with the pairing
    paired = pair_buffers(specs, src_bufs, dst_bufs, tuple(specs))
    print(
        f"plan_transfer: {args.tokens:,} tokens = {num_pages:,} pages x {num_layers} layers "
        f"({', '.join(f'{n} {s.num_layers}' for n, s in specs.items())}), page size {page_size}"
    )
    header = ("cp", "lanes", "dst pages", "rank pages", "slices", "ideal", "GB", "ms/rank", "max ms")
    print("{:>3} {:<12} {:<11} {:>10} {:>9} {:>9} {:>6} {:>8} {:>7}".format(*header))
    for cp_size, rule in ((1, "interleaved"), (4, "interleaved"), (4, "contiguous")):
        lanes = OwnerLanes(cp_size, rule)
        # lane-major: the contiguous block ordered so each rank's pages are consecutive (one run per rank)
        tables = dict(dst_tables, **{"lane-major": 32 + lanes.lane_major(num_pages)})
        for dst_kind, dst_table in tables.items():
            slices = ideal = num_bytes = 0
            times = []
            for rank in range(cp_size):
                logical = lanes.owned_pages(rank, num_pages)
                src = 8 + np.arange(len(logical))  # the rank's local pages, allocated contiguously
                dst = dst_table[logical]
                samples = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    plan = plan_transfer(
                        specs, src_bufs, dst_bufs, logical, src, dst, args.tokens, room=1, rank=f"cp{rank}",
                        paired=paired,
                    )
                    samples.append(time.perf_counter() - t0)
                times.append(statistics.median(samples))
                slices, ideal = plan.num_slices, ideal_slices(src, dst, num_layers)
                num_bytes += plan.num_bytes
                if plan.num_slices != ideal:
                    raise SystemExit(f"cp{rank}: {plan.num_slices} slices, ideal {ideal}")
            print(
                f"{cp_size:>3} {rule:<12} {dst_kind:<11} {len(logical):>10,} {slices:>9,} {ideal:>9,} "
                f"{num_bytes / 1e9:>6.2f} {statistics.mean(times) * 1e3:>8.2f} {max(times) * 1e3:>7.2f}"
            )
    print("slices/ideal: last rank shown; every rank checked equal to its ideal. GB: all ranks together.")


if __name__ == "__main__":
    main()
