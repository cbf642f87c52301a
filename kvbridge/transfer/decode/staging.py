"""Decode's staging area as the rooms see it: grants, landings, scatters (sans-I/O).

The decode rank owns one registered staging area (``DecodeConfig.staging_bytes``, cut into
slots of ``staging_slot_bytes``) and describes it in every TransferRequest. Remote writes of a
staged target land only there:

    SlotRequest(room, cp, chunk,  ->  every destination checked inside the room's own pages, the list
                scatter list)         kept for the landing (one that is not: the room fails, no grant)
                                  ->  acquire (FIFO; none free: the chunk waits, back-pressure)
                                  ->  SlotGrant(slot) to that prefill rank
    ChunkLanded(ok)               ->  slot SCATTERING, Scatter action by the checked list (the shell
                                      starts the copy slot -> pages: on a GPU a kernel whose event
                                      the loop polls)
                                  ->  scattered() once the copy completed: slot free, the next
                                      waiter granted at once (the slot's credit goes back)
    room failed                   ->  ASSIGNED slots QUARANTINED (a write may still land in them)
                                      until that prefill rank acks the abort (or reports the room
                                      failed), or its lease expires plus the quarantine
    ChunkLanded(failed)           ->  the slot is free (nothing of that write is in flight)

Granted with the request (``grant_with_request``, the area's reserved slots): a sender's first
chunk of the room may hold a slot from the room's TransferRequest on. Its SlotRequest, which
then comes ahead of its write on the same connection, is checked as any other and answered with
no SlotGrant; a ChunkLanded for it before its checked list fails the room as any other. A slot
granted so that no chunk used is freed when the room commits (``room_done``: every sender
reported its last write), quarantined like any ASSIGNED slot when it fails.

Chunks are keyed per sender: ``(cp_rank, tp_rank, chunk)`` -> one int of the area. Pages count
in the ledger only from a PagesDone, which follows the write's ChunkLanded on the same
connection; the room commits only once no scatter of it is pending, and a failed room's pages
are free only once no scatter of it is still running (``in_flight``: the copy writes them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
HELD_CACHE_BYTES = 64 << 20  # rooms' unit tables kept at most (the least recently checked go first)
# checked scatter lists kept for chunks not landed yet, per asking prefill endpoint: a rank asks for at most twice its
# gather slots at once (StagedWrites.ahead), a 256 MiB slot's list is about 0.5 MiB; a request past the cap fails its room
LISTS_CAP_BYTES = 64 << 20
_NONE_UNPROVEN = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Scatter:
    """Copy ``length[i]`` bytes from ``src[i]`` (in staging slot ``slot``) to ``dst[i]`` (the room's
    pages); answer with ``DecodeRooms.scattered(room, slot, now)``.

    ``unproven``: the indices of the entries ``request`` did not prove to lie inside the stager's
    device memory (``DecodeStaging(kernel_ranges=)``): the aux row's, and those of a buffer whose
    checked extent is not inside one of those ranges. None: nothing was proven (no ranges given),
    the stager looks every entry up (``CudaStager.copy(unproven=)``)."""

    room: int
    slot: int
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    unproven: np.ndarray | None = None


class _Held:
    """One room's pages and kind units as one table over every group's units, built at its first
    slot request and kept while its inputs stay equal (the engine's page ids are fixed at init,
    kind units from the room's request): a request's list is then checked in one pass.

        group g: 0 the room's pages, 1 + k kind pool k, each as many units as its largest buffer
        unit u of group g is global unit start[g] + u                  (DecodeStaging._start)
        free[j] = units NOT held below global unit j                   (int32 unless huge)

    An entry of units ``[lo, hi1)`` (global, inside one buffer: checked before) is all held iff
    ``free[hi1] == free[lo]``."""

    __slots__ = ("page_ids", "kind_units", "free", "nbytes")

    def __init__(self, page_ids: np.ndarray, kind_units: dict[str, np.ndarray], kinds: list[str],
                 start: np.ndarray) -> None:
        self.page_ids, self.kind_units = page_ids, kind_units
        total = int(start[-1])
        held = np.zeros(total, dtype=np.int8)
        for g, units in enumerate([page_ids] + [kind_units.get(k, _NONE_UNPROVEN) for k in kinds]):
            lo, hi = int(start[g]), int(start[g + 1])
            held[lo + units[(units >= 0) & (units < hi - lo)]] = 1
        self.free = np.zeros(total + 1, dtype=np.int32 if total < 2**31 else np.int64)
        np.cumsum(1 - held, out=self.free[1:])
        self.nbytes = self.free.nbytes + page_ids.nbytes + sum(a.nbytes for a in kind_units.values())

    def same(self, page_ids: np.ndarray, kind_units: dict[str, np.ndarray]) -> bool:
        """Were these the inputs the table was built from (equal content, not only the same objects:
        nothing may depend on a caller never writing into its arrays)?"""
        return (_equal(self.page_ids, page_ids) and self.kind_units.keys() == kind_units.keys()
                and all(_equal(a, kind_units[k]) for k, a in self.kind_units.items()))


class _FastUnits:
    """The fast path of ``DecodeStaging._outside``'s look-ups, the same answers in fewer and cheaper
    passes over a chunk's list (thousands of entries a chunk, checked on decode's loop):

    - the buffer of an address by one shift and two gathers instead of a binary search: the
      address space from the lowest buffer's base to the highest end, cut into buckets no wider
      than the smallest gap between two bases, so that a bucket holds at most one base; an
      address's buffer is the last one based at or below its bucket's start, or the next one
      when its base lies at or below the address (``buffer``);
    - the first and past-last global unit of an entry by float64 division instead of uint64
      floor division: exact where every dividend and divisor is below 2**53 (an integer quotient
      x / u with u <= x < 2**53 rounds to within x * 2**-53 < 1 / u of itself, never across an
      integer), which ``of`` checks per tree of buffers once (``units``).

    None of it applies (``of`` answers None) where two buffers share a base, where the table
    would exceed ``MAX_BUCKETS``, or where a unit index could reach 2**53; and an address past
    the table (``covered``) takes the binary search."""

    MAX_BUCKETS = 1 << 20
    __slots__ = ("first", "next_base", "low", "shift", "covered", "unit_f")

    def __init__(self, first: np.ndarray, next_base: np.ndarray, low: int, shift: int, covered: int,
                 unit_f: np.ndarray) -> None:
        self.first, self.next_base, self.low, self.shift = first, next_base, np.uint64(low), np.uint64(shift)
        self.covered, self.unit_f = covered, unit_f

    @classmethod
    def of(cls, base: np.ndarray, end: np.ndarray, unit: np.ndarray, shift: Sequence[int]) -> _FastUnits | None:
        if not base.size:
            return None
        low, high = int(base[0]), int(end.max())
        gap = int(np.diff(base.astype(object)).min()) if base.size > 1 else max(1, high - low)
        if gap < 1 or high <= low:
            return None
        bits = gap.bit_length() - 1  # 2**bits <= gap
        buckets = ((high - 1 - low) >> bits) + 1
        # every dividend of ``units`` (an entry's distance from its buffer's shifted base, plus its length
        # and a unit) stays below the buffer's shift + extent + 2 units: checked against 2**53 per buffer
        top = max(s + (int(e) - int(b)) + 2 * int(u) for s, b, e, u in zip(shift, base, end, unit))
        if buckets > cls.MAX_BUCKETS or top >= 1 << 53:
            return None
        starts = np.uint64(low) + (np.arange(buckets, dtype=np.uint64) << np.uint64(bits))
        first = np.searchsorted(base, starts, side="right").astype(np.int64) - 1
        next_base = np.append(base[1:], np.uint64(2**64 - 1))
        return cls(first, next_base, low, bits, low + (buckets << bits), unit.astype(np.float64))

    def buffer(self, addr: np.ndarray) -> np.ndarray:
        """Per address in ``[base[0], covered)``: the index of the last buffer based at or below it
        (``np.searchsorted(base, addr, side="right") - 1``)."""
        j = self.first[(addr - self.low) >> self.shift]
        j += addr >= self.next_base[j]
        return j

    def units(self, dst: np.ndarray, length: np.ndarray, lo_base: np.ndarray,
              i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per entry of buffer ``i[k]`` (inside it: checked before), its first global unit and one past
        its last: ``(dst - lo_base[i]) // unit[i]`` and ``(dst + length - hi_base[i]) // unit[i]``."""
        x = (dst - lo_base[i]).astype(np.float64)
        u = self.unit_f[i]
        lo = (x / u).astype(np.int64)
        x += length
        x += u
        x -= 1.0
        x /= u
        return lo, x.astype(np.int64)


