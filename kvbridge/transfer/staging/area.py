"""A staging area's slots and who may use them: a sans-I/O state machine.

A registered staging area of ``num_slots * slot_bytes`` bytes is cut into fixed slots;
a chunk of a staged room (``kvbridge.layout.staging``) passes through one slot:

    FREE --acquire--> ASSIGNED(room, chunk) --landed--> LANDED --scatter--> SCATTERING --scattered--> SCATTERED
                          |                               |                                              |
                          |                               +--release (room failed; nothing more lands)   release
                          |                                  --> FREE                                    --> FREE
                          +--quarantine (room failed, a write may still land)--> QUARANTINED
                          +--unused (granted with the room's request; its room committed, so every
                                     sender reported its last write: nothing lands any more)--> FREE
    QUARANTINED --acknowledged (the sender confirmed the abort) / expired (lease + quarantine)--> FREE

SCATTERING: the receiver's copy out of the slot is running (a CUDA event not yet complete). A
failed room leaves it as it is: the slot is read, and the room's pages written, until the copy
completes; only then is the slot free (and the room's pages with it).

Hard rule 6 for staging: remote writes land only in slots, so a failed room's pages are free
at once, while its ASSIGNED slots wait in QUARANTINED until nothing of the room can land.

Back-pressure: when no slot is free, ``acquire`` queues the request (FIFO) and returns None;
every event that frees a slot hands it to the oldest waiter and returns the grants made, so a
room never fails for want of staging and the area never grows.

Reserved slots (``reserved``, the area's last ones): granted with a room's request, before any
chunk asks (``reserve``), never to a waiter and never queued for: ``reserve`` returns None when
none is free, and a reserved slot that turns FREE goes back to the reserved ones. Kept apart, a
slot granted before its chunk holds a sender's gather slot never holds up a chunk that does (the
senders' ask-ahead order, ``prefill/staged.py``, stays deadlock-free). Time is the caller's
(``now``: monotonic seconds), and so are the threads: the endpoint calls this under its lock.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from kvbridge.errors import ConfigError, StagingSlotError

__all__ = ["EVENTS", "Grant", "SlotState", "StagingArea", "StagingSlotError", "TRANSITIONS"]


class SlotState(enum.Enum):
    FREE = "free"
    ASSIGNED = "assigned"
    LANDED = "landed"
    SCATTERING = "scattering"
    SCATTERED = "scattered"
    QUARANTINED = "quarantined"


S = SlotState
# state -> {event: next state}; any event not listed for a state is refused
TRANSITIONS: dict[SlotState, dict[str, SlotState]] = {
    S.FREE: {"acquire": S.ASSIGNED},
    S.ASSIGNED: {"landed": S.LANDED, "quarantine": S.QUARANTINED, "unused": S.FREE},
    S.LANDED: {"scatter": S.SCATTERING, "release": S.FREE},
    S.SCATTERING: {"scattered": S.SCATTERED},
    S.SCATTERED: {"release": S.FREE},
    S.QUARANTINED: {"acknowledged": S.FREE, "expire": S.FREE},
}
EVENTS = ("acquire", "landed", "scatter", "scattered", "release", "quarantine", "acknowledged", "expire", "unused")


@dataclass(frozen=True)
class Grant:
    """Slot ``slot`` is now ASSIGNED to ``(room, chunk)``; ``waited``: the request had queued."""

    room: int
    chunk: int
    slot: int
    waited: bool = False


@dataclass
class _Slot:
    state: SlotState = S.FREE
    room: int | None = None
    chunk: int | None = None
    free_at: float | None = None  # QUARANTINED: when expiry frees it


class StagingArea:
    """Slots of one registered staging area and the FIFO of chunks waiting for one."""

    def __init__(self, num_slots: int, slot_bytes: int, *, rank: str | None = None, reserved: int = 0) -> None:
        for name, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"staging {name} must be a positive integer, got {value!r}", field=name, rank=rank)
        if not isinstance(reserved, int) or isinstance(reserved, bool) or not 0 <= reserved < num_slots:
            raise ConfigError(f"staging reserved slots must be an integer from 0 to {num_slots - 1} (at least one slot "
                              f"is left for chunks that ask), got {reserved!r}", field="reserved", rank=rank)
        self.num_slots, self.slot_bytes, self.rank = num_slots, slot_bytes, rank
        self.reserved = reserved
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free: deque[int] = deque(range(num_slots - reserved))
        self._free_reserved: deque[int] = deque(range(num_slots - reserved, num_slots))
        self._waiting: deque[tuple[int, int]] = deque()
        self.counters = {"acquired": 0, "waits": 0, "max_waiting": 0, "quarantined": 0, "expired": 0,
                         "acknowledged": 0, "reserved": 0, "reserve_refused": 0, "unused": 0}

    # ---- views ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in the area."""
        self._slot(slot)
        return slot * self.slot_bytes

    def state(self, slot: int) -> SlotState:
        return self._slot(slot).state

    def owner(self, slot: int) -> tuple[int | None, int | None]:
        s = self._slot(slot)
        return s.room, s.chunk

    @property
    def num_free(self) -> int:
        """FREE slots that a chunk's ask may take (the reserved ones not counted)."""
        return len(self._free)

    @property
    def num_free_reserved(self) -> int:
        return len(self._free_reserved)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def slots_of(self, room: int) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.room == room]

    def next_waiting(self, n: int) -> list[tuple[int, int]]:
        """The first ``n`` ``(room, chunk)`` waiting for a slot, in the order they will get one."""
        return [w for _, w in zip(range(n), self._waiting)]

    # ---- events --------------------------------------------------------------------------------
    def acquire(self, room: int, chunk: int) -> Grant | None:
        """A FREE slot for ``(room, chunk)``, or None: the request waits its turn (FIFO) and comes
        back as a Grant from the event that frees a slot."""
        self._check_unheld(room, chunk)
        if self._free and not self._waiting:
            return self._assign(self._free.popleft(), room, chunk, waited=False)
        self._waiting.append((room, chunk))
        self.counters["waits"] += 1
        self.counters["max_waiting"] = max(self.counters["max_waiting"], len(self._waiting))
        return None

    def reserve(self, room: int, chunk: int) -> Grant | None:
        """A FREE reserved slot for ``(room, chunk)``, granted before the chunk asks, or None when
        none is free (nothing queues: the chunk asks later, as any other)."""
        self._check_unheld(room, chunk)
        if not self._free_reserved:
            self.counters["reserve_refused"] += 1
            return None
        self.counters["reserved"] += 1
        return self._assign(self._free_reserved.popleft(), room, chunk, waited=False)

    def _check_unheld(self, room: int, chunk: int) -> None:
        """StagingSlotError when ``(room, chunk)`` already holds (ASSIGNED) or awaits a slot."""
        if (room, chunk) in self._waiting or any(s.room == room and s.chunk == chunk and s.state is S.ASSIGNED
                                                 for s in self._slots):
            raise StagingSlotError(f"chunk {chunk} already holds or awaits a staging slot", room=room,
                                   rank=self.rank, field="chunk")

    def unused(self, slot: int) -> list[Grant]:
        """An ASSIGNED slot that nothing will write (granted with the request, and its room committed:
        every sender reported its last write) -> FREE."""
        self._move(slot, "unused")
        self.counters["unused"] += 1
        return self._freed(slot)

    def landed(self, slot: int, room: int, chunk: int) -> None:
        """The chunk's write into ``slot`` completed (the sender reported it)."""
        s = self._slot(slot)
        self._next(slot, "landed")
        if (s.room, s.chunk) != (room, chunk):
            raise StagingSlotError(
                f"slot {slot} holds room {s.room} chunk {s.chunk}, not chunk {chunk}", room=room, rank=self.rank,
                field="slot")
        self._move(slot, "landed")

    def scatter(self, slot: int) -> None:
        """The copy out of the slot into the pages started (LANDED -> SCATTERING)."""
        self._move(slot, "scatter")

    def scattered(self, slot: int) -> None:
        """The copy out of the slot completed (SCATTERING -> SCATTERED)."""
        self._move(slot, "scattered")

    def release(self, slot: int) -> list[Grant]:
        """SCATTERED (done) or LANDED (its room failed: nothing more lands) -> FREE."""
        self._move(slot, "release")
        return self._freed(slot)

    def quarantine(self, slot: int, free_at: float) -> None:
        """ASSIGNED slot of a failed room -> QUARANTINED until acknowledged or ``free_at`` passes
        (the sender's lease expiry plus the quarantine)."""
        self._move(slot, "quarantine")
        self._slots[slot].free_at = free_at
        self.counters["quarantined"] += 1

    def acknowledged(self, slot: int) -> list[Grant]:
        """The sender confirmed it posts nothing more into the slot: QUARANTINED -> FREE."""
        self._move(slot, "acknowledged")
        self.counters["acknowledged"] += 1
        return self._freed(slot)

    def expire(self, now: float) -> list[Grant]:
        """Every QUARANTINED slot whose ``free_at`` passed -> FREE."""
        grants: list[Grant] = []
        for i, s in enumerate(self._slots):
            if s.state is S.QUARANTINED and s.free_at is not None and s.free_at <= now:
                self._move(i, "expire")
                self.counters["expired"] += 1
                grants += self._freed(i)
        return grants

    def fail_room(self, room: int, free_at: float) -> list[Grant]:
        """A failed or aborted room: its waiting requests leave the queue, its ASSIGNED slots go
        to QUARANTINED (a write may still land), its LANDED and SCATTERED slots are free, its
        SCATTERING slots free once their copy completed (``scattered``, then ``release``)."""
        self._waiting = deque(w for w in self._waiting if w[0] != room)
        grants: list[Grant] = []
        for i in self.slots_of(room):
            state = self._slots[i].state
            if state is S.ASSIGNED:
                self.quarantine(i, free_at)
            elif state in (S.LANDED, S.SCATTERED):
                grants += self.release(i)
        return grants

    def withdraw(self, room: int) -> None:
        """The room's requests still waiting leave the queue (its slots stay as they are)."""
        self._waiting = deque(w for w in self._waiting if w[0] != room)

    def room_acknowledged(self, room: int) -> list[Grant]:
        """The sender acknowledged the room's abort: its QUARANTINED slots are free."""
        return [g for i in self.slots_of(room) if self._slots[i].state is S.QUARANTINED
                for g in self.acknowledged(i)]

    # ---- internals -----------------------------------------------------------------------------
    def _slot(self, slot: int) -> _Slot:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise StagingSlotError(f"slot {slot!r} outside the area's {self.num_slots} slots", rank=self.rank,
                                   field="slot")
        return self._slots[slot]

    def _next(self, slot: int, event: str) -> SlotState:
        """The state ``event`` moves ``slot`` to; StagingSlotError when the table has no such move."""
        s = self._slot(slot)
        moves = TRANSITIONS[s.state]
        if event not in moves:
            raise StagingSlotError(
                f"slot {slot}: {event} not allowed in state {s.state.name} (allowed: {sorted(moves) or 'none'})",
                room=s.room, rank=self.rank, field="slot")
        return moves[event]

    def _move(self, slot: int, event: str) -> None:
        new = self._next(slot, event)
        s = self._slots[slot]
        s.state = new
        if new is S.FREE:
            s.room = s.chunk = s.free_at = None

    def _assign(self, slot: int, room: int, chunk: int, waited: bool) -> Grant:
        self._move(slot, "acquire")
        s = self._slots[slot]
        s.room, s.chunk = room, chunk
        self.counters["acquired"] += 1
        return Grant(room, chunk, slot, waited)

    def _freed(self, slot: int) -> list[Grant]:
        """A slot turned FREE: the oldest waiter takes it, else it joins the free list (a reserved
        slot: the reserved ones, never a waiter)."""
        if slot >= self.num_slots - self.reserved:
            self._free_reserved.append(slot)
            return []
        if self._waiting:
            room, chunk = self._waiting.popleft()
            return [self._assign(slot, room, chunk, waited=True)]
        self._free.append(slot)
        return []
