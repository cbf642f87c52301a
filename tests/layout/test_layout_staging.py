"""Staged plans on simulated memory: a room's slices gathered into a slot, carried as wire
pieces into another slot, scattered into the destination pages, chunk by chunk, must leave
the destination byte for byte as the direct plan does (poison everywhere else), with every
chunk inside its slot.

Memory is simulated as in test_layout_e2e: a dict of numpy byte arrays, a buffer's base
address ``region_id << 40``; the two staging slots are regions of their own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import LayoutError
from kvbridge.layout import (
    PathThresholds,
    StagedPlan,
    TransferPlan,
    choose_path,
    deepseek_pools,
    plan_transfer,
    stage_plan,
)
from kvbridge.layout.heads import HeadGeometry, head_slices, plan_head_transfer
from test_layout_e2e import DST_POISON, REGION_BITS, apply_plan, buffers

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MASK = (1 << REGION_BITS) - 1


def copy(memory: dict, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    apply_plan(memory, TransferPlan(src, dst, length))


def run_staged(memory: dict, staged: StagedPlan, send_slot: int, recv_slot: int) -> None:
    """Gather, wire, scatter every chunk through one slot on each side (poisoned between
    chunks, so a byte that only a previous chunk staged would show)."""
    for k in range(staged.num_chunks):
        memory[send_slot >> REGION_BITS][:] = 0xEE
        memory[recv_slot >> REGION_BITS][:] = 0xDD
        copy(memory, *staged.gather(k, send_slot))
        copy(memory, *staged.wire(k, send_slot, recv_slot))
        copy(memory, *staged.scatter(k, recv_slot))


def check_layout(staged: StagedPlan, plan: TransferPlan) -> None:
    B = staged.slot_bytes
    assert staged.num_bytes == plan.num_bytes
    assert int(staged.chunk_span.max(initial=0)) <= B
    for k in range(staged.num_chunks):
        _, goff, glen = staged.gather(k)
        soff, _, slen = staged.scatter(k)
        woff, _, wlen = staged.wire(k, 0, 0)
        assert int((goff + glen).max()) <= B and int((soff + slen).max()) <= B
        assert int(glen.sum()) == int(slen.sum()) == int(staged.chunk_bytes[k])
        # the staged ranges of a chunk never overlap, and the wire pieces cover them exactly once
        order = np.argsort(goff)
        assert (goff[order][1:] >= (goff + glen)[order][:-1]).all()
        assert int(woff[0]) == 0 and (woff[1:] == (woff + wlen)[:-1]).all()
        assert int((woff + wlen)[-1]) == int(staged.chunk_span[k]) >= int((goff + glen).max())
    if staged.num_chunks > 1:  # every chunk but the last fills its slot (a room streams through it)
        assert (staged.chunk_span[:-1] > B - 16).all()


@st.composite
def page_cases(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    num_tokens = draw(st.integers(1, 40 * page_size))
    num_pages = -(-num_tokens // page_size)
    capacity = num_pages + draw(st.integers(0, 8))
    contiguous = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    slot = draw(st.sampled_from([64, 1024, 4096, 1 << 20]))
    piece = draw(st.sampled_from([16, 48, 1 << 20]))
    pools = draw(st.sampled_from([("target",), ("index",), ("target", "index", "draft")]))
    return page_size, num_tokens, capacity, contiguous, seed, slot, piece, pools


def world(page_size: int, capacity: int, pools=("target", "index", "draft")):
    specs = {k: v for k, v in deepseek_pools(num_layers=2, page_size=page_size, kv_dtype="fp8").items()
             if k in pools}
    memory: dict[int, np.ndarray] = {}
    src = buffers(specs, memory, capacity, 0)
    rng = np.random.default_rng(capacity)
    for d in src:
        memory[d.base >> REGION_BITS][:] = rng.integers(0, 256, d.nbytes, dtype=np.uint8)
    dst = buffers(specs, memory, capacity, DST_POISON)
    return specs, memory, src, dst


def slots(memory: dict, slot_bytes: int) -> tuple[int, int]:
    out = []
    for _ in range(2):
        region = max(memory) + 1
        memory[region] = np.zeros(slot_bytes, np.uint8)
        out.append(region << REGION_BITS)
    return out[0], out[1]


def snapshot(memory: dict, descs) -> list[np.ndarray]:
    return [memory[d.base >> REGION_BITS].copy() for d in descs]


@SETTINGS
@given(page_cases())
def test_staged_equals_direct(case) -> None:
    page_size, num_tokens, capacity, contiguous, seed, slot, piece, pools = case
    specs, memory, src, dst = world(page_size, capacity, pools)
    rng = np.random.default_rng(seed)
    num_pages = -(-num_tokens // page_size)
    logical = np.arange(num_pages)
    sp = np.arange(num_pages) if contiguous else rng.permutation(capacity)[:num_pages]
    dp = np.arange(num_pages) if contiguous else rng.permutation(capacity)[:num_pages]
    plan = plan_transfer(specs, src, dst, logical, sp, dp, num_tokens)
    staged = stage_plan(plan, slot, max_piece_bytes=piece)
    check_layout(staged, plan)

    send_slot, recv_slot = slots(memory, slot)
    run_staged(memory, staged, send_slot, recv_slot)
    got = snapshot(memory, dst)
    for d in dst:  # the direct path on fresh poison
        memory[d.base >> REGION_BITS][:] = DST_POISON
    apply_plan(memory, plan)
    assert all((a == b).all() for a, b in zip(got, snapshot(memory, dst)))


def test_partial_index_page_stays_two_ranges_and_padding_stays_poisoned() -> None:
    page_size, num_tokens = 16, 16 * 3 + 5  # last page: 5 valid rows of 16
    specs, memory, src, dst = world(page_size, 8, ("index",))
    plan = plan_transfer(specs, src, dst, np.arange(4), np.array([5, 2, 7, 0]), np.array([1, 6, 3, 4]), num_tokens)
    staged = stage_plan(plan, 4096, max_piece_bytes=1000)
    send_slot, recv_slot = slots(memory, 4096)
    run_staged(memory, staged, send_slot, recv_slot)
    spec = specs["index"]
    for d in dst:
        page = memory[d.base >> REGION_BITS].reshape(8, -1)[4]  # the partial page's destination
        assert (page[5 * 128 : spec.scale_offset] == DST_POISON).all()  # value tail
        assert (page[spec.scale_offset + 5 * 4 :] == DST_POISON).all()  # scale tail
        assert not (page[: 5 * 128] == DST_POISON).all()
        untouched = [p for p in range(8) if p not in (1, 6, 3, 4)]
        assert (memory[d.base >> REGION_BITS].reshape(8, -1)[untouched] == DST_POISON).all()


def test_a_room_larger_than_the_slot_streams_and_long_runs_split() -> None:
    specs, memory, src, dst = world(4, 64, ("target",))
    plan = plan_transfer(specs, src, dst, np.arange(60), np.arange(60), np.arange(60), 60 * 4)
    assert plan.num_slices == 2  # one run per layer
    staged = stage_plan(plan, 10_000, max_piece_bytes=3_000)
    assert staged.num_chunks == -(-plan.num_bytes // 10_000)
    assert (staged.counts()["wire_pieces"][:-1] == 4).all()
    check_layout(staged, plan)
    send_slot, recv_slot = slots(memory, 10_000)
    run_staged(memory, staged, send_slot, recv_slot)
    for s, d in zip(src, dst):
        assert (memory[s.base >> REGION_BITS][: 60 * s.bytes_per_page] ==
                memory[d.base >> REGION_BITS][: 60 * d.bytes_per_page]).all()


def test_gather_and_scatter_merge_what_runs_on() -> None:
    # three slices contiguous at the source, scattered at the destination: one gather entry, three scatter
    plan = TransferPlan(np.array([1000, 1064, 1128]), np.array([9000, 5000, 7000]), np.array([64, 64, 64]))
    staged = stage_plan(plan, 4096)
    assert staged.stats() == {"plan_slices": 3, "chunks": 1, "gather_slices": 1, "scatter_slices": 3,
                              "wire_pieces": 1, "bytes_staged": 192}
    assert staged.gather(0, 100)[1].tolist() == [100]
    assert staged.scatter(0, 100)[0].tolist() == [100, 164, 228]
    # an unaligned length leaves a gap: no merge across it
    plan = TransferPlan(np.array([1000, 1010]), np.array([0, 10]), np.array([10, 10]))
    staged = stage_plan(plan, 4096)
    assert staged.gather(0)[1].tolist() == [0, 16] and staged.chunk_span.tolist() == [26]


def test_only_the_gather_entries_of_slices_not_proven_are_named_for_the_look_up() -> None:
    # two pages, an aux row (not proven) that runs on from the second page at the source, a third
    # page, a second row: the first three merge into one gather entry, which is then not proven
    plan = TransferPlan(np.array([1000, 1064, 1128, 5000, 9000]), np.array([0, 100, 200, 300, 400]),
                        np.array([64, 64, 32, 64, 32]), np.array([True, True, False, True, False]))
    staged = stage_plan(plan, 256)
    src, _, length = staged.gather(0)
    assert (src.tolist(), length.tolist()) == ([1000, 5000, 9000], [160, 64, 32])
    assert staged.gather_unproven(0).tolist() == [0, 2]
    # chunks of 128 bytes: the merge stops at each chunk's end, each entry named by what it holds
    staged = stage_plan(plan, 128)
    rows = set(range(1128, 1160)) | set(range(9000, 9032))
    named = 0
    for k in range(staged.num_chunks):
        src, _, length = staged.gather(k)
        unproven = set(staged.gather_unproven(k).tolist())
        for i, (a, n) in enumerate(zip(src.tolist(), length.tolist())):
            assert (i in unproven) == bool(rows & set(range(a, a + n))), (k, i, a, n)
            named += i in unproven
    assert named == 2
    # a plan that proves nothing: every entry is looked up
    assert stage_plan(TransferPlan(plan.src, plan.dst, plan.length), 128).gather_unproven(0) is None


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4)])
def test_head_sliced_plans_stage_into_whole_pieces(src_tp: int, dst_tp: int) -> None:
    geom = HeadGeometry(num_heads=4, head_dim=8, abi="bfloat16")
    page_size, num_tokens, capacity = 4, 4 * 5 + 3, 12
    rng = np.random.default_rng(src_tp * 10 + dst_tp)
    memory: dict[int, np.ndarray] = {}
    src_specs = [{"k": geom.spec("k", page_size, (0, 1), src_tp, r)} for r in range(src_tp)]
    dst_specs = [{"k": geom.spec("k", page_size, (0, 1), dst_tp, r)} for r in range(dst_tp)]
    src_bufs = [buffers(s, memory, capacity, 0) for s in src_specs]
    for bufs in src_bufs:
        for d in bufs:
            memory[d.base >> REGION_BITS][:] = rng.integers(0, 256, d.nbytes, dtype=np.uint8)
    dst_bufs = [buffers(s, memory, capacity, DST_POISON) for s in dst_specs]
    num_pages = 6
    sp, dp = rng.permutation(capacity)[:num_pages], rng.permutation(capacity)[:num_pages]
    plans = []
    for j in range(dst_tp):
        for hs in head_slices(geom, src_tp, dst_tp, j):
            plans.append(plan_head_transfer(src_specs[hs.src_rank], dst_specs[j], hs, src_bufs[hs.src_rank],
                                            dst_bufs[j], np.arange(num_pages), sp, dp, num_tokens))
    direct = TransferPlan.concat(plans)
    staged = [stage_plan(p, 512, max_piece_bytes=256) for p in plans]
    for s, p in zip(staged, plans):
        check_layout(s, p)
        if p.num_slices > 2 * 2:  # head-sliced: one range per row, but the wire carries pieces
            assert s.num_wire_pieces * 4 <= p.num_slices
            st = s.stats()
            # the side whose rows hold just the slice's heads runs on row after row: merged there
            if src_tp < dst_tp:  # p1 -> d2: gather cuts the heads out, scatter writes whole pages
                assert st["scatter_slices"] * 3 <= st["gather_slices"]  # rows of 4-row pages
            else:  # p2 -> d1: gather reads whole pages, scatter spreads rows over wider rows
                assert st["gather_slices"] * 3 <= st["scatter_slices"]
    send_slot, recv_slot = slots(memory, 512)
    for s in staged:
        run_staged(memory, s, send_slot, recv_slot)
    got = [memory[d.base >> REGION_BITS].copy() for bufs in dst_bufs for d in bufs]
    for bufs in dst_bufs:
        for d in bufs:
            memory[d.base >> REGION_BITS][:] = DST_POISON
    apply_plan(memory, direct)
    want = [memory[d.base >> REGION_BITS] for bufs in dst_bufs for d in bufs]
    assert all((a == b).all() for a, b in zip(got, want))


def test_bad_arguments_are_named() -> None:
    plan = TransferPlan(np.array([0]), np.array([0]), np.array([8]))
    with pytest.raises(LayoutError, match="slot_bytes"):
        stage_plan(plan, 0)
    with pytest.raises(LayoutError, match="power of two dividing slot_bytes"):
        stage_plan(plan, 100)
    with pytest.raises(LayoutError, match="empty"):
        stage_plan(TransferPlan(np.array([0]), np.array([0]), np.array([0])), 64)
    with pytest.raises(LayoutError, match="chunk 1 outside"):
        stage_plan(plan, 64).gather(1)
    assert stage_plan(TransferPlan.empty(), 64).num_chunks == 0


def test_choose_path() -> None:
    """Thresholds are data the caller passes (an engine's registry entry, tests/transfer/
    test_engine_registry.py); None: the engine copies scattered slices at once, never staged."""
    host = PathThresholds(min_slices=2048, max_mean_slice_bytes=64 << 10)
    gpu = PathThresholds(min_slices=512, max_mean_slice_bytes=64 << 10)
    pages = TransferPlan(np.arange(4000) * 41984, np.arange(4000) * 41984, np.full(4000, 41984))
    runs = TransferPlan(np.arange(20) * (1 << 22), np.arange(20) * (1 << 22), np.full(20, 1 << 22))
    assert choose_path(pages, host) == "staged"
    assert choose_path(runs, host) == "direct"
    assert choose_path(pages, None) == "direct"  # e.g. the slice kernel copies scattered pages at once
    assert choose_path(10, host, mean_slice_bytes=41984) == "direct"  # few slices
    assert choose_path(4000, host, mean_slice_bytes=4 * 41984) == "direct"  # runs of pages
    assert choose_path(4000, host, mean_slice_bytes=64 << 10) == "staged"  # the bounds are inclusive
    assert choose_path(2047, host, mean_slice_bytes=1) == "direct"
    assert choose_path(pages, PathThresholds(min_slices=10_000, max_mean_slice_bytes=1 << 20)) == "direct"
    # GPU pages: a 1K-token room's rank posts ~1,000 page slices (staged: about twice direct's rate
    # on one H200), while a contiguous room's ~120 runs of ~200 KB stay direct
    assert choose_path(984, gpu, mean_slice_bytes=25_000) == "staged"
    assert choose_path(984, host, mean_slice_bytes=25_000) == "direct"  # host pages: too few
    assert choose_path(123, gpu, mean_slice_bytes=200_000) == "direct"
    with pytest.raises(LayoutError, match="thresholds must be PathThresholds or None, got 'mooncake'"):
        choose_path(pages, "mooncake")  # type: ignore[arg-type]  # a name is the registry's to resolve
    with pytest.raises(LayoutError, match="mean_slice_bytes"):
        choose_path(4000, host)
    with pytest.raises(LayoutError, match="min_slices"):
        PathThresholds(min_slices=-1, max_mean_slice_bytes=0)


def test_a_wider_rule_stages_larger_slices_only_from_its_own_count() -> None:
    """``wider``: a second (count, mean) pair for slices the first rule leaves direct; each bound
    inclusive, and a plan under neither rule direct."""
    rule = PathThresholds(min_slices=64, max_mean_slice_bytes=48 << 10,
                          wider=PathThresholds(min_slices=1024, max_mean_slice_bytes=64 << 10))
    assert choose_path(64, rule, mean_slice_bytes=48 << 10) == "staged"  # the first rule
    assert choose_path(63, rule, mean_slice_bytes=1) == "direct"
    assert choose_path(1023, rule, mean_slice_bytes=64 << 10) == "direct"  # too few for the wider rule
    assert choose_path(1024, rule, mean_slice_bytes=64 << 10) == "staged"
    assert choose_path(1 << 20, rule, mean_slice_bytes=(64 << 10) + 1) == "direct"  # larger than either
    slices = TransferPlan(np.arange(1025) << 17, np.arange(1025) << 17, np.full(1025, 60 << 10))
    assert choose_path(slices, rule) == "staged"
    assert choose_path(TransferPlan(slices.src[:600], slices.dst[:600], slices.length[:600]), rule) == "direct"
    for bad in (PathThresholds(min_slices=32, max_mean_slice_bytes=64 << 10),  # fewer slices than the first
                PathThresholds(min_slices=1024, max_mean_slice_bytes=48 << 10)):  # no larger mean
        with pytest.raises(LayoutError, match="wider must be PathThresholds of at least 64 slices"):
            PathThresholds(min_slices=64, max_mean_slice_bytes=48 << 10, wider=bad)
    with pytest.raises(LayoutError, match="wider"):
        PathThresholds(min_slices=64, max_mean_slice_bytes=48 << 10, wider=(1024, 64 << 10))  # type: ignore[arg-type]
