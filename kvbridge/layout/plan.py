"""Transfer plans: which byte ranges to copy from prefill pools to decode pools
(hard rules 1, 3, 5 and 8).

One page mapping (``logical_pages[i]``: source page ``src_pages[i]`` -> destination
page ``dst_pages[i]``) serves every layer of every pool (target, index, draft).
Pages consecutive on both sides merge into one slice per (run, layer):

    src pages   7 8 9 | 3 | 12 13          3 runs x num_layers x num_pools slices
    dst pages   0 1 2 | 9 | 10 11

The request's last page is partial when ``num_tokens % page_size != 0``; only its
valid rows travel:

    rows                 [ valid rows | tail ]          one range; merges onto its run
    values_then_scales   [ valid values | tail | valid scales | tail ]  two ranges, own slices

Which buffers pair with which (by pool and layer id, hard rule 8) is ``pairing.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError, PageRangeError
from kvbridge.layout.pairing import BufferDesc, LayoutGroup, PairedBuffers, describe_buffer, pair_buffers
from kvbridge.layout.pools import PoolSpec

_I64 = np.dtype(np.int64)

# checked_pages, check_inside and broadcast_plan are the steps every planner shares (heads.py plans
# head slices with them)
__all__ = ["BufferDesc", "PairedBuffers", "TransferPlan", "broadcast_plan", "check_inside", "checked_pages",
           "describe_buffer", "pair_buffers", "plan_transfer"]


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Slices to write: ``length[i]`` bytes from address ``src[i]`` to ``dst[i]``.

    ``proven`` (None: not known): per slice, whether its source was checked inside the source
    buffers the planner was given (``plan_transfer``'s pages, hard rule 5), against a slice the
    caller added (``extra``: an aux row, which may lie anywhere). A staged plan's gather asks the
    stager's address look-up only for the slices not proven (``StagedPlan.gather_unproven``)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    proven: np.ndarray | None = None

    def __post_init__(self) -> None:
        arrays = [np.ascontiguousarray(a, dtype=np.uint64).reshape(-1) for a in (self.src, self.dst, self.length)]
        if not len(arrays[0]) == len(arrays[1]) == len(arrays[2]):
            raise LayoutError(f"plan arrays differ in length: {[len(a) for a in arrays]}", field="plan")
        for name, a in zip(("src", "dst", "length"), arrays):
            a.setflags(write=False)
            object.__setattr__(self, name, a)
        if self.proven is not None:
            proven = np.ascontiguousarray(self.proven, dtype=bool).reshape(-1)
            if len(proven) != len(arrays[0]):
                raise LayoutError(f"plan has {len(arrays[0])} slices but {len(proven)} proven flags", field="plan")
            proven.setflags(write=False)
            object.__setattr__(self, "proven", proven)

    @property
    def num_slices(self) -> int:
        return len(self.length)

    @property
    def num_bytes(self) -> int:
        return int(self.length.sum(dtype=np.uint64))

    def batches(self, max_slices: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Views of at most ``max_slices`` slices each (transfer engines cap a call)."""
        if max_slices < 1:
            raise LayoutError(f"max_slices must be positive, got {max_slices}", field="max_slices")
        for i in range(0, self.num_slices, max_slices):
            yield self.src[i : i + max_slices], self.dst[i : i + max_slices], self.length[i : i + max_slices]

    @classmethod
    def _of(cls, src: np.ndarray, dst: np.ndarray, length: np.ndarray, proven: np.ndarray | None = None
            ) -> TransferPlan:
        """A plan of three fresh 1-D uint64 arrays of one length (the planner's own), and its fresh
        bool ``proven`` flags or None, made read-only."""
        plan = object.__new__(cls)
        for name, a in (("src", src), ("dst", dst), ("length", length), ("proven", proven)):
            if a is not None:
                a.setflags(write=False)
            object.__setattr__(plan, name, a)
        return plan

    @classmethod
    def empty(cls) -> TransferPlan:
        return cls(np.zeros(0), np.zeros(0), np.zeros(0))

    @classmethod
    def concat(cls, plans: Sequence[TransferPlan]) -> TransferPlan:
        """The plans' slices in order; proven flags where every plan with slices has them."""
        if not plans:
            return cls.empty()
        flags = [p.proven if p.proven is not None or p.num_slices else np.zeros(0, dtype=bool) for p in plans]
        proven = None if any(f is None for f in flags) else np.concatenate(flags)
        return cls(*(np.concatenate([getattr(p, k) for p in plans]) for k in ("src", "dst", "length")), proven)


