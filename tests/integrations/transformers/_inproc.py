"""An in-process stand-in for the cluster: prefill CP x TP ranks page what they
own, "transfer" applies kvbridge's own plans (``plan_transfer`` /
``plan_head_transfer``) with ``memmove`` between the ranks' pools, and decode
rebuilds the caches from its pages. No network, no endpoints: the plans, the
pages and the model are real.

One prefill run feeds every prefill rank's writer: each CP rank would run the
whole prompt (model mode's honest CP simulation) and compute the same rows, so
running it once per rank would only repeat identical work."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

import kvbridge as kvb
from kvbridge.integrations.transformers import (
    DST_POISON,
    SRC_STALE,
    PageAllocator,
    PagedKV,
    RankWriter,
    RequestCheck,
    cache_geometry,
    check_request,
    compare_pages,
    decode,
    model_pools,
    prefill,
    read_rows,
    rebuild_caches,
    untouched_bytes,
)
from kvbridge.layout import describe_buffer, head_slices, plan_head_transfer, plan_transfer


def memmove_plan(plan: kvb.layout.TransferPlan) -> None:
    for src, dst, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        ctypes.memmove(dst, src, n)


def descs(paged: PagedKV) -> list:
    return [describe_buffer(paged.specs[p], lid, buf) for (p, lid), buf in paged.buffers().items()]


@dataclass
class Run:
    checks: list[RequestCheck]
    src: dict[tuple[int, int], PagedKV]
    dst: list[PagedKV]
    dst_tables: list[np.ndarray]
    prefilled: list = field(default_factory=list)
    geoms: list = field(default_factory=list)


def run_inproc(
    lm,
    prompts: Sequence[Sequence[int]],
    *,
    page_size: int = 4,
    cp: int = 1,
    chunk_size: int | None = None,
    src_tp: int = 1,
    dst_tp: int = 1,
    max_new_tokens: int = 3,
    seed: int = 0,
    corrupt: str | None = None,
) -> Run:
    """``corrupt=POOL`` flips one byte of the first row of the last request's
    first page in that pool of decode rank 0, after the transfer."""
    lanes = kvb.OwnerLanes(cp)
    lens = [len(p) for p in prompts]
    num_pages = [-(-n // page_size) for n in lens]
    # prefill: cp x src_tp ranks; the TP ranks of one CP rank share its page table
    src, src_tables, writers = {}, [], []
    for r in range(cp):
        need = [lanes.num_local_pages(r, m) for m in num_pages]
        alloc = PageAllocator(sum(need) + 3, seed=seed * 31 + r)
        tables = [alloc.allocate(k) for k in need]
        src_tables.append(tables)
        for t in range(src_tp):
            paged = PagedKV(model_pools(lm.model, page_size, src_tp, t), alloc.capacity, fill=SRC_STALE)
            writer = RankWriter(cache_geometry(lm.model, tp_size=src_tp, tp_rank=t), paged, lanes, r)
            for q, n in enumerate(lens):
                writer.add_request(q, n, tables[q])
            src[(r, t)] = paged
            writers.append(writer)
    pre = prefill(lm, prompts, chunk_size=chunk_size, writers=writers)

    # decode: dst_tp ranks sharing one page table per request, poisoned pools
    alloc = PageAllocator(sum(num_pages) + 5, seed=seed * 31 + 17)
    dst_tables = [alloc.allocate(m) for m in num_pages]
    geoms = [cache_geometry(lm.model, tp_size=dst_tp, tp_rank=j) for j in range(dst_tp)]
    dst = [PagedKV(model_pools(lm.model, page_size, dst_tp, j), alloc.capacity, fill=DST_POISON) for j in range(dst_tp)]
    for r in range(cp):
        for q, n in enumerate(lens):
            logical = lanes.owned_pages(r, num_pages[q])
            _, local = lanes.owners(logical, num_pages[q])
            pages = (logical, src_tables[r][q][local], dst_tables[q][logical])
            for j, d in enumerate(dst):
                if src_tp == dst_tp == 1 or geoms[j].kind == "mla":
                    s = src[(r, j % src_tp)]  # MLA rows are replicated across TP: any rank's will do
                    memmove_plan(plan_transfer(d.specs, descs(s), descs(d), *pages, n))
                    continue
                for hs in head_slices(geoms[j].heads, src_tp, dst_tp, j):
                    s = src[(r, hs.src_rank)]
                    memmove_plan(plan_head_transfer(s.specs, d.specs, hs, descs(s), descs(d), *pages, n))
    if corrupt:  # negative control: one flipped byte in a received valid row
        slot = int(dst_tables[-1][0]) * page_size
        dst[0].byte_view(corrupt)[0, slot, 1] ^= 0x01

    full = cache_geometry(lm.model)
    checks = []
    for q, p in enumerate(pre):
        pages_diff = next((x for j, d in enumerate(dst) if (x := compare_pages(geoms[j], d, dst_tables[q], p))), None)
        rows = read_rows(geoms, dst, dst_tables[q], p.num_tokens)
        cache, draft_cache = rebuild_caches(lm, full, rows)
        disagg = decode(lm, cache, draft_cache, p.first_token, p.num_tokens, max_new_tokens)
        coloc = decode(lm, p.cache, p.draft_cache, p.first_token, p.num_tokens, max_new_tokens)
        checks.append(check_request(p, coloc, disagg, pages_diff=pages_diff, poison_diff=None))
    poison = next((x for d in dst if (x := untouched_bytes(d, dst_tables, lens, DST_POISON))), None)
    if poison:
        checks = [dataclasses.replace(c, poison_intact=False, detail=poison) for c in checks]
    return Run(checks=checks, src=src, dst=dst, dst_tables=dst_tables, prefilled=pre, geoms=geoms)
