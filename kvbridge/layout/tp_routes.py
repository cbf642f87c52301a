"""TP routes: which prefill TP ranks each decode TP rank draws each pool from,
when the two sides have different TP sizes (``p`` prefill, ``d`` decode).

    head-sharded pool (k, v)   the prefill TP ranks whose heads overlap the decode
                               rank's head range (``head_slices``), one slice each
    sharded state slot         the prefill TP ranks whose part of every shard group
    (Mamba conv, SSM heads)    overlaps the decode rank's (``kvbridge.layout.kinds.
                               state_slices`` cuts the bytes); every group splits alike,
                               so the ranks whose share [p/P, (p+1)/P) meets [d/D, (d+1)/D)
    replicated pool (MLA)      one source: the decode rank's *first source*
    aux row                    the first source too (of the CP rank that owns the
                               last valid token: hard rule 4 picks the CP rank,
                               this the TP rank inside it)

The first source is the lowest prefill TP rank the decode rank draws head slices
or sharded state from, or TP rank 0 when no pool is sharded: a decode rank never talks to a
prefill rank only for a replicated pool or the aux row.

    4 KV heads, p 2 -> d 4       decode 0: p0 h0   decode 1: p0 h1   decode 2: p1 h2   decode 3: p1 h3
                                 first sources 0, 0, 1, 1
    4 KV heads, p 2 -> d 1       decode 0: p0 h0-1 + p1 h2-3             first source 0
    MLA only, any p, d           every decode rank: tp 0, whole rows

Both sides compute the route from the contract's pools and the two TP sizes:
the bootstrap daemon to list the senders a decode rank needs, the decode rank
to know what to ask each of them and how to count what arrives, the prefill
rank to check what it is asked and how many decode ranks will ask it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvbridge.errors import TopologyError
from kvbridge.layout.heads import HeadGeometry, HeadSlice, head_slices, rank_heads
from kvbridge.layout.pools import PoolSpec


@dataclass(frozen=True)
class TPRoute:
    """Decode TP rank ``dst_rank`` of ``dst_tp``, drawing from a prefill TP group of
    ``src_tp``: per pool, ``(prefill tp rank, head slice or None for a whole row)``."""

    src_tp: int
    dst_tp: int
    dst_rank: int
    pools: tuple[tuple[str, tuple[tuple[int, HeadSlice | None], ...]], ...]

    @property
    def sources(self) -> tuple[int, ...]:
        """Prefill TP ranks this decode rank asks, ascending."""
        return tuple(sorted({src for _, parts in self.pools for src, _ in parts}))

    @property
    def first_source(self) -> int:
        """Where replicated pools and the aux row come from."""
        return self.sources[0]

    def pools_from(self, src_rank: int) -> tuple[str, ...]:
        """Pools that prefill TP rank ``src_rank`` sends to this decode rank, by name."""
        return tuple(sorted(name for name, parts in self.pools if any(src == src_rank for src, _ in parts)))

    def slice_from(self, pool: str, src_rank: int) -> HeadSlice | None:
        """The head slice of ``pool`` that ``src_rank`` sends (None: the whole row)."""
        for name, parts in self.pools:
            if name == pool:
                for src, hs in parts:
                    if src == src_rank:
                        return hs
        raise TopologyError(f"decode tp rank {self.dst_rank} draws pool {pool!r} not from prefill tp rank "
                            f"{src_rank}", rank=src_rank, field="tp_rank")

    def sources_of(self, pool: str) -> tuple[int, ...]:
        return tuple(src for name, parts in self.pools if name == pool for src, _ in parts)


def tp_route(specs: Mapping[str, PoolSpec] | Iterable[PoolSpec], src_tp: int, dst_tp: int, dst_rank: int) -> TPRoute:
    """The route of decode TP rank ``dst_rank``; ``specs`` are any rank's specs (or the
    contract's whole rows): only their head geometry counts. TopologyError when a TP
    size neither divides a pool's heads nor is a multiple of them."""
    specs = list(specs.values()) if isinstance(specs, Mapping) else list(specs)
    if not isinstance(dst_tp, int) or not 0 <= dst_rank < dst_tp:
        raise TopologyError(f"decode tp rank {dst_rank} outside tp size {dst_tp}", rank=dst_rank, field="tp_rank")
    rank_heads(1, src_tp, 0)  # a positive prefill tp size
    sharded: dict[str, tuple[tuple[int, HeadSlice | None], ...]] = {}
    for spec in specs:
        if spec.head_sharded:
            slices = head_slices(HeadGeometry.of(spec), src_tp, dst_tp, dst_rank)
            sharded[spec.name] = tuple((hs.src_rank, None if _whole(hs) else hs) for hs in slices)
        elif spec.kind == "state" and spec.shard_units:
            sharded[spec.name] = tuple((src, None) for src in state_sources(src_tp, dst_tp, dst_rank))
    first = min((src for parts in sharded.values() for src, _ in parts), default=0)
    pools = [(s.name, sharded.get(s.name, ((first, None),))) for s in specs]
    return TPRoute(src_tp, dst_tp, dst_rank, tuple(sorted(pools)))


def state_sources(src_tp: int, dst_tp: int, dst_rank: int) -> tuple[int, ...]:
    """The prefill TP ranks (of ``src_tp``) whose share of a sharded state slot overlaps decode
    rank ``dst_rank``'s (of ``dst_tp``): every shard group splits evenly on both sides, so rank
    ``p`` holds ``[p/src_tp, (p+1)/src_tp)`` of each group, and they overlap where those meet."""
    return tuple(p for p in range(src_tp)
                 if p * dst_tp < (dst_rank + 1) * src_tp and dst_rank * src_tp < (p + 1) * dst_tp)


def _whole(hs: HeadSlice) -> bool:
    return hs.whole_rows


def num_drawing(specs: Mapping[str, PoolSpec] | Iterable[PoolSpec], src_tp: int, dst_tp: int, src_rank: int) -> int:
    """How many of the ``dst_tp`` decode ranks draw from prefill TP rank ``src_rank``:
    the number of decode ranks that will ask it for each room."""
    return sum(src_rank in tp_route(specs, src_tp, dst_tp, j).sources for j in range(dst_tp))
