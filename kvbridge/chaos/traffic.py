"""Rooms through the chaos cluster: every room runs on every prefill rank and the decode
rank (ops channel); a room is *ok* when every rank reports success, *failed* when one
reports a failure, and a rank's part is *lost* when its process died before answering.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvbridge.chaos.cluster import ChaosCluster, Member
from kvbridge.worker import ops

__all__ = ["Room", "Traffic"]


@dataclass
class Room:
    room: int
    started: float
    waiting: dict[str, int] = field(default_factory=dict)  # member name -> request id, until it answers
    results: dict[str, tuple[float, ops.RoomResult | None]] = field(default_factory=dict)  # None: lost

    @property
    def done(self) -> bool:
        return not self.waiting

    @property
    def ok(self) -> bool:
        return self.done and all(r is not None and r.ok for _, r in self.results.values())

    @property
    def failures(self) -> list[tuple[str, float, str]]:
        """(member, when, reason) of every rank that reported a failure."""
        return [(name, t, r.reason) for name, (t, r) in self.results.items() if r is not None and not r.ok]

    @property
    def lost(self) -> list[str]:
        return [name for name, (_, r) in self.results.items() if r is None]


class Traffic:
    def __init__(self, cluster: ChaosCluster, tokens: int, chunk_tokens: int, concurrency: int) -> None:
        self.cluster = cluster
        self.tokens, self.chunk_tokens, self.concurrency = tokens, chunk_tokens, concurrency
        self.rooms: dict[int, Room] = {}
        self._ids = itertools.count(1000)
        self.flowing = False  # keep `concurrency` rooms open while pumping

    def open_rooms(self) -> list[Room]:
        return [r for r in self.rooms.values() if not r.done]

    def submit(self) -> Room:
        room = Room(next(self._ids), time.monotonic())
        c = self.cluster
        for m in c.workers:
            op: ops.Op = (ops.Prefill(room.room, self.tokens, self.chunk_tokens) if m.role == "prefill"
                          else ops.Decode(room.room, self.tokens, c.prefill_instance))
            room.waiting[m.name] = m.client.submit(op)  # type: ignore[union-attr]
        self.rooms[room.room] = room
        return room

    def pump(self, seconds: float) -> None:
        """Collect replies for ``seconds``; while flowing, top the open rooms up."""
        end = time.monotonic() + seconds
        while True:
            if self.flowing:
                while len(self.open_rooms()) < self.concurrency:
                    self.submit()
            self._collect(0.01)
            if time.monotonic() >= end:
                return

    def _collect(self, timeout: float) -> None:
        for m in self.cluster.workers:
            if m.client is None:
                continue  # a dead member's replies already received still sit in its socket: read them
            m.client.poll(timeout / len(self.cluster.workers) if m.alive else 0.0)
            for room in self.open_rooms():
                request_id = room.waiting.get(m.name)
                if request_id is None:
                    continue
                reply = m.client.take(request_id)
                if reply is None:
                    continue
                result = reply if isinstance(reply, ops.RoomResult) else ops.RoomResult(room.room, False, str(reply))
                room.results[m.name] = (time.monotonic(), result)
                del room.waiting[m.name]

    def lose(self, m: Member) -> None:
        """``m`` died: what it answered before is read, what it still owed is lost."""
        self._collect(0.05)
        now = time.monotonic()
        for room in self.open_rooms():
            if room.waiting.pop(m.name, None) is not None:
                room.results[m.name] = (now, None)

    def settle(self, timeout: float) -> list[Room]:
        """Pump until every open room is answered by every live rank; returns what is still open."""
        deadline = time.monotonic() + timeout
        while self.open_rooms() and time.monotonic() < deadline:
            for m in self.cluster.workers:
                if not m.alive:
                    self.lose(m)
            self.pump(0.05)
        return self.open_rooms()

    def batch(self, n: int, timeout: float) -> list[Room]:
        """``n`` rooms at once, waited for; returns them."""
        rooms = [self.submit() for _ in range(n)]
        deadline = time.monotonic() + timeout
        while any(not r.done for r in rooms) and time.monotonic() < deadline:
            self.pump(0.05)
        return rooms
