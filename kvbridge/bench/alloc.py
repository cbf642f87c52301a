"""Where a request's pages live on both sides, as an engine's page allocator would put them.

    contiguous   prefill rank r: local pages 0 .. n_r-1 (its owned logical pages, ascending);
                 decode: one block, lane-major (each CP rank's pages consecutive: one run per
                 rank) or in logical order (page_ids[l] = l)
    random       both sides take pages off a shuffled free list: the state of a pool after
                 some traffic, every page its own slice

Pure numpy, deterministic in ``seed``: every process of a bench (and raw Mooncake)
derives the same pages, so all methods move exactly the same slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.layout import OwnerLanes

ALLOCS = ("contiguous", "random")
DST_ORDERS = ("lane-major", "logical")


@dataclass(frozen=True)
class Allocation:
    page_ids: np.ndarray  # decode page of each logical page
    owned: list[np.ndarray]  # per CP rank: its owned logical pages, ascending
    local: list[np.ndarray]  # per CP rank: the local page holding each of them

    def for_rank(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        return self.owned[rank], self.local[rank]


def allocate(alloc: str, num_pages: int, lanes: OwnerLanes, src_capacity: int, dst_capacity: int,
             dst_order: str = "lane-major", seed: int = 0) -> Allocation:
    """Pages of one request of ``num_pages`` pages; capacities are the pools' page counts."""
    if alloc not in ALLOCS:
        raise ValueError(f"alloc must be one of {ALLOCS}, got {alloc!r}")
    if dst_order not in DST_ORDERS:
        raise ValueError(f"dst_order must be one of {DST_ORDERS}, got {dst_order!r}")
    if num_pages > dst_capacity:
        raise ValueError(f"{num_pages} pages do not fit a decode pool of {dst_capacity}")
    owned = [lanes.owned_pages(r, num_pages).astype(np.int64) for r in range(lanes.cp_size)]
    if any(o.size > src_capacity for o in owned):
        raise ValueError(f"a rank owns more than its pool's {src_capacity} pages")
    if alloc == "contiguous":
        local = [np.arange(o.size, dtype=np.int64) for o in owned]
        page_ids = (lanes.lane_major(num_pages) if dst_order == "lane-major" else np.arange(num_pages))
        return Allocation(np.asarray(page_ids, dtype=np.int64), owned, local)
    rng = np.random.default_rng(seed)
    local = [rng.permutation(src_capacity)[:o.size].astype(np.int64) for o in owned]
    return Allocation(rng.permutation(dst_capacity)[:num_pages].astype(np.int64), owned, local)
