"""A decode rank's books for the pool kinds beyond paged KV (window, compressed, request
state): what a room must receive of each (``KindLedger``) and the state slots it holds
(``StateSlots``). Sans-I/O: reports in, errors and released slots out.

    KindLedger, n = 45 tokens            units: 0 1 2 3 ...            (pool's own units)
      swa      window 15 -> pages 7..11          . x x x x             every needed unit once
      hca      ratio 32 -> 1 entry, page 0       x
      hca_tail state (tail 13 rows)              S                     only with the last chunk, once
    complete  <=>  every unit of every pool, and every state slot, counted (from every pipeline
                   stage that holds layers of the pool: one row per stage)

A state slot is a destination like a page: a failed or aborted room's slots are released
only once no write can still land (every prefill rank that was asked acknowledged the abort,
or its lease expired: hard rule 6), the moment its pages are.

    StateSlots   free --assign--> held --succeed--> (the engine's: release when the request ends)
                                   |---fail(asked)--> draining --quiet(rank) for every asked--> free
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvbridge.errors import LedgerError, StagingSlotError
from kvbridge.layout import Extent, PoolSpec, has_repeats, needed_extent

__all__ = ["KindLedger", "StateSlots"]


class KindLedger:
    """Exactly-once ledger of one room's kind pools: each unit of each pool's needed extent
    reported once by every pipeline stage that holds layers of the pool (one stage without PP),
    by the last chunk at the latest; a state slot only in a report at the request's full length.

        pool hca, stages (0, 1)     unit:  0 1 2
          pp0 (layers 0-1)                 x x x
          pp1 (layer 2)                    x . x      unit 1 not complete: pp1's layer missing"""

    def __init__(self, room: int, specs: Mapping[str, PoolSpec], num_tokens: int,
                 stages: Mapping[str, Sequence[int]] | None = None,
                 sources: Mapping[str, Sequence[int]] | None = None) -> None:
        """``stages``: pool -> the pipeline stages that send its layers (``Placement.stages``;
        None: one stage, pp 0); ``sources``: pool -> the prefill TP ranks that send it (the TP
        route's: several for a sharded state slot across TP sizes; None: any one TP rank)."""
        self.room = room
        self.kinds = {name: spec.kind for name, spec in specs.items()}
        self.extents: dict[str, Extent] = {name: needed_extent(spec, num_tokens) for name, spec in specs.items()}
        self.stages = {name: tuple(stages.get(name, (0,))) if stages is not None else (0,) for name in specs}
        self.sources = {name: tuple(sources.get(name, (None,))) if sources is not None else (None,) for name in specs}
        self.staged = any(st != (0,) for st in self.stages.values())
        self._rows = {name: [(tp, pp) for tp in self.sources[name] for pp in self.stages[name]] for name in specs}
        self._seen = {name: np.zeros((len(self._rows[name]), ext.count), dtype=bool)
                      for name, ext in self.extents.items()}
        self._left = sum(m.size for m in self._seen.values())

    def record(self, pool: str, first: int, count: int, *, last: bool, rank: str = "", pp_rank: int = 0,
               tp_rank: int | None = None) -> None:
        """Units ``[first, first + count)`` of ``pool`` written; ``last``: at the request's full length."""
        self.record_units(pool, np.arange(first, first + max(count, 0), dtype=np.int64), last=last, rank=rank,
                          pp_rank=pp_rank, tp_rank=tp_rank)

    def record_units(self, pool: str, units: np.ndarray, *, last: bool, rank: str = "", pp_rank: int = 0,
                     tp_rank: int | None = None) -> None:
        """Logical ``units`` of ``pool`` written by pipeline stage ``pp_rank`` of prefill TP rank
        ``tp_rank`` (a CP rank's owned pages: ``kvbridge.lane_units``; every layer of them that the
        stage holds; a sharded state slot: its TP part); ``last``: at the request's full length.
        Checks everything before marking anything."""
        if pool not in self.extents:
            raise LedgerError(f"units reported for pool {pool!r}, which this room does not receive", room=self.room,
                              rank=rank, field="pools")
        if pp_rank not in self.stages[pool]:
            raise LedgerError(f"units of pool {pool!r} reported by pipeline stage pp{pp_rank}, which holds no layer "
                              f"of it (stages {list(self.stages[pool])})", room=self.room, rank=rank, field="pp_rank")
        ext, kind = self.extents[pool], self.kinds[pool]
        units = np.asarray(units, dtype=np.int64).reshape(-1)
        if kind == "state" and not last:
            raise LedgerError(f"state of pool {pool!r} reported before the last chunk: state is committed once, "
                              "with the chunk that ends at the request's length", room=self.room, rank=rank,
                              field="state")
        if len(units) and (units.min() < ext.first or units.max() >= ext.stop):
            raise LedgerError(f"pool {pool!r} ({kind}): units [{units.min()}, {units.max() + 1}) outside what decode "
                              f"needs [{ext.first}, {ext.stop})", room=self.room, rank=rank, field="logical_pages")
        if has_repeats(np.asarray(units)):
            raise LedgerError(f"pool {pool!r} ({kind}): a unit reported twice in one report", room=self.room,
                              rank=rank, field="logical_pages")
        tp = tp_rank if self.sources[pool] != (None,) else None
        if (tp, pp_rank) not in self._rows[pool]:
            raise LedgerError(f"units of pool {pool!r} reported by prefill TP rank {tp_rank}, which this decode "
                              f"rank does not draw it from (TP ranks {list(self.sources[pool])})", room=self.room,
                              rank=rank, field="tp_rank")
        row = self._seen[pool][self._rows[pool].index((tp, pp_rank))]
        seen = row[units - ext.first]
        if seen.any():
            what = "state slot" if kind == "state" else f"unit {int(units[np.argmax(seen)])}"
            raise LedgerError(f"pool {pool!r} ({kind}): {what} reported twice", room=self.room, rank=rank,
                              field="state" if kind == "state" else "logical_pages")
        row[units - ext.first] = True
        self._left -= len(units)

    @property
    def complete(self) -> bool:
        return self._left == 0

    def missing(self) -> dict[str, list[int]]:
        """Units not yet reported, per pool (first few); with pipeline stages per pool and stage
        (``"hca@pp1"``)."""
        out = {}
        for name, seen in self._seen.items():
            for (tp, stage), row in zip(self._rows[name], seen):
                if not row.all():
                    key = name + (f"@tp{tp}" if len(self.sources[name]) > 1 else "") + \
                        (f"@pp{stage}" if self.staged else "")
                    out[key] = (np.flatnonzero(~row)[:8] + self.extents[name].first).tolist()
        return out


