"""plan_transfer, BufferDesc, TransferPlan and buffer validation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import BufferSpecError, LayoutError, PageRangeError, PairingError
from kvbridge.layout import BufferDesc, OwnerLanes, PoolSpec, TransferPlan, deepseek_pools, describe_buffer, plan_transfer
from kvbridge.layout.pairing import pair_buffers

FAST = settings(max_examples=80, deadline=None)


def descs(specs, capacity=64, start=1) -> list[BufferDesc]:
    out, region = [], start
    for spec in specs.values():
        for lid in spec.layer_ids:
            out.append(BufferDesc(spec.name, lid, region << 32, capacity, spec.bytes_per_page))
            region += 1
    return out


def count_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Maximal runs consecutive on both sides, counted the slow way."""
    runs = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


@FAST
@given(
    num_pages=st.integers(1, 300),
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    num_layers=st.integers(1, 3),
    cp=st.tuples(st.integers(1, 4), st.sampled_from(["interleaved", "contiguous"])),
    num_src_blocks=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_slice_count_is_ideal_for_contiguous_allocation(num_pages, page_size, num_layers, cp, num_src_blocks, seed):
    specs = deepseek_pools(num_layers=num_layers, page_size=page_size, kv_dtype="fp8")
    lanes = OwnerLanes(*cp)
    rng = random.Random(seed)
    logical = lanes.owned_pages(rng.randrange(cp[0]), num_pages)
    if not len(logical):
        return
    # destination: one contiguous range for the whole request; source: a few contiguous blocks
    dst = 10 + logical
    cuts = sorted(rng.sample(range(1, len(logical)), min(num_src_blocks - 1, len(logical) - 1)))
    src = np.concatenate(
        [np.arange(b - a) + 3 * i + 2 * a for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(logical)]))]
    )
    num_tokens = num_pages * page_size  # whole pages
    plan = plan_transfer(specs, descs(specs, 2000), descs(specs, 2000, 100), logical, src, dst, num_tokens)
    ideal = count_runs(src, dst) * sum(s.num_layers for s in specs.values())
    assert plan.num_slices == ideal
    assert plan.num_bytes == len(logical) * sum(s.bytes_per_page * s.num_layers for s in specs.values())
    if cp[0] == 1 and num_src_blocks == 1:
        assert plan.num_slices == sum(s.num_layers for s in specs.values())  # one slice per layer


def test_partial_last_page_rows_merge_and_index_k_splits_in_two():
    specs = deepseek_pools(num_layers=1, page_size=4, kv_dtype="fp8", draft_layers=0)
    target, index = specs["target"], specs["index"]
    src_bufs, dst_bufs = descs(specs), descs(specs, start=10)
    # 10 tokens: pages 0, 1 full, page 2 holds 2 valid rows
    plan = plan_transfer(specs, src_bufs, dst_bufs, np.arange(3), np.array([5, 6, 7]), np.array([1, 2, 3]), 10)
    t_src, i_src = src_bufs[0].base, src_bufs[1].base
    t_dst, i_dst = dst_bufs[0].base, dst_bufs[1].base
    got = sorted(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()))
    want = sorted(
        [
            (t_src + 5 * target.bytes_per_page, t_dst + 1 * target.bytes_per_page, 10 * 656),  # one merged slice
            (i_src + 5 * 528, i_dst + 1 * 528, 2 * 528),  # full index pages 0, 1
            (i_src + 7 * 528, i_dst + 3 * 528, 2 * 128),  # valid value bytes of page 2
            (i_src + 7 * 528 + 4 * 128, i_dst + 3 * 528 + 4 * 128, 2 * 4),  # valid scale bytes of page 2
        ]
    )
    assert index.bytes_per_page == 528 and got == want


def test_partial_page_first_in_order_ends_its_run():
    specs = deepseek_pools(num_layers=1, page_size=4, kv_dtype="bf16", index=False, draft_layers=0)
    bpp, src_bufs, dst_bufs = specs["target"].bytes_per_page, descs(specs), descs(specs, start=10)
    # logical 2 (partial, 1 valid row) then logical 1: consecutive on both sides, but may not merge
    plan = plan_transfer(specs, src_bufs, dst_bufs, np.array([2, 1]), np.array([4, 5]), np.array([8, 9]), 9)
    assert plan.length.tolist() == [1152, bpp]
    assert plan.src.tolist() == [src_bufs[0].base + 4 * bpp, src_bufs[0].base + 5 * bpp]


