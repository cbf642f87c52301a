"""kvbridge's lane rules against SGLang's own CP page filters (0.5.23), replayed
the way SGLang's sender applies them: chunk by chunk."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from sglang.srt.disaggregation import utils  # noqa: E402

from kvbridge import OwnerLanes  # noqa: E402


def _chunks(num_pages: int, cuts: list[int]) -> list[tuple[int, int]]:
    """Chunk boundaries of a chunked prefill, in pages."""
    bounds = sorted({0, num_pages, *(c % (num_pages + 1) for c in cuts)})
    return list(zip(bounds, bounds[1:]))


@settings(max_examples=150, deadline=None)
@given(cp=st.integers(2, 8), num_pages=st.integers(0, 120), cuts=st.lists(st.integers(0, 200), max_size=4))
def test_all_cp_ranks_mode_is_the_balanced_rule(cp, num_pages, cuts):
    """CommonKVSender._prepare_send_indices -> filter_kv_indices_for_cp_rank keeps, per
    chunk, the positions inside the rank's _get_cp_rank_page_bounds run."""
    lanes = OwnerLanes(cp, "balanced")
    page_ids = np.arange(1000, 1000 + num_pages)  # any physical pages
    for rank in range(cp):
        mgr = SimpleNamespace(attn_cp_rank=rank, attn_cp_size=cp)
        sent = []
        for start, stop in _chunks(num_pages, cuts):
            kept, positions = utils.filter_kv_indices_for_cp_rank(mgr, page_ids[start:stop], slice(start, stop),
                                                                  total_pages=num_pages)  # fmt: skip
            assert kept.tolist() == page_ids[positions].tolist()
            sent.extend(range(positions.start, positions.stop))
        assert sent == lanes.owned_pages(rank, num_pages).tolist()
        sizes = [len(lanes.owned_pages(r, num_pages)) for r in range(cp)]
        assert utils._get_cp_rank_page_bounds(num_pages, rank, cp) == (sum(sizes[:rank]), sum(sizes[: rank + 1]))


def test_contiguous_is_not_sglangs_split():
    assert utils._get_cp_rank_page_bounds(4, 2, 3) == (3, 4)
    assert OwnerLanes(3, "contiguous").owned_pages(2, 4).tolist() == []
    assert OwnerLanes(3, "balanced").owned_pages(2, 4).tolist() == [3]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 4), num_pages=st.integers(0, 60), base=st.integers(0, 30), rotation=st.integers(0, 3))
def test_kv_cache_sharding_is_interleaved_when_page_ids_follow_positions(n, num_pages, base, rotation):
    """filter_kv_indices_for_shard_rank gives page l to rank (page id % N). The
    allocator hands a request's pages round-robin from a rotation base; with base 0
    that is kvbridge's interleaved rule, otherwise it is the rule shifted."""
    rotation %= n
    page_ids = np.array([(base + p) * n + (p + rotation) % n for p in range(num_pages)], dtype=np.int64)
    lanes = OwnerLanes(n, "interleaved")
    for rank in range(n):
        local, positions = utils.filter_kv_indices_for_shard_rank(
            kv_indices=page_ids, index_slice=slice(0, num_pages), shard_rank=rank, shard_size=n)
        assert local.tolist() == (page_ids[positions] // n).tolist()
        expected = lanes.owned_pages((rank - rotation) % n, num_pages)
        assert positions.tolist() == expected.tolist()
