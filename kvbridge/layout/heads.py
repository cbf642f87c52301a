"""Head slicing for heterogeneous TP: a decode TP size other than the prefill's
(MHA/GQA ``k``/``v`` pools; MLA latent pools are replicated and move whole).

A ``k``/``v`` row of a TP rank holds that rank's KV heads, head-major (``hb`` =
``head_dim * itemsize`` bytes per head):

    num_heads 4     prefill tp 2   rank 0 | h0 | h1 |        rank 1 | h2 | h3 |
                    decode  tp 1   rank 0 | h0 | h1 | h2 | h3 |
                                          ^ from p0 ^ from p1 ^  one range per valid row, per source
                    decode  tp 4   rank j | hj |                 p(j//2), byte j%2*hb of its row

    num_heads 2     decode  tp 4   rank j | h(j*2//4) |          replicated: ranks 0,1 hold h0; 2,3 hold h1

A TP size either divides ``num_heads`` (rank ``r`` holds ``[r*H/tp, (r+1)*H/tp)``)
or is a multiple of it (replication: rank ``r`` holds the one head ``r*H//tp``,
so ``tp/H`` consecutive ranks share a head). When the *prefill* replicates, a
decode rank takes a head from replica ``dst_rank % replicas`` to spread the load.

Coalescing: when a slice is the whole row on both sides (same head range), rows
are contiguous and pages merge into runs exactly as in ``plan_transfer``;
otherwise a page's share is one range per valid row, with a constant stride on
each side (``src_row_bytes``, ``dst_row_bytes``), also across pages consecutive on
both sides. Such a run could be posted as one strided descriptor
``(src, dst, length, count, src_stride, dst_stride)`` where an engine accepts it;
the plan below lists the ranges.

What is contract and what is topology: the number of KV heads, head_dim and
dtype (hence ``head_bytes``), page size, in-row order (head-major) and layer ids
give the bytes their meaning (contract); the TP sizes and ranks of each side may
differ legally (topology, checked here with ``TopologyError``).
"""

from __future__ import annotations

import dataclasses

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import BufferSpecError, LayoutError, PairingError, TopologyError
from kvbridge.layout.pairing import BufferDesc, PairedBuffers, index_buffers
from kvbridge.layout.plan import TransferPlan, broadcast_plan, check_inside, checked_pages, plan_transfer
from kvbridge.layout.pools import ABI_ITEMSIZE, ROWS, PoolSpec


