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
from kvbridge.layout.pairing import BufferDesc, PairedBuffers, describe_buffer, pair_buffers
from kvbridge.layout.pools import ROWS, PoolSpec

__all__ = ["BufferDesc", "PairedBuffers", "TransferPlan", "describe_buffer", "pair_buffers", "plan_transfer"]


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Slices to write: ``length[i]`` bytes from address ``src[i]`` to ``dst[i]``."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        arrays = [np.ascontiguousarray(a, dtype=np.uint64).reshape(-1) for a in (self.src, self.dst, self.length)]
        if not len(arrays[0]) == len(arrays[1]) == len(arrays[2]):
            raise LayoutError(f"plan arrays differ in length: {[len(a) for a in arrays]}", field="plan")
        for name, a in zip(("src", "dst", "length"), arrays):
            a.setflags(write=False)
            object.__setattr__(self, name, a)

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
    def empty(cls) -> TransferPlan:
        return cls(np.zeros(0), np.zeros(0), np.zeros(0))

    @classmethod
    def concat(cls, plans: Sequence[TransferPlan]) -> TransferPlan:
        if not plans:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, k) for p in plans]) for k in ("src", "dst", "length")))


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
) -> TransferPlan:
    """Plan the writes of ``logical_pages`` for every layer of every pool in
    ``pools`` (default: all of ``specs``). Everything is checked before anything
    is returned: an error means nothing may be written."""
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
    logical, src, dst, num_valid_last, paired = _checked_pages(
        logical_pages, src_pages, dst_pages, num_tokens, page_size, names, paired,
        lambda: pair_buffers(specs, src_bufs, dst_bufs, names, room=room, rank=rank), ctx,
    )
    pairs = paired.pairs
    _check_inside(paired, specs, specs, src, dst, logical, ctx)
    if not len(logical) or not names:
        return TransferPlan.empty()

    # position of the partial last page in the given order, if this call carries it
    last = (num_tokens - 1) // page_size
    partial = np.flatnonzero(logical == last) if num_valid_last < page_size else np.zeros(0, dtype=np.int64)
    parts = []
    runs: dict[bool, tuple[np.ndarray, np.ndarray]] = {}
    for spec, src_base, dst_base, _, _ in pairs:
        tail_merges = spec.layout == ROWS
        if tail_merges not in runs:
            runs[tail_merges] = _runs(src, dst, partial, tail_merges)
        parts.append((src_base, dst_base, *_layer_slices(spec, src, dst, *runs[tail_merges], partial, num_valid_last)))
    return _broadcast(parts)


def _checked_pages(
    logical_pages: Any, src_pages: Any, dst_pages: Any, num_tokens: int, page_size: int, names: tuple[str, ...],
    paired: PairedBuffers | None, pair: Callable[[], PairedBuffers], ctx: dict[str, Any],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, PairedBuffers]:
    """A plan's page arrays and token count checked, and its buffers paired (``pair()`` when
    ``paired`` is None): ``(logical, src, dst, valid rows of the last page, paired)``."""
    logical, src, dst = _page_arrays(logical_pages, src_pages, dst_pages, ctx)
    num_valid_last = _check_logical(logical, num_tokens, page_size, ctx)
    if paired is None:
        paired = pair()
    elif paired.pools != names:
        raise LayoutError(f"buffers paired for pools {paired.pools}, plan asked for {names}", field="pools", **ctx)
    return logical, src, dst, num_valid_last, paired


def _broadcast(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> TransferPlan:
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
        a = np.asarray(a)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise LayoutError(
                f"{name} must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}", field=name, **ctx
            )
        out.append(a.astype(np.int64, copy=False))
    if not len(out[0]) == len(out[1]) == len(out[2]):
        raise LayoutError(f"page arrays differ in length: {[len(a) for a in out]}", field="logical_pages", **ctx)
    return tuple(out)


def _check_logical(logical: np.ndarray, num_tokens: int, page_size: int, ctx: dict[str, Any]) -> int:
    """Checks the logical pages; returns the number of valid rows of the last page."""
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise LayoutError(f"num_tokens must be a non-negative integer, got {num_tokens!r}", field="num_tokens", **ctx)
    num_pages = -(-num_tokens // page_size)
    if len(logical) and (logical.min() < 0 or logical.max() >= num_pages):
        bad = logical[(logical < 0) | (logical >= num_pages)][0]
        raise LayoutError(
            f"logical page {bad} is outside the request's {num_pages} pages "
            f"({num_tokens} tokens, page size {page_size})",
            field="logical_pages",
            **ctx,
        )
    ordered = np.sort(logical)
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(dup):
        raise LayoutError(f"logical page {dup[0]} appears more than once in one plan", field="logical_pages", **ctx)
    return num_tokens - (num_pages - 1) * page_size if num_pages else page_size


def _check_inside(paired: PairedBuffers, src_specs: Mapping[str, Any], dst_specs: Mapping[str, Any], src: np.ndarray,
                 dst: np.ndarray, logical: np.ndarray, ctx: dict) -> None:
    """Hard rule 5 for a plan: every source and destination page inside every paired buffer.
    Two comparisons when they are (``PairedBuffers.all_inside``); else the first offending page
    is named, with its pool and layer."""
    src_span = (int(src.min()), int(src.max())) if len(src) else (0, -1)
    dst_span = (int(dst.min()), int(dst.max())) if len(dst) else (0, -1)
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


def _runs(src: np.ndarray, dst: np.ndarray, partial: np.ndarray, tail_merges: bool) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths (in entries) of runs consecutive on both sides. The
    partial page always ends its run; unless its tail merges (``rows`` layout)
    it also starts one, so it stands alone."""
    n = len(src)
    brk = np.ones(n, dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + 1) | (dst[1:] != dst[:-1] + 1)
    after = partial + 1
    brk[after[after < n]] = True
    if not tail_merges:
        brk[partial] = True
    starts = np.flatnonzero(brk)
    return starts, np.diff(np.append(starts, n))


def _layer_slices(
    spec: PoolSpec,
    src: np.ndarray,
    dst: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    partial: np.ndarray,
    num_valid_last: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slices of one layer, as offsets from its buffer bases."""
    bpp = np.uint64(spec.bytes_per_page)
    rel_src = src[starts].astype(np.uint64) * bpp
    rel_dst = dst[starts].astype(np.uint64) * bpp
    length = lengths.astype(np.uint64) * bpp
    if not len(partial):
        return rel_src, rel_dst, length
    p = int(partial[0])
    run = int(np.searchsorted(starts, p, side="right")) - 1
    if spec.layout == ROWS:
        # the partial page is the last page of its run: cut the run short by the page's tail
        length[run] -= np.uint64((spec.page_size - num_valid_last) * spec.bytes_per_token)
        return rel_src, rel_dst, length
    keep = np.arange(len(starts)) != run  # the partial page's own run is replaced by its row ranges
    ranges = spec.row_ranges(0, num_valid_last)
    offs = np.array([off for off, _ in ranges], dtype=np.uint64)
    lens = np.array([ln for _, ln in ranges], dtype=np.uint64)
    return (
        np.concatenate([rel_src[keep], np.uint64(src[p]) * bpp + offs]),
        np.concatenate([rel_dst[keep], np.uint64(dst[p]) * bpp + offs]),
        np.concatenate([length[keep], lens]),
    )