def test_pairing_by_pool_and_layer_not_position():
    specs = deepseek_pools(num_layers=3, page_size=2, kv_dtype="fp8")
    src_bufs, dst_bufs = descs(specs), descs(specs, start=50)
    pages = np.arange(4)
    plan = plan_transfer(specs, src_bufs, dst_bufs, pages, pages, pages + 7, 8)
    shuffled = list(dst_bufs)
    random.Random(3).shuffle(shuffled)
    again = plan_transfer(specs, src_bufs[::-1], shuffled, pages, pages, pages + 7, 8)
    assert np.array_equal(plan.src, again.src) and np.array_equal(plan.dst, again.dst)
    missing = [d for d in shuffled if not (d.pool == "index" and d.layer_id == 1)]
    with pytest.raises(PairingError, match=r"pool 'index' layer 1: no destination buffer") as info:
        plan_transfer(specs, src_bufs, missing, pages, pages, pages + 7, 8, room=9, rank="cp0")
    assert "room=9" in str(info.value) and "rank=cp0" in str(info.value)
    wrong = [
        BufferDesc(d.pool, d.layer_id, d.base, d.capacity_pages, d.bytes_per_page + 1) if d.pool == "draft" else d
        for d in dst_bufs
    ]
    with pytest.raises(PairingError, match=r"pool 'draft' layer 3: source pages are \d+ B, destination pages \d+ B"):
        plan_transfer(specs, src_bufs, wrong, pages, pages, pages + 7, 8)
    with pytest.raises(PairingError, match="twice"):
        plan_transfer(specs, src_bufs, dst_bufs + dst_bufs[:1], pages, pages, pages + 7, 8)


def test_only_requested_pools_and_their_pairs():
    specs = deepseek_pools(num_layers=2, page_size=2)
    dst_without_draft = [d for d in descs(specs, start=9) if d.pool != "draft"]
    plan = plan_transfer(
        specs, descs(specs), dst_without_draft, np.arange(2), np.arange(2), np.arange(2), 4, pools=["target", "index"]
    )
    assert plan.num_slices == 4
    with pytest.raises(LayoutError, match="no spec"):
        plan_transfer(specs, descs(specs), descs(specs), np.arange(2), np.arange(2), np.arange(2), 4, pools=["nope"])


@pytest.mark.parametrize(
    "logical, num_tokens, match",
    [
        ([0, 1, 1], 6, "logical page 1 appears more than once"),
        ([0, 3], 6, "logical page 3 is outside the request's 3 pages"),
        ([-1], 6, "logical page -1"),
        ([0], 0, "outside the request's 0 pages"),
    ],
)
def test_bad_logical_pages(logical, num_tokens, match):
    specs = deepseek_pools(num_layers=1, page_size=2)
    n = len(logical)
    with pytest.raises(LayoutError, match=match):
        plan_transfer(specs, descs(specs), descs(specs), np.array(logical), np.arange(n), np.arange(n), num_tokens)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_page_range_checked_on_every_layer(side):
    specs = deepseek_pools(num_layers=2, page_size=2, draft_layers=1)
    src_bufs, dst_bufs = descs(specs, capacity=8), descs(specs, capacity=8, start=20)
    bufs = src_bufs if side == "src" else dst_bufs
    # only the draft layer is smaller: the check must look at every buffer's own capacity
    bufs[-1] = BufferDesc("draft", 2, bufs[-1].base, 5, bufs[-1].bytes_per_page)
    pages = np.array([1, 5, 2])
    with pytest.raises(PageRangeError) as info:
        plan_transfer(specs, src_bufs, dst_bufs, np.arange(3), pages, pages, 6, room=77, rank="cp1")
    msg = str(info.value)
    word = "source" if side == "src" else "destination"
    assert f"pool 'draft' layer 2: {word} page 5 (logical page 1) is outside the registered region of 5 pages" in msg
    assert "room=77" in msg and "rank=cp1" in msg and f"field={side}_pages" in msg


def test_plan_batches_and_concat():
    plan = TransferPlan(np.arange(10), np.arange(10) + 100, np.full(10, 8))
    batches = list(plan.batches(4))
    assert [len(b[0]) for b in batches] == [4, 4, 2] and batches[1][1].tolist() == [104, 105, 106, 107]
    assert plan.num_bytes == 80 and plan.src.dtype == np.uint64 and not plan.src.flags.writeable
    both = TransferPlan.concat([plan, TransferPlan.empty(), plan])
    assert both.num_slices == 20 and TransferPlan.concat([]).num_slices == 0
    with pytest.raises(LayoutError):
        list(plan.batches(0))
    with pytest.raises(LayoutError):
        TransferPlan(np.arange(2), np.arange(3), np.arange(2))


def test_empty_request_plan_is_empty():
    specs = deepseek_pools(num_layers=1, page_size=2)
    empty = np.zeros(0, dtype=np.int64)
    assert plan_transfer(specs, descs(specs), descs(specs), empty, empty, empty, 5).num_slices == 0


