"""Owner lanes: logical page -> (owner CP rank, local page)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbridge.layout
from kvbridge.errors import LayoutError
from kvbridge.layout import LANE_RULES, OwnerLanes

FAST = settings(max_examples=100, deadline=None)


def test_docstring_tables():
    pages = np.arange(8)
    assert [a.tolist() for a in OwnerLanes(3).owners(pages, 8)] == [[0, 1, 2, 0, 1, 2, 0, 1], [0, 0, 0, 1, 1, 1, 2, 2]]
    assert [a.tolist() for a in OwnerLanes(3, "contiguous").owners(pages, 8)] == [
        [0, 0, 0, 1, 1, 1, 2, 2],
        [0, 1, 2, 0, 1, 2, 0, 1],
    ]
    assert [a.tolist() for a in OwnerLanes(3, "replicated").owners(pages, 8)] == [[0] * 8, list(range(8))]
    assert [a.tolist() for a in OwnerLanes(3, "balanced").owners(pages, 8)] == [
        [0, 0, 0, 1, 1, 1, 2, 2],
        [0, 1, 2, 0, 1, 2, 0, 1],
    ]


def test_balanced_and_contiguous_split_differently():
    """4 pages over 3 ranks: ceil chunks (2 2 0) against base + remainder (2 1 1)."""
    sizes = {rule: [len(OwnerLanes(3, rule).owned_pages(r, 4)) for r in range(3)] for rule in ("contiguous", "balanced")}
    assert sizes == {"contiguous": [2, 2, 0], "balanced": [2, 1, 1]}
    assert OwnerLanes(3, "balanced").owners(np.arange(4), 4)[0].tolist() == [0, 0, 1, 2]


@FAST
@given(cp_size=st.integers(1, 9), num_pages=st.integers(0, 300))
def test_balanced_is_base_plus_remainder(cp_size, num_pages):
    """Rank r holds the run [r*base + min(r, rem), +base + (r < rem)): sizes differ by
    at most one, the longer runs first, runs back to back in rank order."""
    lanes = OwnerLanes(cp_size, "balanced")
    base, rem = divmod(num_pages, cp_size)
    start = 0
    for rank in range(cp_size):
        owned = lanes.owned_pages(rank, num_pages)
        size = base + (1 if rank < rem else 0)
        assert owned.tolist() == list(range(start, start + size))
        assert start == rank * base + min(rank, rem)
        start += size
    assert start == num_pages
    if num_pages:
        assert lanes.lane_major(num_pages).tolist() == list(range(num_pages))  # already rank-major


@FAST
@given(cp_size=st.integers(1, 6), rule=st.sampled_from(LANE_RULES), num_pages=st.integers(0, 200))
def test_owned_pages_partition_and_agree_with_owners(cp_size, rule, num_pages):
    lanes = OwnerLanes(cp_size, rule)
    owner, local = lanes.owners(np.arange(num_pages), num_pages)
    seen = np.zeros(num_pages, dtype=int)
    for rank in range(cp_size):
        owned = lanes.owned_pages(rank, num_pages)
        seen[owned] += 1
        assert np.all(np.diff(owned) > 0) and np.all(owner[owned] == rank)
        if rule != "replicated":
            # local indices of a rank's pages are 0..n-1, in logical order
            assert local[owned].tolist() == list(range(len(owned)))
            assert lanes.num_local_pages(rank, num_pages) == len(owned)
        else:
            assert lanes.num_local_pages(rank, num_pages) == num_pages
    assert (seen == 1).all()
    for token in range(0, num_pages * 3, 7):
        assert lanes.owner_of_token(token, 3, num_pages) == owner[token // 3]
    # one page in integers (the endpoints' aux owner) agrees with the vectorised rule
    assert [lanes.owner_of_page(p, num_pages) for p in range(num_pages)] == owner.tolist()
    with pytest.raises(LayoutError, match="outside a request"):
        lanes.owner_of_page(num_pages, num_pages)


def test_dict_round_trip_and_errors():
    for rule in LANE_RULES:
        lanes = OwnerLanes(4, rule)
        assert OwnerLanes.from_dict(lanes.to_dict()) == lanes
    with pytest.raises(LayoutError, match="rule"):
        OwnerLanes(2, "striped")
    with pytest.raises(LayoutError, match="cp_size"):
        OwnerLanes(0)
    with pytest.raises(LayoutError, match="keys"):
        OwnerLanes.from_dict({"cp_size": 2})
    with pytest.raises(LayoutError, match="logical page 5 outside a request of 5 pages"):
        OwnerLanes(2).owners(np.array([1, 5]), 5)
    with pytest.raises(LayoutError, match="cp rank 2 outside cp_size 2"):
        OwnerLanes(2).owned_pages(2, 5)
    with pytest.raises(LayoutError, match="token 10 outside"):
        OwnerLanes(2).owner_of_token(10, 2, 5)


def test_public_names_are_pinned():
    assert sorted(kvbridge.layout.__all__) == sorted(
        [
            "AuxRegion", "AuxRow", "AuxSchema", "BufferDesc", "LANE_RULES", "LAYOUTS", "LocalRows", "OwnerLanes", "PRESETS",
            "PoolSpec", "RawBuffer", "RowDomain", "TransferPlan", "aux_dtype", "build_rank_rows", "deepseek_pools",
            "describe_buffer", "float32_to_bf16_bits", "local_row_order", "owner_of_last_token", "plan_transfer",
            "preset_pools", "request_bases", "strip_padding", "valid_row_index",
            # heterogeneous TP (layout/heads.py)
            "HeadGeometry", "HeadSlice", "head_slices", "plan_head_transfer", "rank_heads", "slices_to_send",
            "pair_head_buffers", "tp_spec",
            # TP routes: which prefill TP ranks a decode TP rank draws each pool from (layout/tp_routes.py)
            "TPRoute", "num_drawing", "tp_route",
            # staged transfers: chunks through staging slots, and when to use them (layout/staging.py)
            "PathThresholds", "StagedPlan", "choose_path", "stage_plan",
            # pipeline-parallel prefill: a stage's layers of every pool, the tiling rule (layout/stages.py)
            "check_stage_layers", "layer_range_specs", "stage_conflict", "stage_layer_ids", "stage_specs",
            # pool kinds beyond paged KV and hybrid models' pools (layout/kinds.py, layout/hybrid.py)
            "KINDS", "KIND_PRESETS", "Extent", "check_kind_topology", "chunk_extent", "compressed_pool",
            "deepseek_v4_layer_types", "deepseek_v4_pools", "lane_units", "mamba_pools", "needed_bytes",
            "needed_extent", "plan_kind", "row_bytes", "state_pool", "state_slices", "state_tp_spec", "tail_tokens",
            "window_pool",
            # the rooms' duplicate-page check, without np.unique's import of numpy.ma (layout/lanes.py)
            "has_repeats",
        ]
    )  # fmt: skip
    assert all(hasattr(kvbridge.layout, name) for name in kvbridge.layout.__all__)


def test_layout_is_pure():
    """layout imports numpy and kvbridge.errors only: no torch, sockets or other kvbridge parts."""
    code = (
        "import sys, kvbridge.layout; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'zmq', 'httpx', 'fastapi', 'mooncake') "
        "or m.startswith(('kvbridge.bootstrap', 'kvbridge.transfer', 'kvbridge.worker'))]; print(bad)"
    )
    # import the subpackage alone, bypassing kvbridge/__init__.py's own imports
    out = subprocess.run(
        [sys.executable, "-c", "import sys, types; sys.modules['kvbridge'] = types.ModuleType('kvbridge'); "
         f"sys.modules['kvbridge'].__path__ = {list(kvbridge.__path__)!r}; " + code.replace("import sys, ", "import ")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@FAST
@given(cp_size=st.integers(1, 5), rule=st.sampled_from(LANE_RULES), num_tokens=st.integers(1, 300),
       page_size=st.sampled_from([1, 4, 16]), base=st.integers(0, 50))
def test_lane_major_destination_gives_one_run_per_rank(cp_size, rule, num_tokens, page_size, base):
    """A lane-major block on decode turns per-page slices into one run per CP rank."""
    from kvbridge.layout import BufferDesc, plan_transfer, preset_pools

    lanes = OwnerLanes(cp_size, rule)
    num_pages = -(-num_tokens // page_size)
    pos = lanes.lane_major(num_pages)
    assert sorted(pos.tolist()) == list(range(num_pages))  # a permutation of the block
    specs = preset_pools("deepseek-v3.2-fp8", num_layers=2, page_size=page_size)
    cap = base + num_pages + 1

    def bufs(shift):
        return [BufferDesc(p, layer, shift + 10**7 * (i + 1), cap, s.bytes_per_page)
                for i, (p, s) in enumerate(specs.items()) for layer in s.layer_ids]

    partial = num_tokens % page_size != 0
    for rank in range(cp_size):
        owned = lanes.owned_pages(rank, num_pages)
        if not owned.size:
            continue
        local = np.arange(owned.size)
        plan = plan_transfer(specs, bufs(0), bufs(1 << 40), owned, local, base + pos[owned], num_tokens)
        has_partial = partial and owned[-1] == num_pages - 1
        has_full = owned.size > 1 or not has_partial
        expected = 0
        for spec in specs.values():
            if spec.layout == "rows":
                expected += spec.num_layers  # the partial tail merges onto the run
            else:
                expected += spec.num_layers * (int(has_full) + 2 * int(has_partial))
        assert plan.num_slices == expected


def test_has_repeats_agrees_with_unique_without_importing_numpy_ma():
    """The rooms' duplicate-page check: the same answer as ``np.unique``, without its first call's
    import of ``numpy.ma`` (98 ms on a GPU host's first room)."""
    import subprocess
    import sys

    from kvbridge.layout import has_repeats

    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 7, 300):
        for hi in (2, 10, 10**6):
            values = rng.integers(0, hi, n)
            assert has_repeats(values) == (np.unique(values).size != values.size), (n, hi)
    code = ("import sys, numpy as np; from kvbridge.layout import has_repeats; "
            "has_repeats(np.array([3, 1, 3])); print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
