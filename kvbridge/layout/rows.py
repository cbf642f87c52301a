"""Row domains and CP-local row order (hard rules 1 and 2).

A CP rank's flat row tensor for a batch is, request by request in *batch order*,
only the rows that rank computes:

    request 0                              request 1
    | owned valid | compute pad | static pad | owned valid | compute pad | static pad |
    ^ base 0                                 ^ base 1 = rows of request 0 on THIS rank

* owned valid rows: the request's real tokens on the pages the rank owns,
  ascending token order (pages ascending, then offset);
* compute padding: the tail of the rank's partial last owned page (the page
  holding the request's last token, when it is not full): dummy rows the rank
  computes so that it works on whole pages;
* static padding: rows added so every DP rank runs the same shape; dummy.

Bases are *rank-local* offsets, never global token offsets. Padding is removed
only through an explicit ``RowDomain`` per request, never inferred from shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import LayoutError, PaddingError
from kvbridge.layout.lanes import OwnerLanes


@dataclass(frozen=True)
class RowDomain:
    """Where one request's rows on one CP rank come from."""

    num_valid: int
    num_compute_padding: int
    num_static_padding: int

    def __post_init__(self) -> None:
        for name in ("num_valid", "num_compute_padding", "num_static_padding"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise PaddingError(f"row domain {name} must be a non-negative integer, got {value!r}", field=name)

    @property
    def num_padding(self) -> int:
        return self.num_compute_padding + self.num_static_padding

    @property
    def num_rows(self) -> int:
        return self.num_valid + self.num_padding


def request_bases(domains: Sequence[RowDomain]) -> np.ndarray:
    """Rank-local offset of each request's first row (exclusive prefix sum)."""
    sizes = np.array([d.num_rows for d in domains], dtype=np.int64)
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if len(sizes) else sizes


def valid_row_index(domains: Sequence[RowDomain], num_rows: int | None = None) -> np.ndarray:
    """Indices of the valid rows in a rank's flat row tensor, in order. With
    ``num_rows`` (the tensor's length), checks that the domains account for
    every row, naming the first request where they stop adding up."""
    bases = request_bases(domains)
    if num_rows is not None:
        _check_total(domains, bases, num_rows)
    counts = np.array([d.num_valid for d in domains], dtype=np.int64)
    if not counts.sum():
        return np.zeros(0, dtype=np.int64)
    # row k of request q sits at bases[q] + k: repeat each base, add a ramp that restarts per request
    starts = np.repeat(bases, counts)
    ramp = np.arange(counts.sum(), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return starts + ramp


def strip_padding(rows: np.ndarray, domains: Sequence[RowDomain]) -> np.ndarray:
    """Exactly the valid rows of a rank's flat row tensor (first axis = rows)."""
    return rows[valid_row_index(domains, num_rows=len(rows))]


def _check_total(domains: Sequence[RowDomain], bases: np.ndarray, num_rows: int) -> None:
    total = int(sum(d.num_rows for d in domains))
    if total == num_rows:
        return
    for q, (d, base) in enumerate(zip(domains, bases)):
        if base + d.num_rows > num_rows:
            raise PaddingError(
                f"row tensor has {num_rows} rows but request {q} (valid {d.num_valid} + compute padding "
                f"{d.num_compute_padding} + static padding {d.num_static_padding} = {d.num_rows} rows at "
                f"base {base}) ends at row {base + d.num_rows}; the domains account for {total} rows",
                field="rows",
            )
    raise PaddingError(
        f"row tensor has {num_rows} rows but the {len(domains)} requests' domains account for {total}: "
        f"{num_rows - total} rows after request {len(domains) - 1} have no recorded provenance",
        field="rows",
    )


@dataclass(frozen=True, eq=False)
class LocalRows:
    """One CP rank's rows of a batch, in rank-local valid order (hard rule 2).

    ``row_ids[i]`` is where owned valid row ``i`` sits in the rank's flat row
    tensor; ``req_ids[i]`` / ``positions[i]`` say which request and token it is;
    ``slots[i]`` is its cache slot ``physical_page * page_size + offset`` in the
    rank's own pool."""

    cp_rank: int
    seq_lens: tuple[int, ...]
    domains: tuple[RowDomain, ...]
    bases: np.ndarray
    row_ids: np.ndarray
    req_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(sum(d.num_rows for d in self.domains))

    @property
    def num_valid(self) -> int:
        return len(self.row_ids)


def local_row_order(
    cp_rank: int,
    seq_lens: Sequence[int],
    page_size: int,
    lanes: OwnerLanes,
    local_page_tables: Sequence[np.ndarray],
    static_padding: Sequence[int] | None = None,
) -> LocalRows:
    """Rank-local row order of a batch for one CP rank. ``local_page_tables[q]``
    maps request ``q``'s local page index on this rank to a physical page of
    this rank's pool."""
    if page_size <= 0:
        raise LayoutError(f"page_size must be positive, got {page_size}", rank=cp_rank, field="page_size")
    num_reqs = len(seq_lens)
    static = [0] * num_reqs if static_padding is None else list(static_padding)
    if len(local_page_tables) != num_reqs or len(static) != num_reqs:
        raise LayoutError(
            f"{num_reqs} requests but {len(local_page_tables)} page tables and {len(static)} static paddings",
            rank=cp_rank,
            field="local_page_tables",
        )
    domains, positions, req_ids, slots = [], [], [], []
    for q, (seq_len, table) in enumerate(zip(seq_lens, local_page_tables)):
        if seq_len <= 0:
            raise LayoutError(f"request {q}: seq_len must be positive, got {seq_len}", rank=cp_rank, field="seq_lens")
        num_pages = -(-seq_len // page_size)
        owned = lanes.owned_pages(cp_rank, num_pages)
        table = np.asarray(table, dtype=np.int64).reshape(-1)
        if len(table) < lanes.num_local_pages(cp_rank, num_pages):
            raise LayoutError(
                f"request {q}: local page table has {len(table)} pages, rank stores "
                f"{lanes.num_local_pages(cp_rank, num_pages)}",
                rank=cp_rank,
                field="local_page_tables",
            )
        _, local = lanes.owners(owned, num_pages)
        tokens = (owned[:, None] * page_size + np.arange(page_size)).reshape(-1)
        page_slots = (table[local][:, None] * page_size + np.arange(page_size)).reshape(-1)
        keep = tokens < seq_len
        num_valid = int(keep.sum())
        domains.append(RowDomain(num_valid, len(tokens) - num_valid, int(static[q])))
        positions.append(tokens[keep])
        slots.append(page_slots[keep])
        req_ids.append(np.full(num_valid, q, dtype=np.int64))
    bases = request_bases(domains)
    return LocalRows(
        cp_rank=cp_rank,
        seq_lens=tuple(int(n) for n in seq_lens),
        domains=tuple(domains),
        bases=bases,
        row_ids=valid_row_index(domains),
        req_ids=_cat(req_ids),
        positions=_cat(positions),
        slots=_cat(slots),
    )


def build_rank_rows(global_rows: Sequence[np.ndarray], order: LocalRows, fill: int | float = 0) -> np.ndarray:
    """The flat row tensor a CP forward pass would give this rank:
    ``global_rows[q]`` (shape ``(seq_len, ...)``) holds request ``q``'s rows in
    token order; owned valid rows are gathered in rank-local order and every
    padding row is ``fill``. The rank never needs more than its own rows; this
    helper is for tests and the demo, where the global rows are synthetic."""
    if len(global_rows) != len(order.seq_lens):
        raise LayoutError(f"{len(global_rows)} row arrays for {len(order.seq_lens)} requests", field="global_rows")
    for q, (rows, seq_len) in enumerate(zip(global_rows, order.seq_lens)):
        if len(rows) != seq_len:
            raise LayoutError(f"request {q}: {len(rows)} rows for {seq_len} tokens", field="global_rows")
    if not global_rows:
        return np.zeros(0)
    first = np.asarray(global_rows[0])
    flat = np.full((order.num_rows, *first.shape[1:]), fill, dtype=first.dtype)
    picked = [np.asarray(rows)[order.positions[order.req_ids == q]] for q, rows in enumerate(global_rows)]
    flat[order.row_ids] = np.concatenate(picked)
    return flat


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
