"""Pool kinds: which rows of a request decode needs, per kind, and the plan that moves
exactly those bytes (hard rules 1 and 5 for every kind).

    tokens of the request     0                                         n-1
                              |----|----|----|----|----|----|----|--     |     page_size 4
    paged                     [====|====|====|====|====|====|====|==]          every valid row
    window  (W = 10)                                  [=|====|==]           rows [n-W, n): pages of the
                                                                            window, the first one from row (n-W) % ps
    window ring (stride S)    slot = row * S + pos % S for pos in [n-W, n)  at most two runs per side
    compressed (R = 4)        entries e0 e1 ... e_{n//R - 1}                an entry only once its R tokens
                                                  tail: n % R tokens ----> are complete; the tail is state
    state                     one slot per request row                      the whole slot, once, with the
                                                                            last chunk (like the aux row)
    state, tail (R)           slot = R rows, pos at row pos % R             rows [0, n % R): a compressor's
                                                                            incomplete window, once, last chunk

A compressed pool's "token" is an entry: ``page_size`` entries per page, ``bytes_per_token``
bytes per entry. A state pool's "page" is a slot (``page_size`` 1). ``Extent`` is what decode
needs of one pool for ``n`` tokens: logical units ``[first, first + count)`` with the rows of
the first and the last; ``chunk_extent`` is the share of it one prefill chunk sends (whole
units only, the rest with the last chunk: no unit travels twice).

Heterogeneous TP of state slots (``state_slices``): a slot is groups of units (Mamba conv:
the x, B and C channel groups, SGLang's ``state_conv_shard_groups``; SSM state: one group of
heads), each group split evenly across the TP ranks; a replicated slot (no groups) is whole
on every rank.

    group g of u units, tp 2        | g0: r0 r1 | g1: r0 r1 |      rank r's slot: | g0 r | g1 r |
    decode tp 1 rank 0 takes, per group, its whole range from the two prefill ranks
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvbridge.errors import LayoutError, PageRangeError, PairingError, TopologyError
from kvbridge.layout.aux import owner_of_last_token
from kvbridge.layout.lanes import OwnerLanes
from kvbridge.layout.pairing import BufferDesc
from kvbridge.layout.plan import TransferPlan, broadcast_plan
from kvbridge.layout.pools import COMPRESSED, KINDS, PAGED, ROWS, STATE, WINDOW, PoolSpec

__all__ = ["KINDS", "Extent", "check_kind_topology", "kind_specs", "own_units_pools", "token_page_size", "chunk_extent", "lane_units", "needed_bytes", "needed_extent",
           "plan_kind", "row_bytes", "state_slices", "state_tp_spec", "tail_tokens"]


@dataclass(frozen=True)
class Extent:
    """Logical units ``[first, first + count)`` of one pool that decode needs: rows
    ``[first_row, unit_rows)`` of the first unit, ``last_rows`` of the last (one unit: rows
    ``[first_row, last_rows)``), every row of those between."""

    first: int
    count: int
    first_row: int
    last_rows: int
    unit_rows: int

    @property
    def stop(self) -> int:
        return self.first + self.count

    @property
    def num_rows(self) -> int:
        if not self.count:
            return 0
        return self.count * self.unit_rows - self.first_row - (self.unit_rows - self.last_rows)

    def rows(self, units: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per unit (of ``units``, logical units inside the extent; default all), the first row
        and the number of rows that travel."""
        units = np.arange(self.first, self.stop, dtype=np.int64) if units is None else units
        start = np.where(units == self.first, self.first_row, 0).astype(np.int64)
        stop = np.where(units == self.stop - 1, self.last_rows, self.unit_rows).astype(np.int64)
        return start, stop - start


def kind_specs(specs: dict[str, PoolSpec] | Sequence[PoolSpec] | object) -> dict[str, PoolSpec]:
    """The pools of ``specs`` (name -> spec) that are not paged."""
    return {name: spec for name, spec in specs.items() if spec.kind != PAGED}  # type: ignore[attr-defined]


def own_units_pools(specs: dict[str, PoolSpec]) -> list[str]:
    """Kind pools on units of their own, not the room's page mapping: compressed and state pools,
    and ring windows (slots by request row). Paged windows share the token pages' mapping."""
    return sorted(name for name, spec in specs.items()
                  if spec.kind in (COMPRESSED, STATE) or (spec.kind == WINDOW and spec.ring_stride))