def test_buffer_desc_wire_form():
    d = BufferDesc("index", 3, 1 << 40, 128, 528)
    assert d.to_list() == ["index", 3, 1 << 40, 128, 528] and BufferDesc.from_list(d.to_list()) == d
    for bad in (
        ["index", 3, 0, 1],
        ["index", -1, 0, 1, 528],
        ["", 0, 0, 1, 8],
        ["index", 0, 0, 1, 0],
        ("x", 0, 0.5, 1, 8),
    ):
        with pytest.raises(LayoutError):
            BufferDesc.from_list(bad)


def test_validate_buffer_names_pool_layer_expected_and_actual():
    specs = deepseek_pools(num_layers=2, page_size=4, kv_dtype="fp8")
    index, target = specs["index"], specs["target"]
    with pytest.raises(BufferSpecError, match=r"pool 'index' layer 1: buffer dtype int8, expected uint8"):
        index.validate_buffer(1, np.zeros((8, 4 * 132), dtype=np.int8))
    with pytest.raises(BufferSpecError, match=r"pool 'target' layer 0: buffer dtype float8_e4m3fn, expected uint8"):
        target.validate_buffer(0, torch.zeros((8, 4 * 656), dtype=torch.float8_e4m3fn))
    with pytest.raises(BufferSpecError, match=r"pool 'index' layer 0: uint8 buffer of shape \[8, 532\] holds 4256 "
                       r"bytes, not a whole number of 528-byte pages .*expected .* \[pages, 528\] or \[pages \* 4, 132\]"):
        index.validate_buffer(0, np.zeros((8, 532), dtype=np.uint8))
    with pytest.raises(BufferSpecError, match=r"pool 'index' has no layer 5"):
        index.validate_buffer(5, np.zeros((8, 528), dtype=np.uint8))
    bf16 = deepseek_pools(num_layers=1, page_size=4)["target"]
    assert bf16.validate_buffer(0, torch.zeros((6, 4, 576), dtype=torch.bfloat16)) == 6
    with pytest.raises(BufferSpecError, match=r"pool 'target' layer 0: buffer dtype float16, expected bfloat16"):
        bf16.validate_buffer(0, torch.zeros((6, 4, 576), dtype=torch.float16))
    buf = np.zeros((12, 4, 132), dtype=np.uint8)
    assert describe_buffer(index, 1, buf) == BufferDesc("index", 1, buf.ctypes.data, 12, 528)
    with pytest.raises(BufferSpecError, match="whole number of 528-byte pages"):
        describe_buffer(index, 1, np.zeros((12, 4, 131), dtype=np.uint8))


def test_buffers_are_accepted_whatever_their_shape_when_their_bytes_are_whole_pages():
    """A token-major [pages * page_size, row] tensor is byte-identical to a page-major one."""
    k = PoolSpec("k", "float32", "float32", 2 * 8 * 4, 4, (0, 1))  # 2 kv heads x head dim 8, fp32
    assert k.validate_buffer(0, torch.zeros((10 * 4, 16), dtype=torch.float32)) == 10  # token-major
    assert k.validate_buffer(1, torch.zeros((10, 4, 2, 8), dtype=torch.float32)) == 10  # [pages, ps, heads, dim]
    assert k.validate_buffer(1, np.zeros(10 * 4 * 16, dtype=np.float32)) == 10  # flat
    with pytest.raises(BufferSpecError, match="not contiguous"):
        k.validate_buffer(0, torch.zeros((16, 40), dtype=torch.float32).t())
    with pytest.raises(BufferSpecError, match=r"holds 0 bytes"):
        k.validate_buffer(0, torch.zeros((0, 16), dtype=torch.float32))


def test_pre_paired_buffers_plan_the_same_slices_and_must_match_the_pools():
    from kvbridge.layout import preset_pools
    from kvbridge.layout.plan import pair_buffers

    specs = preset_pools("deepseek-v3.2-fp8", num_layers=3, page_size=4)

    def bufs(shift):
        return [BufferDesc(p, layer, shift + 10**6 * (i * 10 + layer), 32, s.bytes_per_page)
                for i, (p, s) in enumerate(specs.items()) for layer in s.layer_ids]

    src, dst = bufs(0), bufs(1 << 40)
    logical, local, dest = np.array([0, 2, 3]), np.array([5, 6, 7]), np.array([9, 1, 2])
    paired = pair_buffers(specs, src, dst, tuple(specs))
    a = plan_transfer(specs, src, dst, logical, local, dest, 15)
    b = plan_transfer(specs, src, dst, logical, local, dest, 15, paired=paired)
    assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("src", "dst", "length"))
    with pytest.raises(PageRangeError):  # capacity is still checked on every plan
        plan_transfer(specs, src, dst, logical, local, np.array([9, 1, 32]), 15, paired=paired)
    with pytest.raises(LayoutError, match="paired for pools"):
        plan_transfer(specs, src, dst, logical, local, dest, 15, pools=["target"], paired=paired)


