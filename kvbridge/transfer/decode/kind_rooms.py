"""A decode rank's books for the pool kinds beyond paged KV in its rooms: the units each room
asks of its window, compressed and state pools, what was reported of them (``KindLedger``), and
the state slots the rooms hold (``StateSlots``). The room machine (``machine.py``) asks it.

    init(kind_units)  -> check_units (the shell, before anything is kept)
                      -> InitKinds: the room's units; its state slot claimed (a slot another
                         room holds, or a failed room's that a write may still reach, is refused)
    request           -> request_units: what the TransferRequest carries; the KindLedger starts
    SlotRequest       -> dest_units: the units a staged chunk may scatter into (DecodeStaging
                         checks its scatter list against them, per kind pool)
    PagesDone         -> record: every unit once per (source TP rank, pipeline stage) that sends
                         it, state only in a write at the request's full length (LedgerError)
    commit            <- complete: every unit of every kind pool, and every state slot (every
                         stage's layers of it; a sharded slot: every source TP rank's part)
    success           -> the slot is the engine's request's; failure: the slot is released when
                         the room's pages are (hard rule 6), never before

Window pools on pages use the room's page ids (token-paged pools share one mapping): decode
asks for the window's pages only and the ledger counts those; pages outside the window are
neither asked for nor accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError, LedgerError, PageRangeError
from kvbridge.layout import BufferDesc, PoolSpec
from kvbridge.layout.kinds import kind_specs, needed_bytes, needed_extent, own_units_pools
from kvbridge.layout.pools import STATE, WINDOW
from kvbridge.transfer.decode.kinds import KindLedger, StateSlots

__all__ = ["DecodeKinds"]


class DecodeKinds:
    """The kind pools' books of a decode rank's rooms (module docstring)."""

    def __init__(self, specs: Mapping[str, PoolSpec], descs: Sequence[BufferDesc], rank: str) -> None:
        self.specs = kind_specs(specs)
        self.own = own_units_pools(self.specs)
        # paged windows the engine may put on pages of their own (an SWA pool beside the full KV)
        self.windows = sorted(n for n, s in self.specs.items() if s.kind == WINDOW and not s.ring_stride)
        self.rank = rank
        self.caps: dict[str, int] = {}
        for d in descs:
            if d.pool in self.specs:
                self.caps[d.pool] = min(self.caps.get(d.pool, 1 << 62), d.capacity_pages)
        states = [n for n, s in self.specs.items() if s.kind == STATE]
        self.slots = StateSlots(min(self.caps[n] for n in states)) if states and self.caps else None
        self.units: dict[int, dict[str, np.ndarray]] = {}
        self.ledgers: dict[int, KindLedger] = {}
        self.slot_of: dict[int, int] = {}  # room -> the state slot it holds (claimed)

    def __bool__(self) -> bool:
        return bool(self.specs)

    # -- init -----------------------------------------------------------------------------------

    def check_units(self, room: int, units: Mapping[str, Any] | None, num_tokens: int | None,
                    first_page: int) -> dict[str, np.ndarray]:
        """The engine's ``kind_units`` checked: one array per compressed, state and ring pool (a
        state or ring pool: its one slot), as many units as decode needs of ``num_tokens``,
        inside the registered buffers (hard rule 5). Raises LayoutError/PageRangeError."""
        ctx = dict(room=room, rank=self.rank)
        if not self.specs:
            if units:
                raise LayoutError("kind_units given, but this rank has no window, compressed or state pool",
                                  field="kind_units", **ctx)
            return {}
        if num_tokens is None:
            raise LayoutError(f"pools {sorted(self.specs)} are window, compressed or state pools: init() must say "
                              "num_tokens (it decides the window and the complete entries)", field="num_tokens", **ctx)
        if first_page:
            raise LayoutError("a decode prefix (first_page) is not carried for window, compressed and state pools",
                              field="first_page", **ctx)
        units = dict(units or {})
        windows = sorted(set(units) & set(self.windows))
        if sorted(units) != sorted(self.own + windows):
            raise LayoutError(f"kind_units names {sorted(units)}; this rank's pools on units of their own are "
                              f"{self.own} (and paged windows {self.windows} may be: their window's pages, from "
                              "the first)", field="kind_units", **ctx)
        out = {}
        for pool in self.own + windows:
            spec = self.specs[pool]
            arr = np.asarray(units[pool]).reshape(-1)
            if arr.size and arr.dtype.kind not in "iu":
                raise LayoutError(f"kind_units[{pool!r}] must be integers, got {arr.dtype}", field="kind_units", **ctx)
            arr = arr.astype(np.int64)
            ext = needed_extent(spec, num_tokens)
            want = (1 if ext.count else 0) if spec.kind == STATE or spec.ring_stride else ext.count
            if arr.size != want:
                raise LayoutError(f"kind_units[{pool!r}]: {arr.size} units, decode needs {want} of {num_tokens} tokens",
                                  field="kind_units", **ctx)
            cap = min(self.caps.get(pool, 0), 2**31)
            if arr.size and (arr.min() < 0 or arr.max() >= cap):
                raise PageRangeError(f"kind_units[{pool!r}] must lie in [0, {cap}) (registered capacity)",
                                     field="kind_units", **ctx)
            out[pool] = arr
        return out

    def claim(self, room: int, units: Mapping[str, np.ndarray], releasable: Mapping[int, bool]) -> None:
        """Keep room ``room``'s units and claim its state slot. ``releasable``: for rooms holding
        slots, whether their pages are releasable now (a failed room's slot frees with them)."""
        self.units[room] = dict(units)
        slot = next((int(u[0]) for p, u in units.items() if self.specs[p].kind == STATE and u.size), None)
        if slot is None or self.slots is None:
            return
        holder = next((other for other, s in self.slot_of.items() if s == slot and other != room), None)
        if holder is not None and releasable.get(holder, False):
            self.release(holder)
        if holder is not None and holder in self.slot_of:
            self.units.pop(room, None)
            raise LayoutError(f"state slot {slot} is held by room {holder}, whose writes may still land there (hard "
                              "rule 6)", field="kind_units", room=room, rank=self.rank)
        self.slots.claim(room, slot)
        self.slot_of[room] = slot

    # -- the request and its reports ---------------------------------------------------------------

    def request_units(self, room: int, pools: Sequence[str] | None = None) -> dict[str, bytes]:
        """The units a ``TransferRequest`` for ``pools`` carries (None: every pool; a pipeline stage
        is asked for the pools it holds layers of)."""
        return {pool: u.astype("<i4").tobytes() for pool, u in self.units.get(room, {}).items()
                if (pool in self.own or pool in self.windows) and (pools is None or pool in pools)}

    def start(self, room: int, num_tokens: int | None, stages: Mapping[str, Sequence[int]] | None = None,
              sources: Mapping[str, Sequence[int]] | None = None) -> None:
        """The room's ledger; ``stages``: pool -> the pipeline stages that send its layers;
        ``sources``: pool -> the prefill TP ranks that send it (the TP route)."""
        if self.specs and num_tokens is not None:
            self.ledgers[room] = KindLedger(room, self.specs, num_tokens, stages, sources)

    def record(self, room: int, msg: Any, rank: str, pp_rank: int = 0, tp_rank: int | None = None) -> None:
        """A PagesDone's kind units (``kind_units``, ``kind_last``) from pipeline stage ``pp_rank``
        into the room's ledger."""
        ledger = self.ledgers.get(room)
        if ledger is None:
            raise LedgerError("kind units reported for a room that asked for none", room=room, rank=rank,
                              field="kind_units")
        for pool in msg.kind_units:
            if pool not in ledger.extents:
                raise LedgerError(f"units reported for pool {pool!r}, which this room does not receive", room=room,
                                  rank=rank, field="kind_units")
        for pool, packed in msg.kind_units.items():
            ledger.record_units(pool, np.frombuffer(packed, dtype="<i4").astype(np.int64), last=msg.kind_last,
                                rank=rank, pp_rank=pp_rank, tp_rank=tp_rank)

    def dest_units(self, room: int, page_ids: np.ndarray | None) -> dict[str, np.ndarray]:
        """Per kind pool, the units a write of room ``room`` may reach on this rank (a staged
        chunk's scatter list is checked against them, ``DecodeStaging``): what the room asked of
        each pool on units of its own (entry pages, its state slot, its ring row, a window's own
        pages), and a paged window's pages of the window on the room's mapping (``page_ids``).
        Empty before the room's request (nothing may land yet)."""
        ledger = self.ledgers.get(room)
        if ledger is None:
            return {}
        units = self.units.get(room, {})
        out = {}
        for pool, ext in ledger.extents.items():
            if pool in units:
                out[pool] = units[pool]
            elif page_ids is not None:  # a paged window on the room's pages: the window's only
                out[pool] = np.asarray(page_ids[ext.first:ext.stop], dtype=np.int64)
        return out

    def digest_units(self, room: int, pool: str, logical: np.ndarray, page_ids: np.ndarray) -> np.ndarray:
        """Our units holding ``logical`` units of ``pool`` (a state or ring pool: its one slot or
        row; a paged window on the room's mapping: its pages): what a unit digest reads back."""
        spec, units = self.specs[pool], self.units.get(room, {})
        if pool in units:
            if spec.kind == STATE or spec.ring_stride:
                return units[pool][:1]
            return units[pool][logical - self.ledgers[room].extents[pool].first]
        return np.asarray(page_ids, dtype=np.int64)[logical]

    def complete(self, room: int) -> bool:
        """Every kind unit of the room reported (True for a room without kind pools)."""
        ledger = self.ledgers.get(room)
        return ledger is None or ledger.complete

    def needed_bytes(self, num_tokens: int) -> int:
        """What a room of ``num_tokens`` receives of the kind pools (``KVReceiver.stats['bytes']``)."""
        return sum(needed_bytes(spec, num_tokens) for spec in self.specs.values())

    def missing(self, room: int) -> dict[str, list[int]]:
        ledger = self.ledgers.get(room)
        return {} if ledger is None else ledger.missing()

    # -- the end ----------------------------------------------------------------------------------

    def succeed(self, room: int) -> None:
        """The room committed: its state slot is the engine's request's now."""
        if room in self.slot_of:
            self.slots.succeed(room)
            del self.slot_of[room]

    def release(self, room: int) -> None:
        """The room's pages are releasable (it failed and every asked prefill rank is quiet), or it
        is forgotten: its slot is free again, its books dropped."""
        if room in self.slot_of:
            self.slots.fail(room, ())
            del self.slot_of[room]
        self.units.pop(room, None)
        self.ledgers.pop(room, None)

    def draining(self) -> list[int]:
        """Rooms holding a state slot (held or waiting for their writes to stop)."""
        return list(self.slot_of)
