"""End to end on simulated memory: CP-sharded prefill pools -> plans -> decode
pools, compared byte for byte with a colocated reference (hard rules 1, 2, 3, 5, 8).

Memory is a dict of numpy byte arrays; a buffer's base address is
``region_id << 40``, so a plan's addresses decode to (region, offset)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbridge.errors import PageRangeError
from kvbridge.layout import (
    LANE_RULES,
    BufferDesc,
    OwnerLanes,
    TransferPlan,
    build_rank_rows,
    deepseek_pools,
    local_row_order,
    plan_transfer,
    strip_padding,
)

REGION_BITS = 40
SRC_DUMMY = 0xAA  # padding rows the prefill ranks compute
SRC_STALE = 0xC3  # prefill pool bytes nobody wrote
DST_POISON = 0x55  # decode pool before the transfer
PAGE_SIZES = (1, 2, 4, 16, 64)
# physical page allocation per request: one ascending range, one descending range, scattered
ALLOCS = ("contiguous", "descending", "scattered")

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Scenario:
    specs: dict
    lanes: OwnerLanes
    seq_lens: list[int]
    static: list[int]
    page_size: int
    seed: int
    src_alloc: str
    dst_alloc: str
    page_order: str


@st.composite
def scenarios(draw, max_len: int = 600) -> Scenario:
    bs = draw(st.integers(1, 4))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    specs = deepseek_pools(
        num_layers=draw(st.integers(1, 3)),
        page_size=page_size,
        kv_dtype=draw(st.sampled_from(["bf16", "fp8"])),
        index=True,
        draft_layers=1,
    )
    return Scenario(
        specs=specs,
        lanes=OwnerLanes(draw(st.integers(1, 4)), draw(st.sampled_from(LANE_RULES))),
        seq_lens=draw(st.lists(st.integers(1, max_len), min_size=bs, max_size=bs)),
        static=draw(st.lists(st.integers(0, 5), min_size=bs, max_size=bs)),
        page_size=page_size,
        seed=draw(st.integers(0, 2**32 - 1)),
        src_alloc=draw(st.sampled_from(ALLOCS)),
        dst_alloc=draw(st.sampled_from(ALLOCS)),
        page_order=draw(st.sampled_from(["ascending", "descending", "shuffled"])),
    )


def buffers(specs: dict, memory: dict, capacity: int, fill: int) -> list[BufferDesc]:
    """One region per (pool, layer), registered in memory."""
    descs = []
    for spec in specs.values():
        for lid in spec.layer_ids:
            region = len(memory) + 1
            memory[region] = np.full(capacity * spec.bytes_per_page, fill, dtype=np.uint8)
            descs.append(BufferDesc(spec.name, lid, region << REGION_BITS, capacity, spec.bytes_per_page))
    return descs


def region_of(memory: dict, desc: BufferDesc) -> np.ndarray:
    return memory[desc.base >> REGION_BITS]


def page_tables(rng: np.random.Generator, sizes: list[int], capacity: int, alloc: str) -> list[np.ndarray]:
    """Physical pages per request (``ALLOCS``); a descending range sent in
    descending logical order puts the partial last page *before* a page that is
    consecutive with it on both sides."""
    order = rng.permutation(capacity) if alloc == "scattered" else np.arange(capacity)
    cuts = np.cumsum([0, *sizes])
    tables = [order[cuts[q] : cuts[q + 1]] for q in range(len(sizes))]
    return [t[::-1].copy() for t in tables] if alloc == "descending" else tables


def reference_write(spec, region: np.ndarray, table: np.ndarray, rows: np.ndarray) -> None:
    """Colocated reference, written from DESIGN.md's byte layout, not through kvbridge."""
    ps, bpp, tokens = spec.page_size, spec.bytes_per_page, np.arange(len(rows))
    page_start = table[tokens // ps] * bpp
    offset = tokens % ps
    if spec.layout == "rows":
        idx = (page_start + offset * spec.bytes_per_token)[:, None] + np.arange(spec.bytes_per_token)
        region[idx] = rows
        return
    v, s = spec.value_bytes_per_token, spec.scale_bytes_per_token
    region[(page_start + offset * v)[:, None] + np.arange(v)] = rows[:, :v]
    region[(page_start + ps * v + offset * s)[:, None] + np.arange(s)] = rows[:, v:]


def expected_flat(sc: Scenario, rank: int, rows_per_req: list[np.ndarray]) -> np.ndarray:
    """A rank's flat row tensor built by hand: per request in batch order, owned
    valid rows, then compute padding, then static padding (rank-local bases)."""
    cp, ps = sc.lanes.cp_size, sc.page_size
    parts = []
    for q, (n, rows) in enumerate(zip(sc.seq_lens, rows_per_req)):
        num_pages = -(-n // ps)
        chunk = -(-num_pages // cp)
        base, rem = divmod(num_pages, cp)
        owner = {
            "interleaved": np.arange(num_pages) % cp,
            "contiguous": np.arange(num_pages) // chunk,
            "balanced": np.repeat(np.arange(cp), [base + (r < rem) for r in range(cp)]),
        }
        owned = [p for p in range(num_pages) if owner.get(sc.lanes.rule, np.zeros(num_pages))[p] == rank]
        tokens = [t for p in owned for t in range(p * ps, min((p + 1) * ps, n))]
        pad = (ps - n % ps) % ps if owned and owned[-1] == num_pages - 1 else 0
        parts.append(rows[tokens])
        parts.append(np.full((pad + sc.static[q], rows.shape[1]), SRC_DUMMY, dtype=np.uint8))
    return np.concatenate(parts)


def apply_plan(memory: dict, plan: TransferPlan) -> None:
    mask = (1 << REGION_BITS) - 1
    for src, dst, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        s_mem, d_mem = memory[src >> REGION_BITS], memory[dst >> REGION_BITS]
        s_off, d_off = src & mask, dst & mask
        assert 0 < n and s_off + n <= len(s_mem) and d_off + n <= len(d_mem), "slice outside its region"
        d_mem[d_off : d_off + n] = s_mem[s_off : s_off + n]


class World:
    """Prefill CP ranks with their local pools filled by a simulated forward
    pass; a decode pool; and the colocated reference."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        rng = np.random.default_rng(sc.seed)
        ps, lanes = sc.page_size, sc.lanes
        self.num_pages = [-(-n // ps) for n in sc.seq_lens]
        self.memory: dict[int, np.ndarray] = {}
        # global rows per (pool, layer), per request: what an unsharded model would compute
        self.rows = {
            (spec.name, lid): [rng.integers(0, 256, (n, spec.bytes_per_token), dtype=np.uint8) for n in sc.seq_lens]
            for spec in sc.specs.values()
            for lid in spec.layer_ids
        }
        self.rank_tables, self.rank_bufs = [], []
        for rank in range(lanes.cp_size):
            sizes = [lanes.num_local_pages(rank, m) for m in self.num_pages]
            capacity = sum(sizes) + 2
            tables = page_tables(rng, sizes, capacity, sc.src_alloc)
            bufs = buffers(sc.specs, self.memory, capacity, SRC_STALE)
            self._forward(rank, tables, bufs)
            self.rank_tables.append(tables)
            self.rank_bufs.append(bufs)
        self.dst_capacity = sum(self.num_pages) + 3
        self.dst_tables = page_tables(rng, self.num_pages, self.dst_capacity, sc.dst_alloc)
        self.dst_bufs = buffers(sc.specs, self.memory, self.dst_capacity, DST_POISON)
        self.reference = {d: np.full_like(region_of(self.memory, d), DST_POISON) for d in self.dst_bufs}
        for d in self.dst_bufs:
            spec = sc.specs[d.pool]
            for q, rows in enumerate(self.rows[(d.pool, d.layer_id)]):
                reference_write(spec, self.reference[d], self.dst_tables[q], rows)
        self.order_rng = random.Random(sc.seed)

    def _forward(self, rank: int, tables: list[np.ndarray], bufs: list[BufferDesc]) -> None:
        sc = self.sc
        order = local_row_order(rank, sc.seq_lens, sc.page_size, sc.lanes, tables, sc.static)
        for desc in bufs:
            spec = sc.specs[desc.pool]
            flat = build_rank_rows(self.rows[(desc.pool, desc.layer_id)], order, fill=SRC_DUMMY)
            assert np.array_equal(flat, expected_flat(sc, rank, self.rows[(desc.pool, desc.layer_id)]))
            region = region_of(self.memory, desc)
            spec.write_rows(region, order.slots, strip_padding(flat, order.domains))
            # the kernel works on whole pages: compute-padding rows land in the partial page's tail
            for q, (dom, base) in enumerate(zip(order.domains, order.bases)):
                if dom.num_compute_padding:
                    _, local = sc.lanes.owners(np.array([self.num_pages[q] - 1]), self.num_pages[q])
                    tail = np.arange(sc.page_size - dom.num_compute_padding, sc.page_size)
                    slots = tables[q][local[0]] * sc.page_size + tail
                    pad_rows = flat[base + dom.num_valid : base + dom.num_valid + dom.num_compute_padding]
                    spec.write_rows(region, slots, pad_rows)

    def mapping(self, rank: int, q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logical, src, dst) pages that ``rank`` sends for request ``q``."""
        owned = self.sc.lanes.owned_pages(rank, self.num_pages[q])
        if self.sc.page_order == "descending":
            owned = owned[::-1].copy()
        elif self.sc.page_order == "shuffled":
            owned = np.array(self.order_rng.sample(list(owned), len(owned)), dtype=np.int64)
        _, local = self.sc.lanes.owners(owned, self.num_pages[q])
        return owned, self.rank_tables[rank][q][local], self.dst_tables[q][owned]

    def plan(self, rank: int, q: int, src=None, dst=None) -> TransferPlan:
        logical, src_pages, dst_pages = self.mapping(rank, q)
        dst_bufs = list(self.dst_bufs)
        self.order_rng.shuffle(dst_bufs)  # pairing is by (pool, layer id), never by position
        return plan_transfer(
            self.sc.specs,
            self.rank_bufs[rank],
            dst_bufs,
            logical,
            src_pages if src is None else src,
            dst_pages if dst is None else dst,
            self.sc.seq_lens[q],
            room=q,
            rank=f"cp{rank}",
        )


def _pinned(rule: str, cp: int, ps: int, seq_lens: list[int], alloc: str, page_order: str) -> Scenario:
    specs = deepseek_pools(num_layers=2, page_size=ps, kv_dtype="fp8", index=True, draft_layers=1)
    return Scenario(specs, OwnerLanes(cp, rule), seq_lens, [1] * len(seq_lens), ps, 7, alloc, alloc, page_order)


@SETTINGS
@given(scenarios())
# the partial last page sent first, followed by a page consecutive with it on both sides
@example(_pinned("interleaved", 1, 4, [10, 7], "descending", "descending"))
@example(_pinned("contiguous", 2, 16, [100, 33], "descending", "descending"))
# the partial page at the end of a long run (rows: merges; values_then_scales: own slices)
@example(_pinned("replicated", 3, 2, [9, 1, 5], "contiguous", "ascending"))
def test_disaggregated_equals_colocated(sc: Scenario) -> None:
    world = World(sc)
    sent = [np.zeros(m, dtype=int) for m in world.num_pages]
    for rank in range(sc.lanes.cp_size):
        for q in range(len(sc.seq_lens)):
            logical, _, _ = world.mapping(rank, q)
            sent[q][logical] += 1
            apply_plan(world.memory, world.plan(rank, q))
    assert all((s == 1).all() for s in sent), "every logical page is sent by exactly one CP rank"
    for d in world.dst_bufs:
        got = region_of(world.memory, d)
        assert np.array_equal(got, world.reference[d]), f"decode pool {d.pool} layer {d.layer_id} differs"


@SETTINGS
@given(scenarios(max_len=200), st.sampled_from(["dst_over", "dst_negative", "src_over"]), st.data())
def test_out_of_range_pages_refused_and_nothing_written(sc: Scenario, fault: str, data) -> None:
    world = World(sc)
    senders = [(r, q) for r in range(sc.lanes.cp_size) for q in range(len(sc.seq_lens)) if len(world.mapping(r, q)[0])]
    rank, q = data.draw(st.sampled_from(senders))
    logical, src, dst = world.mapping(rank, q)
    i = data.draw(st.integers(0, len(logical) - 1))
    src, dst = src.copy(), dst.copy()
    if fault == "dst_over":
        dst[i] = world.dst_capacity + data.draw(st.integers(0, 5))
        bad, cap = dst[i], world.dst_capacity
    elif fault == "dst_negative":
        dst[i] = -1
        bad, cap = -1, world.dst_capacity
    else:
        src[i] = world.rank_bufs[rank][0].capacity_pages + data.draw(st.integers(0, 5))
        bad, cap = src[i], world.rank_bufs[rank][0].capacity_pages
    before = {k: v.copy() for k, v in world.memory.items()}
    with pytest.raises(PageRangeError) as info:
        world.plan(rank, q, src=src, dst=dst)
    message = str(info.value)
    assert f"room={q}" in message and f"rank=cp{rank}" in message
    assert f"page {bad} " in message and f"{cap} pages" in message and "pool '" in message and "layer" in message
    assert all(np.array_equal(before[k], world.memory[k]) for k in before)
