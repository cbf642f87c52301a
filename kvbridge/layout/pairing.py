"""Registered buffers and their pairing (hard rule 8): a buffer is one layer of one pool
(:class:`BufferDesc`), and a plan's source and destination buffers pair by (pool, layer
id), never by position. A prefill rank pairs its buffers with a decode peer's once per
pool set (:class:`PairedBuffers`) and hands the pairing to every plan (``plan.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from kvbridge.errors import BufferSpecError, LayoutError, PairingError
from kvbridge.layout.buffers import RawBuffer
from kvbridge.layout.pools import ROWS, PoolSpec

_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class BufferDesc:
    """One registered buffer (one layer of one pool) as a peer sees it."""

    pool: str
    layer_id: int
    base: int
    capacity_pages: int
    bytes_per_page: int

    def __post_init__(self) -> None:
        if not isinstance(self.pool, str) or not self.pool:
            raise LayoutError(f"buffer pool name must be a non-empty string, got {self.pool!r}", field="pool")
        for name in ("layer_id", "base", "capacity_pages", "bytes_per_page"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise LayoutError(
                    f"buffer {self.pool!r}: {name} must be a non-negative integer, got {value!r}", field=name
                )
        if self.bytes_per_page == 0 or self.base + self.nbytes > _U64_MAX:
            raise LayoutError(
                f"buffer {self.pool!r} layer {self.layer_id}: empty pages or region past 2**64", field="base"
            )

    @property
    def nbytes(self) -> int:
        return self.capacity_pages * self.bytes_per_page

    def to_list(self) -> list[Any]:
        return [self.pool, int(self.layer_id), int(self.base), int(self.capacity_pages), int(self.bytes_per_page)]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> BufferDesc:
        if not isinstance(item, (list, tuple)) or len(item) != 5:
            raise LayoutError(
                f"a buffer descriptor is [pool, layer_id, base, capacity_pages, bytes_per_page], got {item!r}",
                field="buffers",
            )
        return cls(*item)


def describe_buffer(spec: PoolSpec, layer_id: int, buf: Any, base: int | None = None) -> BufferDesc:
    """Validate one layer's buffer (numpy array, torch tensor or RawBuffer) against its spec
    and describe it; ``base`` defaults to the buffer's own address."""
    capacity = spec.validate_buffer(layer_id, buf)
    if base is None:
        base = buf.ptr if isinstance(buf, RawBuffer) else buf.data_ptr() if hasattr(buf, "data_ptr") else buf.ctypes.data
    return BufferDesc(spec.name, layer_id, int(base), capacity, spec.bytes_per_page)


@dataclass(frozen=True, eq=False)
class PairedBuffers:
    """Source and destination buffers of some pools, paired by (pool, layer id) and
    checked once: per pool, (spec, src bases, dst bases, src capacities, dst
    capacities), one entry per layer. A prefill rank keeps one per decode peer, whose
    registered buffers do not change, and hands it to every ``plan_transfer``."""

    pools: tuple[str, ...]
    pairs: tuple[tuple[Any, ...], ...]

    @cached_property
    def min_dst_capacity(self) -> int:
        return min((int(p[4].min()) for p in self.pairs), default=0)

    @cached_property
    def min_src_capacity(self) -> int:
        return min((int(p[3].min()) for p in self.pairs), default=0)

    @cached_property
    def groups(self) -> tuple[LayoutGroup, ...]:
        """The paired layers grouped by in-page layout, pools in order inside a group: what the
        planner computes every group's slices from in one broadcast (``plan._plan_groups``)."""
        by_layout: dict[str, list[tuple[PoolSpec, np.ndarray, np.ndarray]]] = {}
        for spec, src_base, dst_base, _, _ in self.pairs:
            by_layout.setdefault(spec.layout, []).append((spec, src_base, dst_base))
        return tuple(LayoutGroup.of(layout, members) for layout, members in by_layout.items())

    @cached_property
    def whole_pages(self) -> LayoutGroup:
        """Every group's layers stacked in the groups' order: whole pages are sliced alike in every
        layout, so a plan without a partial page is one broadcast over all of them."""
        g = self.groups
        return LayoutGroup(True, *(np.concatenate([getattr(x, k) for x in g]) for k in
                                   ("src_base", "dst_base", "bytes_per_page", "row_bytes", "scale_bytes",
                                    "scale_offset")))

    def cut(self, specs: Mapping[str, PoolSpec]) -> PairedBuffers:
        """The pairs of the pools in ``specs`` only, each cut to its spec's layer ids (a subset of
        the paired ones: ``layer_range_specs``), for the plan of one layer range."""
        pairs = []
        for spec, src_base, dst_base, src_cap, dst_cap in self.pairs:
            cut = specs.get(spec.name)
            if cut is None:
                continue
            if tuple(cut.layer_ids) == tuple(spec.layer_ids):
                pairs.append((spec, src_base, dst_base, src_cap, dst_cap))
                continue
            keep = np.isin(np.asarray(spec.layer_ids), np.asarray(cut.layer_ids))
            pairs.append((cut, src_base[keep], dst_base[keep], src_cap[keep], dst_cap[keep]))
        return PairedBuffers(tuple(p[0].name for p in pairs), tuple(pairs))

    def all_inside(self, src_span: tuple[int, int], dst_span: tuple[int, int]) -> bool:
        """Pages spanning ``[lo, hi]`` on each side lie inside every paired buffer (one comparison
        per side; ``plan.check_inside`` names the offending page and layer when not)."""
        return (src_span[0] >= 0 and src_span[1] < self.min_src_capacity
                and dst_span[0] >= 0 and dst_span[1] < self.min_dst_capacity)