@dataclass(frozen=True)
class HeadGeometry:
    """The TP-invariant geometry of a head-sharded pool (contract side)."""

    num_heads: int
    head_dim: int
    abi: str

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}", field=name)
        if self.abi not in ABI_ITEMSIZE:
            raise LayoutError(f"abi {self.abi!r} is not one of {tuple(ABI_ITEMSIZE)}", field="abi")

    @classmethod
    def of(cls, spec: PoolSpec) -> HeadGeometry:
        """The head geometry of a head-sharded pool spec (any rank's)."""
        if not spec.head_sharded:
            raise LayoutError(f"pool {spec.name!r} is replicated across TP, not head-sharded", field="num_heads")
        return cls(spec.num_heads, spec.head_dim, spec.abi)

    @property
    def head_bytes(self) -> int:
        return self.head_dim * ABI_ITEMSIZE[self.abi]

    def rank_heads(self, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """Head range ``[h0, h1)`` held by ``tp_rank`` of a TP group of ``tp_size``."""
        return rank_heads(self.num_heads, tp_size, tp_rank)

    def row_bytes(self, tp_size: int, tp_rank: int = 0) -> int:
        h0, h1 = self.rank_heads(tp_size, tp_rank)
        return (h1 - h0) * self.head_bytes

    def spec(
        self,
        name: str,
        page_size: int,
        layer_ids: Sequence[int],
        tp_size: int = 1,
        tp_rank: int = 0,
        *,
        dtype: str | None = None,
        kernel_abi: str = "",
    ) -> PoolSpec:
        """The ``rows`` pool spec of one TP rank: its heads, head-major in the row."""
        h0, h1 = self.rank_heads(tp_size, tp_rank)
        return PoolSpec(
            name=name,
            dtype=dtype or self.abi,
            abi=self.abi,
            bytes_per_token=self.row_bytes(tp_size, tp_rank),
            page_size=page_size,
            layer_ids=tuple(layer_ids),
            kernel_abi=kernel_abi,
            num_heads=self.num_heads,
            head_start=h0,
            head_stop=h1,
        )


def tp_spec(spec: PoolSpec, tp_size: int, tp_rank: int) -> PoolSpec:
    """The spec of ``tp_rank`` of a TP group of ``tp_size`` (its heads; a sharded state slot its
    part of every shard group, as ``kvbridge.layout.kinds.state_tp_spec``; a replicated pool as it is)."""
    if spec.shard_units:
        full = spec.full()
        return dataclasses.replace(full, bytes_per_token=sum(full.shard_units) // tp_size * full.unit_bytes,
                                   tp_size=tp_size) if tp_size > 1 else full
    if not spec.head_sharded:
        return spec
    return spec.with_heads(*rank_heads(spec.num_heads, tp_size, tp_rank))


def rank_heads(num_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Head range ``[h0, h1)`` of ``tp_rank``: a block of ``H/tp`` heads, or with
    ``tp > H`` (replication) the single head ``tp_rank * H // tp``."""
    _check_tp(num_heads, tp_size, "tp_size")
    if not 0 <= tp_rank < tp_size:
        raise TopologyError(f"tp rank {tp_rank} outside tp size {tp_size}", rank=tp_rank, field="tp_rank")
    if tp_size <= num_heads:
        per = num_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    head = tp_rank * num_heads // tp_size
    return head, head + 1


def _check_tp(num_heads: int, tp_size: int, field: str) -> None:
    if not isinstance(tp_size, (int, np.integer)) or isinstance(tp_size, bool) or tp_size < 1:
        raise TopologyError(f"{field} must be a positive integer, got {tp_size!r}", field=field)
    if num_heads % tp_size and tp_size % num_heads:
        raise TopologyError(
            f"{field} {tp_size} neither divides the {num_heads} KV heads nor is a multiple of them "
            "(replication needs tp % num_heads == 0)",
            field=field,
        )


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[head_start, head_stop)`` that prefill TP rank ``src_rank`` sends
    to decode TP rank ``dst_rank``: ``nbytes`` bytes at ``src_offset`` of each
    source row land at ``dst_offset`` of the destination row."""

    src_rank: int
    dst_rank: int
    head_start: int
    head_stop: int
    src_offset: int
    dst_offset: int
    nbytes: int
    src_row_bytes: int
    dst_row_bytes: int

    @property
    def whole_rows(self) -> bool:
        """Source and destination rows hold the same heads: rows (and pages) move whole."""
        return self.nbytes == self.src_row_bytes == self.dst_row_bytes


def head_slices(geom: HeadGeometry, src_tp: int, dst_tp: int, dst_rank: int) -> tuple[HeadSlice, ...]:
    """Where decode TP rank ``dst_rank`` gets its heads from, in head order: one
    slice per prefill rank it draws from (contiguous heads of one source)."""
    _check_tp(geom.num_heads, src_tp, "src_tp")
    d0, d1 = rank_heads(geom.num_heads, dst_tp, dst_rank)
    hb = geom.head_bytes
    src_rows = geom.row_bytes(src_tp)
    replicas = max(src_tp // geom.num_heads, 1)
    slices: list[HeadSlice] = []
    head = d0
    while head < d1:  # bounded: every pass takes at least one head
        if replicas > 1:
            src, s0, s1 = head * replicas + dst_rank % replicas, head, head + 1
        else:
            per = geom.num_heads // src_tp
            src = head // per
            s0, s1 = src * per, (src + 1) * per
        stop = min(s1, d1)
        slices.append(
            HeadSlice(
                src_rank=src,
                dst_rank=dst_rank,
                head_start=head,
                head_stop=stop,
                src_offset=(head - s0) * hb,
                dst_offset=(head - d0) * hb,
                nbytes=(stop - head) * hb,
                src_row_bytes=src_rows,
                dst_row_bytes=(d1 - d0) * hb,
            )
        )
        head = stop
    return tuple(slices)


def slices_to_send(geom: HeadGeometry, src_tp: int, dst_tp: int, src_rank: int) -> tuple[HeadSlice, ...]:
    """What prefill TP rank ``src_rank`` sends: its slice for every decode rank
    that draws from it (none for a replica no decode rank picks)."""
    rank_heads(geom.num_heads, src_tp, src_rank)
    return tuple(s for j in range(dst_tp) for s in head_slices(geom, src_tp, dst_tp, j) if s.src_rank == src_rank)


def pair_head_buffers(
    src_specs: Mapping[str, PoolSpec],
    dst_specs: Mapping[str, PoolSpec],
    head_slice: HeadSlice,
    src_bufs: Sequence[BufferDesc],
    dst_bufs: Sequence[BufferDesc],
    pools: Sequence[str],
    *,
    room: int | None = None,
    rank: str | None = None,
) -> PairedBuffers:
    """Buffers of ``pools`` paired by (pool, layer id) for one head slice, each side
    with its own row width; checked once (a prefill rank keeps it per decode peer)."""
    ctx: dict[str, Any] = {"room": room, "rank": rank}
    names = tuple(pools)
    _check_specs(src_specs, dst_specs, names, head_slice, ctx)
    src_index, dst_index = index_buffers(src_bufs, "source", ctx), index_buffers(dst_bufs, "destination", ctx)
    return PairedBuffers(names, tuple((dst_specs[n], *_pair_sliced(src_specs[n], dst_specs[n], src_index, dst_index,
                                                                    ctx)) for n in names))


def plan_head_transfer(
    src_specs: Mapping[str, PoolSpec],
    dst_specs: Mapping[str, PoolSpec],
    head_slice: HeadSlice,
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
    """Plan the writes of one head slice for ``logical_pages`` of every layer of
    every pool in ``pools`` (default: all of ``dst_specs``): source buffers are
    the prefill TP rank's (its row width), destination buffers the decode TP
    rank's (``paired``: from ``pair_head_buffers``, checked once). Only valid rows
    travel; every page is checked against both sides' registered capacities
    before anything is returned (hard rule 5)."""
    ctx: dict[str, Any] = {"room": room, "rank": rank}
    names = tuple(dst_specs) if pools is None else tuple(pools)
    page_size = _check_specs(src_specs, dst_specs, names, head_slice, ctx)
    if head_slice.whole_rows:
        # same heads on both sides: the specs agree, so this is a plain page plan
        return plan_transfer(
            dst_specs, src_bufs, dst_bufs, logical_pages, src_pages, dst_pages, num_tokens,
            pools=names, room=room, rank=rank, paired=paired,
        )
    logical, src, dst, _, num_valid_last, paired = checked_pages(
        logical_pages, src_pages, dst_pages, num_tokens, page_size, names, paired,
        lambda: pair_head_buffers(src_specs, dst_specs, head_slice, src_bufs, dst_bufs, names, room=room, rank=rank),
        ctx,
    )
    check_inside(paired, src_specs, dst_specs, src, dst, logical, ctx)
    if not len(logical) or not names:
        return TransferPlan.empty()

    # one range per valid row: entry e (a page) contributes rows [0, valid[e])
    last = (num_tokens - 1) // page_size
    valid = np.where(logical == last, num_valid_last, page_size).astype(np.int64)
    entry = np.repeat(np.arange(len(logical)), valid)
    row = np.arange(len(entry), dtype=np.int64) - np.repeat(np.cumsum(valid) - valid, valid)
    s, d = head_slice.src_row_bytes, head_slice.dst_row_bytes
    rel_src = (src[entry] * (page_size * s) + row * s + head_slice.src_offset).astype(np.uint64)
    rel_dst = (dst[entry] * (page_size * d) + row * d + head_slice.dst_offset).astype(np.uint64)
    length = np.full(len(entry), head_slice.nbytes, dtype=np.uint64)
    return broadcast_plan([(sb, db, rel_src, rel_dst, length) for _, sb, db, _, _ in paired.pairs])


def _check_specs(
    src_specs: Mapping[str, PoolSpec],
    dst_specs: Mapping[str, PoolSpec],
    names: tuple[str, ...],
    hs: HeadSlice,
    ctx: dict[str, Any],
) -> int:
    """Both sides have every pool, as ``rows``, with the slice's row widths, one
    page size and the same layers; returns the page size."""
    page_sizes = set()
    for n in names:
        if n not in src_specs or n not in dst_specs:
            raise LayoutError(f"pool {n!r} has no spec on both sides", field="pools", **ctx)
        src, dst = src_specs[n], dst_specs[n]
        for side, spec, width in (("source", src, hs.src_row_bytes), ("destination", dst, hs.dst_row_bytes)):
            if spec.layout != ROWS:
                raise LayoutError(
                    f"pool {n!r}: head slicing needs the rows layout, {side} has {spec.layout}", field="layout", **ctx
                )
            if spec.bytes_per_token != width:
                raise BufferSpecError(
                    f"pool {n!r}: {side} rows are {spec.bytes_per_token} B, the head slice expects {width} B "
                    f"(heads {hs.head_start}..{hs.head_stop - 1}, "
                    f"tp rank {hs.src_rank if side == 'source' else hs.dst_rank})",
                    field="bytes_per_token",
                    **ctx,
                )
        if src.layer_ids != dst.layer_ids or src.page_size != dst.page_size or src.abi != dst.abi:
            raise PairingError(
                f"pool {n!r}: source layers/page size/abi {src.layer_ids}/{src.page_size}/{src.abi} differ from "
                f"destination {dst.layer_ids}/{dst.page_size}/{dst.abi}",
                field="pools",
                **ctx,
            )
        page_sizes.add(src.page_size)
    if len(page_sizes) > 1:
        raise LayoutError(
            f"pools {names} share one page mapping but have page sizes {sorted(page_sizes)}", field="page_size", **ctx
        )
    return page_sizes.pop() if page_sizes else 1


def _pair_sliced(
    src_spec: PoolSpec, dst_spec: PoolSpec, src_index: dict, dst_index: dict, ctx: dict[str, Any]
) -> tuple[np.ndarray, ...]:
    """Per-layer (src bases, dst bases, src capacities, dst capacities) of one
    pool, paired by (pool, layer id) (hard rule 8); each side's pages are its own width."""
    rows = []
    for lid in dst_spec.layer_ids:
        pair = []
        for side, index, spec in (("source", src_index, src_spec), ("destination", dst_index, dst_spec)):
            buf = index.get((spec.name, lid))
            if buf is None:
                have = sorted(k[1] for k in index if k[0] == spec.name)
                raise PairingError(
                    f"pool {spec.name!r} layer {lid}: no {side} buffer (the {side} has layers {have} of this pool)",
                    field="buffers",
                    **ctx,
                )
            if buf.bytes_per_page != spec.bytes_per_page:
                raise BufferSpecError(
                    f"pool {spec.name!r} layer {lid}: {side} buffer has {buf.bytes_per_page} B pages, "
                    f"its spec says {spec.bytes_per_page}",
                    field="bytes_per_page",
                    **ctx,
                )
            pair.append(buf)
        rows.append((pair[0].base, pair[1].base, pair[0].capacity_pages, pair[1].capacity_pages))
    sb, db, sc, dc = zip(*rows)
    return (
        np.array(sb, dtype=np.uint64),
        np.array(db, dtype=np.uint64),
        np.array(sc, dtype=np.int64),
        np.array(dc, dtype=np.int64),
    )
