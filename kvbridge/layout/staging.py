"""Staged transfers as plans: a room's slices packed into fixed-size staging slots.

A scattered room is tens of thousands of small slices; posting each costs the same
per-slice overhead on every transport. Staged, the sender *gathers* them into a
registered staging buffer, the wire carries a few large contiguous *pieces* into the
receiver's staging slot, and the receiver *scatters* them into its pages:

    plan slices      s0 (41,984 B)  s1 (41,984 B)  s2 (41,984 B)  s3 (8,448 B: a partial page)  ...
    stream           |s0           |s1           |s2           |s3   |pad|s4 ...     (offsets aligned)
    chunks           |<------------ slot_bytes ------------>|<------------ slot_bytes ------...
                      chunk 0: s0, s1, the head of s2        chunk 1: the tail of s2, s3, ...
    gather           src[i] -> slot offset (sender's slot)   merged where both sides run on
    wire             [0, span) of the slot in pieces of at most max_piece_bytes
    scatter          slot offset (receiver's slot) -> dst[i] merged where both sides run on

Every slice of the plan, with its exact length, appears once across the chunks, so
whatever the plan guarantees holds staged: only valid rows (a partial ``values_then_scales``
page is its two ranges), one page mapping for every pool, pages checked against both
sides' registered capacities (hard rules 1, 3, 5). A head-sliced plan for heterogeneous
TP (``plan_head_transfer``: one range per valid row) is cut in the gather (the sender
packs only the heads the receiver takes) or in the scatter (the receiver spreads packed
rows over its wider rows); either way the wire carries whole pieces.

Offsets are relative to a slot: the executor adds the slot's address on each side, and
the two sides may use different slots for the same chunk. Nothing here touches memory.

``choose_path`` decides per target whether staging pays: direct when the slices are few
and large (gather and scatter then cost more than they save), staged when they are many
and small. Where that turns is a property of the engine and its transport, measured per
pair: the caller passes the thresholds (``PathThresholds``, or None for a route never
staged: an engine that copies scattered slices in one launch, Mooncake TCP on host pages);
this module knows no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError
from kvbridge.layout.plan import TransferPlan

__all__ = [
    "PATHS",
    "PathThresholds",
    "StagedPlan",
    "choose_path",
    "stage_plan",
]

PATHS = ("direct", "staged")
ALIGN = 16  # every slice starts 16-byte aligned in the slot: the GPU slice kernel's vector path
MAX_PIECE_BYTES = 16 << 20  # one wire piece: large enough that per-slice cost vanishes on every transport

_U64 = np.uint64


@dataclass(frozen=True, eq=False)
class StagedPlan:
    """A room's slices as chunks of at most ``slot_bytes`` each.

    Three lists of ``(a, b, length)`` entries, each grouped by chunk through its
    ``*_bounds`` array (entries of chunk ``k``: ``bounds[k]:bounds[k + 1]``):

    - gather: ``gather_src`` (absolute source address) -> ``gather_off`` (offset in the
      sender's slot);
    - wire: ``wire_off`` (offset in both slots) for ``wire_len`` bytes;
    - scatter: ``scatter_off`` (offset in the receiver's slot) -> ``scatter_dst``
      (absolute destination address).

    Per chunk: ``chunk_bytes`` (payload bytes staged) and ``chunk_span`` (bytes of the slot
    the wire carries: the payload plus alignment gaps). ``gather_proven`` (None: nothing
    proven): per gather entry, every part of it comes from a plan slice whose source the planner
    checked inside its source buffers (``TransferPlan.proven``): the gather need not look it up."""

    slot_bytes: int
    gather_src: np.ndarray
    gather_off: np.ndarray
    gather_len: np.ndarray
    gather_bounds: np.ndarray
    wire_off: np.ndarray
    wire_len: np.ndarray
    wire_bounds: np.ndarray
    scatter_off: np.ndarray
    scatter_dst: np.ndarray
    scatter_len: np.ndarray
    scatter_bounds: np.ndarray
    chunk_bytes: np.ndarray
    chunk_span: np.ndarray
    num_plan_slices: int
    gather_proven: np.ndarray | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_bytes)

    @property
    def num_bytes(self) -> int:
        """Payload bytes of the room (the plan's bytes)."""
        return int(self.chunk_bytes.sum())

    @property
    def num_wire_pieces(self) -> int:
        return len(self.wire_len)

    def gather(self, chunk: int, slot_base: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, length)`` that fill the sender's slot at ``slot_base`` for ``chunk``."""
        a, b = self._span(self.gather_bounds, chunk)
        return self.gather_src[a:b], self.gather_off[a:b] + _U64(slot_base), self.gather_len[a:b]

    def gather_unproven(self, chunk: int) -> np.ndarray | None:
        """Indices into ``gather(chunk)``'s entries whose sources are not proven inside the
        planner's source buffers (an aux row), or None when the plan proved none."""
        if self.gather_proven is None:
            return None
        a, b = self._span(self.gather_bounds, chunk)
        return np.flatnonzero(~self.gather_proven[a:b])

    def wire(self, chunk: int, src_slot: int, dst_slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, length)`` of the pieces from the sender's slot to the receiver's."""
        a, b = self._span(self.wire_bounds, chunk)
        off = self.wire_off[a:b]
        return off + _U64(src_slot), off + _U64(dst_slot), self.wire_len[a:b]

    def scatter(self, chunk: int, slot_base: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src, dst, length)`` that empty the receiver's slot at ``slot_base`` into the pages."""
        a, b = self._span(self.scatter_bounds, chunk)
        return self.scatter_off[a:b] + _U64(slot_base), self.scatter_dst[a:b], self.scatter_len[a:b]

    def counts(self) -> dict[str, np.ndarray]:
        """Per chunk, for stats: slices gathered, slices scattered, bytes staged, wire pieces."""
        return {
            "gather_slices": np.diff(self.gather_bounds),
            "scatter_slices": np.diff(self.scatter_bounds),
            "bytes_staged": self.chunk_bytes.copy(),
            "wire_pieces": np.diff(self.wire_bounds),
        }

    def stats(self) -> dict[str, int]:
        """Room totals (what a sender's stats and a bench row show)."""
        return {
            "plan_slices": self.num_plan_slices,
            "chunks": self.num_chunks,
            "gather_slices": len(self.gather_len),
            "scatter_slices": len(self.scatter_len),
            "wire_pieces": self.num_wire_pieces,
            "bytes_staged": self.num_bytes,
        }

    def _span(self, bounds: np.ndarray, chunk: int) -> tuple[int, int]:
        if not 0 <= chunk < self.num_chunks:
            raise LayoutError(f"chunk {chunk} outside the plan's {self.num_chunks} chunks", field="chunk")
        return int(bounds[chunk]), int(bounds[chunk + 1])


def stage_plan(
    plan: TransferPlan,
    slot_bytes: int,
    *,
    max_piece_bytes: int = MAX_PIECE_BYTES,
    align: int = ALIGN,
    room: int | None = None,
    rank: str | None = None,
) -> StagedPlan:
    """Pack ``plan``'s slices into chunks of at most ``slot_bytes``, in plan order. A slice
    that crosses a slot's end continues at the start of the next chunk (a room or a run
    larger than a slot streams through several). ``align`` (a power of two dividing
    ``slot_bytes``) aligns every slice's slot offset."""
    ctx: dict[str, Any] = {"room": room, "rank": rank}
    for name, value in (("slot_bytes", slot_bytes), ("max_piece_bytes", max_piece_bytes), ("align", align)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}", field=name, **ctx)
    if align & (align - 1) or slot_bytes % align:
        raise LayoutError(
            f"align {align} must be a power of two dividing slot_bytes {slot_bytes}", field="slot_bytes", **ctx
        )
    length = plan.length.view(np.int64)  # (lengths are far below 2**63: the bits are the value)
    n = len(length)
    if n == 0:
        return _empty(slot_bytes)
    if int(length.min()) < 1:
        raise LayoutError(f"slice {int(np.argmin(length))} of the plan is empty", field="length", **ctx)

    # each slice's place in one unbounded stream; chunk k is the stream's [k*B, (k+1)*B)
    B = int(slot_bytes)
    padded = (length + (align - 1)) & ~(align - 1)
    end = np.cumsum(padded)
    start = end - padded
    end -= padded - length  # (the slice's own end, not its padding's)
    one = int(end[-1]) <= B  # the whole plan in one slot (a small room, or one slot-sized group)
    if not one:
        first, last = start // B, (end - 1) // B
        parts = last - first + 1
    if one or int(parts.max()) == 1:  # no slice crosses a slot's end: the plan's own arrays (read-only: shared)
        owner = None
        p_chunk = None if one else first  # (None: every part in chunk 0)
        p_len, p_src, p_dst = plan.length, plan.src, plan.dst
        p_off = (start if one else start - first * B).view(_U64)
    else:
        owner = np.repeat(np.arange(n), parts)
        j = np.arange(len(owner)) - np.repeat(np.cumsum(parts) - parts, parts)
        p_chunk = first[owner] + j
        p_start = np.maximum(start[owner], p_chunk * B)
        p_end = np.minimum(end[owner], (p_chunk + 1) * B)
        within = (p_start - start[owner]).view(_U64)  # how far into its slice the part begins
        p_len = (p_end - p_start).view(_U64)
        p_off = (p_start - p_chunk * B).view(_U64)
        p_src = plan.src[owner] + within
        p_dst = plan.dst[owner] + within

    num_chunks = 1 if p_chunk is None else int(p_chunk[-1]) + 1
    if num_chunks == 1:
        part_bounds = np.array([0, len(p_len)])
        chunk_bytes = np.array([int(p_len.sum())], dtype=np.int64)
        chunk_span = np.array([int(p_off[-1] + p_len[-1])], dtype=np.int64)  # (offsets ascend in a chunk)
    else:
        part_bounds = np.searchsorted(p_chunk, np.arange(num_chunks + 1))
        chunk_bytes = np.add.reduceat(p_len, part_bounds[:-1]).astype(np.int64)
        chunk_span = (p_off[part_bounds[1:] - 1] + p_len[part_bounds[1:] - 1]).astype(np.int64)

    # an entry runs on from the one before where the slot offsets do (inside one chunk) and the
    # addresses do too: the offsets' test is shared by both sides
    on = None
    if len(p_len) > 1:
        on = p_off[1:] == p_off[:-1] + p_len[:-1]
        if num_chunks > 1:
            on &= p_chunk[1:] == p_chunk[:-1]
    g_src, g_off, g_len, g_bounds, g_starts = _merge(p_src, p_off, p_len, part_bounds, on)
    s_dst, s_off, s_len, s_bounds, _ = _merge(p_dst, p_off, p_len, part_bounds, on)
    g_proven = None
    if plan.proven is not None:  # an entry merged of several parts is proven when each of them is
        p_proven = plan.proven if owner is None else plan.proven[owner]
        g_proven = np.logical_and.reduceat(p_proven, g_starts) if len(g_starts) < len(p_proven) else p_proven
    pieces = -(-chunk_span // max_piece_bytes)
    w_chunk = np.repeat(np.arange(num_chunks), pieces)
    w_first = np.cumsum(pieces) - pieces
    w_off = (np.arange(len(w_chunk)) - w_first[w_chunk]) * max_piece_bytes
    w_len = np.minimum(chunk_span[w_chunk] - w_off, max_piece_bytes)
    w_bounds = np.concatenate(([0], np.cumsum(pieces)))
    return StagedPlan(
        slot_bytes=B,
        gather_src=_frozen(g_src), gather_off=_frozen(g_off), gather_len=_frozen(g_len),
        gather_bounds=_frozen(g_bounds),
        wire_off=_frozen(w_off.astype(_U64)), wire_len=_frozen(w_len.astype(_U64)), wire_bounds=_frozen(w_bounds),
        scatter_off=_frozen(s_off), scatter_dst=_frozen(s_dst), scatter_len=_frozen(s_len),
        scatter_bounds=_frozen(s_bounds),
        chunk_bytes=_frozen(chunk_bytes), chunk_span=_frozen(chunk_span), num_plan_slices=n,
        gather_proven=None if g_proven is None else _frozen(g_proven),
    )


def _merge(addr: np.ndarray, off: np.ndarray, length: np.ndarray, part_bounds: np.ndarray,
           on: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Entries of one side merged where consecutive entries run on in both the address and the
    slot offset, inside one chunk: ``(addr, off, length, bounds, starts)`` (``starts``: the first
    part of each entry). ``on``: per entry after the first, whether its slot offset runs on from
    the one before inside the same chunk (shared by both sides); ``part_bounds``: each chunk's
    first part (bounds of the merged entries where nothing merges).

        addr   a   a+n | b          merged: (a, o, n+m), (b, ...)
        off    o   o+n | o+n+m+pad"""
    n = len(addr)
    if on is None:  # one entry
        return addr, off, length, part_bounds, np.zeros(n, dtype=np.int64)
    cont = on & (addr[1:] == addr[:-1] + length[:-1])
    if not cont.any():  # nothing runs on (random pages, the usual case): every part is an entry
        return addr, off, length, part_bounds, np.arange(n)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.logical_not(cont, out=brk[1:])
    starts = np.flatnonzero(brk)
    merged_len = np.add.reduceat(length, starts).astype(_U64)
    bounds = np.searchsorted(starts, part_bounds)  # (each chunk's first part starts an entry)
    return addr[starts], off[starts], merged_len, bounds, starts


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _empty(slot_bytes: int) -> StagedPlan:
    u, z = np.zeros(0, dtype=_U64), np.zeros(1, dtype=np.int64)
    e = np.zeros(0, dtype=np.int64)
    return StagedPlan(slot_bytes, u, u, u, z, u, u, z, u, u, u, z, e, e, 0)


# ---- choosing the path ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PathThresholds:
    """Staged when a plan has at least ``min_slices`` slices *and* its mean slice is at most
    ``max_mean_slice_bytes``; else under ``wider`` when given (a second rule for larger slices,
    from more of them: at least as many slices, a larger mean); direct otherwise."""

    min_slices: int
    max_mean_slice_bytes: int
    wider: PathThresholds | None = None

    def __post_init__(self) -> None:
        for name in ("min_slices", "max_mean_slice_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"{name} must be a non-negative integer, got {value!r}", field=name)
        w = self.wider
        if w is not None and (not isinstance(w, PathThresholds) or w.min_slices < self.min_slices
                              or w.max_mean_slice_bytes <= self.max_mean_slice_bytes):
            raise LayoutError(f"wider must be PathThresholds of at least {self.min_slices} slices and a mean above "
                              f"{self.max_mean_slice_bytes} bytes, got {w!r}", field="wider")


def choose_path(plan: TransferPlan | int, thresholds: PathThresholds | None, *,
                mean_slice_bytes: int | None = None) -> str:
    """``"direct"`` or ``"staged"`` for a target's plan under ``thresholds``: the route's engine's
    and transport's (its registry entry, ``kvbridge/transfer/engine/registry.py``); None for a
    route never staged (direct). ``plan`` may be a slice count, with ``mean_slice_bytes`` given."""
    if thresholds is None:
        return "direct"
    if not isinstance(thresholds, PathThresholds):
        raise LayoutError(f"thresholds must be PathThresholds or None, got {thresholds!r}", field="thresholds")
    if isinstance(plan, TransferPlan):
        num_slices = plan.num_slices
        if num_slices < max(thresholds.min_slices, 1):  # too few slices to gain: no byte count needed
            return "direct"
        mean = plan.num_bytes // num_slices
    else:
        if mean_slice_bytes is None:
            raise LayoutError("a slice count needs mean_slice_bytes", field="mean_slice_bytes")
        num_slices, mean = int(plan), int(mean_slice_bytes)
    rule: PathThresholds | None = thresholds
    while rule is not None and num_slices >= max(rule.min_slices, 1):  # (each wider rule wants more slices)
        if mean <= rule.max_mean_slice_bytes:
            return "staged"
        rule = rule.wider
    return "direct"