@dataclass(frozen=True, eq=False)
class LayoutGroup:
    """Every paired layer of the pools sharing one in-page layout, as ``(layers, 1)`` uint64
    columns: bases, bytes per page, and what a partial last page keeps of each layer's page
    (``rows``: the valid rows are a prefix, ``row_bytes`` per row; ``values_then_scales``: two
    ranges, ``row_bytes`` value bytes per row at 0 and ``scale_bytes`` per row at
    ``scale_offset``)."""

    rows: bool
    src_base: np.ndarray
    dst_base: np.ndarray
    bytes_per_page: np.ndarray
    row_bytes: np.ndarray
    scale_bytes: np.ndarray
    scale_offset: np.ndarray

    @property
    def num_layers(self) -> int:
        return len(self.src_base)

    @cached_property
    def bases(self) -> np.ndarray:
        """``(2, layers, 1)``: source bases, then destination bases (the planner moves both at once)."""
        return np.stack((self.src_base, self.dst_base))

    @classmethod
    def of(cls, layout: str, members: Sequence[tuple[PoolSpec, np.ndarray, np.ndarray]]) -> LayoutGroup:
        rows = layout == ROWS

        def column(values: Any) -> np.ndarray:
            return np.concatenate([np.broadcast_to(np.asarray(v, dtype=np.uint64), (len(sb),)) for v, (_, sb, _) in
                                   zip(values, members)]).reshape(-1, 1)

        specs = [m[0] for m in members]
        return cls(
            rows,
            np.concatenate([sb for _, sb, _ in members]).reshape(-1, 1),
            np.concatenate([db for _, _, db in members]).reshape(-1, 1),
            column([s.bytes_per_page for s in specs]),
            column([s.bytes_per_token if rows else s.value_bytes_per_token for s in specs]),
            column([0 if rows else s.scale_bytes_per_token for s in specs]),
            column([0 if rows else s.scale_offset for s in specs]),
        )


def pair_buffers(
    specs: Mapping[str, PoolSpec],
    src_bufs: Sequence[BufferDesc],
    dst_bufs: Sequence[BufferDesc],
    pools: Sequence[str],
    *,
    room: int | None = None,
    rank: str | None = None,
) -> PairedBuffers:
    """Pair buffers by (pool, layer id), never by position (hard rule 8): a missing
    layer or differing page sizes raise PairingError naming pool and layer."""
    ctx: dict[str, Any] = {"room": room, "rank": rank}
    src_index, dst_index = index_buffers(src_bufs, "source", ctx), index_buffers(dst_bufs, "destination", ctx)
    return PairedBuffers(tuple(pools), tuple(_pair(specs[n], src_index, dst_index, ctx) for n in pools))


def index_buffers(bufs: Sequence[BufferDesc], side: str, ctx: dict[str, Any]) -> dict[tuple[str, int], BufferDesc]:
    index: dict[tuple[str, int], BufferDesc] = {}
    for buf in bufs:
        key = (buf.pool, int(buf.layer_id))
        if key in index:
            raise PairingError(f"{side} registers pool {buf.pool!r} layer {buf.layer_id} twice", field="buffers", **ctx)
        index[key] = buf
    return index


def _pair(spec: PoolSpec, src_index: dict, dst_index: dict, ctx: dict[str, Any]) -> tuple[Any, ...]:
    """Per-layer bases and capacities of one pool, paired by (pool, layer id)."""
    rows = []
    for lid in spec.layer_ids:
        pair = []
        for side, index in (("source", src_index), ("destination", dst_index)):
            buf = index.get((spec.name, lid))
            if buf is None:
                have = sorted(k[1] for k in index if k[0] == spec.name)
                raise PairingError(
                    f"pool {spec.name!r} layer {lid}: no {side} buffer (the {side} has layers {have} of this pool)",
                    field="buffers",
                    **ctx,
                )
            pair.append(buf)
        s, d = pair
        if s.bytes_per_page != d.bytes_per_page:
            raise PairingError(
                f"pool {spec.name!r} layer {lid}: source pages are {s.bytes_per_page} B, "
                f"destination pages {d.bytes_per_page} B",
                field="bytes_per_page",
                **ctx,
            )
        if s.bytes_per_page != spec.bytes_per_page:
            raise BufferSpecError(
                f"pool {spec.name!r} layer {lid}: buffers have {s.bytes_per_page} B pages, "
                f"the spec says {spec.bytes_per_page}",
                field="bytes_per_page",
                **ctx,
            )
        rows.append((s.base, d.base, s.capacity_pages, d.capacity_pages))
    src_base, dst_base, src_cap, dst_cap = zip(*rows)
    return (
        spec,
        np.array(src_base, dtype=np.uint64),
        np.array(dst_base, dtype=np.uint64),
        np.array(src_cap, dtype=np.int64),
        np.array(dst_cap, dtype=np.int64),
    )
