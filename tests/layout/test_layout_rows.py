"""Row domains, padding stripping and CP-local row order (hard rules 1 and 2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import LayoutError, PaddingError
from kvbridge.layout import (
    LANE_RULES,
    OwnerLanes,
    RowDomain,
    build_rank_rows,
    deepseek_pools,
    local_row_order,
    request_bases,
    strip_padding,
    valid_row_index,
)

FAST = settings(max_examples=80, deadline=None)
domains_st = st.lists(st.builds(RowDomain, st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)), max_size=5)


@FAST
@given(domains_st)
def test_strip_padding_keeps_exactly_the_valid_rows(domains):
    # valid rows carry their (request, k) label; padding rows carry -1
    parts = [
        np.concatenate([q * 100 + np.arange(d.num_valid), -np.ones(d.num_padding, dtype=int)])
        for q, d in enumerate(domains)
    ]
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype=int)
    kept = strip_padding(rows, domains)
    assert kept.tolist() == [q * 100 + k for q, d in enumerate(domains) for k in range(d.num_valid)]
    assert request_bases(domains).tolist() == np.cumsum([0] + [d.num_rows for d in domains])[:-1].tolist()


def test_padding_counts_that_do_not_add_up():
    domains = [RowDomain(3, 1, 0), RowDomain(4, 0, 2), RowDomain(2, 0, 0)]  # 4 + 6 + 2 = 12 rows
    with pytest.raises(
        PaddingError,
        match=r"9 rows but request 1 \(valid 4 \+ compute padding 0 \+ static padding 2 = 6 rows at base 4\)"
        r".*account for 12",
    ) as info:
        strip_padding(np.zeros((9, 3)), domains)  # a 9-row tensor: request 1 runs past the end
    assert info.value.field == "rows"
    with pytest.raises(PaddingError, match=r"2 rows after request 2 have no recorded provenance"):
        strip_padding(np.zeros((14, 3)), domains)
    # a length coincidence never stands in for provenance: same length, different domains, different rows
    rows = np.arange(12)
    assert strip_padding(rows, domains).tolist() != strip_padding(rows, [RowDomain(12, 0, 0)]).tolist()
    for bad in ((-1, 0, 0), (1, -2, 0), (1, 0, 1.5)):
        with pytest.raises(PaddingError):
            RowDomain(*bad)


def test_rank_local_order_for_a_batch_is_not_global_order():
    """bs=2, cp=2 interleaved, page size 2; rank 1 owns logical page 1 of request 0
    (tokens 2, 3) and pages 1, 3 of request 1 (tokens 2, 3 and 6 + one compute-padding row).

        rank 1 flat rows: | r0 t2 | r0 t3 | S | r1 t2 | r1 t3 | r1 t6 | C | S | S |
                            base 0               base 3 (NOT 5 = seq_lens[0])
    """
    lanes = OwnerLanes(2)
    tables = [np.array([4]), np.array([0, 9])]  # local page -> physical page on rank 1
    order = local_row_order(1, [5, 7], 2, lanes, tables, static_padding=[1, 2])
    assert order.domains == (RowDomain(2, 0, 1), RowDomain(3, 1, 2))
    assert order.bases.tolist() == [0, 3]
    assert order.row_ids.tolist() == [0, 1, 3, 4, 5]
    assert order.req_ids.tolist() == [0, 0, 1, 1, 1] and order.positions.tolist() == [2, 3, 2, 3, 6]
    assert order.slots.tolist() == [8, 9, 0, 1, 18]  # physical page * 2 + offset
    tokens = [np.arange(5) + 10, np.arange(7) + 20]  # row value = 10*(req+1) + token
    flat = build_rank_rows(tokens, order, fill=-1)
    assert flat.tolist() == [12, 13, -1, 22, 23, 26, -1, -1, -1]
    assert strip_padding(flat, order.domains).tolist() == [12, 13, 22, 23, 26]
    # the same rows read with global request bases (0, seq_lens[0]) would be wrong
    global_ids = np.array([0, 1, 5, 6, 7])
    assert flat[global_ids].tolist() != [12, 13, 22, 23, 26]


@FAST
@given(
    seq_lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    cp_size=st.integers(1, 4),
    rule=st.sampled_from(LANE_RULES),
    data=st.data(),
)
def test_ranks_together_cover_every_token_once(seq_lens, page_size, cp_size, rule, data):
    lanes = OwnerLanes(cp_size, rule)
    static = data.draw(st.lists(st.integers(0, 4), min_size=len(seq_lens), max_size=len(seq_lens)))
    seen = [np.zeros(n, dtype=int) for n in seq_lens]
    for rank in range(cp_size):
        sizes = [lanes.num_local_pages(rank, -(-n // page_size)) for n in seq_lens]
        perm = np.random.default_rng(rank).permutation(sum(sizes) + 1)
        tables = np.split(perm[: sum(sizes)], np.cumsum(sizes)[:-1])
        order = local_row_order(rank, seq_lens, page_size, lanes, tables, static)
        for q, pos in zip(order.req_ids, order.positions):
            seen[q][pos] += 1
        assert len(np.unique(order.slots)) == order.num_valid  # distinct cache slots on this rank
        assert np.array_equal(order.row_ids, valid_row_index(order.domains))
        # compute padding is exactly the partial page's tail, on the rank that owns that page
        for q, (n, dom) in enumerate(zip(seq_lens, order.domains)):
            last_owner = lanes.owner_of_token(n - 1, page_size, -(-n // page_size))
            tail = (page_size - n % page_size) % page_size
            assert dom.num_compute_padding == (tail if last_owner == rank else 0)
            assert dom.num_static_padding == static[q]
    assert all((s == 1).all() for s in seen)


def test_write_rows_and_read_rows_follow_the_in_page_layout():
    index = deepseek_pools(num_layers=1, page_size=4, kv_dtype="fp8")["index"]
    pages = np.zeros((3, index.bytes_per_page), dtype=np.uint8)
    rows = np.arange(2 * 132, dtype=np.uint32).reshape(2, 132).astype(np.uint8)
    index.write_rows(pages, np.array([5, 6]), rows)  # page 1, offsets 1 and 2
    assert np.array_equal(pages[1, 128:384].reshape(2, 128), rows[:, :128])
    assert np.array_equal(pages[1, 512 + 4 : 512 + 12].reshape(2, 4), rows[:, 128:])
    assert pages.sum() == rows.astype(int).sum()
    assert np.array_equal(index.read_rows(pages, np.array([5, 6])), rows)
    with pytest.raises(LayoutError):
        index.write_rows(pages, np.array([12]), rows[:1])  # 3 pages x 4 slots


def test_local_row_order_rejects_short_tables():
    with pytest.raises(LayoutError, match="local page table has 1 pages, rank stores 3"):
        local_row_order(0, [9], 2, OwnerLanes(2), [np.array([0])])
    with pytest.raises(LayoutError, match="2 requests but 1 page tables"):
        local_row_order(0, [3, 3], 2, OwnerLanes(1), [np.array([0, 1])])