def token_page_size(specs: dict[str, PoolSpec]) -> int:
    """The page size of a room's page mapping: the paged pools'; without them the paged windows'
    (the largest: a window may page finer on units of its own, DeepSeek-V4's C4 compressor rings
    per SWA page); the first pool's when none is."""
    for spec in specs.values():
        if spec.kind == PAGED:
            return spec.page_size
    windows = [spec.page_size for spec in specs.values() if spec.kind == WINDOW and not spec.ring_stride]
    return max(windows) if windows else next(iter(specs.values())).page_size


def _entries(spec: PoolSpec, num_tokens: int) -> int:
    """Rows of the pool that ``num_tokens`` tokens fill: complete entries of a compressed pool."""
    return num_tokens // spec.ratio if spec.kind == COMPRESSED else num_tokens


def tail_tokens(spec: PoolSpec, num_tokens: int) -> int:
    """Tokens of a compressed pool's incomplete last window: never an entry, carried as state."""
    return num_tokens % spec.ratio if spec.kind == COMPRESSED else 0


def needed_extent(spec: PoolSpec, num_tokens: int) -> Extent:
    """What decode needs of ``spec`` for a request of ``num_tokens`` valid tokens (padding is not
    a token: pass the valid count, never a padded length)."""
    if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise LayoutError(f"pool {spec.name!r}: num_tokens must be a non-negative integer, got {num_tokens!r}",
                          field="num_tokens")
    ps = spec.page_size
    if spec.kind == STATE:
        if spec.ratio:  # a tail slot: rows [0, n % R) (positions n - n % R .. n - 1, each at pos % R)
            return Extent(0, 1 if num_tokens else 0, 0, num_tokens % spec.ratio, spec.ratio)
        return Extent(0, 1 if num_tokens else 0, 0, 1, 1)
    rows = _entries(spec, num_tokens)
    start = max(0, rows - spec.window) if spec.kind == WINDOW else 0
    if spec.kind == WINDOW and spec.ring_stride:
        return Extent(start, rows - start, 0, 1, 1)  # ring: one "unit" per token position
    if rows == start:
        return Extent(start // ps, 0, 0, ps, ps)
    first, stop = start // ps, -(-rows // ps)
    return Extent(first, stop - first, start - first * ps, rows - (stop - 1) * ps, ps)


def needed_bytes(spec: PoolSpec, num_tokens: int) -> int:
    """Bytes of ``spec`` (this rank's rows, every layer) that decode needs for ``num_tokens``."""
    return needed_extent(spec, num_tokens).num_rows * row_bytes(spec) * spec.num_layers


def row_bytes(spec: PoolSpec) -> int:
    """Bytes of one row of an extent: a token's (an entry's) row, a slot, or a tail slot's row."""
    return spec.bytes_per_token // spec.ratio if spec.kind == STATE and spec.ratio else spec.bytes_per_token


def chunk_extent(spec: PoolSpec, num_tokens: int, done: int, end: int, last: bool) -> Extent:
    """The units of the final extent that a prefill chunk of tokens ``[done, end)`` sends:
    those complete at ``end`` and not complete at ``done`` (a unit is complete when every row of
    it is computed; the last chunk completes every unit). So every unit travels once, a
    partial page or an incomplete compressed window never before the last chunk, and state
    only with the last chunk."""
    if not 0 <= done <= end <= num_tokens or (last and end != num_tokens):
        raise LayoutError(f"pool {spec.name!r}: chunk [{done}, {end}) of {num_tokens} tokens "
                          f"(last={last}) is not a chunk of the request", field="chunk")
    final = needed_extent(spec, num_tokens)
    unit = 1 if (spec.kind == WINDOW and spec.ring_stride) else spec.page_size

    def complete(t: int, is_last: bool) -> int:
        if spec.kind == STATE:
            return final.stop if is_last else 0
        if is_last:
            return final.stop
        return _entries(spec, t) // unit

    lo = max(final.first, complete(done, False) if done else final.first)
    hi = min(final.stop, complete(end, last))
    if hi <= lo:
        return Extent(lo, 0, 0, final.unit_rows, final.unit_rows)
    first_row = final.first_row if lo == final.first else 0
    last_rows = final.last_rows if hi == final.stop else final.unit_rows
    return Extent(lo, hi - lo, first_row, last_rows, final.unit_rows)


def state_tp_spec(spec: PoolSpec, tp_size: int) -> PoolSpec:
    """A TP rank's state spec: its part of every shard group (a replicated slot is unchanged)."""
    full = spec.full()
    if not full.shard_units or tp_size == 1:
        return full
    return replace(full, bytes_per_token=sum(full.shard_units) // tp_size * full.unit_bytes, tp_size=tp_size)


def state_slices(spec: PoolSpec, src_tp: int, src_rank: int, dst_tp: int,
                 dst_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """In-slot byte ranges ``(src offsets, dst offsets, lengths)`` that prefill TP rank
    ``src_rank`` of ``src_tp`` sends to decode rank ``dst_rank`` of ``dst_tp``: per shard group,
    the overlap of the two ranks' unit ranges. A replicated slot: the whole slot from the
    decode rank's first source (``dst_rank * src_tp // dst_tp``), nothing from the others."""
    for name, tp, rank in (("src", src_tp, src_rank), ("dst", dst_tp, dst_rank)):
        if tp < 1 or not 0 <= rank < tp:
            raise LayoutError(f"pool {spec.name!r}: {name} TP rank {rank} of {tp}", field=f"{name}_rank")
    full = spec.full()
    if not full.shard_units:
        if src_rank != dst_rank * src_tp // dst_tp:  # the route's first source (kvbridge.layout.tp_route)
            return (np.zeros(0, np.int64),) * 3  # type: ignore[return-value]
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, full.bytes_per_token, np.int64)
    units = np.array(full.shard_units, dtype=np.int64)
    for tp in (src_tp, dst_tp):
        if (units % tp).any():
            raise LayoutError(f"pool {spec.name!r}: shard groups {full.shard_units} do not split into {tp} TP parts",
                              field="shard_units")
    src_part, dst_part = units // src_tp, units // dst_tp
    lo = np.maximum(src_rank * src_part, dst_rank * dst_part)
    hi = np.minimum((src_rank + 1) * src_part, (dst_rank + 1) * dst_part)
    keep = hi > lo
    src_base = np.concatenate(([0], np.cumsum(src_part)[:-1]))  # each group's start in the rank's slot
    dst_base = np.concatenate(([0], np.cumsum(dst_part)[:-1]))
    ub = full.unit_bytes
    src_off = (src_base + lo - src_rank * src_part)[keep] * ub
    dst_off = (dst_base + lo - dst_rank * dst_part)[keep] * ub
    return src_off, dst_off, (hi - lo)[keep] * ub


def _paired_bases(src_spec: PoolSpec, src_bufs: Sequence[BufferDesc], dst_bufs: Sequence[BufferDesc],
                  room: int | None, rank: str | None) -> tuple[np.ndarray, ...]:
    """Per layer of the pool (hard rule 8: by layer id): source and destination bases and
    capacities, in units of each side's pages (slots)."""
    by_layer = []
    for side, bufs in (("source", src_bufs), ("destination", dst_bufs)):
        mine = {b.layer_id: b for b in bufs if b.pool == src_spec.name}
        missing = [lid for lid in src_spec.layer_ids if lid not in mine]
        if missing:
            raise PairingError(f"pool {src_spec.name!r}: no {side} buffer for layer {missing[0]}", field="layer_id",
                               room=room, rank=rank)
        by_layer.append([mine[lid] for lid in src_spec.layer_ids])
    src, dst = by_layer
    return tuple(np.array([getattr(b, k) for b in side], dtype=np.int64)
                 for side in (src, dst) for k in ("base", "capacity_pages", "bytes_per_page"))


def _check_units(spec: PoolSpec, side: str, units: np.ndarray, caps: np.ndarray, room: int | None,
                 rank: str | None) -> None:
    """Hard rule 5: every unit inside every layer's registered region."""
    if not len(units):
        return
    lo, hi = int(units.min()), int(units.max())
    bad = np.flatnonzero((caps <= hi) | (lo < 0))
    if len(bad):
        j = int(bad[0])
        unit = units[(units < 0) | (units >= caps[j])][0]
        raise PageRangeError(f"pool {spec.name!r} ({spec.kind}) layer {spec.layer_ids[j]}: {side} "
                             f"{'slot' if spec.kind == STATE or spec.ring_stride else 'page'} {unit} is outside the "
                             f"registered region of {int(caps[j])}", field="src_pages" if side == "source"
                             else "dst_pages", room=room, rank=rank)


def _merge(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, ...]:
    """Slices that continue each other on both sides merged into one."""
    if len(length) < 2:
        return src, dst, length
    cont = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def plan_kind(
    spec: PoolSpec,
    src_bufs: Sequence[BufferDesc],
    dst_bufs: Sequence[BufferDesc],
    extent: Extent,
    src_units: np.ndarray | Sequence[int],
    dst_units: np.ndarray | Sequence[int],
    *,
    dst_spec: PoolSpec | None = None,
    tp: tuple[int, int, int, int] = (1, 0, 1, 0),
    logical: np.ndarray | Sequence[int] | None = None,
    room: int | None = None,
    rank: str | None = None,
) -> TransferPlan:
    """The writes of ``extent`` of one pool for every layer: exactly the rows decode needs.

    ``src_units`` / ``dst_units``: the physical pages of the extent's logical units (paged,
    window, compressed), or one request row each (ring window: slots ``row * stride + pos %
    stride``; state: the slot). ``dst_spec``: decode's spec when it differs (a state slot cut
    for another TP size); ``tp``: ``(src_tp, src_rank, dst_tp, dst_rank)`` for state slices.
    ``logical``: only these logical units of the extent (a CP rank's owned pages,
    ``lane_units``), with ``src_units``/``dst_units`` theirs. Checked before anything is
    returned: an error means nothing may be written."""
    ctx = {"room": room, "rank": rank}
    dst_spec = dst_spec or spec
    src_units = np.asarray(src_units, dtype=np.int64).reshape(-1)
    dst_units = np.asarray(dst_units, dtype=np.int64).reshape(-1)
    ring = spec.kind == WINDOW and bool(spec.ring_stride)
    per_unit = not (ring or spec.kind == STATE)
    want = extent.count if per_unit else (1 if extent.count else 0)
    if logical is not None:
        logical = np.asarray(logical, dtype=np.int64).reshape(-1)
        if not per_unit:
            raise LayoutError(f"pool {spec.name!r} ({spec.kind}): a unit subset applies to pages only",
                              field="logical_pages", **ctx)
        if len(logical) and (logical.min() < extent.first or logical.max() >= extent.stop
                             or (np.diff(logical) <= 0).any()):
            raise LayoutError(f"pool {spec.name!r}: logical units must ascend inside [{extent.first}, "
                              f"{extent.stop})", field="logical_pages", **ctx)
        want = len(logical)
    if len(src_units) != want or len(dst_units) != want:
        raise LayoutError(f"pool {spec.name!r} ({spec.kind}): {len(src_units)} source and {len(dst_units)} "
                          f"destination units for an extent of {want}", field="dst_pages", **ctx)
    src_base, src_cap, src_bpp, dst_base, dst_cap, dst_bpp = _paired_bases(spec, src_bufs, dst_bufs, room, rank)
    if (src_bpp != spec.bytes_per_page).any() or (dst_bpp != dst_spec.bytes_per_page).any():
        raise PairingError(f"pool {spec.name!r}: registered pages of {sorted(set(src_bpp) | set(dst_bpp))} B, "
                           f"the spec's are {spec.bytes_per_page} / {dst_spec.bytes_per_page} B", field="bytes_per_page",
                           **ctx)
    if not extent.count or not want:
        return TransferPlan.empty()
    if spec.kind == STATE:
        _check_units(spec, "source", src_units, src_cap, room, rank)
        _check_units(dst_spec, "destination", dst_units, dst_cap, room, rank)
        s_off, d_off, length = state_slices(spec, *tp)
        if spec.ratio:  # a tail slot: its first n % R rows
            length = np.minimum(length, extent.num_rows * row_bytes(spec))
        rel = (s_off + src_units[0] * spec.bytes_per_page, d_off + dst_units[0] * dst_spec.bytes_per_page)
    elif ring:
        rel = _ring_ranges(spec, extent, int(src_units[0]), int(dst_units[0]), src_cap, dst_cap, ctx)
        length = rel[2]
        rel = rel[:2]
    else:
        _check_units(spec, "source", src_units, src_cap, room, rank)
        _check_units(spec, "destination", dst_units, dst_cap, room, rank)
        start, count = extent.rows(logical)
        parts = []
        for offset, width in _parts(spec):
            parts.append((src_units * spec.bytes_per_page + offset + start * width,
                          dst_units * spec.bytes_per_page + offset + start * width, count * width))
        s_off, d_off, length = (np.concatenate([p[i] for p in parts]) for i in range(3))
        rel = (s_off, d_off)
    s_off, d_off, length = _merge(np.asarray(rel[0], np.int64), np.asarray(rel[1], np.int64),
                                  np.asarray(length, np.int64))
    keep = length > 0
    u = np.uint64
    return broadcast_plan([(src_base.astype(u), dst_base.astype(u), s_off[keep].astype(u), d_off[keep].astype(u),
                            length[keep].astype(u))])


def _parts(spec: PoolSpec) -> tuple[tuple[int, int], ...]:
    """(offset in the page, bytes per row) of each part of a page: one for rows, values and
    scales for values_then_scales."""
    if spec.layout == ROWS:
        return ((0, spec.bytes_per_token),)
    return ((0, spec.value_bytes_per_token), (spec.scale_offset, spec.scale_bytes_per_token))


def _ring_ranges(spec: PoolSpec, extent: Extent, src_row: int, dst_row: int, src_cap: np.ndarray,
                 dst_cap: np.ndarray, ctx: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ring window's token rows: position p lives in slot ``row * stride + p % stride`` on each
    side (the same stride: it is in the contract), so the window is at most two runs."""
    if spec.layout != ROWS:
        raise LayoutError(f"pool {spec.name!r}: a ring window uses the rows layout", field="layout", **ctx)
    stride, bpt = spec.ring_stride, spec.bytes_per_token
    pos = np.arange(extent.first, extent.stop, dtype=np.int64)
    for side, row, caps in (("source", src_row, src_cap), ("destination", dst_row, dst_cap)):
        slots = np.array([row * stride, row * stride + stride - 1], dtype=np.int64)
        _check_units(spec, side, slots // spec.page_size, caps, ctx["room"], ctx["rank"])
    src = (src_row * stride + pos % stride) * bpt
    dst = (dst_row * stride + pos % stride) * bpt
    return src, dst, np.full(len(pos), bpt, dtype=np.int64)



def check_kind_topology(specs: Sequence[PoolSpec], cp_size: int, lane_rule: str = "interleaved") -> None:
    """Refuse, by name, what the kinds do not support under CP (the rule is in docs/concepts.md):

    * paged and paged-window pools: token pages, owned like every page (the lane rule);
    * ring-addressed window pools: CP 1 only (slots by request row, not pages: no owner lane);
    * compressed pools: CP 1 only, or every page on every rank (``replicated``): an entry
      needs all R tokens of its window on the rank that builds it, and lanes split them;
    * state slots: written by the owner of the last valid token, with the aux row (any CP).

    Layer ranges (PP, layer-wise sends) cut every kind's layers alike."""
    if cp_size <= 1 or lane_rule == "replicated":
        return
    for spec in specs:
        if spec.kind == COMPRESSED:
            raise TopologyError(f"pool {spec.name!r} is compressed (ratio {spec.ratio}): CP {cp_size} with "
                                f"{lane_rule} lanes would split an entry's {spec.ratio}-token window across ranks",
                                field="cp_size")
        if spec.kind == WINDOW and spec.ring_stride:
            raise TopologyError(f"pool {spec.name!r} is a ring-addressed window: its slots have no owner lane "
                                f"under CP {cp_size}", field="cp_size")


def lane_units(spec: PoolSpec, extent: Extent, lanes: OwnerLanes, cp_rank: int, num_tokens: int,
               token_page_size: int) -> np.ndarray:
    """The logical units of ``extent`` that CP rank ``cp_rank`` owns and sends (docs/concepts.md):
    a token page's owner lane (paged and paged-window pools, the lane rule over the request's
    token pages); a state slot on the owner of the last valid token (``token_page_size``: the
    token pages the lanes split), nothing on the others. Under ``replicated`` lanes every rank
    holds every unit and rank 0 sends them all (as it sends every page), the others nothing.
    Compressed pools and ring windows under other CP lanes are refused (``check_kind_topology``)."""
    check_kind_topology([spec], lanes.cp_size, lanes.rule)
    units = np.arange(extent.first, extent.stop, dtype=np.int64)
    if lanes.cp_size == 1 or not len(units):
        return units
    if lanes.rule == "replicated":
        return units if cp_rank == 0 else units[:0]
    if spec.kind == STATE:
        return units if owner_of_last_token(num_tokens, token_page_size, lanes) == cp_rank else units[:0]
    owner, _ = lanes.owners(units, -(-num_tokens // spec.page_size))
    return units[owner == cp_rank]
