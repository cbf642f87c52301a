"""The rooms of one endpoint: the registry both sides use, and a room's lifecycle beside
its poll state (``poll.py``).

Written down once, like the poll states; every change goes through :class:`Life`,
which refuses transitions not in the table.

    decode asked first (prefill only)
      UNATTACHED ──first sender(room)──▶ OPEN ──close() / end of `with` / handle dropped──▶ DRAINING
           │                                                                                    │
           └────────── final and quiet, no handle ever ──────▶ CLOSED ◀──── final and quiet ────┘

    OPEN        a KVSender / KVReceiver holds the room. Its final state (Success, or Failed
                with its reason, and the aux row) stays readable as long as the handle lives,
                whatever the clock: the handle holds the room object itself.
    DRAINING    the handle let go. A room not yet final is failed ("closed by the engine");
                it stays until nothing of it can still land: prefill, no posted write in
                flight; decode, every asked CP rank quiet (hard rule 6).
    CLOSED      forgotten. Prefill keeps a tombstone (the outcome) for ``TOMBSTONE_S`` so a
                late decode request for the room is refused with the reason, not reopened.
                (An UNATTACHED room that failed lingers ``target_timeout`` first, so that the
                engine's sender() still attaches to it and reads why.)

``sender(room)`` / ``receiver(room)`` on an OPEN or DRAINING id raise ``RoomInUse``
(``.draining`` says which; with ``wait=`` they wait that long for a DRAINING id to close,
``open_waiting``); on a CLOSED id they open a fresh room. Room ids are meant to be used
once (the router draws them at random); an id reused within ``TOMBSTONE_S`` works when
the prefill sender opens before the decode rank asks, else the request meets the
tombstone. UNATTACHED -> OPEN is the first handle of a room decode asked for first: an
attachment, not a reattachment. Memory is bounded: open rooms by the handles the engine
holds, draining rooms by their writes, tombstones by age and count.

:class:`Rooms` holds no socket, thread, lock or clock: the side's state machine
(``prefill/machine.py``, ``decode/machine.py``) passes the time in. :class:`RoomHandle` and
``open_waiting`` are the engine-facing half, used by the endpoints' shells.
"""

from __future__ import annotations

import enum
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from kvbridge.errors import RoomInUse
from kvbridge.transfer.poll import FINAL, IllegalTransition, KVPoll, RoomState

T = TypeVar("T")
H = TypeVar("H", bound="RoomHandle")

TOMBSTONE_S = 60.0
MAX_TOMBSTONES = 100_000


class Stage(enum.Enum):
    UNATTACHED = "unattached"
    OPEN = "open"
    DRAINING = "draining"
    CLOSED = "closed"


STAGES: dict[Stage, frozenset[Stage]] = {
    Stage.UNATTACHED: frozenset({Stage.OPEN, Stage.CLOSED}),
    Stage.OPEN: frozenset({Stage.DRAINING}),
    Stage.DRAINING: frozenset({Stage.CLOSED}),
    Stage.CLOSED: frozenset(),
}


class Life:
    """Where one room is in its lifecycle."""

    __slots__ = ("stage",)

    def __init__(self, stage: Stage = Stage.OPEN) -> None:
        self.stage = stage

    @property
    def in_use(self) -> bool:
        """An id in this stage cannot be opened again (RoomInUse)."""
        return self.stage in (Stage.OPEN, Stage.DRAINING)

    def to(self, new: Stage) -> bool:
        """Move to ``new``; False if already there; a table violation raises IllegalTransition."""
        if new == self.stage:
            return False
        if new not in STAGES[self.stage]:
            raise IllegalTransition(f"{self.stage.name} -> {new.name}")
        self.stage = new
        return True


class Room(Protocol):
    """What the registry needs of a side's room."""

    room: int
    state: RoomState
    life: Life

    @property
    def drain_reason(self) -> str: ...


R = TypeVar("R", bound=Room)


class Tombstones:
    """Outcomes of closed rooms, kept ``ttl_s`` seconds and at most ``max_entries`` (oldest out)."""

    def __init__(self, ttl_s: float = TOMBSTONE_S, max_entries: int = MAX_TOMBSTONES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[float, str]] = OrderedDict()

    def add(self, room: int, outcome: str, now: float | None = None) -> None:
        self._entries.pop(room, None)
        self._entries[room] = (time.monotonic() if now is None else now, outcome)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, room: int) -> str | None:
        hit = self._entries.get(room)
        return None if hit is None else hit[1]

    def discard(self, room: int) -> None:
        self._entries.pop(room, None)

    def prune(self, now: float) -> None:
        while self._entries:
            room, (when, _) = next(iter(self._entries.items()))
            if now - when <= self.ttl_s:
                return
            del self._entries[room]

    def __len__(self) -> int:
        return len(self._entries)


