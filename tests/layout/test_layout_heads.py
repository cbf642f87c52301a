"""Heterogeneous TP head slicing, on simulated memory: p prefill TP ranks (times
CP ranks) fill their pools with their heads of a global reference, d decode TP
ranks receive through ``plan_head_transfer``, and every decode rank's pools are
compared byte for byte with its head range of the reference (poison elsewhere).

Memory is simulated as in test_layout_e2e (whose helpers this reuses): a dict of
numpy byte arrays, a buffer's base address ``region_id << 40``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbridge.errors import BufferSpecError, PageRangeError, TopologyError
from kvbridge.layout import BufferDesc, OwnerLanes, TransferPlan
from kvbridge.layout.heads import HeadGeometry, head_slices, plan_head_transfer, rank_heads, slices_to_send
from test_layout_e2e import DST_POISON, REGION_BITS, SRC_STALE, apply_plan

POOLS = ("k", "v")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Case:
    num_heads: int
    head_dim: int
    abi: str
    src_tp: int
    dst_tp: int
    cp: int
    page_size: int
    num_layers: int
    seq_lens: tuple[int, ...]
    seed: int


def valid_tp(num_heads: int) -> list[int]:
    return [t for t in (1, 2, 3, 4, 6, 8) if num_heads % t == 0 or t % num_heads == 0]


@st.composite
def cases(draw) -> Case:
    num_heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
    tps = valid_tp(num_heads)
    bs = draw(st.integers(1, 3))
    return Case(
        num_heads=num_heads,
        head_dim=draw(st.sampled_from([1, 4, 8])),
        abi=draw(st.sampled_from(["float32", "bfloat16", "uint8"])),
        src_tp=draw(st.sampled_from(tps)),
        dst_tp=draw(st.sampled_from(tps)),
        cp=draw(st.integers(1, 2)),
        page_size=draw(st.sampled_from([1, 3, 4, 16])),
        num_layers=draw(st.integers(1, 2)),
        seq_lens=tuple(draw(st.lists(st.integers(1, 40), min_size=bs, max_size=bs))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


class World:
    """CP x p prefill ranks and d decode ranks over one simulated memory."""

    def __init__(self, c: Case) -> None:
        self.c = c
        self.geom = HeadGeometry(c.num_heads, c.head_dim, c.abi)
        rng = np.random.default_rng(c.seed)
        self.lanes = OwnerLanes(c.cp)
        self.num_pages = [-(-n // c.page_size) for n in c.seq_lens]
        self.memory: dict[int, np.ndarray] = {}
        hb = self.geom.head_bytes
        # global reference: (pool, layer) -> per request [tokens, heads, head bytes]
        self.ref = {
            (pool, lid): [rng.integers(0, 256, (n, c.num_heads, hb), dtype=np.uint8) for n in c.seq_lens]
            for pool in POOLS
            for lid in range(c.num_layers)
        }
        self.src_tables, self.src = [], {}
        for r in range(c.cp):
            sizes = [self.lanes.num_local_pages(r, m) for m in self.num_pages]
            capacity = sum(sizes) + 2
            perm = rng.permutation(capacity)
            cuts = np.cumsum([0, *sizes])
            tables = [perm[cuts[q] : cuts[q + 1]] for q in range(len(sizes))]
            self.src_tables.append(tables)
            for t in range(c.src_tp):
                specs, bufs = self._pools(c.src_tp, t, capacity, SRC_STALE)
                self._fill(r, t, tables, specs, bufs)
                self.src[(r, t)] = (specs, bufs)
        self.dst_capacity = sum(self.num_pages) + 3
        perm = rng.permutation(self.dst_capacity)
        cuts = np.cumsum([0, *self.num_pages])
        self.dst_tables = [perm[cuts[q] : cuts[q + 1]] for q in range(len(self.num_pages))]
        self.dst = {j: self._pools(c.dst_tp, j, self.dst_capacity, DST_POISON) for j in range(c.dst_tp)}

    def _pools(self, tp: int, rank: int, capacity: int, fill: int) -> tuple[dict, list[BufferDesc]]:
        specs = {p: self.geom.spec(p, self.c.page_size, range(self.c.num_layers), tp, rank) for p in POOLS}
        bufs = []
        for spec in specs.values():
            for lid in spec.layer_ids:
                region = len(self.memory) + 1
                self.memory[region] = np.full(capacity * spec.bytes_per_page, fill, dtype=np.uint8)
                bufs.append(BufferDesc(spec.name, lid, region << REGION_BITS, capacity, spec.bytes_per_page))
        return specs, bufs

    def _fill(self, r: int, t: int, tables: list, specs: dict, bufs: list[BufferDesc]) -> None:
        """What prefill (cp r, tp t) computed: its heads of the tokens on its owned pages."""
        h0, h1 = rank_heads(self.c.num_heads, self.c.src_tp, t)
        ps = self.c.page_size
        for desc in bufs:
            spec = specs[desc.pool]
            region = self.memory[desc.base >> REGION_BITS]
            for q, n in enumerate(self.c.seq_lens):
                owned = self.lanes.owned_pages(r, self.num_pages[q])
                _, local = self.lanes.owners(owned, self.num_pages[q])
                tok = (owned[:, None] * ps + np.arange(ps)).reshape(-1)
                slot = (tables[q][local][:, None] * ps + np.arange(ps)).reshape(-1)
                keep = tok < n
                heads = self.ref[(desc.pool, desc.layer_id)][q][tok[keep], h0:h1]
                rows = heads.reshape(int(keep.sum()), (h1 - h0) * self.geom.head_bytes)
                spec.write_rows(region, slot[keep], rows)

    def run(self) -> dict[int, list[TransferPlan]]:
        """Every decode rank pulls every head slice of every request from every CP rank."""
        c, plans = self.c, {}
        for j in range(c.dst_tp):
            dst_specs, dst_bufs = self.dst[j]
            plans[j] = []
            for hs in head_slices(self.geom, c.src_tp, c.dst_tp, j):
                for r in range(c.cp):
                    src_specs, src_bufs = self.src[(r, hs.src_rank)]
                    for q, n in enumerate(c.seq_lens):
                        logical = self.lanes.owned_pages(r, self.num_pages[q])
                        _, local = self.lanes.owners(logical, self.num_pages[q])
                        plan = plan_head_transfer(
                            src_specs, dst_specs, hs, src_bufs, dst_bufs, logical,
                            self.src_tables[r][q][local], self.dst_tables[q][logical], n,
                        )
                        apply_plan(self.memory, plan)
                        plans[j].append(plan)
        return plans

    def check(self) -> None:
        """Each decode rank holds exactly its head range of every valid row; poison elsewhere."""
        c, ps = self.c, self.c.page_size
        for j in range(c.dst_tp):
            h0, h1 = rank_heads(c.num_heads, c.dst_tp, j)
            dst_specs, dst_bufs = self.dst[j]
            for desc in dst_bufs:
                spec = dst_specs[desc.pool]
                expect = np.full(self.dst_capacity * spec.bytes_per_page, DST_POISON, dtype=np.uint8)
                for q, n in enumerate(c.seq_lens):
                    tok = np.arange(n)
                    slot = self.dst_tables[q][tok // ps] * ps + tok % ps
                    rows = self.ref[(desc.pool, desc.layer_id)][q][:, h0:h1].reshape(n, -1)
                    spec.write_rows(expect, slot, rows)
                got = self.memory[desc.base >> REGION_BITS]
                diff = np.flatnonzero(got != expect)
                assert not len(diff), f"decode tp {j} pool {desc.pool} layer {desc.layer_id}: byte {diff[0]} differs"


def check_coalescing(w: World, plans: dict[int, list[TransferPlan]]) -> None:
    """Whole-row slices move page runs; strided slices one range per valid row
    per layer and pool; every plan carries exactly the valid bytes."""
    c = w.c
    rows_total = sum(c.seq_lens) * c.num_layers * len(POOLS)
    for j, js in plans.items():
        slices = head_slices(w.geom, c.src_tp, c.dst_tp, j)
        n_slices = sum(p.num_slices for p in js)
        moved = sum(p.num_bytes for p in js)
        assert moved == rows_total * w.geom.row_bytes(c.dst_tp, j)
        if all(s.whole_rows for s in slices):
            assert n_slices <= sum(w.num_pages) * c.num_layers * len(POOLS)
        else:
            assert n_slices == rows_total * len(slices)


@pytest.mark.parametrize(
    "num_heads,src_tp,dst_tp",
    [(4, 1, 2), (4, 2, 1), (4, 2, 4), (2, 2, 4), (2, 1, 8), (2, 4, 1), (4, 4, 8), (2, 2, 2)],
    ids=["p1-d2", "p2-d1", "p2-d4", "p2-d4-replicated", "p1-d8-replicated", "p4-replicated-d1", "p4-d8", "p2-d2"],
)
@pytest.mark.parametrize("cp", [1, 2])
def test_named_cases_land_per_head_slice(num_heads, src_tp, dst_tp, cp):
    c = Case(num_heads, 4, "bfloat16", src_tp, dst_tp, cp, 4, 2, (13, 4, 1), seed=src_tp * 10 + dst_tp)
    w = World(c)
    plans = w.run()
    w.check()
    check_coalescing(w, plans)


@SETTINGS
@given(cases())
@example(Case(4, 8, "float32", 1, 2, 1, 4, 1, (10,), 0))
@example(Case(4, 8, "float32", 2, 1, 2, 4, 1, (10, 7), 1))
@example(Case(4, 8, "float32", 2, 4, 1, 16, 2, (33,), 2))
@example(Case(2, 8, "bfloat16", 1, 8, 2, 3, 1, (11, 1), 3))
def test_any_tp_pair_lands_per_head_slice(c):
    w = World(c)
    plans = w.run()
    w.check()
    check_coalescing(w, plans)


def test_head_ranges_and_replication():
    assert [rank_heads(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [rank_heads(2, 8, r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    for bad in (3, 0):
        with pytest.raises(TopologyError) as err:
            rank_heads(4, bad, 0)
        assert err.value.field == "tp_size"
    with pytest.raises(TopologyError):
        rank_heads(4, 2, 2)


def test_slices_name_sources_offsets_and_widths():
    g = HeadGeometry(num_heads=4, head_dim=8, abi="bfloat16")  # 16 B per head
    (a, b) = head_slices(g, src_tp=2, dst_tp=1, dst_rank=0)
    assert (a.src_rank, a.head_start, a.head_stop, a.src_offset, a.dst_offset, a.nbytes) == (0, 0, 2, 0, 0, 32)
    assert (b.src_rank, b.head_start, b.head_stop, b.src_offset, b.dst_offset, b.nbytes) == (1, 2, 4, 0, 32, 32)
    assert (a.src_row_bytes, a.dst_row_bytes, a.whole_rows) == (32, 64, False)
    (s,) = head_slices(g, src_tp=1, dst_tp=2, dst_rank=1)
    assert (s.src_rank, s.src_offset, s.dst_offset, s.nbytes) == (0, 32, 0, 32)
    assert (s.src_row_bytes, s.dst_row_bytes) == (64, 32)
    (s,) = head_slices(g, src_tp=2, dst_tp=4, dst_rank=3)
    assert (s.src_rank, s.head_start, s.src_offset, s.nbytes) == (1, 3, 16, 16)
    # prefill replicates (tp 8 over 4 heads): decode ranks spread over the replicas
    picks = [[x.src_rank for x in head_slices(g, src_tp=8, dst_tp=2, dst_rank=j)] for j in range(2)]
    assert picks == [[0, 2], [5, 7]]
    assert all(x.whole_rows for x in head_slices(HeadGeometry(2, 8, "bfloat16"), 2, 4, 3))


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 4), (8, 2), (4, 8), (1, 1)])
def test_senders_cover_exactly_what_receivers_draw(src_tp, dst_tp):
    g = HeadGeometry(num_heads=4, head_dim=2, abi="float32")
    drawn = {s for j in range(dst_tp) for s in head_slices(g, src_tp, dst_tp, j)}
    sent = {s for i in range(src_tp) for s in slices_to_send(g, src_tp, dst_tp, i)}
    assert drawn == sent
    for j in range(dst_tp):  # each decode rank's heads exactly once
        heads = [h for s in head_slices(g, src_tp, dst_tp, j) for h in range(s.head_start, s.head_stop)]
        assert heads == list(range(*rank_heads(4, dst_tp, j)))


def test_destination_outside_capacity_fails_before_planning():
    c = Case(4, 4, "float32", 2, 1, 1, 4, 2, (10,), 0)
    w = World(c)
    dst_specs, dst_bufs = w.dst[0]
    hs = head_slices(w.geom, 2, 1, 0)[1]
    src_specs, src_bufs = w.src[(0, hs.src_rank)]
    logical = np.arange(3)
    with pytest.raises(PageRangeError) as err:
        plan_head_transfer(
            src_specs, dst_specs, hs, src_bufs, dst_bufs, logical, w.src_tables[0][0],
            np.array([0, 1, w.dst_capacity]), 10, room=7, rank="p0-tp1",
        )
    assert err.value.field == "dst_pages" and err.value.room == 7 and "layer 0" in str(err.value)


def test_row_width_that_disagrees_with_the_slice_is_refused():
    c = Case(4, 4, "float32", 2, 1, 1, 4, 1, (10,), 0)
    w = World(c)
    hs = head_slices(w.geom, 2, 1, 0)[0]
    src_specs, src_bufs = w.src[(0, 0)]
    dst_specs, dst_bufs = w.dst[0]
    with pytest.raises(BufferSpecError) as err:  # decode registered its tp-2 width by mistake
        plan_head_transfer(src_specs, src_specs, hs, src_bufs, dst_bufs, np.arange(3), np.arange(3), np.arange(3), 10)
    assert err.value.field == "bytes_per_token" and "destination" in str(err.value)
