"""Pool kinds (kvbridge.layout.kinds): what decode needs of a window, compressed and state
pool, and plans that move exactly that (hard rules 1 and 5 per kind), executed on numpy
regions and compared byte for byte against what a colocated decode would read."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvbridge.errors import LayoutError, PageRangeError, PairingError
from kvbridge.layout import BufferDesc, PoolSpec
from kvbridge.layout.kinds import (
    Extent,
    chunk_extent,
    needed_bytes,
    needed_extent,
    plan_kind,
    state_slices,
    state_tp_spec,
    tail_tokens,
)

REGION = 40  # address = region id << REGION | offset
SENTINEL = 0xEE


class Memory:
    """Numpy regions addressed like registered buffers."""

    def __init__(self) -> None:
        self.regions: dict[int, np.ndarray] = {}

    def buffers(self, spec: PoolSpec, capacity: int, fill: int | None = None, seed: int = 0) -> list[BufferDesc]:
        rng = np.random.default_rng(seed)
        out = []
        for lid in spec.layer_ids:
            rid = len(self.regions) + 1
            data = (np.full(capacity * spec.bytes_per_page, fill, np.uint8) if fill is not None
                    else rng.integers(0, 256, capacity * spec.bytes_per_page, dtype=np.uint8))
            self.regions[rid] = data
            out.append(BufferDesc(spec.name, lid, rid << REGION, capacity, spec.bytes_per_page))
        return out

    def region(self, desc: BufferDesc) -> np.ndarray:
        return self.regions[desc.base >> REGION]

    def apply(self, plan) -> None:
        mask = (1 << REGION) - 1
        for src, dst, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
            s, d = self.regions[src >> REGION], self.regions[dst >> REGION]
            so, do = src & mask, dst & mask
            assert n > 0 and so + n <= len(s) and do + n <= len(d), "slice outside its region"
            d[do : do + n] = s[so : so + n]


def window_spec(**kw) -> PoolSpec:
    base = dict(name="swa", dtype="bfloat16", abi="bfloat16", bytes_per_token=8, page_size=4, layer_ids=(0, 1),
                kind="window", window=10)
    return PoolSpec(**{**base, **kw})


def compressed_spec(ratio: int = 4, **kw) -> PoolSpec:
    base = dict(name=f"c{ratio}", dtype="bfloat16", abi="bfloat16", bytes_per_token=6, page_size=4, layer_ids=(0, 2),
                kind="compressed", ratio=ratio)
    return PoolSpec(**{**base, **kw})


def state_spec(**kw) -> PoolSpec:
    base = dict(name="conv", dtype="float32", abi="float32", bytes_per_token=16 * 4, page_size=1, layer_ids=(1,),
                kind="state", shard_units=(8, 4, 4), unit_bytes=4)
    return PoolSpec(**{**base, **kw})


def token_rows(spec: PoolSpec, rows: np.ndarray, mem: Memory, bufs, pages: np.ndarray) -> None:
    """Write the pool's logical rows (per layer) into its pages like a kernel: row r on
    page pages[r // ps], offset r % ps."""
    for j, desc in enumerate(bufs):
        slots = pages[np.arange(len(rows[j])) // spec.page_size] * spec.page_size + np.arange(len(rows[j])) % spec.page_size
        spec.write_rows(mem.region(desc), slots, rows[j])


# --- specs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, field", [
    (dict(kind="window"), "window"),
    (dict(kind="window", window=8, ring_stride=6), "ring_stride"),
    (dict(kind="paged", ratio=4), "ratio"),
    (dict(kind="compressed"), "ratio"),
    (dict(kind="window", window=4, ratio=4), "ratio"),
    (dict(kind="sliding"), "kind"),
    (dict(kind="paged", window=4), "window"),
])
def test_kind_fields_are_checked_by_name(kw, field):
    with pytest.raises(LayoutError) as err:
        PoolSpec(name="p", dtype="bfloat16", abi="bfloat16", bytes_per_token=8, page_size=4, layer_ids=(0,), **kw)
    assert err.value.field == field


@pytest.mark.parametrize("kw, field", [
    (dict(page_size=4), "page_size"),
    (dict(shard_units=(8, 4, 0)), "shard_units"),
    (dict(bytes_per_token=60), "bytes_per_token"),
    (dict(unit_bytes=0), "unit_bytes"),
    (dict(tp_size=3), "shard_units"),
])
def test_state_fields_are_checked_by_name(kw, field):
    with pytest.raises(LayoutError) as err:
        state_spec(**kw)
    assert err.value.field == field