def plan_transfer(
    specs: Mapping[str, PoolSpec],
    src_bufs: Sequence[BufferDesc],
    dst_bufs: Sequence[BufferDesc],
    logical_pages: np.ndarray,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    num_tokens: int,
    *,
    pools: Sequence[str] | None = None,
    room: int | None = None,
    rank: str | None = None,
    paired: PairedBuffers | None = None,
    extra: tuple[Any, Any, Any] | None = None,
) -> TransferPlan:
    """Plan the writes of ``logical_pages`` for every layer of every pool in
    ``pools`` (default: all of ``specs``). Everything is checked before anything
    is returned: an error means nothing may be written. ``extra``: ``(src, dst,
    length)`` of slices the caller adds after the plan's (an aux row riding in the
    same write), written into the plan's arrays as they are."""
    ctx: dict[str, Any] = {"room": room, "rank": rank}
    names = tuple(specs) if pools is None else tuple(pools)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise LayoutError(f"pools {unknown} have no spec; known pools are {list(specs)}", field="pools", **ctx)
    page_sizes = {specs[n].page_size for n in names}
    if len(page_sizes) > 1:
        raise LayoutError(
            f"pools {names} share one page mapping but have page sizes {sorted(page_sizes)}", field="page_size", **ctx
        )
    page_size = page_sizes.pop() if names else 1
    logical, src, dst, increasing, num_valid_last, paired = checked_pages(
        logical_pages, src_pages, dst_pages, num_tokens, page_size, names, paired,
        lambda: pair_buffers(specs, src_bufs, dst_bufs, names, room=room, rank=rank), ctx,
    )
    pages = np.array((src, dst))  # (2, n): source and destination move through every step together
    if len(logical):
        (src_lo, dst_lo), (src_hi, dst_hi) = pages.min(axis=1).tolist(), pages.max(axis=1).tolist()
        spans = ((src_lo, src_hi), (dst_lo, dst_hi))
    else:
        spans = ((0, -1), (0, -1))
    check_inside(paired, specs, specs, src, dst, logical, ctx, spans)
    if not len(logical) or not names:
        return TransferPlan.empty() if extra is None else TransferPlan(*extra)
    # position of the partial last page in the given order, if this call carries it; ascending
    # logical pages (every chunk the endpoints plan) hold it at the end
    partial = -1
    if num_valid_last < page_size:
        last = (num_tokens - 1) // page_size
        if increasing:
            partial = len(logical) - 1 if logical[-1] == last else -1
        else:
            at = np.flatnonzero(logical == last)
            partial = int(at[0]) if len(at) else -1
    # whole pages only: every layout slices them alike, one broadcast over every layer of every group
    groups = paired.groups if partial >= 0 else (paired.whole_pages,)
    return _plan_groups(groups, pages, partial, page_size, num_valid_last, extra)


