"""The prefill peers of a decode rank's rooms, and their liveness (the ``RoomBook``'s half
that watches peers; its state lives on the book, under the endpoint's lock).

Peer liveness: a prefill rank that has rooms here is pinged every
``ping_interval``; any message from it counts as alive. Silent for
``peer_timeout`` -> its rooms fail with a reason naming the rank. Its writes are
assumed to have stopped (the rank counts as quiet, hard rule 6) when it acknowledges
the abort, or once the bootstrap daemon no longer lists it (lease expired, checked off
the loop thread) *and* ``lease_quarantine`` more seconds have passed: a process frozen
past its lease (SIGSTOP, a paused VM) still holds queued writes that land when it
resumes, so an expired lease alone does not free pages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.errors import KVBridgeError, UnknownInstance
from kvbridge.transfer.channel import wire

if TYPE_CHECKING:
    from kvbridge.transfer.receiver import RecvRoom


@dataclass
class Peer:
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


class PeerLiveness:
    """Pings, silence, lease checks and quarantine of the prefill ranks rooms wait on; uses the
    book's ``peers``, ``rooms``, ``cache``, ``cfg``, ``ep`` and ``fail``."""

    def _peer(self, s: Any, instance: str) -> Peer:
        p = self.peers.get(s.control_endpoint)
        revived = p is not None and p.dead is not None and p.last_seen > p.dead_at
        if p is None or p.rank_id != s.rank_id or revived:
            tp = f"/tp{s.tp_rank}" if s.tp_rank else ""
            p = self.peers[s.control_endpoint] = Peer(s.control_endpoint, f"{instance}/cp{s.cp_rank}{tp}", s.rank_id,
                                                      instance, last_seen=time.monotonic())
        return p

    def _any_active(self, p: Peer) -> bool:
        """A room toward this peer may still see writes from it (stops at the first)."""
        rooms = self.rooms
        return any(k in rooms and not rooms[k].pages_releasable for k in p.rooms)

    def _active_rooms(self, p: Peer) -> list[RecvRoom]:
        """Rooms toward this peer that may still see writes from it."""
        return [self.rooms[k] for k in p.rooms if k in self.rooms and not self.rooms[k].pages_releasable]

    def _liveness(self, now: float) -> None:
        for p in list(self.peers.values()):
            active = self._active_rooms(p)
            if not active:
                if p.dead is not None and p.lease_gone:  # gone for good: close its socket, forget it
                    self.ep.drop_peer(p.endpoint)
                    del self.peers[p.endpoint]
                continue
            if p.dead is None and now - p.last_seen > self.cfg.peer_timeout:
                p.dead = f"prefill rank {p.label} ({p.endpoint}) sent nothing for {now - p.last_seen:.1f}s"
                p.dead_at = now
                self.cache = {k: v for k, v in self.cache.items() if k[0] != p.instance}
            if p.dead is not None:
                for r in active:
                    self.fail(r, p.dead)
                if p.lease_gone and now - p.gone_at >= self.cfg.lease_quarantine:
                    for r in active:
                        r.quiet.update(k for k, s in r.senders.items() if s.control_endpoint == p.endpoint)
                elif not p.lease_check_pending and now >= p.next_lease_check:
                    self._check_lease(p)
            elif now - p.last_ping >= self.cfg.ping_interval:
                p.last_ping, p.seq = now, p.seq + 1
                self.ep.send(p.endpoint, wire.Ping(decode_rank=self.cfg.rank_label, seq=p.seq))

    def _check_lease(self, p: Peer) -> None:
        """Ask the daemon (off the loop) whether the dead rank's lease is gone."""
        p.lease_check_pending = True

        def check() -> None:
            try:
                view = self.ep.bootstrap.instance(p.instance)
                gone = all(rk.rank_id != p.rank_id for rk in view.ranks)
            except UnknownInstance:  # the whole instance is gone
                gone = True
            except KVBridgeError:  # daemon unreachable: cannot tell, so keep waiting (safe)
                gone = False
            self.ep.hand_to_loop(lambda: self._lease_checked(p, gone))

        self.ep._pool.submit(check)

    def _lease_checked(self, p: Peer, gone: bool) -> None:
        if gone and not p.lease_gone:
            p.gone_at = time.monotonic()
        p.lease_gone = gone
        p.lease_check_pending = False
        p.next_lease_check = time.monotonic() + self.cfg.ping_interval  # ask again after a while
