"""Decode's staging area as the rooms see it: grants, landings, scatters (sans-I/O).

The decode rank owns one registered staging area (``DecodeConfig.staging_bytes``, cut into
slots of ``staging_slot_bytes``) and describes it in every TransferRequest. Remote writes of a
staged target land only there:

    SlotRequest(room, cp, chunk)  ->  acquire (FIFO; none free: the chunk waits, back-pressure)
                                  ->  SlotGrant(slot) to that prefill rank
    ChunkLanded(ok, scatter list) ->  every destination checked inside the room's own pages
                                  ->  slot SCATTERING, Scatter action (the shell starts the copy
                                      slot -> pages: on a GPU a kernel whose event the loop polls)
                                  ->  scattered() once the copy completed: slot free, the next
                                      waiter granted at once (the slot's credit goes back)
    room failed                   ->  ASSIGNED slots QUARANTINED (a write may still land in them)
                                      until that prefill rank acks the abort (or reports the room
                                      failed), or its lease expires plus the quarantine
    ChunkLanded(failed)           ->  the slot is free (nothing of that write is in flight)

Chunks are keyed per sender: ``(cp_rank, tp_rank, chunk)`` -> one int of the area. Pages count
in the ledger only from a PagesDone, which follows the write's ChunkLanded on the same
connection; the room commits only once no scatter of it is pending, and a failed room's pages
are free only once no scatter of it is still running (``in_flight``: the copy writes them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import LedgerError
from kvbridge.layout import BufferDesc, PoolSpec
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.staging import Grant, SlotState, StagingArea

__all__ = ["DecodeStaging", "Scatter"]

_SENDER_SHIFT = 32  # chunk key = sender index << 32 | chunk
_TP_SPAN = 4096  # sender index = (cp * span + tp) * span + pp (every size is at most 4096)
Sender = tuple[int, int, int]  # (cp_rank, tp_rank, pp_rank) of a prefill sender


@dataclass(frozen=True, slots=True)
class Scatter:
    """Copy ``length[i]`` bytes from ``src[i]`` (in staging slot ``slot``) to ``dst[i]`` (the room's
    pages); answer with ``DecodeRooms.scattered(room, slot, now)``."""

    room: int
    slot: int
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray


class DecodeStaging:
    """The slots of this rank's staging area at ``base`` and who asked for them."""

    def __init__(self, area: StagingArea, base: int, dst_bufs: Sequence[BufferDesc], rank: str,
                 aux_ranges: Callable[[int], list[tuple[int, int]]] = lambda slot: [],
                 kind_specs: Mapping[str, PoolSpec] | None = None) -> None:
        """``aux_ranges(slot)``: the ``[start, end)`` byte ranges of aux row ``slot`` (the aux row
        rides in a staged target's last write, so it is scattered from a slot too);
        ``kind_specs``: the window, compressed and state pools among ``dst_bufs``, whose
        destinations are checked against the room's units of each (``landed(kind_units=)``)
        rather than its pages."""
        self.area, self.base, self.rank = area, base, rank
        self.aux_ranges = aux_ranges
        self.asks: dict[tuple[int, int], str] = {}  # (room, chunk key) -> the asking prefill rank's endpoint
        self.pending: dict[int, int] = {}  # room -> chunks landed, not yet scattered (cleared when it fails)
        self.in_flight: dict[int, int] = {}  # room -> scatters started, not yet completed (kept when it fails)
        # (room, endpoint) -> the (cp, tp, pp) sender that asked there: a late report of a room already
        # forgotten (staged only: its pages were freed at once) still frees its quarantined slots
        self.senders: dict[tuple[int, str], Sender] = {}
        # (room, sender) -> chunks landed since its last PagesDone: a staged-only room's report with
        # none before it means that sender wrote the pages directly
        self.unreported: dict[tuple[int, Sender], int] = {}
        bufs = sorted(dst_bufs, key=lambda b: b.base)
        self._base = np.array([b.base for b in bufs], dtype=np.uint64)
        self._end = np.array([b.base + b.capacity_pages * b.bytes_per_page for b in bufs], dtype=np.uint64)
        self._page = np.array([b.bytes_per_page for b in bufs], dtype=np.uint64)
        # per buffer: -1 for a pool on the room's pages, else its kind pool's index in ``_kinds``;
        # the bytes of one unit (a ring window's unit is a request row: ``stride`` token rows)
        kinds = dict(kind_specs or {})
        self._kinds = sorted(kinds)
        self._pool = np.array([self._kinds.index(b.pool) if b.pool in kinds else -1 for b in bufs], dtype=np.int64)
        self._unit = np.array([kinds[b.pool].ring_stride * kinds[b.pool].bytes_per_token
                               if b.pool in kinds and kinds[b.pool].ring_stride else b.bytes_per_page for b in bufs],
                              dtype=np.uint64)
        self.counters = {"slot_requests": 0, "granted_at_once": 0, "slot_waits": 0, "chunks_scattered": 0,
                         "bytes_scattered": 0, "scatter_slices": 0, "chunks_failed": 0}

    @staticmethod
    def key(sender: Sender, chunk: int) -> int:
        cp, tp, pp = sender
        return (((cp * _TP_SPAN + tp) * _TP_SPAN + pp) << _SENDER_SHIFT) | chunk

    @staticmethod
    def sender_of(key: int) -> Sender:
        cp_tp, pp = divmod(key >> _SENDER_SHIFT, _TP_SPAN)
        cp, tp = divmod(cp_tp, _TP_SPAN)
        return (cp, tp, pp)

    # ---- events ------------------------------------------------------------------------------
    def request(self, room: int, sender: Sender, endpoint: str, msg: wire.SlotRequest,
                out: list) -> None:
        if msg.chunk >= 1 << _SENDER_SHIFT or msg.num_bytes > self.area.slot_bytes:
            raise LedgerError(f"slot request for chunk {msg.chunk} of {msg.num_bytes} B: slots hold "
                              f"{self.area.slot_bytes} B", room=room, rank=f"cp{msg.cp_rank}", field="chunk")
        ck = self.key(sender, msg.chunk)
        self.asks[(room, ck)] = endpoint
        self.senders[(room, endpoint)] = sender
        self.counters["slot_requests"] += 1
        grant = self.area.acquire(room, ck)
        if grant is None:
            self.counters["slot_waits"] += 1
        else:
            self.counters["granted_at_once"] += 1
            self.grant([grant], out)

    def grant(self, grants: list[Grant], out: list) -> None:
        for g in grants:
            endpoint = self.asks.pop((g.room, g.chunk), None)
            _, chunk = divmod(g.chunk, 1 << _SENDER_SHIFT)
            out.append(Send((endpoint,), wire.SlotGrant(room=g.room, decode_rank=self.rank,
                                                        chunk=chunk, slot=g.slot)))

    def landed(self, room: int, sender: Sender, msg: wire.ChunkLanded, page_ids: np.ndarray | None,
               aux_slot: int, out: list, kind_units: Mapping[str, np.ndarray] | None = None) -> None:
        """A chunk's write into its slot is final: scatter it (ok) or free the slot (failed).
        ``kind_units``: per kind pool, the units of it the room may be written in
        (``DecodeKinds.dest_units``)."""
        ck = self.key(sender, msg.chunk)
        if msg.slot >= self.area.num_slots or self.area.owner(msg.slot) != (room, ck):
            raise LedgerError(f"chunk {msg.chunk} reported in slot {msg.slot}, which it was not granted", room=room,
                              rank=f"cp{msg.cp_rank}", field="slot")
        state = self.area.state(msg.slot)
        if state is SlotState.QUARANTINED:  # the room failed; the write is final now: nothing more lands
            self.grant(self.area.acknowledged(msg.slot), out)
            return
        self.area.landed(msg.slot, room, ck)
        if msg.status != "ok":
            self.counters["chunks_failed"] += 1
            self.grant(self.area.release(msg.slot), out)
            return
        off, dst, length = wire.unpack_scatter(msg.scatter)
        problem = self._outside(off, dst, length, page_ids, aux_slot, kind_units or {})
        if problem is not None:
            self.grant(self.area.release(msg.slot), out)
            raise LedgerError(f"chunk {msg.chunk}'s scatter list {problem}", room=room, rank=f"cp{msg.cp_rank}",
                              field="scatter")
        self.area.scatter(msg.slot)
        self.pending[room] = self.pending.get(room, 0) + 1
        self.in_flight[room] = self.in_flight.get(room, 0) + 1
        self.unreported[(room, sender)] = self.unreported.get((room, sender), 0) + 1
        self.counters["scatter_slices"] += len(length)
        self.counters["bytes_scattered"] += int(length.sum())
        out.append(Scatter(room, msg.slot, off + np.uint64(self.base + self.area.offset(msg.slot)), dst, length))

    def reported(self, room: int, sender: Sender) -> bool:
        """``sender`` reported a write (PagesDone ok): True when chunks of it landed in staging."""
        return self.unreported.pop((room, sender), 0) > 0

    def scattered(self, room: int, slot: int, out: list) -> None:
        """The shell's copy of the slot into the pages completed: the slot is free (also when the
        room failed meanwhile: nothing of it reads the slot or writes the pages any more)."""
        for book in (self.pending, self.in_flight):
            if book.get(room, 0) > 0:
                book[room] -= 1
                if not book[room]:
                    del book[room]
        if self.area.state(slot) is SlotState.SCATTERING and self.area.owner(slot)[0] == room:
            self.area.scattered(slot)
            self.counters["chunks_scattered"] += 1
            self.grant(self.area.release(slot), out)

    def scattering(self, room: int) -> int:
        """Scatters of ``room`` started and not completed (its pages are being written)."""
        return self.in_flight.get(room, 0)

    def fail_room(self, room: int, free_at: float, out: list) -> None:
        """The room failed: its waiting requests leave, its ASSIGNED slots are quarantined."""
        for key in [k for k in self.asks if k[0] == room]:
            del self.asks[key]
        self.pending.pop(room, None)
        self.unreported = {k: v for k, v in self.unreported.items() if k[0] != room}
        self.grant(self.area.fail_room(room, free_at), out)

    def sender_quiet(self, room: int, sender: Sender, out: list) -> None:
        """``sender`` acknowledged the room's abort (or reported it failed): its quarantined slots are free."""
        for i in self.area.slots_of(room):
            owner = self.area.owner(i)[1]
            if self.area.state(i) is SlotState.QUARANTINED and owner is not None and self.sender_of(owner) == sender:
                self.grant(self.area.acknowledged(i), out)

        self.senders = {k: v for k, v in self.senders.items() if not (k[0] == room and v == sender)}

    def late(self, room: int, endpoint: str, msg: object, out: list) -> None:
        """A report for a room the rooms forgot (AbortAck, failed PagesDone or ChunkLanded)."""
        sender = self.senders.get((room, endpoint))
        if sender is None:
            return
        if isinstance(msg, wire.ChunkLanded):
            ck = self.key(sender, msg.chunk)
            if msg.slot < self.area.num_slots and self.area.owner(msg.slot) == (room, ck) and \
                    self.area.state(msg.slot) is SlotState.QUARANTINED:
                self.grant(self.area.acknowledged(msg.slot), out)
        elif isinstance(msg, wire.AbortAck) or getattr(msg, "status", "ok") == "failed":
            self.sender_quiet(room, sender, out)

    def forget(self, room: int) -> None:
        """The rooms forgot ``room``: keep its senders only while a slot of it is quarantined."""
        self.unreported = {k: v for k, v in self.unreported.items() if k[0] != room}
        if not self.area.slots_of(room):
            self.senders = {k: v for k, v in self.senders.items() if k[0] != room}

    def expire(self, now: float, out: list) -> None:
        before = self.area.counters["expired"]
        grants = self.area.expire(now)
        if self.area.counters["expired"] != before:
            held = {self.area.owner(i)[0] for i in range(self.area.num_slots)}
            self.senders = {k: v for k, v in self.senders.items() if k[0] in held or k[0] in self.pending}
        self.grant(grants, out)

    # ---- checks ------------------------------------------------------------------------------
    def _outside(self, off: np.ndarray, dst: np.ndarray, length: np.ndarray, page_ids: np.ndarray | None,
                 aux_slot: int, kind_units: Mapping[str, np.ndarray]) -> str | None:
        """Why a scatter list would write outside the slot or the room's own pages, its units of
        each kind pool, and its aux row (None: it does not)."""
        if not length.size:
            return None
        if page_ids is None:
            return "came before the room's pages are known"
        if int(length.min()) < 1 or int((off + length).max()) > self.area.slot_bytes:
            return f"reads outside its {self.area.slot_bytes} B slot"
        in_aux = np.zeros(len(dst), dtype=bool)
        for start, end in self.aux_ranges(aux_slot) if aux_slot >= 0 else ():
            in_aux |= (dst >= np.uint64(start)) & (dst + length <= np.uint64(end))
        dst, length = dst[~in_aux], length[~in_aux]
        if not length.size:
            return None
        i = np.searchsorted(self._base, dst, side="right").astype(np.int64) - 1
        if (i < 0).any():
            return "writes below every registered buffer"
        base, unit = self._base[i], self._unit[i]
        if ((dst + length) > self._end[i]).any():
            return "writes past a registered buffer's end"
        first = ((dst - base) // unit).astype(np.int64)
        last = ((dst + length - np.uint64(1) - base) // unit).astype(np.int64)
        pool = self._pool[i]
        for k in np.unique(pool).tolist():
            sel = pool == k
            held = page_ids if k < 0 else kind_units.get(self._kinds[k], np.zeros(0, dtype=np.int64))
            if not _covered(first[sel], last[sel], np.asarray(held, dtype=np.int64)):
                if k < 0:
                    return "writes into pages this room does not hold"
                return f"writes into units of pool {self._kinds[k]!r} that this room does not hold"
        return None


def _covered(first: np.ndarray, last: np.ndarray, held: np.ndarray) -> bool:
    """Every unit of every ``[first[i], last[i]]`` is among ``held``."""
    top = int(last.max()) + 1
    mine = np.zeros(top + 1, dtype=np.int64)
    mine[held[(held >= 0) & (held < top)]] = 1
    count = np.concatenate(([0], np.cumsum(mine)))
    return bool(((count[last + 1] - count[first]) == (last - first + 1)).all())
