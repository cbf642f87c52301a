"""A room's lifecycle on one endpoint, beside its poll state (``poll.py``).

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
(``.draining`` says which; with ``wait=`` they wait that long for a DRAINING id to close);
on a CLOSED id they open a fresh room. Room ids are meant to be used once (the router
draws them at random); an id reused within ``TOMBSTONE_S`` works when the prefill
sender opens before the decode rank asks, else the request meets the tombstone. UNATTACHED -> OPEN is the first handle of a
room decode asked for first: an attachment, not a reattachment. Memory is bounded:
open rooms by the handles the engine holds, draining rooms by their writes, tombstones
by age and count.
"""

from __future__ import annotations

import enum
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from kvbridge.transfer.poll import KVPoll

from kvbridge.errors import RoomInUse
from kvbridge.transfer.poll import IllegalTransition

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


def open_waiting(open_room: Callable[[], T], freed: threading.Condition, wait: float) -> T:
    """``open_room()``; while it raises RoomInUse for a draining id, wait (lock released) for a
    room to be forgotten, up to ``wait`` seconds in all. Called with the endpoint's lock held."""
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        try:
            return open_room()
        except RoomInUse as exc:
            left = deadline - time.monotonic()
            if not exc.draining or left <= 0:
                raise
            freed.wait(min(left, 0.05))  # also re-checks on its own: housekeeping may forget it


class Tombstones:
    """Outcomes of closed rooms, kept ``ttl_s`` seconds and at most ``max_entries`` (oldest out)."""

    def __init__(self, ttl_s: float = TOMBSTONE_S, max_entries: int = MAX_TOMBSTONES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[float, str]] = OrderedDict()

    def add(self, room: int, outcome: str) -> None:
        self._entries.pop(room, None)
        self._entries[room] = (time.monotonic(), outcome)
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


class RoomHandle:
    """What a KVSender and a KVReceiver share: the engine's handle on one OPEN room of an
    endpoint (thread-safe: reads take the endpoint's lock). ``close()``, leaving a ``with``
    block or dropping the handle moves the room to DRAINING; until then its final state and
    the reason of a failure stay readable. The endpoint provides ``_locked``, ``_release``
    (a GC finalizer: must not lock) and ``_close_room``; the room, ``state`` (a RoomState)."""

    def __init__(self, endpoint: Any, room: Any) -> None:
        self._ep = endpoint
        self._room = room
        # dropping the handle closes the room (the finalizer must not reference self)
        self._finalizer = weakref.finalize(self, endpoint._release, room)

    @property
    def room(self) -> int:
        return self._room.room

    def poll(self) -> KVPoll:
        return self._ep._locked(lambda: self._room.state.state)

    def wait(self, timeout: float | None = None) -> KVPoll:
        """Block until the room is final (Success or Failed) or ``timeout`` seconds passed; the
        poll state then. For a thread that has nothing else to do: no polling loop, no spin."""
        done = self._ep._locked(self._room.state.waiter)
        if done is not None:
            done.wait(timeout)
        return self.poll()

    @property
    def failure_reason(self) -> str | None:
        return self._ep._locked(lambda: self._room.state.reason)

    def close(self) -> None:
        """End the room: one not yet final fails ("closed by the engine"); the id is free again
        once nothing of it can land any more (idempotent)."""
        if self._finalizer.detach() is not None:
            self._ep._close_room(self._room)

    def __enter__(self: H) -> H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