def _registered_end(buf: BufferDesc, registered: Sequence[tuple[int, int]]) -> int:
    """Where ``buf``'s writable bytes end: its pages' extent, or the end of the registered region
    that holds its base, whichever comes first."""
    end = buf.base + buf.capacity_pages * buf.bytes_per_page
    for addr, nbytes in registered:
        if addr <= buf.base < addr + nbytes:
            end = min(end, addr + nbytes)
    return end


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a == b).all())


class DecodeStaging:
    """The slots of this rank's staging area at ``base`` and who asked for them."""

    def __init__(self, area: StagingArea, base: int, dst_bufs: Sequence[BufferDesc], rank: str,
                 aux_ranges: Callable[[int], list[tuple[int, int]]] = lambda slot: [],
                 kind_specs: Mapping[str, PoolSpec] | None = None, kernel_ranges: Any = None,
                 registered: Sequence[tuple[int, int]] = ()) -> None:
        """``aux_ranges(slot)``: the ``[start, end)`` byte ranges of aux row ``slot`` (the aux row
        rides in a staged target's last write, so it is scattered from a slot too);
        ``kind_specs``: the window, compressed and state pools among ``dst_bufs``, whose
        destinations are checked against the room's units of each (``request(kind_units=)``)
        rather than its pages.

        ``kernel_ranges``: the shell's stager's device regions (``CudaStager.ranges``, an
        ``AddressRanges``), or None. ``request`` proves every entry it passes, but an aux row's,
        inside the slot and inside one buffer of ``dst_bufs`` (``[base, base + capacity_pages *
        bytes_per_page)``); the stager would look each up again to pick kernel or plain copy.
        Such an entry needs no second look-up only where that proof implies the stager's answer:
        where the staging area and the entry's whole buffer extent each lie inside ONE of the
        stager's regions. That is checked here, once, per buffer (``_vouched``), not assumed: the
        decode endpoint builds both from the same tensors (``StagingBuffer``: the area and
        ``tensor_region`` of each page buffer); a buffer whose extent is not inside one region
        keeps its entries in ``Scatter.unproven``.

        ``registered``: the ``(address, nbytes)`` of the memory registered for ``dst_bufs``. A
        buffer's checked extent ends where its registered region ends, where that comes first: a
        padded ``RawBuffer`` whose last page ends with its payload counts that page
        (``PoolSpec.validate_buffer``), but the stride after its payload is not the buffer's, and
        a scatter entry into it would be decode's own stray write (its kernel or plain copy does
        what the list says), refused here as a write past the buffer's end."""
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
        # (room, chunk key) -> the chunk's scatter list as its request carried it, checked: (slot offsets, page
        # addresses, lengths, Scatter.unproven, the asking endpoint); taken when the chunk lands
        self.lists: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, str]] = {}
        self.list_bytes: dict[str, int] = {}  # per asking endpoint: the bytes of its lists kept
        # (room, chunk key) -> the reserved slot granted with the room's request, until the chunk's SlotRequest
        self.with_request: dict[tuple[int, int], int] = {}
        bufs = sorted(dst_bufs, key=lambda b: b.base)
        self._base = np.array([b.base for b in bufs], dtype=np.uint64)
        self._end = np.array([_registered_end(b, registered) for b in bufs], dtype=np.uint64)
        self._page = np.array([b.bytes_per_page for b in bufs], dtype=np.uint64)
        # per buffer: -1 for a pool on the room's pages, else its kind pool's index in ``_kinds``;
        # the bytes of one unit (a ring window's unit is a request row: ``stride`` token rows)
        kinds = dict(kind_specs or {})
        self._kinds = sorted(kinds)
        self._pool = np.array([self._kinds.index(b.pool) if b.pool in kinds else -1 for b in bufs], dtype=np.int64)
        self._unit = np.array([kinds[b.pool].ring_stride * kinds[b.pool].bytes_per_token
                               if b.pool in kinds and kinds[b.pool].ring_stride else b.bytes_per_page for b in bufs],
                              dtype=np.uint64)
        # a room's units of every group in one table (_Held): group g's units start at _start[g]; per buffer
        # ``_lo_base``/``_hi_base`` shift an address so that one division gives its global unit:
        #     (dst - _lo_base[i]) // unit = start[g] + first unit,   (stop - _hi_base[i]) // unit = start[g] + last + 1
        # per buffer: its units (a ring window's last may be partial)
        units = (self._end - self._base + self._unit - np.uint64(1)) // self._unit
        group = self._pool + 1
        span = np.array([int(units[group == g].max(initial=0)) for g in range(len(self._kinds) + 1)], dtype=np.int64)
        self._start = np.concatenate(([0], np.cumsum(span)))
        shift = [int(s) * int(u) for s, u in zip(self._start[group], self._unit)]
        self._lo_base = np.array([(int(b) - d) % 2**64 for b, d in zip(self._base, shift)], dtype=np.uint64)
        self._hi_base = np.array([(int(b) - d - int(u) + 1) % 2**64 for b, d, u in zip(self._base, shift, self._unit)],
                                 dtype=np.uint64)
        self._fast = _FastUnits.of(self._base, self._end, self._unit, shift)
        area_end = base + area.num_slots * area.slot_bytes
        if kernel_ranges is None or not kernel_ranges.within(base, area_end):
            self._vouched = None  # nothing proven to the stager: it looks every entry up
        else:
            self._vouched = np.array([kernel_ranges.within(int(b), int(e)) for b, e in zip(self._base, self._end)],
                                     dtype=bool)
        self._all_vouched = self._vouched is not None and bool(self._vouched.all())
        self._held: dict[int, _Held] = {}  # room -> its unit table (least recently checked first)
        self._held_bytes = 0
        self.counters = {"slot_requests": 0, "granted_at_once": 0, "slot_waits": 0, "chunks_scattered": 0,
                         "bytes_scattered": 0, "scatter_slices": 0, "chunks_failed": 0, "granted_with_request": 0,
                         "granted_with_request_used": 0, "granted_with_request_unused": 0}

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
    def grant_with_request(self, room: int, sender: Sender, again: bool = False) -> list[int]:
        """A reserved slot for ``sender``'s first chunk of ``room``, granted in the room's
        TransferRequest (``[slot]``), or none free (``[]``: that chunk asks, as any other).
        ``again``: the request is sent again (its sender refused it): the slot granted the first
        time while that chunk has not asked, never a new one."""
        ck = self.key(sender, 0)
        held = self.with_request.get((room, ck))
        if held is not None or again:
            return [] if held is None else [held]
        grant = self.area.reserve(room, ck)
        if grant is None:
            return []
        self.with_request[(room, ck)] = grant.slot
        self.counters["granted_with_request"] += 1
        return [grant.slot]

    def request(self, room: int, sender: Sender, endpoint: str, msg: wire.SlotRequest, page_ids: np.ndarray | None,
                aux_slot: int, out: list, kind_units: Mapping[str, np.ndarray] | None = None) -> None:
        """A chunk asks for a slot with its scatter list. The list is checked now (as ``landed`` did
        before wire 16: inside the slot, into the room's own pages, its units of each kind pool
        (``kind_units``, ``DecodeKinds.dest_units``) and its aux row) and kept for the chunk's
        landing, which then only starts the copy; a list that fails fails the room
        (LedgerError) before any slot is granted to it. Then the slot: granted at once when one
        is free, else the chunk waits (FIFO)."""
        if msg.chunk >= 1 << _SENDER_SHIFT or msg.num_bytes > self.area.slot_bytes:
            raise LedgerError(f"slot request for chunk {msg.chunk} of {msg.num_bytes} B: slots hold "
                              f"{self.area.slot_bytes} B", room=room, rank=f"cp{msg.cp_rank}", field="chunk")
        ck = self.key(sender, msg.chunk)
        if (room, ck) in self.lists:
            raise LedgerError(f"chunk {msg.chunk} asked for a slot again before it landed", room=room,
                              rank=f"cp{msg.cp_rank}", field="chunk")
        held = self.list_bytes.get(endpoint, 0)
        if held + len(msg.scatter) > LISTS_CAP_BYTES:
            raise LedgerError(f"chunk {msg.chunk}'s scatter list ({len(msg.scatter)} B) would make {endpoint}'s lists "
                              f"of chunks not landed {held + len(msg.scatter)} B, over {LISTS_CAP_BYTES} B",
                              room=room, rank=f"cp{msg.cp_rank}", field="scatter")
        off, dst, length = wire.unpack_scatter(msg.scatter)
        problem, unproven = self._outside(room, off, dst, length, page_ids, aux_slot, kind_units or {})
        if problem is not None:
            raise LedgerError(f"chunk {msg.chunk}'s scatter list {problem}", room=room, rank=f"cp{msg.cp_rank}",
                              field="scatter")
        self.lists[(room, ck)] = (off, dst, length, unproven, endpoint)
        self.list_bytes[endpoint] = held + len(msg.scatter)
        self.senders[(room, endpoint)] = sender
        self.counters["slot_requests"] += 1
        if self.with_request.pop((room, ck), None) is not None:  # its slot came with the request: no SlotGrant
            self.counters["granted_with_request_used"] += 1
            return
        self.asks[(room, ck)] = endpoint
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

    def landed(self, room: int, sender: Sender, msg: wire.ChunkLanded, out: list) -> None:
        """A chunk's write into its slot is final: scatter it (ok) by the list its request carried,
        checked then (``request``), or free the slot (failed)."""
        ck = self.key(sender, msg.chunk)
        if msg.slot >= self.area.num_slots or self.area.owner(msg.slot) != (room, ck):
            raise LedgerError(f"chunk {msg.chunk} reported in slot {msg.slot}, which it was not granted", room=room,
                              rank=f"cp{msg.cp_rank}", field="slot")
        checked = self._take_list(room, ck)
        self.with_request.pop((room, ck), None)  # (a chunk granted with the request that reports before asking)
        state = self.area.state(msg.slot)
        if state is SlotState.QUARANTINED:  # the room failed; the write is final now: nothing more lands
            self.grant(self.area.acknowledged(msg.slot), out)
            return
        self.area.landed(msg.slot, room, ck)
        if msg.status != "ok":
            self.counters["chunks_failed"] += 1
            self.grant(self.area.release(msg.slot), out)
            return
        if checked is None:  # (a granted chunk's request was checked, or its room failed: not reached)
            self.grant(self.area.release(msg.slot), out)
            raise LedgerError(f"chunk {msg.chunk} landed with no checked scatter list", room=room,
                              rank=f"cp{msg.cp_rank}", field="scatter")
        off, dst, length, unproven, _ = checked
        self.area.scatter(msg.slot)
        self.pending[room] = self.pending.get(room, 0) + 1
        self.in_flight[room] = self.in_flight.get(room, 0) + 1
        self.unreported[(room, sender)] = self.unreported.get((room, sender), 0) + 1
        self.counters["scatter_slices"] += len(length)
        self.counters["bytes_scattered"] += int(length.sum())
        out.append(Scatter(room, msg.slot, off + np.uint64(self.base + self.area.offset(msg.slot)), dst, length,
                           unproven))

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

    def room_done(self, room: int, out: list) -> None:
        """The room committed: every sender reported its last write, so a slot granted with its
        request that no chunk used is free."""
        for key in [k for k in self.with_request if k[0] == room]:
            slot = self.with_request.pop(key)
            if self.area.owner(slot) == key and self.area.state(slot) is SlotState.ASSIGNED:
                self.counters["granted_with_request_unused"] += 1
                self.grant(self.area.unused(slot), out)

    def fail_room(self, room: int, free_at: float, out: list) -> None:
        """The room failed: its waiting requests leave, its ASSIGNED slots are quarantined (those
        granted with its request too: a sender may be writing into one)."""
        for key in [k for k in self.asks if k[0] == room]:
            del self.asks[key]
        for key in [k for k in self.with_request if k[0] == room]:
            del self.with_request[key]
        self._drop_lists(room)
        self.pending.pop(room, None)
        self._drop_held(room)
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
        self._drop_held(room)
        for key in [k for k in self.with_request if k[0] == room]:  # (a room forgotten without failing or committing)
            del self.with_request[key]
        self._drop_lists(room)
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
    def _outside(self, room: int, off: np.ndarray, dst: np.ndarray, length: np.ndarray,
                 page_ids: np.ndarray | None, aux_slot: int,
                 kind_units: Mapping[str, np.ndarray]) -> tuple[str | None, np.ndarray | None]:
        """Why a scatter list would write outside the slot or the room's own pages, its units of
        each kind pool, and its aux row (None: it does not); and the entries not proven to lie
        in the stager's device memory (``Scatter.unproven``).

        First every entry as one into the room's pages or units (a list without the aux row: all
        of them, one pass); only a list where some entry is not goes entry by entry
        (``_diagnose``: the aux row's entries apart, then what is wrong with the others)."""
        if not length.size:
            return None, _NONE_UNPROVEN
        if page_ids is None:
            return "came before the room's pages are known", None
        slot_bytes = self.area.slot_bytes
        # (each of offset and length inside the slot first: their sum cannot wrap around 2**64)
        if int(length.min()) < 1 or int(np.maximum(off, length).max()) > slot_bytes or \
                int((off + length).max()) > slot_bytes:
            return f"reads outside its {slot_bytes} B slot", None
        top = int(dst.max())
        if top > (1 << 64) - 1 - slot_bytes:  # dst + length would wrap around
            return "writes past the end of the address space", None
        stop = dst + length
        held = self._held_of(room, page_ids, kind_units)
        if self._base.size and int(dst.min()) >= int(self._base[0]):
            fast = self._fast if self._fast is not None and top < self._fast.covered else None
            i = fast.buffer(dst) if fast is not None else np.searchsorted(self._base, dst, side="right") - 1
            if bool((stop <= self._end[i]).all()):
                if fast is not None:
                    lo, hi1 = fast.units(dst, length, self._lo_base, i)
                else:
                    unit = self._unit[i]
                    lo = ((dst - self._lo_base[i]) // unit).view(np.int64)
                    hi1 = ((stop - self._hi_base[i]) // unit).view(np.int64)
                if bool((held.free[hi1] == held.free[lo]).all()):
                    return None, self._unproven(i, None, length.size)
        return self._diagnose(held, dst, stop, aux_slot)

    def _diagnose(self, held: _Held, dst: np.ndarray, stop: np.ndarray,
                  aux_slot: int) -> tuple[str | None, np.ndarray | None]:
        """``_outside`` for a list with entries outside the room's pages and units: those in the
        aux row are fine; of the others, the first of: below every buffer, past a buffer's end,
        into units the room does not hold (its pages first, then the kind pools in order)."""
        n = dst.size
        kept = None  # indices of the entries not in the aux row (None: all of them)
        for start, end in self.aux_ranges(aux_slot) if aux_slot >= 0 else ():
            in_aux = (dst >= np.uint64(start)) & (stop <= np.uint64(end))
            kept = np.flatnonzero(~in_aux) if kept is None else kept[~in_aux[kept]]
        if kept is not None:
            dst, stop = dst[kept], stop[kept]
            if not dst.size:
                return None, self._unproven(np.zeros(0, dtype=np.int64), kept, n)
        i = np.searchsorted(self._base, dst, side="right") - 1
        if (i < 0).any():
            return "writes below every registered buffer", None
        if (stop > self._end[i]).any():
            return "writes past a registered buffer's end", None
        unit = self._unit[i]
        lo = ((dst - self._lo_base[i]) // unit).view(np.int64)
        hi1 = ((stop - self._hi_base[i]) // unit).view(np.int64)
        ok = held.free[hi1] == held.free[lo]
        if not ok.all():
            k = int(self._pool[i[~ok]].min())  # the first pool refused, pages first
            if k < 0:
                return "writes into pages this room does not hold", None
            return f"writes into units of pool {self._kinds[k]!r} that this room does not hold", None
        return None, self._unproven(i, kept, n)

    def _unproven(self, i: np.ndarray, kept: np.ndarray | None, n: int) -> np.ndarray | None:
        """``Scatter.unproven`` of a list that passed: its aux entries (every index not ``kept``)
        and those in a buffer the stager's regions do not vouch for."""
        if self._vouched is None:
            return None
        if self._all_vouched:
            if kept is None:
                return _NONE_UNPROVEN
            mask = np.ones(n, dtype=bool)
            mask[kept] = False
            return np.flatnonzero(mask)
        kept = np.arange(n) if kept is None else kept
        mask = np.ones(n, dtype=bool)
        mask[kept[self._vouched[i]]] = False
        return np.flatnonzero(mask)

    def _held_of(self, room: int, page_ids: np.ndarray, kind_units: Mapping[str, np.ndarray]) -> _Held:
        """The room's unit table, built when its inputs changed (or it was dropped to bound the
        cache at ``HELD_CACHE_BYTES``, least recently checked first); dropped when the room fails
        or is forgotten."""
        pages = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        units = {k: np.asarray(kind_units[k], dtype=np.int64).reshape(-1) for k in self._kinds if k in kind_units}
        held = self._held.pop(room, None)
        if held is not None and not held.same(pages, units):
            self._held_bytes -= held.nbytes
            held = None
        if held is None:
            held = _Held(pages.copy(), {k: a.copy() for k, a in units.items()}, self._kinds, self._start)
            self._held_bytes += held.nbytes
            while self._held and self._held_bytes > HELD_CACHE_BYTES:
                self._drop_held(next(iter(self._held)))
        self._held[room] = held  # (last: the most recently checked)
        return held

    def _take_list(self, room: int, ck: int) -> tuple | None:
        checked = self.lists.pop((room, ck), None)
        if checked is not None:
            endpoint = checked[4]
            left = self.list_bytes[endpoint] - 24 * checked[2].size
            if left:
                self.list_bytes[endpoint] = left
            else:
                del self.list_bytes[endpoint]
        return checked

    def _drop_lists(self, room: int) -> None:
        for key in [k for k in self.lists if k[0] == room]:
            self._take_list(*key)

    def _drop_held(self, room: int) -> None:
        held = self._held.pop(room, None)
        if held is not None:
            self._held_bytes -= held.nbytes