# --- extents -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5, 9, 10, 11, 13, 16, 37])
def test_window_extent_is_the_last_w_tokens(n):
    spec = window_spec()
    ext = needed_extent(spec, n)
    assert ext.num_rows == min(n, 10)
    rows = np.concatenate([np.arange(p * 4 + s, p * 4 + s + c) for p, s, c in
                           zip(range(ext.first, ext.stop), *ext.rows())]) if ext.count else np.zeros(0)
    assert rows.tolist() == list(range(max(0, n - 10), n))
    assert needed_bytes(spec, n) == min(n, 10) * 8 * 2


@pytest.mark.parametrize("n", [0, 3, 4, 7, 130, 255, 256, 257])
@pytest.mark.parametrize("ratio", [4, 128, 3])
def test_compressed_extent_counts_complete_windows_only(n, ratio):
    spec = compressed_spec(ratio)
    ext = needed_extent(spec, n)
    assert ext.num_rows == n // ratio  # never ceil: an incomplete window is no entry
    assert tail_tokens(spec, n) == n % ratio
    assert needed_bytes(spec, n) == (n // ratio) * 6 * 2


def test_state_extent_is_one_slot():
    spec = state_spec()
    assert needed_extent(spec, 0).count == 0
    assert needed_extent(spec, 17) == Extent(0, 1, 0, 1, 1)
    assert needed_bytes(spec, 17) == 64


# --- plans, executed ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 10, 13, 22])
@pytest.mark.parametrize("layout", ["rows", "values_then_scales"])
def test_window_pool_moves_the_window_and_nothing_else(n, layout):
    kw = dict(layout=layout, value_bytes_per_token=6, scale_bytes_per_token=2) if layout != "rows" else {}
    spec = window_spec(**kw)
    mem = Memory()
    src = mem.buffers(spec, 16)
    dst = mem.buffers(spec, 16, fill=SENTINEL)
    num_pages = -(-n // 4)
    src_pages = np.arange(num_pages) + 3
    ext = needed_extent(spec, n)
    dst_pages = np.arange(ext.count)[::-1] + 7  # scattered on decode
    plan = plan_kind(spec, src, dst, ext, src_pages[ext.first:], dst_pages)
    assert plan.num_bytes == needed_bytes(spec, n)
    mem.apply(plan)
    window = np.arange(max(0, n - 10), n)
    for s, d in zip(src, dst):
        got = spec.read_rows(mem.region(d), dst_pages[window // 4 - ext.first] * 4 + window % 4)
        want = spec.read_rows(mem.region(s), src_pages[window // 4] * 4 + window % 4)
        assert (got == want).all()
        # nothing outside the window: every other decode byte is still the sentinel
        touched = np.zeros(len(mem.region(d)), bool)
        slots = dst_pages[window // 4 - ext.first] * 4 + window % 4
        for off, width in ((0, 8),) if layout == "rows" else ((0, 6), (4 * 6, 2)):
            page, row = np.divmod(slots, 4)
            for k in range(width):
                touched[page * 32 + off + row * width + k] = True
        assert (mem.region(d)[~touched] == SENTINEL).all()


def test_window_plan_reads_no_source_page_outside_the_window():
    spec = window_spec()
    mem = Memory()
    src, dst = mem.buffers(spec, 64), mem.buffers(spec, 64, fill=SENTINEL)
    n = 41  # window: tokens 31..40 = pages 7..10
    ext = needed_extent(spec, n)
    assert (ext.first, ext.count) == (7, 4)
    plan = plan_kind(spec, src, dst, ext, np.arange(7, 11) + 20, np.arange(4))
    mask = (1 << REGION) - 1
    src_pages = (plan.src.astype(np.int64) & mask) // spec.bytes_per_page
    assert set(src_pages.tolist()) <= set(range(27, 31))


@pytest.mark.parametrize("n", [5, 9, 10, 23, 40])
def test_ring_window_moves_each_position_to_its_slot(n):
    spec = window_spec(ring_stride=12)
    mem = Memory()
    src, dst = mem.buffers(spec, 12), mem.buffers(spec, 9, fill=SENTINEL)  # 4 rows x 12 / 3 rows x 12
    ext = needed_extent(spec, n)
    plan = plan_kind(spec, src, dst, ext, [2], [1])
    assert plan.num_bytes == needed_bytes(spec, n)
    assert plan.num_slices <= 2 * 2  # at most two runs per layer
    mem.apply(plan)
    pos = np.arange(max(0, n - 10), n)
    for s, d in zip(src, dst):
        got = spec.read_rows(mem.region(d), 12 + pos % 12)
        assert (got == spec.read_rows(mem.region(s), 24 + pos % 12)).all()
        rest = np.setdiff1d(np.arange(36), 12 + pos % 12)
        assert (spec.read_rows(mem.region(d), rest) == SENTINEL).all()


def test_ring_window_row_outside_the_ring_is_refused():
    spec = window_spec(ring_stride=12)
    mem = Memory()
    src, dst = mem.buffers(spec, 12), mem.buffers(spec, 9)
    with pytest.raises(PageRangeError) as err:
        plan_kind(spec, src, dst, needed_extent(spec, 20), [0], [3], room=5)
    assert err.value.field == "dst_pages" and "room=5" in str(err.value)


@pytest.mark.parametrize("n, ratio", [(130, 4), (131, 4), (300, 128), (127, 128), (17, 3)])
def test_no_compressed_entry_from_an_incomplete_window_is_persisted(n, ratio):
    spec = compressed_spec(ratio)
    mem = Memory()
    src, dst = mem.buffers(spec, 20), mem.buffers(spec, 20, fill=SENTINEL)
    built = -(-n // ratio)  # a kernel may hold a half-built entry for the incomplete window
    entry_pages = np.arange(-(-built // 4)) + 2
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 256, (built, 6), dtype=np.uint8) for _ in src]
    token_rows(spec, rows, mem, src, entry_pages)
    ext = needed_extent(spec, n)
    dst_pages = np.arange(len(entry_pages)) + 9
    mem.apply(plan_kind(spec, src, dst, ext, entry_pages[: ext.count], dst_pages[: ext.count]))
    complete = n // ratio
    for j, d in enumerate(dst):
        got = spec.read_rows(mem.region(d), dst_pages[np.arange(built) // 4] * 4 + np.arange(built) % 4)
        assert (got[:complete] == rows[j][:complete]).all()
        assert (got[complete:] == SENTINEL).all()  # the incomplete window's entry never arrives


def test_padding_rows_of_the_last_page_never_travel():
    spec = compressed_spec(4)
    mem = Memory()
    src, dst = mem.buffers(spec, 4, fill=0x11), mem.buffers(spec, 4, fill=SENTINEL)
    ext = needed_extent(spec, 4 * 6)  # 6 entries: page 1 holds 2 valid rows + 2 padding rows
    mem.apply(plan_kind(spec, src, dst, ext, [0, 1], [2, 3]))
    page3 = mem.region(dst[0])[3 * 24 : 4 * 24]
    assert (page3[: 2 * 6] == 0x11).all() and (page3[2 * 6 :] == SENTINEL).all()


def test_pages_outside_the_registered_region_are_refused():
    spec = compressed_spec(4)
    mem = Memory()
    src, dst = mem.buffers(spec, 4), mem.buffers(spec, 2)
    with pytest.raises(PageRangeError) as err:
        plan_kind(spec, src, dst, needed_extent(spec, 32), [0, 1], [1, 2], room=7, rank="p0")
    assert "layer 0" in str(err.value) and err.value.field == "dst_pages"


def test_buffers_pair_by_layer_id():
    spec = compressed_spec(4)
    mem = Memory()
    src, dst = mem.buffers(spec, 4), mem.buffers(spec, 4)
    with pytest.raises(PairingError):
        plan_kind(spec, src, dst[:1], needed_extent(spec, 32), [0, 1], [1, 2])
    plan = plan_kind(spec, src, dst[::-1], needed_extent(spec, 32), [0, 1], [1, 2])
    mask = (1 << REGION) - 1
    assert {(int(s) >> REGION, int(d) >> REGION) for s, d in zip(plan.src, plan.dst)} == {(1, 3), (2, 4)}
    assert all(int(s) & mask == 0 for s in plan.src)


# --- chunked prefill ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [window_spec(), window_spec(ring_stride=12), compressed_spec(4), compressed_spec(128),
                                  state_spec(), PoolSpec(name="t", dtype="bfloat16", abi="bfloat16",
                                                         bytes_per_token=8, page_size=4, layer_ids=(0,))])
@pytest.mark.parametrize("n, cuts", [(37, (8, 16, 32)), (300, (128, 256)), (13, ()), (130, (5, 129))])
def test_chunks_send_each_unit_once_and_state_only_last(spec, n, cuts):
    bounds = [0, *cuts, n]
    final = needed_extent(spec, n)
    seen_rows = 0
    units: list[int] = []
    for i, (done, end) in enumerate(zip(bounds, bounds[1:])):
        last = i == len(bounds) - 2
        ext = chunk_extent(spec, n, done, end, last)
        if spec.kind == "state" and not last:
            assert ext.count == 0
        units.extend(range(ext.first, ext.stop))
        seen_rows += ext.num_rows
        if not last and spec.kind == "compressed":
            assert ext.stop * spec.page_size * spec.ratio <= end  # only entries complete by the chunk's end
    assert units == list(range(final.first, final.stop))  # each unit once, in order
    assert seen_rows == final.num_rows


def test_a_chunk_that_is_not_one_is_refused():
    with pytest.raises(LayoutError) as err:
        chunk_extent(window_spec(), 20, 8, 16, last=True)
    assert err.value.field == "chunk"


# --- state slots under heterogeneous TP ---------------------------------------------------------------------


@pytest.mark.parametrize("src_tp, dst_tp", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (1, 4), (2, 2)])
@pytest.mark.parametrize("groups", [(8, 4, 4), (4,)])
def test_state_slices_rebuild_every_decode_rank_slot(src_tp, dst_tp, groups):
    full = state_spec(shard_units=groups, bytes_per_token=sum(groups) * 4)
    ub = full.unit_bytes
    whole = np.arange(sum(groups) * ub, dtype=np.int64)  # the unsharded slot's bytes, by position

    def rank_slot(tp: int, r: int) -> np.ndarray:
        parts, at = [], 0
        for g in groups:
            part = g // tp * ub
            parts.append(whole[at + r * part : at + (r + 1) * part])
            at += g * ub
        return np.concatenate(parts)

    for d in range(dst_tp):
        want = rank_slot(dst_tp, d)
        got = np.full(len(want), -1, dtype=np.int64)
        for p in range(src_tp):
            src = rank_slot(src_tp, p)
            for so, do, ln in zip(*state_slices(full, src_tp, p, dst_tp, d)):
                assert (got[do : do + ln] == -1).all(), "a byte written twice"
                got[do : do + ln] = src[so : so + ln]
        assert (got == want).all()
        assert len(want) == state_tp_spec(full, dst_tp).bytes_per_token


@pytest.mark.parametrize("src_tp, dst_tp", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_replicated_state_comes_whole_from_one_source(src_tp, dst_tp):
    spec = PoolSpec(name="req", dtype="float32", abi="float32", bytes_per_token=40, page_size=1, layer_ids=(0,),
                    kind="state")
    for d in range(dst_tp):
        senders = [p for p in range(src_tp) if len(state_slices(spec, src_tp, p, dst_tp, d)[2])]
        assert len(senders) == 1
        assert state_slices(spec, src_tp, senders[0], dst_tp, d)[2].tolist() == [40]


def test_state_plan_moves_one_slot_per_layer():
    spec = state_spec(layer_ids=(1, 3))
    mem = Memory()
    src, dst = mem.buffers(spec, 5), mem.buffers(spec, 3, fill=SENTINEL)
    plan = plan_kind(spec, src, dst, needed_extent(spec, 9), [4], [2])
    assert plan.num_slices == 2 and plan.num_bytes == 2 * 64
    mem.apply(plan)
    for s, d in zip(src, dst):
        assert (mem.region(d)[128:192] == mem.region(s)[256:320]).all()
        assert (mem.region(d)[:128] == SENTINEL).all()
    with pytest.raises(PageRangeError):
        plan_kind(spec, src, dst, needed_extent(spec, 9), [4], [3])


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2)])
def test_state_plan_across_tp_sizes(src_tp, dst_tp):
    full = state_spec()
    mem = Memory()
    dst_spec = state_tp_spec(full, dst_tp)
    whole = np.arange(64, dtype=np.uint8)
    for d in range(dst_tp):
        dst = mem.buffers(dst_spec, 2, fill=SENTINEL)
        for p in range(src_tp):
            src_spec = state_tp_spec(full, src_tp)
            src = mem.buffers(src_spec, 2)
            src_slot = np.concatenate([whole[a * 4 + p * g // src_tp * 4: a * 4 + (p + 1) * g // src_tp * 4]
                                       for a, g in zip((0, 8, 12), (8, 4, 4))])
            mem.region(src[0])[src_spec.bytes_per_page:] = src_slot
            mem.apply(plan_kind(src_spec, src, dst, needed_extent(src_spec, 3), [1], [0], dst_spec=dst_spec,
                                tp=(src_tp, p, dst_tp, d)))
        want = np.concatenate([whole[a * 4 + d * g // dst_tp * 4: a * 4 + (d + 1) * g // dst_tp * 4]
                               for a, g in zip((0, 8, 12), (8, 4, 4))])
        assert (mem.region(dst[0])[: dst_spec.bytes_per_page] == want).all()


def test_every_kind_extent_matches_bytes_over_many_lengths():
    specs = [window_spec(), window_spec(ring_stride=12), compressed_spec(4), compressed_spec(128), state_spec()]
    for spec, n in itertools.product(specs, range(0, 300, 7)):
        ext = needed_extent(spec, n)
        assert needed_bytes(spec, n) == ext.num_rows * spec.bytes_per_token * spec.num_layers


@pytest.mark.parametrize("spec", [compressed_spec(4), window_spec(ring_stride=12)])
def test_cp_combinations_the_kinds_do_not_support_are_refused_by_name(spec):
    from kvbridge.errors import TopologyError
    from kvbridge.layout.kinds import check_kind_topology

    with pytest.raises(TopologyError) as err:
        check_kind_topology([window_spec(), spec], cp_size=2)
    assert err.value.field == "cp_size" and spec.name in str(err.value)
    check_kind_topology([spec], cp_size=1)
    check_kind_topology([spec], cp_size=2, lane_rule="replicated")
    check_kind_topology([window_spec(), state_spec()], cp_size=4)


@pytest.mark.parametrize("n", [0, 4, 5, 7, 130])
def test_tail_state_moves_the_incomplete_window_rows_only(n):
    spec = PoolSpec(name="tail", dtype="float32", abi="float32", bytes_per_token=4 * 8, page_size=1, layer_ids=(0,),
                    kind="state", ratio=4)
    mem = Memory()
    src, dst = mem.buffers(spec, 2), mem.buffers(spec, 2, fill=SENTINEL)
    ext = needed_extent(spec, n)
    assert needed_bytes(spec, n) == (n % 4) * 8
    mem.apply(plan_kind(spec, src, dst, ext, [1] * ext.count, [0] * ext.count))
    got, want = mem.region(dst[0])[:32], mem.region(src[0])[32:]
    assert (got[: (n % 4) * 8] == want[: (n % 4) * 8]).all() and (got[(n % 4) * 8 :] == SENTINEL).all()
    with pytest.raises(LayoutError) as err:
        PoolSpec(name="tail", dtype="float32", abi="float32", bytes_per_token=16, page_size=1, layer_ids=(0,),
                 kind="state", ratio=3)
    assert err.value.field == "ratio"


def test_layer_ranges_cut_every_kind_and_sum_to_the_whole():
    from kvbridge.layout import deepseek_v4_pools, stage_specs

    specs = deepseek_v4_pools(6, 4, sliding_window=16, hca_ratio=32, head_dim=8, index_head_dim=4)
    stages = [stage_specs(specs, r, 6) for r in ((0, 2), (2, 5), (5, 6))]
    for name, spec in specs.items():
        parts = [s[name] for s in stages if name in s]
        assert all(p.kind == spec.kind and p.window == spec.window and p.ratio == spec.ratio for p in parts)
        assert sorted(lid for p in parts for lid in p.layer_ids) == list(spec.layer_ids)
        for n in (7, 45, 131):
            assert sum(needed_bytes(p, n) for p in parts) == needed_bytes(spec, n)


@pytest.mark.parametrize("rule", ["interleaved", "contiguous", "balanced"])
@pytest.mark.parametrize("n", [13, 41])
def test_cp_lanes_split_a_window_and_the_state_once(rule, n):
    from kvbridge.layout import OwnerLanes
    from kvbridge.layout.kinds import lane_units

    lanes = OwnerLanes(3, rule)
    spec, state = window_spec(), state_spec()
    ext = needed_extent(spec, n)
    parts = [lane_units(spec, ext, lanes, r, n, 4) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(ext.first, ext.stop))
    owner, _ = lanes.owners(np.arange(ext.first, ext.stop), -(-n // 4))
    for r, part in enumerate(parts):
        assert (owner[part - ext.first] == r).all()
    senders = [r for r in range(3) if len(lane_units(state, needed_extent(state, n), lanes, r, n, 4))]
    assert senders == [int(lanes.owners(np.array([(n - 1) // 4]), -(-n // 4))[0][0])]
    # the ranks' plans together move the window once
    mem = Memory()
    src, dst = mem.buffers(spec, 16), mem.buffers(spec, 16, fill=SENTINEL)
    total = 0
    for part in parts:
        plan = plan_kind(spec, src, dst, ext, part, part - ext.first, logical=part)
        total += plan.num_bytes
        mem.apply(plan)
    assert total == needed_bytes(spec, n)
    window = np.arange(max(0, n - 10), n)
    for s, d in zip(src, dst):
        got = spec.read_rows(mem.region(d), (window // 4 - ext.first) * 4 + window % 4)
        assert (got == spec.read_rows(mem.region(s), window)).all()


def test_a_unit_subset_outside_the_extent_is_refused():
    spec = window_spec()
    mem = Memory()
    src, dst = mem.buffers(spec, 16), mem.buffers(spec, 16)
    ext = needed_extent(spec, 41)
    with pytest.raises(LayoutError) as err:
        plan_kind(spec, src, dst, ext, [1], [1], logical=[6])
    assert err.value.field == "logical_pages"


@pytest.mark.parametrize("n", [5, 37, 130])
def test_v4_fp8_preset_moves_values_and_scales_of_the_needed_rows_never_the_page_padding(n):
    """``deepseek_v4_pools(kv_dtype="fp8")``: SGLang's FlashMLA V4 layout, 576 value + 8 scale
    bytes a row, pages padded to whole 576-byte rows (page_stride). Each window / compressed pool's
    plan moves exactly ``needed_bytes`` (values and scales of the needed rows) and decode's padding
    and every other byte keep the sentinel."""
    from kvbridge.layout.hybrid import deepseek_v4_pools

    pools = deepseek_v4_pools(4, 16, sliding_window=32, csa_ratio=4, hca_ratio=8, kv_dtype="fp8")
    assert {k: (s.dtype, s.value_bytes_per_token, s.scale_bytes_per_token, s.page_stride)
            for k, s in pools.items() if s.kind != "state"} == {
        name: ("v4_fp8_nope_bf16_rope", 576, 8, 17 * 576) for name in ("swa", "csa", "hca", "draft")
    } | {"csa_index": ("fp8_e4m3_with_scale", 128, 4, 0)}  # 16 x 584 = 9,344 B in 17 rows of 576
    for spec in (s for s in pools.values() if s.kind != "state"):
        mem = Memory()
        src, dst = mem.buffers(spec, 12), mem.buffers(spec, 12, fill=SENTINEL)
        ext = needed_extent(spec, n)
        src_pages, dst_pages = np.arange(ext.first, ext.stop) + 1, np.arange(ext.count)[::-1] + 3
        plan = plan_kind(spec, src, dst, ext, src_pages, dst_pages)
        assert plan.num_bytes == needed_bytes(spec, n)
        mem.apply(plan)
        rows = np.arange(ext.first * spec.page_size + ext.first_row,
                         ext.first * spec.page_size + ext.first_row + ext.num_rows)
        page, at = np.divmod(rows, spec.page_size)
        v, sc, ps = spec.value_bytes_per_token, spec.scale_bytes_per_token, spec.page_size
        for s, d in zip(src, dst):
            touched = np.zeros(len(mem.region(d)), bool)
            for off, width in ((0, v), (ps * v, sc)):
                for k in range(width):
                    so = src_pages[page - ext.first] * spec.bytes_per_page + off + at * width + k
                    do = dst_pages[page - ext.first] * spec.bytes_per_page + off + at * width + k
                    assert (mem.region(d)[do] == mem.region(s)[so]).all(), spec.name
                    touched[do] = True
            assert (mem.region(d)[~touched] == SENTINEL).all(), f"{spec.name}: a byte outside the needed rows"


def test_v4_preset_refuses_an_fp8_kv_dtype_it_does_not_describe():
    from kvbridge.layout.hybrid import deepseek_v4_pools

    with pytest.raises(LayoutError, match=r"kv_dtype 'fp8_e5m2' is not one of .* for SGLang's FlashMLA") as err:
        deepseek_v4_pools(4, 16, kv_dtype="fp8_e5m2")
    assert err.value.field == "kv_dtype"
    with pytest.raises(LayoutError, match="rope_head_dim") as err:
        deepseek_v4_pools(4, 16, kv_dtype="fp8", head_dim=500)  # 436 nope values: not whole 64-value tiles