def _plan_groups(groups: Sequence[LayoutGroup], pages: np.ndarray, partial: int, page_size: int,
                 num_valid: int, extra: tuple[Any, Any, Any] | None = None) -> TransferPlan:
    """The slices of every layer of every group, one broadcast per group over its layers:

        runs (consecutive on both sides)     r0        r1   r2 (ends in the partial page p)
        slice (layer l, run r)               src_base[l] + src[start r] * bytes_per_page[l], ...
        rows                                 r2 cut short by p's tail rows
        values_then_scales                   p leaves its run for a slice of its valid value bytes
                                             (or keeps it, when p is the run) and one more slice
                                             of its valid scale bytes

    Written straight into the plan's arrays (a scattered 128K-token room is 126,000 slices
    per rank)."""
    n = pages.shape[1]
    brk = np.empty(n, dtype=bool)  # True where a run starts
    brk[0] = True
    if n > 1:
        np.logical_or.reduce(pages[:, 1:] - pages[:, :-1] != 1, axis=0, out=brk[1:])
    if 0 <= partial < n - 1:
        brk[partial + 1] = True  # the partial page always ends its run
    first, pages_in_run, run = _runs_of(brk, pages, partial)  # the partial page ends its run
    # values_then_scales: the partial page leaves its run (unless it is the run) for two ranges
    alone = partial >= 0 and int(pages_in_run[run]) == 1
    r = len(pages_in_run)
    shapes = [(g.num_layers, r + (0 if partial < 0 or g.rows else 1 if alone else 2)) for g in groups]
    total = sum(layers * cols for layers, cols in shapes)
    size = total + (len(extra[2]) if extra is not None else 0)
    addr, length = np.empty((2, size), dtype=np.uint64), np.empty(size, dtype=np.uint64)  # addr: src, dst rows
    proven = np.ones(size, dtype=bool)  # the pages' slices: checked inside the source buffers (check_inside)
    if extra is not None:
        addr[0, total:], addr[1, total:], length[total:] = extra
        proven[total:] = False  # the caller's (an aux row): anywhere
    at = 0
    for g, (layers, cols) in zip(groups, shapes):
        a = addr[:, at : at + layers * cols].reshape(2, layers, cols)
        ln = length[at : at + layers * cols].reshape(layers, cols)
        np.multiply(g.bytes_per_page, first, out=a[:, :, :r])
        a[:, :, :r] += g.bases
        np.multiply(g.bytes_per_page, pages_in_run, out=ln[:, :r])
        at += layers * cols
        if partial < 0:
            continue
        if g.rows:  # the run keeps the partial page's valid rows, a prefix of it
            ln[:, run : run + 1] -= g.row_bytes * (page_size - num_valid)
            continue
        values = run  # the column of the page's valid value bytes: its run, when that is the page alone
        if not alone:  # else the run loses the page, which gets a column of its own
            ln[:, run : run + 1] -= g.bytes_per_page
            values = r
            a[:, :, r : r + 1] = g.bytes_per_page * pages[:, None, partial : partial + 1].view(np.uint64) + g.bases
        ln[:, values : values + 1] = g.row_bytes * num_valid
        a[:, :, cols - 1 :] = a[:, :, values : values + 1] + g.scale_offset  # the valid scale bytes: last column
        ln[:, cols - 1 :] = g.scale_bytes * num_valid
    addr.setflags(write=False)
    return TransferPlan._of(addr[0], addr[1], length, proven)


