"""Decode's view of the prefill ranks its rooms wait on: their liveness, as state.

A prefill rank that has rooms here is pinged every ``ping_interval``; any message
from it counts as alive. Silent for ``peer_timeout`` -> it is declared dead and its
rooms fail with a reason naming the rank. Its writes are assumed to have stopped
(the rank counts as quiet, hard rule 6) when it acknowledges the abort, or once the
bootstrap daemon no longer lists it (lease expired, asked off the loop: a
``CheckLease`` action, answered by ``lease_checked``) *and* ``lease_quarantine`` more
seconds have passed: a process frozen past its lease (SIGSTOP, a paused VM) still holds
queued writes that land when it resumes, so an expired lease alone does not free pages.

    alive ──silent peer_timeout──▶ dead ──lease gone──▶ quarantined ──lease_quarantine──▶ quiet
      ▲                              │
      └──── heard from again (a new record replaces the dead one) ◀─┘

A rank with no room here is pinged every ``keepalive`` seconds for ``keepalive_for`` seconds after
its last room, so that its connection (and the ownership proof that connection carries) stays
open between rooms: a prefill rank closes a connection silent for its ``PrefillConfig.idle_timeout``
(120 s), and the next room would then connect and prove this rank again (a read of its memory
through the engine) on its own path. Nobody is declared dead for an unanswered keepalive: no room
waits on it.

Rooms asked under an earlier registration of this rank (it registered again: ``machine.py``,
"Re-registration") keep their own connections; while any of them may still see writes, each ping
of their prefill rank goes on those connections too, naming that registration, so that the
prefill rank keeps hearing from the connection its targets are bound to.

No socket, thread or clock: ``tick(now, ...)`` returns what to do (pings, lease checks,
connections to drop) and what it found (peers dead, peers quiet), and the room state
machine (``decode/machine.py``) applies the verdicts to its rooms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from kvbridge.transfer.channel import wire
from kvbridge.transfer.actions import Send
from kvbridge.transfer.decode.config import DecodeConfig


@dataclass(frozen=True, slots=True)
class CheckLease:
    """Ask the daemon (off the loop) whether ``rank_id`` of ``instance`` is still registered;
    answer with ``DecodeRooms.lease_checked(endpoint, rank_id, gone, now)``."""

    endpoint: str
    instance: str
    rank_id: str


@dataclass(frozen=True, slots=True)
class DropPeer:
    """Close the connection to a prefill rank that is gone for good."""

    endpoint: str


@dataclass
class PrefillPeer:
    """One prefill rank (one control endpoint) as decode sees it."""

    endpoint: str
    label: str
    rank_id: str
    instance: str
    last_seen: float
    last_ping: float = 0.0
    seq: int = 0
    dead: str | None = None  # reason once declared dead
    lease_gone: bool = False
    gone_at: float = 0.0  # when its lease was first seen gone (quarantine starts)
    lease_check_pending: bool = False
    next_lease_check: float = 0.0
    dead_at: float = 0.0
    rooms: set[int] = field(default_factory=set)
    last_room: float = 0.0  # its last room's request, or the last pass that found one (keepalive's window)


@dataclass
class Verdicts:
    """What one liveness pass found: actions for the shell; peers newly declared dead (their
    instance's cached topology is no longer trusted); dead peers whose rooms fail; peers now
    known quiet (their rooms' pages may be freed)."""

    actions: list[Any] = field(default_factory=list)
    newly_dead: list[PrefillPeer] = field(default_factory=list)
    dead: list[tuple[PrefillPeer, list[Any]]] = field(default_factory=list)  # with their active rooms
    quiet: list[tuple[PrefillPeer, list[Any]]] = field(default_factory=list)


class PrefillPeers:
    """The prefill ranks decode's rooms talk to, by control endpoint."""

    def __init__(self, config: DecodeConfig) -> None:
        self.cfg = config
        self.registration: str | None = None  # this rank's registration: its pings name it (the machine sets it)
        self._peers: dict[str, PrefillPeer] = {}

    def get(self, endpoint: str) -> PrefillPeer | None:
        return self._peers.get(endpoint)

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._peers

    def __getitem__(self, endpoint: str) -> PrefillPeer:
        return self._peers[endpoint]

    def values(self) -> Any:
        return self._peers.values()

    def heard(self, endpoint: str, now: float) -> None:
        """Any message from ``endpoint``: it is alive."""
        p = self._peers.get(endpoint)
        if p is not None:
            p.last_seen = now

    def peer(self, s: Any, instance: str, now: float) -> PrefillPeer:
        """The record of sender rank ``s`` (a look-up's SenderRank): a new one when the endpoint is
        new, is now another registration, or was dead and spoke since."""
        p = self._peers.get(s.control_endpoint)
        revived = p is not None and p.dead is not None and p.last_seen > p.dead_at
        if p is None or p.rank_id != s.rank_id or revived:
            tp = f"/tp{s.tp_rank}" if s.tp_rank else ""
            p = self._peers[s.control_endpoint] = PrefillPeer(s.control_endpoint, f"{instance}/cp{s.cp_rank}{tp}",
                                                              s.rank_id, instance, last_seen=now)
        return p

    def add_room(self, endpoint: str, room: int) -> None:
        p = self._peers.get(endpoint)
        if p is not None:
            p.rooms.add(room)

    def discard_room(self, endpoint: str, room: int) -> None:
        p = self._peers.get(endpoint)
        if p is not None:
            p.rooms.discard(room)

    def loop_was_frozen(self, now: float) -> None:
        """The caller heard nothing because it listened to nothing: blame no peer for the gap."""
        for p in self._peers.values():
            p.last_seen = max(p.last_seen, now)

    def tick(self, now: float, active: Callable[[PrefillPeer], list[Any]],
             retired: Mapping[str, Set[str]] | None = None) -> Verdicts:
        """One liveness pass. ``active(peer)``: the rooms toward it that may still see its writes
        (rooms not yet releasable); ``retired``: per endpoint, the earlier registrations of this rank
        that such rooms asked it under (pinged on their connections too)."""
        out = Verdicts()
        for p in list(self._peers.values()):
            rooms = active(p)
            also = retired.get(p.endpoint, ()) if retired else ()
            if not rooms:
                if p.dead is not None and p.lease_gone:  # gone for good: close its socket, forget it
                    out.actions.append(DropPeer(p.endpoint))
                    del self._peers[p.endpoint]
                elif p.dead is None and (self._keepalive_due(p, now)
                                         or also and now - p.last_ping >= self.cfg.ping_interval):
                    self._ping(p, now, out, also)
                continue
            p.last_room = now
            if p.dead is None and now - p.last_seen > self.cfg.peer_timeout:
                p.dead = f"prefill rank {p.label} ({p.endpoint}) sent nothing for {now - p.last_seen:.1f}s"
                p.dead_at = now
                out.newly_dead.append(p)
            if p.dead is not None:
                out.dead.append((p, rooms))
                if p.lease_gone and now - p.gone_at >= self.cfg.lease_quarantine:
                    out.quiet.append((p, rooms))
                elif not p.lease_check_pending and now >= p.next_lease_check:
                    p.lease_check_pending = True
                    out.actions.append(CheckLease(p.endpoint, p.instance, p.rank_id))
            elif now - p.last_ping >= self.cfg.ping_interval:
                self._ping(p, now, out, also)
        return out

    def _keepalive_due(self, p: PrefillPeer, now: float) -> bool:
        """A rank with no room here: ping it to keep its connection open (``keepalive``), while its
        last room is at most ``keepalive_for`` seconds old."""
        every = self.cfg.keepalive
        return every > 0 and now - p.last_room <= self.cfg.keepalive_for and now - p.last_ping >= every

    def _ping(self, p: PrefillPeer, now: float, out: Verdicts, also: Set[str] = frozenset()) -> None:
        """Ping ``p`` as this rank's registration, and on the connection of each earlier one in ``also``."""
        p.last_ping, p.seq = now, p.seq + 1
        out.actions.append(Send((p.endpoint,), wire.Ping(decode_rank=self.cfg.rank_label, seq=p.seq,
                                                            decode_rank_id=self.registration or "")))
        for name in sorted(also):
            out.actions.append(Send((p.endpoint,), wire.Ping(decode_rank=self.cfg.rank_label, seq=p.seq,
                                                                decode_rank_id=name), via=name))

    def lease_checked(self, endpoint: str, rank_id: str, gone: bool, now: float) -> None:
        """The daemon's answer to a ``CheckLease`` (for a record since replaced: ignored)."""
        p = self._peers.get(endpoint)
        if p is None or p.rank_id != rank_id or not p.lease_check_pending:
            return
        if gone and not p.lease_gone:
            p.gone_at = now
        p.lease_gone = gone
        p.lease_check_pending = False
        p.next_lease_check = now + self.cfg.ping_interval  # ask again after a while
