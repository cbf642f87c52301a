"""This decode rank's registration, and the earlier ones its rooms in flight still need.

A prefill rank binds a control connection to the registration its Hello names and answers a room
only on the connection that asked for it. When this rank registers again (the daemon restarted and
forgot it: ``Registered`` with a new id), rooms already asked keep the connections of the
registration they asked under, *retired*: their pings, aborts, slot grants and ticket hand-ons go
there, naming that registration, and what prefill sends for them still arrives; new rooms ask on
connections under the new id. A retired registration's connections close once no room asked under
it can still send or receive anything (``DropRegistration``). Nothing is asked twice and no room
changes connection, so no sender is ever counted quiet that may still write (hard rule 6).

    Registered(R')  ->  Rename(R', keep={R: rooms asked under R and not settled})
    room asked under R:   Abort / Ping / SlotGrant / RoomTicket ... via R   (prefill's answers come on R's)
    new rooms:            TransferRequest ... on R'
    every scan: R's rooms settled (final, pages releasable, no staging slot quarantined) -> DropRegistration(R)

Which sender a room asked under which registration is the room's own (``DecodeRoom.asked_as``);
whether a room is settled is the room machine's to say (``settled``). Plain data in and out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode.events import DropRegistration, Rename
from kvbridge.transfer.decode.room import DecodeRoom

__all__ = ["Registrations"]


class Registrations:
    """``current``: this rank's registration id (None before the first); ``retired``: each earlier
    one whose connections stay open, with the rooms asked under it that are not settled."""

    def __init__(self, settled: Callable[[DecodeRoom], bool]) -> None:
        self.current: str | None = None
        self.retired: dict[str, list[DecodeRoom]] = {}
        self._settled = settled

    def register(self, rank_id: str | None, rooms: Iterable[DecodeRoom]) -> tuple[Rename | None, int]:
        """This rank is ``rank_id`` now: the ``Rename`` for the shell (None: nothing changed), and how
        many of ``rooms`` (every room open) keep the earlier registration's connections."""
        old, self.current = self.current, rank_id
        if rank_id is None or old == rank_id:
            return None, 0
        kept = 0
        if old is not None:
            mine = [r for r in rooms if old in r.asked_as.values() and not self._settled(r)]
            if mine:
                self.retired[old] = mine
                kept = len(mine)
        self.retired.pop(rank_id, None)
        return Rename(rank_id, frozenset(self.retired)), kept

    def via(self, rank_id: str | None) -> str | None:
        """``Send.via`` for a message that acts for ``rank_id``: None when that is this rank's
        registration now."""
        return None if rank_id == self.current else rank_id

    def prune(self) -> list[DropRegistration]:
        """The earlier registrations no room needs any more, forgotten: their connections close."""
        dropped = []
        for name in list(self.retired):
            rooms = [r for r in self.retired[name] if name in r.asked_as.values() and not self._settled(r)]
            if rooms:
                self.retired[name] = rooms
            else:
                del self.retired[name]
                dropped.append(DropRegistration(name))
        return dropped

    def retired_at(self) -> dict[str, set[str]]:
        """Per prefill endpoint, the earlier registrations its rooms in flight asked it under (pinged
        on their own connections: a prefill rank fails the targets of a connection gone silent)."""
        at: dict[str, set[str]] = {}
        for name, rooms in self.retired.items():
            for r in rooms:
                if not r.pages_releasable:
                    for endpoint, asked in r.asked_as.items():
                        if asked == name:
                            at.setdefault(endpoint, set()).add(name)
        return at

    def routed(self, out: Sequence[Any], rooms: Mapping[int, DecodeRoom]) -> list[Any]:
        """The staging area's slot grants for a room asked under an earlier registration go on
        that registration's connection, where the prefill rank's target is."""
        routed = []
        for a in out:
            if type(a) is Send and a.via is None and type(a.msg) is wire.SlotGrant:
                r = rooms.get(a.msg.room)
                via = self.via(r.asked_as.get(a.to[0])) if r is not None else None
                if via is not None:
                    a = Send(a.to, a.msg, via=via)
            routed.append(a)
        return routed