def _runs_of(brk: np.ndarray, pages: np.ndarray, partial: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The first (source, destination) page of each run as a ``(2, 1, runs)`` uint64 array,
    the pages in each run, and the run holding the partial page (-1: none)."""
    if not brk[1:].any():  # one run (contiguous on both sides): the common case of a small room
        return pages[:, None, :1].view(np.uint64), np.array([len(brk)], dtype=np.uint64), 0 if partial >= 0 else -1
    starts = np.flatnonzero(brk)
    count = np.empty_like(starts)
    count[:-1] = starts[1:] - starts[:-1]
    count[-1] = len(brk) - starts[-1]
    run = -1
    if partial >= 0:
        run = len(starts) - 1 if partial == len(brk) - 1 else int(np.searchsorted(starts, partial, side="right")) - 1
    # pages were checked non-negative: their int64 bits are their uint64 values
    return pages[:, None, starts].view(np.uint64), count.view(np.uint64), run


def checked_pages(
    logical_pages: Any, src_pages: Any, dst_pages: Any, num_tokens: int, page_size: int, names: tuple[str, ...],
    paired: PairedBuffers | None, pair: Callable[[], PairedBuffers], ctx: dict[str, Any],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool, int, PairedBuffers]:
    """A plan's page arrays and token count checked, and its buffers paired (``pair()`` when
    ``paired`` is None): ``(logical, src, dst, whether logical ascends, valid rows of the last
    page, paired)``."""
    logical, src, dst = _page_arrays(logical_pages, src_pages, dst_pages, ctx)
    increasing, num_valid_last = _check_logical(logical, num_tokens, page_size, ctx)
    if paired is None:
        paired = pair()
    elif paired.pools != names:
        raise LayoutError(f"buffers paired for pools {paired.pools}, plan asked for {names}", field="pools", **ctx)
    return logical, src, dst, increasing, num_valid_last, paired


def broadcast_plan(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> TransferPlan:
    """The plan of ``parts`` = (src layer bases, dst layer bases, src offsets, dst offsets,
    lengths): every layer shares the page mapping, so the per-layer slices broadcast over the
    layer bases, written straight into the plan's arrays (no concatenation: a scattered
    128K-token room is 126,000 slices per rank)."""
    total = sum(len(sb) * len(ln) for sb, _, _, _, ln in parts)
    out = [np.empty(total, dtype=np.uint64) for _ in range(3)]
    at = 0
    for src_base, dst_base, rel_src, rel_dst, length in parts:
        rows, cols = len(src_base), len(length)
        np.add(src_base[:, None], rel_src[None, :], out=out[0][at : at + rows * cols].reshape(rows, cols))
        np.add(dst_base[:, None], rel_dst[None, :], out=out[1][at : at + rows * cols].reshape(rows, cols))
        out[2][at : at + rows * cols].reshape(rows, cols)[:] = length[None, :]
        at += rows * cols
    return TransferPlan(*out)


def _page_arrays(logical: Any, src: Any, dst: Any, ctx: dict[str, Any]) -> tuple[np.ndarray, ...]:
    out = []
    for name, a in (("logical_pages", logical), ("src_pages", src), ("dst_pages", dst)):
        if type(a) is not np.ndarray or a.dtype != _I64 or a.ndim != 1:  # (what the endpoints pass: as it is)
            a = np.asarray(a)
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise LayoutError(
                    f"{name} must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}", field=name, **ctx
                )
            a = a.astype(np.int64, copy=False)
        out.append(a)
    if not len(out[0]) == len(out[1]) == len(out[2]):
        raise LayoutError(f"page arrays differ in length: {[len(a) for a in out]}", field="logical_pages", **ctx)
    return tuple(out)


def _check_logical(logical: np.ndarray, num_tokens: int, page_size: int, ctx: dict[str, Any]) -> tuple[bool, int]:
    """Checks the logical pages (inside the request, each once); returns whether they ascend
    and the number of valid rows of the last page."""
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise LayoutError(f"num_tokens must be a non-negative integer, got {num_tokens!r}", field="num_tokens", **ctx)
    num_pages = -(-num_tokens // page_size)
    num_valid_last = num_tokens - (num_pages - 1) * page_size if num_pages else page_size
    if not len(logical):
        return True, num_valid_last
    increasing = len(logical) == 1 or bool((logical[1:] > logical[:-1]).all())  # then also each page once
    lo, hi = (int(logical[0]), int(logical[-1])) if increasing else (int(logical.min()), int(logical.max()))
    if lo < 0 or hi >= num_pages:
        bad = logical[(logical < 0) | (logical >= num_pages)][0]
        raise LayoutError(
            f"logical page {bad} is outside the request's {num_pages} pages "
            f"({num_tokens} tokens, page size {page_size})",
            field="logical_pages",
            **ctx,
        )
    if not increasing:
        ordered = np.sort(logical)
        dup = ordered[1:][ordered[1:] == ordered[:-1]]
        if len(dup):
            raise LayoutError(f"logical page {dup[0]} appears more than once in one plan", field="logical_pages", **ctx)
    return increasing, num_valid_last


def check_inside(paired: PairedBuffers, src_specs: Mapping[str, Any], dst_specs: Mapping[str, Any], src: np.ndarray,
                 dst: np.ndarray, logical: np.ndarray, ctx: dict,
                 spans: tuple[tuple[int, int], tuple[int, int]] | None = None) -> None:
    """Hard rule 5 for a plan: every source and destination page inside every paired buffer.
    Two comparisons when they are (``PairedBuffers.all_inside``); else the first offending page
    is named, with its pool and layer. ``spans``: the (min, max) of each side, when known."""
    if spans is None:
        spans = ((int(src.min()), int(src.max())) if len(src) else (0, -1),
                 (int(dst.min()), int(dst.max())) if len(dst) else (0, -1))
    src_span, dst_span = spans
    if paired.all_inside(src_span, dst_span):
        return
    for name, (_, _, _, src_cap, dst_cap) in zip(paired.pools, paired.pairs):
        _check_range(src_specs[name], "source", src, src_cap, logical, ctx, src_span)
        _check_range(dst_specs[name], "destination", dst, dst_cap, logical, ctx, dst_span)


def _check_range(
    spec: PoolSpec, side: str, pages: np.ndarray, caps: np.ndarray, logical: np.ndarray, ctx: dict,
    span: tuple[int, int] | None = None,
) -> None:
    """Hard rule 5: every page inside the registered region of every layer (``span``: the pages' min
    and max, when the caller has them)."""
    if not len(pages):
        return
    lo, hi = span if span is not None else (pages.min(), pages.max())
    bad_layers = np.flatnonzero((caps <= hi) | (lo < 0))
    if not len(bad_layers):
        return
    j = bad_layers[0]
    cap = int(caps[j])
    i = np.flatnonzero((pages < 0) | (pages >= cap))[0]
    raise PageRangeError(
        f"pool {spec.name!r} layer {spec.layer_ids[j]}: {side} page {pages[i]} (logical page {logical[i]}) is "
        f"outside the registered region of {cap} pages",
        field="src_pages" if side == "source" else "dst_pages",
        **ctx,
    )