class StateSlots:
    """The state slots of a decode rank (``capacity`` request rows). A room holds one slot from
    assignment; success hands it to the engine; failure drains it (hard rule 6)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise StagingSlotError(f"a state slot table needs capacity >= 1, got {capacity}", field="capacity")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._held: dict[int, int] = {}  # room -> slot
        self._draining: dict[int, tuple[int, set[str]]] = {}  # room -> (slot, asked ranks not yet quiet)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def assign(self, room: int) -> int:
        if room in self._held or room in self._draining:
            raise StagingSlotError(f"room {room} already holds a state slot", room=room, field="room")
        if not self._free:
            raise StagingSlotError(f"no free state slot of {self.capacity}", room=room, field="capacity")
        slot = self._free.pop()
        self._held[room] = slot
        return slot

    def claim(self, room: int, slot: int) -> None:
        """Room ``room`` holds slot ``slot``, chosen by the engine (its request row): refused while
        another room holds it or drains it (a write may still land there: hard rule 6)."""
        if room in self._held or room in self._draining:
            raise StagingSlotError(f"room {room} already holds a state slot", room=room, field="room")
        if not 0 <= slot < self.capacity:
            raise StagingSlotError(f"state slot {slot} outside the {self.capacity} registered", room=room, field="slot")
        busy = {s: r for r, s in self._held.items()} | {s: r for r, (s, _) in self._draining.items()}
        if slot in busy:
            raise StagingSlotError(f"state slot {slot} is held by room {busy[slot]}", room=room, field="slot")
        if slot in self._free:
            self._free.remove(slot)
        self._held[room] = slot

    def succeed(self, room: int) -> int:
        """The room committed: its slot now belongs to the engine's request (returned)."""
        return self._take(room)

    def release(self, slot: int) -> None:
        """The engine's request ended: its slot is free."""
        busy = set(self._held.values()) | {s for s, _ in self._draining.values()}
        if not 0 <= slot < self.capacity or slot in self._free or slot in busy:
            raise StagingSlotError(f"state slot {slot} is not the engine's to release", field="slot")
        self._free.append(slot)

    def fail(self, room: int, asked: Iterable[str]) -> list[int]:
        """The room failed or was aborted: its slot is free once every asked prefill rank is quiet
        (released slots are returned: none while a write may still land)."""
        slot = self._take(room)
        pending = set(asked)
        if not pending:
            self._free.append(slot)
            return [slot]
        self._draining[room] = (slot, pending)
        return []

    def quiet(self, room: int, rank: str) -> list[int]:
        """``rank`` acknowledged the abort (or its lease expired): nothing of it can land any more."""
        if room not in self._draining:
            return []
        slot, pending = self._draining[room]
        pending.discard(rank)
        if pending:
            return []
        del self._draining[room]
        self._free.append(slot)
        return [slot]

    def _take(self, room: int) -> int:
        if room not in self._held:
            raise StagingSlotError(f"room {room} holds no state slot", room=room, field="room")
        return self._held.pop(room)