class Rooms(Generic[R]):
    """One endpoint's rooms by id: open (or attach), close, forget, tombstones. ``handle`` and
    ``reopen`` name the engine's handle and how to wait, for RoomInUse's message."""

    def __init__(self, rank: str, handle: str, reopen: str) -> None:
        self.rank = rank
        self.handle = handle
        self.reopen = reopen
        self._rooms: dict[int, R] = {}
        self.unowned: set[int] = set()  # rooms no handle holds (UNATTACHED or DRAINING): closed once quiet
        self.tombstones = Tombstones()

    # -- reading ------------------------------------------------------------------

    def get(self, room: Any) -> R | None:
        return self._rooms.get(room)

    def __getitem__(self, room: int) -> R:
        return self._rooms[room]

    def __contains__(self, room: object) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rooms)

    def values(self) -> Any:
        return self._rooms.values()

    def items(self) -> Any:
        return self._rooms.items()

    # -- changing -----------------------------------------------------------------

    def open(self, room: int, make: Callable[[], R]) -> R:
        """The room for a new handle: the UNATTACHED one decode asked for first, or a fresh one
        (``make()``). RoomInUse while the id is OPEN or DRAINING."""
        r = self._rooms.get(room)
        if r is not None and r.life.stage == Stage.UNATTACHED:
            r.life.to(Stage.OPEN)
            self.unowned.discard(room)
            return r
        if r is not None:
            draining = r.life.stage == Stage.DRAINING
            what = f"draining: {r.drain_reason}" if draining else f"open: a {self.handle} still holds it"
            raise RoomInUse(f"room {room} is {what} ({r.state.state.name}); close() the old "
                            f"{self.handle[2:].lower()} and wait ({self.reopen}), or use a new room id",
                            draining=draining, room=room, rank=self.rank, field="room")
        self.tombstones.discard(room)
        r = self._rooms[room] = make()
        return r

    def add_unattached(self, r: R) -> R:
        """A room decode asked for before the engine opened it (prefill)."""
        self._rooms[r.room] = r
        self.unowned.add(r.room)
        return r

    def close(self, r: R) -> bool:
        """The handle let go: OPEN -> DRAINING (False if it was not OPEN)."""
        if r.life.stage != Stage.OPEN:
            return False
        r.life.to(Stage.DRAINING)
        self.unowned.add(r.room)
        return True

    def forget(self, r: R, now: float, tombstone: bool = False) -> None:
        """-> CLOSED: the id may be opened again; with ``tombstone`` its outcome is kept a while."""
        r.life.to(Stage.CLOSED)
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        self.unowned.discard(r.room)
        if tombstone:
            self.tombstones.add(r.room, r.state.state.name + (f": {r.state.reason}" if r.state.reason else ""), now)


def open_waiting(open_room: Callable[[], T], freed: threading.Condition, wait: float) -> T:
    """``open_room()``; while it raises RoomInUse for a draining id, wait (lock released) for a
    room to be forgotten, up to ``wait`` seconds in all. Called by an endpoint's shell with its
    lock held; the shell notifies ``freed`` when its state machine frees a room."""
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        try:
            return open_room()
        except RoomInUse as exc:
            left = deadline - time.monotonic()
            if not exc.draining or left <= 0:
                raise
            freed.wait(min(left, 0.05))  # also re-checks on its own: housekeeping may forget it


class RoomHandle:
    """What a KVSender and a KVReceiver share: the engine's handle on one OPEN room of an
    endpoint (thread-safe: reads take the endpoint's lock, but for a poll of a state short of
    final). ``close()``, leaving a ``with`` block or dropping the handle moves the room to
    DRAINING; until then its final state and the reason of a failure stay readable. The endpoint provides ``locked(fn)``,
    ``release(room)`` (a GC finalizer: must not lock) and ``close_room(room)``; the room,
    ``state`` (a RoomState)."""

    def __init__(self, endpoint: Any, room: Any) -> None:
        self._ep = endpoint
        self._room = room
        # dropping the handle closes the room (the finalizer must not reference self)
        self._finalizer = weakref.finalize(self, endpoint.release, room)

    @property
    def room(self) -> int:
        return self._room.room

    def poll(self) -> KVPoll:
        """The room's state. A state short of final is read without the lock (one attribute), so an
        engine's scheduler that polls every request each step never waits out the loop's turn; what
        it does next (``init``, ``send``) takes the lock. A final state is read again under the lock:
        the turn that made it final has then carried out all it does (the aux row kept, the state
        slot handed over) before the engine acts on it."""
        state = self._room.state.state
        if state in FINAL:
            return self._ep.locked(lambda: self._room.state.state)
        return state

    def wait(self, timeout: float | None = None) -> KVPoll:
        """Block until the room is final (Success or Failed) or ``timeout`` seconds passed; the
        poll state then. For a thread that has nothing else to do: no polling loop, no spin."""
        done = self._ep.locked(self._room.state.waiter)
        if done is not None:
            done.wait(timeout)
        return self.poll()

    @property
    def failure_reason(self) -> str | None:
        return self._ep.locked(lambda: self._room.state.reason)

    def close(self) -> None:
        """End the room: one not yet final fails ("closed by the engine"); the id is free again
        once nothing of it can land any more (idempotent)."""
        if self._finalizer.detach() is not None:
            self._ep.close_room(self._room)

    def __enter__(self: H) -> H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