def test_extra_slices_ride_at_the_end_of_the_plan():
    """An aux row posted in the same write: the caller's slices after the plan's, as given."""
    specs = deepseek_pools(num_layers=2, page_size=4, kv_dtype="fp8")
    src, dst = descs(specs), descs(specs, start=50)
    args = (specs, src, dst, np.array([0, 1, 2]), np.array([5, 6, 9]), np.array([1, 2, 3]), 10)
    plain = plan_transfer(*args)
    extra = ([7 << 32], [8 << 32], [96])
    both = plan_transfer(*args, extra=extra)
    assert both.num_slices == plain.num_slices + 1 and not both.src.flags.writeable
    assert both.src.tolist() == plain.src.tolist() + extra[0] and both.length.tolist() == plain.length.tolist() + [96]
    assert both.dst.tolist() == plain.dst.tolist() + extra[1]
    empty = np.zeros(0, np.int64)
    alone = plan_transfer(specs, src, dst, empty, empty, empty, 10, extra=extra)
    assert (alone.src.tolist(), alone.dst.tolist(), alone.length.tolist()) == extra
    # the pages' slices are proven inside the source buffers, the caller's are not (an aux row: anywhere)
    assert plain.proven.tolist() == [True] * plain.num_slices and not plain.proven.flags.writeable
    assert both.proven.tolist() == [True] * plain.num_slices + [False]
    assert alone.proven is None  # (the caller's slices alone: nothing proven)


def test_proven_flags_concatenate_only_when_every_plan_with_slices_has_them():
    specs = deepseek_pools(num_layers=2, page_size=4, kv_dtype="fp8")
    src, dst = descs(specs), descs(specs, start=50)
    pages = plan_transfer(specs, src, dst, np.array([0, 1]), np.array([5, 6]), np.array([1, 2]), 8)
    row = TransferPlan(np.array([7 << 32]), np.array([8 << 32]), np.array([96]))  # made by hand: unknown
    assert TransferPlan.concat([pages, TransferPlan.empty(), pages]).proven.tolist() == [True] * 2 * pages.num_slices
    assert TransferPlan.concat([pages, row]).proven is None
    flagged = TransferPlan(row.src, row.dst, row.length, np.array([False]))
    assert TransferPlan.concat([pages, flagged]).proven.tolist() == [True] * pages.num_slices + [False]
    with pytest.raises(LayoutError, match="1 slices but 2 proven flags"):
        TransferPlan(row.src, row.dst, row.length, np.array([True, True]))


@FAST
@given(num_pages=st.integers(1, 40), num_layers=st.integers(1, 3), scattered=st.booleans(), seed=st.integers(0, 1000))
def test_whole_pages_of_every_layout_plan_as_the_per_layout_formula(num_pages, num_layers, scattered, seed):
    """Whole pages (no partial last page) are planned in one broadcast over every layer of every
    in-page layout: the slices, in order, are each layout group's runs, layer by layer, computed
    here the slow way."""
    specs = deepseek_pools(num_layers=num_layers, page_size=4, kv_dtype="fp8", draft_layers=1)
    rng = np.random.default_rng(seed)
    logical = np.arange(num_pages)
    src = rng.permutation(200)[:num_pages] if scattered else np.arange(num_pages) + 7
    dst = rng.permutation(200)[:num_pages] if scattered else np.arange(num_pages) + 3
    plan = plan_transfer(specs, descs(specs, 256), descs(specs, 256, 100), logical, src, dst, num_pages * 4)
    paired = pair_buffers(specs, descs(specs, 256), descs(specs, 256, 100), tuple(specs))
    starts = [i for i in range(num_pages) if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1]
    counts = np.diff([*starts, num_pages])
    want = []
    for g in paired.groups:  # layouts in order, every layer, then its runs
        for sb, db, bpp in zip(g.src_base[:, 0].tolist(), g.dst_base[:, 0].tolist(), g.bytes_per_page[:, 0].tolist()):
            want += [(sb + int(src[s]) * bpp, db + int(dst[s]) * bpp, int(c) * bpp) for s, c in zip(starts, counts)]
    assert list(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist())) == want
    assert len(paired.groups) == 2  # rows (target, draft) and values_then_scales (index K): both layouts ran
