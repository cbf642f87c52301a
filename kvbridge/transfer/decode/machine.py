"""Decode's rooms as a state machine: events in, actions out.

One :class:`DecodeRoom` per room, and :class:`DecodeRooms`, the side's machine that
drives them all. Events are method calls (open, init, message from a prefill rank,
look-up answered, lease checked, abort, close, tick); each returns the actions for
the endpoint's shell to carry out, in order (``Send``, ``LookUp``, ``Refresh``,
``CheckLease``, ``DropPeer``, ``FreeRoom``). No socket, thread, lock, clock or engine
call inside: the time is passed in, and the one read of memory (the aux row and the
page digests at commit) goes through the two readers given at construction.

The room itself, its states and its pages: ``room.py``; the digest check at its commit (which
digests to read back, and where they differ): ``commit_digests.py``.

Between scans (every ``SCAN_S``) only the rooms something happened to are advanced:
O(events), not O(rooms). A loop that was itself frozen blames no peer for the silence
it did not listen to, and counts the gap toward no room's deadline (``tick``).

**Re-registration** (a room asked just before this rank registered again keeps the connections it
asked on): ``registrations.py``.
"""

from __future__ import annotations


import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.errors import (
    BootstrapUnavailable,
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    LayoutError,
    LedgerError,
)
from kvbridge.layout import AuxSchema, BufferDesc, PoolSpec
from kvbridge.layout.kinds import token_page_size
from kvbridge.transfer.ownership import PROOF_FAILED, ProofKey
from kvbridge.transfer.channel import wire
from kvbridge.transfer.staging.cycle import trace_cycle
from kvbridge.transfer.actions import AbortRoom, CloseRoom, FreeRoom, Send, Shutdown, Tick
from kvbridge.transfer.decode.events import (EVENTS, AuxRowWritten, CommitRead, EchoScratch, Init,
                                             LeaseChecked, LookedUp, LookUp, Message, ReadForCommit, Refresh,
                                             Refreshed, Registered, Release, ScatterFailed, Scattered,
                                             SetStaging, WriteAuxRow, WriteProof)
from kvbridge.transfer.decode.commit_digests import digest_mismatch, digest_reads
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.peers import PrefillPeer, PrefillPeers
from kvbridge.transfer.decode.registrations import Registrations
from kvbridge.transfer.decode.room import DecodeRoom
from kvbridge.transfer.decode.events import InitKinds
from kvbridge.transfer.decode.kind_rooms import DecodeKinds
from kvbridge.transfer.decode.staging import DecodeStaging
from kvbridge.transfer.decode.topologies import Key, SenderKey, Topologies
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.rooms import Rooms, Stage

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse

log = logging.getLogger(__name__)

SCAN_S = 0.02  # every room is looked at on this period; events in between touch only their room
ABORT_RESEND_S = 1.0  # a failed room re-sends its Abort to ranks not yet quiet
# a TransferRequest a prefill rank refused because this rank's memory proof failed (PROOF_FAILED: a read of our scratch
# region that timed out on a starved host, a connection whose proof raced another) is sent again, this many times per
# sender, each after this long (past the prefill admission's retry_s of 1 s, when the next message starts a new proof);
# nothing of the room was written (a refused request never reaches the room), so asking again is safe
PROOF_RETRIES = 2
PROOF_RETRY_S = 2.0
_NONE: tuple = ()  # what an event that asks for nothing returns



class DecodeRooms:
    """The decode rank's rooms and what drives them: one door, ``feed(event)`` (``EVENTS``,
    ``events.py``), and read-only queries for the shell (``unquiet``, ``health``; ``open``
    hands the engine's handle its room record). ``proof_key``: the key whose public half is in
    our registration (answers a KeyChallenge; None: none, and prefill refuses us);
    ``scratch``: whether we registered a scratch region (a Challenge is echoed from it)."""

    def __init__(self, config: DecodeConfig, specs: Mapping[str, PoolSpec], aux_schema: AuxSchema, *,
                 trace: bool = False, staging: DecodeStaging | None = None,
                 proof_key: ProofKey | None = None, scratch: bool = True,
                 kind_buffers: Sequence[BufferDesc] = (), aux_inline: bool = False, aux_ahead: bool = False,
                 daemon: str = "the bootstrap daemon") -> None:
        """``aux_inline``: ask for each room's aux row in the report that carries it (the shell
        writes it into the room's slot: its aux rows are writable by kvbridge); ``aux_ahead``: in a
        report of its own, sent once the pages' write is posted (rows in device memory: the shell
        writes the row while the pages land). A row whose report comes before the room's last is
        written at once, else at the commit.
        ``daemon``: how reasons name the daemon look-ups go to (its URL where the shell knows it)."""
        self.cfg = config
        self.daemon = daemon
        self.aux_inline = aux_inline
        self.aux_ahead = aux_inline and aux_ahead
        self.proof_key = proof_key
        self.scratch = scratch
        # this rank's registration id (``Registered``), and the earlier ones rooms in flight still need
        self.registrations = Registrations(self._settled)
        self.staging_mode = config.staging  # what a room's request offers (DecodeEndpoint.set_staging changes it)
        self.staging = staging  # the staging area remote writes of staged targets land in (None: direct only)
        self.specs = dict(specs)
        self.aux_schema = aux_schema
        self.trace = trace
        self.rooms: Rooms[DecodeRoom] = Rooms(config.rank_label, "KVReceiver", "receiver(room, ..., wait=...)")
        self.peers = PrefillPeers(config)
        self.topologies = Topologies(config, self.specs)
        self.page_size = token_page_size(self.specs)  # the room's page mapping (paged windows share it)
        self.pools = sorted(p for p, s in self.specs.items() if s.kind == "paged")  # the page ledger's
        # the window, compressed and state pools' books (``kind_rooms.py``; ``kind_buffers``: our
        # registered buffers of them, whose capacities bound the units)
        self.kinds = DecodeKinds(self.specs, kind_buffers, config.rank_label)
        self.bytes_per_token = sum(s.bytes_per_token * s.num_layers for s in self.specs.values() if s.kind == "paged")
        self.dirty: set[int] = set()  # rooms to advance at the next tick
        self.next_scan = 0.0
        self.last_scan = 0.0
        self._out: list[Any] = []

    def _actions(self) -> list[Any] | tuple:
        if not self._out:
            return _NONE
        out, self._out = self._out, []
        return out

    def feed(self, event: Any) -> list[Any] | tuple:
        """The door: one event in (``EVENTS``), the actions for the shell out, in order."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"the decode room machine does not take {type(event).__name__}")
        handler(self, event)
        out = self._actions()
        if self.registrations.retired and out:
            out = self.registrations.routed(out, self.rooms)
        if self.trace:
            trace_cycle(self.cfg.rank_label, event, out)
        return out

    def health(self) -> dict[str, Any]:
        """Peers alive and dead; the staging area's counters, slots and waiters (None: no area)."""
        peers = list(self.peers.values())
        staging = None
        if self.staging is not None:
            area = self.staging.area
            staging = {"counters": dict(self.staging.counters), "waiting": area.num_waiting,
                       "slots": [area.state(i) for i in range(area.num_slots)]}
        return {"alive": sum(1 for p in peers if not p.dead), "dead": sum(1 for p in peers if p.dead),
                "staging": staging}

    def rank_id(self) -> str | None:
        return self.registration

    @property
    def registration(self) -> str | None:
        """This rank's registration id (``Registered``)."""
        return self.registrations.current

    @property
    def retired(self) -> dict[str, list[DecodeRoom]]:
        """The earlier registrations whose connections stay open, with the rooms asked under them."""
        return self.registrations.retired

    # -- events from the engine -------------------------------------------------

    def open(self, room: int, prefill_instance: str, dp_rank: int | None, now: float) -> DecodeRoom:
        """A new receiver's room (RoomInUse while the id is open or draining). Asks for nothing:
        its look-up goes out at the next tick, unless a cached topology serves it at once."""
        r = self.rooms.open(room, lambda: DecodeRoom(room, prefill_instance, dp_rank, now))
        self.dirty.add(room)
        cached = self.topologies.cached(self._key(r), now)
        if cached is not None:
            self.topology_ready(r, cached, now)  # (a room failing here asked no rank: nothing to send)
        return r

    def _init(self, e: Any) -> None:
        """The engine's init() (checked by the endpoint): the requests go out now when the topology
        is known, else at the tick that learns it."""
        r, pages, aux_slot, num_tokens, first_page, now = e.room, e.pages, e.aux_slot, e.num_tokens, e.first_page, e.now
        if r.initialised:
            raise LayoutError("init() called twice", room=r.room, rank=self.cfg.rank_label, field="page_ids")
        if r.state.final:  # failed meanwhile (closed, timed out): poll() says why
            return
        r.page_ids, r.aux_slot, r.first_page = pages, aux_slot, first_page
        self.dirty.add(r.room)
        if num_tokens is not None:
            self.learn_num_tokens(r, num_tokens)
        if r.state.state == KVPoll.WaitingForInput:
            self.dirty.discard(r.room)
            self._request(r, now)

    def _release(self, e: Release) -> None:
        """The engine's release() (instead of init()): the room's prefill ranks are told that this
        instance needs nothing of it, now when the topology is known, else at the tick that learns it."""
        r = e.room
        if r.initialised or r.release_reason is not None:
            raise LayoutError("release() after init() or release()", room=r.room, rank=self.cfg.rank_label,
                              field="release")
        if r.state.final:  # failed meanwhile (closed, timed out): poll() says why
            return
        r.release_reason = e.reason or "decode needs nothing of the room"
        if r.state.state == KVPoll.WaitingForInput:
            self._send_release(r, e.now)
        else:
            self.dirty.add(r.room)

    def _send_release(self, r: DecodeRoom, now: float) -> None:
        """A Release to every prefill rank this rank would have asked (each frees its own blocks of the
        room; the union over the instance's decode ranks is every rank that holds any), then Success:
        nothing was asked, so nothing can land in our pages."""
        endpoints = sorted({s.control_endpoint for _, s, _ in r.placement.asks})
        self._out.append(Send(tuple(endpoints), wire.Release(
            room=r.room, decode_rank=self.cfg.rank_label, decode_rank_id=self.registration or "?",
            reason=r.release_reason[:512], binding=r.binding)))
        r.state.advance_to(KVPoll.Success, now=now)
        if self.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f released to %s: %s", r.room, self.cfg.rank_label,
                     r.age_ms(now), now, ", ".join(endpoints), r.release_reason)

    def _abort(self, e: AbortRoom) -> None:
        self.fail(e.room, e.reason, e.now)

    def _close(self, e: CloseRoom) -> None:
        """The engine let go of the room: fail it if unfinished; forget it once quiet."""
        r = e.room
        if self.rooms.close(r):
            self.fail(r, f"the engine closed room {r.room}'s receiver on {self.cfg.rank_label} before it finished",
                      e.now, level=logging.INFO)  # the engine's own decision: not a warning
            self._forget_if_quiet(r, e.now)

    def _shutdown(self, e: Shutdown) -> None:
        """Fail every room (the endpoint closes)."""
        for r in list(self.rooms.values()):
            self.fail(r, e.reason, e.now)

    def _registered(self, e: Registered) -> None:
        """This rank's registration, the first or a new one (the daemon forgot the earlier one):
        the rooms asked under the earlier one keep its connections (``registrations.py``)."""
        self.peers.registration = e.rank_id
        old = self.registration
        rename, kept = self.registrations.register(e.rank_id, self.rooms.values())
        if kept:
            log.info("decode rank %s registered again as %s: %d room(s) asked as %s keep its connections",
                     self.cfg.rank_label, e.rank_id, kept, old)
        if rename is not None:
            self._out.append(rename)

    def _via(self, rank_id: str | None) -> str | None:
        return self.registrations.via(rank_id)

    def _settled(self, r: DecodeRoom) -> bool:
        """Nothing of room ``r`` is still to come or go on its connections: final, no write can
        land in its pages, and no staging slot of it is quarantined (a late report frees one)."""
        return r.state.final and r.pages_releasable and not (
            self.staging is not None and self.staging.area.slots_of(r.room))

    def _set_staging(self, e: SetStaging) -> None:
        self.staging_mode = e.mode

    def unquiet(self) -> bool:
        """Some failed room may still see writes (its pages are not releasable yet)."""
        return any(r.state.state == KVPoll.Failed and not r.pages_releasable for r in self.rooms.values())

    def learn_num_tokens(self, r: DecodeRoom, num_tokens: int, source: str = "init()") -> None:
        """The request's token count (from init(), or from the prefill rank with the aux row): it must
        end inside the last page, and agree with what is known."""
        if r.num_tokens is not None:
            if num_tokens != r.num_tokens:
                raise LedgerError(f"{source} says {num_tokens} tokens, the room has {r.num_tokens}", room=r.room,
                                  rank=self.cfg.rank_label, field="num_tokens")
            return
        low, high = (r.num_pages - 1) * self.page_size + 1, r.num_pages * self.page_size
        if not low <= num_tokens <= high:
            raise LedgerError(f"{source} says {num_tokens} tokens, outside [{low}, {high}] for a request of "
                              f"{r.num_pages} pages", room=r.room, rank=self.cfg.rank_label, field="num_tokens")
        r.num_tokens = num_tokens
        tokens = num_tokens - min(num_tokens, r.first_page * self.page_size)
        r.bytes_expected = self.bytes_per_token * tokens + self.kinds.needed_bytes(num_tokens)

    # -- look-ups -----------------------------------------------------------------

    def _key(self, r: DecodeRoom) -> Key:
        return self.topologies.key(r.prefill_instance, r.dp_rank, r.room)

    def _looked_up(self, e: LookedUp) -> None:
        """The answer to a ``LookUp``: a topology, or the error the daemon (or the way to it) gave."""
        room, key, topo, error, now = e.room, e.key, e.topo, e.error, e.now
        self.topologies.in_flight.pop(key, None)
        self._wake_waiting(key[0])  # rooms that waited for this look-up use its answer now
        r = self.rooms.get(room)
        if r is None or r.state.final:
            return
        r.lookup_pending = False
        if error is None:
            self.topology_ready(r, topo, now, fresh=True)
        elif isinstance(error, ContractMismatch):
            fields = ", ".join(getattr(d, "path", str(d)) for d in error.diff[:6])
            reason = f"contract mismatch with prefill instance {r.prefill_instance!r} (fields: {fields}); nothing transferred"
            # a definitive answer: other rooms toward this instance are refused without asking again for a while
            self.topologies.refuse(r.prefill_instance, reason, list(error.diff), now)
            self._refuse(r, now)
        elif isinstance(error, BootstrapUnavailable):
            # the daemon is down: a topology it gave us before still names live ranks (liveness
            # pings catch the ones that are not); without one, ask again until the bootstrap timeout
            stale = self.topologies.stale(self._key(r))
            r.lookup_problem = str(error)
            if stale is not None:
                self.topology_ready(r, stale, now)
            else:
                r.next_lookup = now + 0.25
        elif isinstance(error, InstanceIncomplete):
            r.next_lookup = now + 0.1  # the instance is still coming up: ask again
            r.lookup_problem = str(error)
        elif isinstance(error, KVBridgeError):
            self.fail(r, f"bootstrap look-up failed: {error}", now)
        else:
            self.fail(r, f"bootstrap look-up failed: {type(error).__name__}: {error}", now)

    def _refreshed(self, e: Refreshed) -> None:
        self.topologies.refreshed(e.key, e.topo, e.now)
        self._wake_waiting(e.key[0])

    def topology_ready(self, r: DecodeRoom, topo: LookupResponse, now: float, fresh: bool = False) -> None:
        """Use a topology; only a ``fresh`` answer from the daemon (re)starts the cache's clock,
        so under steady traffic the cache still expires every ``topology_ttl``."""
        try:
            r.set_topology(self.topologies.placement(topo, r.room))
        except KVBridgeError as exc:
            self.fail(r, f"prefill instance {r.prefill_instance!r} ({topo.topology.shape}): {exc.reason}", now)
            return
        if fresh:
            self.topologies.store(topo, now)
        r.state.to(KVPoll.WaitingForInput, now=now)
        r.mark_bootstrapped()
        self.dirty.add(r.room)

    def _wake_waiting(self, instance: str) -> None:
        self.dirty.update(k for k, r in self.rooms.items()
                          if r.state.state == KVPoll.Bootstrapping and r.prefill_instance == instance)

    def _refuse(self, r: DecodeRoom, now: float) -> None:
        """Fail a room toward an instance whose contract differs (hard rule 7), keeping the diff."""
        _, reason, diff = self.topologies.refusal(r.prefill_instance)
        r.mismatch = list(diff)
        self.fail(r, reason, now)

    def _lease_checked(self, e: LeaseChecked) -> None:
        """The daemon's answer to a ``CheckLease``."""
        self.peers.lease_checked(e.endpoint, e.rank_id, e.gone, e.now)

    # -- failing and quiescence -------------------------------------------------

    def fail(self, r: DecodeRoom, reason: str, now: float, level: int = logging.WARNING) -> None:
        if r.state.final:
            return
        r.state.to(KVPoll.Failed, reason, now=now)
        if self.staging is not None:  # a slot a write may still land in waits out the lease and the quarantine
            self.staging.fail_room(r.room, now + self.cfg.lease_ttl + self.cfg.lease_quarantine, self._out)
        r.mark_bootstrapped()  # wait_bootstrapped() returns (and says why) instead of waiting on
        log.log(level, "room %d on %s failed: %s", r.room, self.cfg.rank_label, reason)
        if r.initialised:
            # pages are assigned: every sender of the DP group must stop before they are freed, also one
            # not asked yet, which another decode rank of this instance may have asked (its ranks free
            # pages together); an abort fails the room for every decode rank there, acked once quiet
            for key, s in r.senders.items():
                if key not in r.requested:
                    r.requested.add(key)
                    self.peers.peer(s, r.prefill_instance, now).rooms.add(r.room)
        self._send_aborts(r, now)

    def _send_aborts(self, r: DecodeRoom, now: float) -> None:
        for key in sorted(r.requested - r.quiet - r.abort_sent):
            s = r.senders[key]
            asked = r.asked_as.get(s.control_endpoint, self.registration)  # where its target is
            self._out.append(Send((s.control_endpoint,), wire.Abort(room=r.room, decode_rank=self.cfg.rank_label,
                                                                   reason=r.state.reason or "aborted",
                                                                   decode_rank_id=asked or "?"),
                                  via=self._via(asked)))
            r.abort_sent.add(key)
        r.last_abort = now

    def _forget_if_quiet(self, r: DecodeRoom, now: float) -> None:
        if r.life.stage != Stage.DRAINING or not r.state.final or not r.pages_releasable:
            return
        self.rooms.forget(r, now)
        self.kinds.release(r.room)  # its state slot frees with its pages
        if self.staging is not None:
            self.staging.forget(r.room)
        self._out.append(FreeRoom(r.room))  # receiver(room, ..., wait=...) may open it now
        for s in r.senders.values():
            self.peers.discard_room(s.control_endpoint, r.room)

    # -- messages from prefill ranks --------------------------------------------

    def _message(self, e: Message) -> None:
        """A message from the prefill rank at ``endpoint`` (or the channel's error for a bad one)."""
        endpoint, msg, now = e.endpoint, e.msg, e.now
        self.peers.heard(endpoint, now)
        if isinstance(msg, KVBridgeError):
            log.warning("bad control message from %s: %s", endpoint, msg)
            return
        if isinstance(msg, wire.Heartbeat):
            return
        if isinstance(msg, wire.Challenge):
            self._answer_challenge(endpoint, msg, e.via or self.registration)
            return
        if isinstance(msg, wire.KeyChallenge):
            self._answer_key_challenge(endpoint, msg, e.via or self.registration)
            return
        r = self.rooms.get(getattr(msg, "room", None))
        if r is None:
            if self.staging is not None and isinstance(msg, (wire.AbortAck, wire.ChunkLanded, wire.PagesDone)):
                self.staging.late(msg.room, endpoint, msg, self._out)
                return
            if isinstance(msg, wire.ErrorReply):
                log.warning("prefill %s refused a %s: %s", endpoint, msg.ref_type, msg.reason)
            return
        cp = getattr(msg, "cp_rank", None)
        key = r.by_endpoint.get(endpoint)  # (cp, tp, pp) of the sender on that connection
        if cp is not None and (key is None or key[0] != cp):
            self.fail(r, f"message from {endpoint} claims cp rank {cp}, which the topology does not place there", now)
            return
        try:
            self._dispatch(r, endpoint, key, msg, now)
        except KVBridgeError as exc:  # ledger violations and the like fail the room, never the loop
            self.fail(r, str(exc), now)
        self._maybe_commit(r, now)
        if r.inline_row is not None and not (r.commit_reading or r.row_writing or r.state.final
                                             or r.row_written is not None):
            # the row came before the room's last pages (a prefill rank reports it when it posts
            # them): written into the slot now, while they land, and not on the commit's path
            r.row_writing = True
            self._out.append(WriteAuxRow(r.room, r.aux_slot, r.inline_row))

    def _answer_key_challenge(self, endpoint: str, msg: wire.KeyChallenge, rank_id: str | None) -> None:
        """A prefill rank asks us to show we are our registration ``rank_id`` (the one the
        challenged connection's Hello named): sign its nonce, that registration id and its endpoint
        as we dialled it (transfer/ownership.py), and answer on that connection."""
        if self.proof_key is None or not rank_id:
            log.warning("prefill %s key-challenged %s, which has no proof key or registration", endpoint,
                        self.cfg.rank_label)
            return
        self._out.append(Send((endpoint,), wire.KeyProof(signature=self.proof_key.sign(rank_id, endpoint, msg.nonce)),
                              via=self._via(rank_id)))

    def _answer_challenge(self, endpoint: str, msg: wire.Challenge, rank_id: str | None) -> None:
        """Our proof that we hold the memory we registered. With a nonce (proof by read): our proof
        key's signature over it, for the shell to write into our own scratch region at ``offset``
        (``WriteProof``) and the prefill rank to read back; the echo says what we wrote (its
        SHA-256). Without: a prefill rank wrote a nonce there; echo what lies at ``offset``. Without a
        scratch region, or for an offset outside it, no echo: that prefill rank then refuses us,
        naming why."""
        if msg.nonce:
            if self.proof_key is None or not self.scratch or not rank_id:
                log.warning("prefill %s asked %s for a memory proof; it has no proof key or scratch region", endpoint,
                            self.cfg.rank_label)
                return
            self._out.append(WriteProof(endpoint, msg.offset,
                                        self.proof_key.sign_memory(rank_id, endpoint, msg.nonce, msg.offset),
                                        self._via(rank_id)))
            return
        if not self.scratch:
            log.warning("prefill %s challenged %s, which has no scratch region", endpoint, self.cfg.rank_label)
            return
        self._out.append(EchoScratch(endpoint, msg.offset, self._via(rank_id)))  # the shell reads the nonce, echoes it

    def _dispatch(self, r: DecodeRoom, endpoint: str, key: SenderKey | None, msg: Any, now: float) -> None:
        if isinstance(msg, wire.PagesDone) and msg.status == "ok" and not r.state.final:  # the common case first
            if self.trace:
                log.info("trace room=%d rank=%s +%.2fms @%.6f report from cp%d%s pages=%d%s", r.room, self.cfg.rank_label,
                         r.age_ms(now), now, msg.cp_rank, f"/pp{key[2]}" if r.placement.aux_stage else "",
                         len(msg.logical_pages) // 4, " +aux" if msg.aux else "")
            wrote = bool(msg.logical_pages or msg.kind_units or msg.aux_row is None)  # (a row alone wrote nothing)
            if r.staged_only and wrote and not self.staging.reported(r.room, key):
                raise LedgerError("reported a write that came through no staging slot, but this rank takes staged "
                                  "writes only (its pages are freed at once on failure)", room=r.room,
                                  rank=f"cp{msg.cp_rank}", field="staging")
            if msg.logical_pages:
                pages = np.frombuffer(msg.logical_pages, dtype="<i4")  # (decoding checked: whole int32s)
                r.ledger.record(msg.cp_rank, msg.pools, pages, tp_rank=key[1], pp_rank=key[2])
                if self.cfg.verify_digest:
                    if msg.digests is None:
                        raise LedgerError("digest check is on but the prefill rank sent no digests", room=r.room,
                                          rank=f"cp{msg.cp_rank}", field="digests")
                    r.digests.append((pages, np.frombuffer(msg.digests, dtype=np.uint64), key, tuple(msg.pools)))
            if msg.kind_units:  # window, compressed and state units (kind_rooms.py)
                self.kinds.record(r.room, msg, _label(msg, endpoint, key, r), key[2], key[1])
                if self.cfg.verify_digest:
                    for pool, packed in msg.kind_units.items():
                        digests = msg.kind_digests.get(pool)
                        if digests is None:
                            raise LedgerError(f"digest check is on but the prefill rank sent no digests of pool "
                                              f"{pool!r}", room=r.room, rank=f"cp{msg.cp_rank}", field="kind_digests")
                        r.kind_digests.append((pool, np.frombuffer(packed, dtype="<i4").astype(np.int64),
                                               np.frombuffer(digests, dtype="<u8"), key))
            if msg.aux_row is not None:  # the row itself, in the report: checked now, written at the commit
                r.inline_row = self._inline_row(r, msg)
            if msg.aux:  # the same write (or, inline, this report) carried the aux row
                r.ledger.record_aux(msg.cp_rank, tp_rank=key[1], pp_rank=key[2])
                if msg.num_tokens and msg.num_tokens != r.num_tokens:
                    self.learn_num_tokens(r, msg.num_tokens, f"{_label(msg, endpoint, key, r)} (with the aux row)")
        elif isinstance(msg, wire.ChunkLanded):
            if self.trace:
                log.info("trace room=%d rank=%s +%.2fms @%.6f chunk %d of cp%d landed in slot %d %s", r.room,
                         self.cfg.rank_label, r.age_ms(now), now, msg.chunk, msg.cp_rank, msg.slot, msg.status)
            staging = self._staging_for(r, msg)
            try:
                staging.landed(r.room, key, msg, self._out)
            finally:
                r.scatters = staging.scattering(r.room)
        elif isinstance(msg, wire.SlotRequest):
            if not r.state.final:  # (a failed room grants nothing: its sender was told to abort)
                self._staging_for(r, msg).request(r.room, key, endpoint, msg, r.page_ids, r.aux_slot, self._out,
                                                  kind_units=self.kinds.dest_units(r.room, r.page_ids)
                                                  if self.kinds else None)
        elif isinstance(msg, wire.AbortAck):
            r.quiet.add(key)
            if self.staging is not None:
                self.staging.sender_quiet(r.room, key, self._out)
        elif isinstance(msg, wire.RoomTicket):
            self._hand_on(r, endpoint, key, msg)
        elif isinstance(msg, wire.ErrorReply):
            if msg.ref_type == wire.TransferRequest.TAG:
                if PROOF_FAILED in msg.reason and self._ask_again(r, endpoint, msg, now):
                    return
                r.quiet.update(k for k, s in r.senders.items() if s.control_endpoint == endpoint)
            self.fail(r, f"{_label(msg, endpoint, key, r)} refused our {msg.ref_type}: {msg.reason}", now)
        elif r.state.final:
            if getattr(msg, "status", "ok") == "failed":
                r.quiet.add(key)  # a failure report means its writes have drained
                if self.staging is not None:
                    self.staging.sender_quiet(r.room, key, self._out)
        elif isinstance(msg, wire.PagesDone):  # failed
            r.quiet.add(key)
            self.fail(r, f"{_label(msg, endpoint, key, r)}: {msg.reason}", now)

    def _ask_again(self, r: DecodeRoom, endpoint: str, msg: wire.ErrorReply, now: float) -> bool:
        """A sender refused the room's TransferRequest because our memory proof failed on that
        connection: ask it again in ``PROOF_RETRY_S`` (``_advance``), at most ``PROOF_RETRIES`` times
        (False: no more; the room fails on the refusal)."""
        if r.state.final or r.state.state != KVPoll.Transferring:
            return False
        n = r.proof_retries.get(endpoint, 0)
        if n >= PROOF_RETRIES:
            return False
        r.proof_retries[endpoint] = n + 1
        r.ask_again[endpoint] = now + PROOF_RETRY_S
        log.warning("room %d on %s: prefill %s refused our transfer_request (%s); asking again in %.1fs (%d of %d)",
                    r.room, self.cfg.rank_label, endpoint, msg.reason, PROOF_RETRY_S, n + 1, PROOF_RETRIES)
        return True

    def _hand_on(self, r: DecodeRoom, endpoint: str, key: SenderKey | None, t: wire.RoomTicket) -> None:
        """The room's decider (cp 0, tp 0, pp 0 of the DP group) granted us the room: hand its
        ticket on, unchanged, to the other ranks we asked, which serve only the instance it names
        (transfer/prefill/tickets.py). Our tp rank 0 (which always draws from tp 0) hands it on to
        every rank of the columns our instance draws from too: our sibling ranks that do not ask
        tp 0 get no ticket of their own. A ticket from any other rank is not a decision: ignored. It
        names the registration we asked the decider under, and goes on that registration's connections
        (the one it acts for, even after this rank registered again)."""
        if r.state.final or key != (0, 0, 0) or t.decode_rank_id != r.asked_as.get(endpoint):
            return
        to = {s.control_endpoint for k, s, _ in r.placement.asks if k != key}
        if self.cfg.tp_rank == 0:
            to.update(r.placement.columns)
        if to:
            self._out.append(Send(tuple(sorted(to)), t, via=self._via(t.decode_rank_id)))

    def _staging_for(self, r: DecodeRoom, msg: Any) -> DecodeStaging:
        if self.staging is None:
            raise LedgerError(f"{msg.TAG} for a rank without a staging area (staging 'never')", room=r.room,
                              rank=f"cp{msg.cp_rank}", field="staging")
        return self.staging

    def _scattered(self, e: Scattered) -> None:
        """The shell carried out a ``Scatter``: the slot is free, and the room may commit."""
        self.staging.scattered(e.room, e.slot, self._out)
        r = self.rooms.get(e.room)
        if r is not None:
            r.scatters = self.staging.scattering(e.room)
            self._maybe_commit(r, e.now)
            self._forget_if_quiet(r, e.now)  # a failed room's pages are free once no scatter writes them

    def _inline_row(self, r: DecodeRoom, msg: wire.PagesDone) -> np.ndarray:
        """The aux row a report carried (``TransferRequest.aux_inline``), checked before anything
        of it is kept: asked for, one whole row, echoing this room (hard rule 4), readable as the
        schema's row. Raises LedgerError (the room fails; nothing was written into the slot)."""
        who = dict(room=r.room, rank=f"cp{msg.cp_rank}", field="aux_row")
        if not self.aux_inline:
            raise LedgerError("sent the aux row in its report, which this rank did not ask for (the row is written "
                              "into its aux rows by the transfer)", **who)
        if len(msg.aux_row) != self.aux_schema.row_bytes:
            raise LedgerError(f"sent an aux row of {len(msg.aux_row)} bytes in its report; the schema's row is "
                              f"{self.aux_schema.row_bytes}", **who)
        row = np.frombuffer(msg.aux_row, dtype=np.uint8)
        refusal = self._row_refusal(r, row, "the aux row in its report")
        if refusal is not None:
            raise LedgerError(refusal, **who)
        return row

    def _row_refusal(self, r: DecodeRoom, row: np.ndarray, what: str) -> str | None:
        """Why room ``r`` may not commit with aux row ``row`` (``what`` names where it is): another
        room's echo (hard rule 4), or what unpacking it would refuse (decoding waits for a reader)."""
        echoed, problem = self.aux_schema.head(row)
        if echoed != r.room:
            return f"{what} carries room {echoed}, expected {r.room}"
        return None if problem is None else f"{what} is unreadable: {problem}"

    def _scatter_failed(self, e: ScatterFailed) -> None:
        """Fail the room (never commit unwritten pages), then free the slot."""
        r = self.rooms.get(e.room)
        if r is not None:
            self.fail(r, e.reason, e.now)
        self._scattered(Scattered(e.room, e.slot, e.now))

    def _maybe_commit(self, r: DecodeRoom, now: float) -> None:
        """Every page is written: ask the shell to read the aux row (and the digests to check)."""
        if r.state.final or r.ledger is None or not r.ledger.complete or r.commit_reading:
            return
        if not self.kinds.complete(r.room):
            return  # a window, compressed or state unit is not reported yet
        if self.staging is not None and self.staging.pending.get(r.room):
            return  # a landed chunk is not scattered yet: its pages are not written
        r.commit_reading = True
        reads = digest_reads(r, self.pools, self.kinds) if self.cfg.verify_digest and r.num_tokens is not None else ()
        self._out.append(ReadForCommit(r.room, r.aux_slot, reads, r.inline_row, r.row_written is not None))

    def _aux_row_written(self, e: AuxRowWritten) -> None:
        """A row written ahead of the commit (``WriteAuxRow``): there now, or the room fails. A room
        that ended meanwhile (committed, the commit writing the row again behind it, or failed) is
        forgotten now if nothing else of it may still land."""
        r = self.rooms.get(e.room)
        if r is None:
            return
        r.row_writing = False
        if r.state.final:
            self._forget_if_quiet(r, e.now)
            return
        if e.error is not None:
            self.fail(r, f"the aux row its report carried could not be written into slot {r.aux_slot}: {e.error}",
                      e.now)
            return
        r.row_written = e.write_s

    def _commit_read(self, e: CommitRead) -> None:
        """The aux row (and digests) as read: check the room echo and the digests, then commit."""
        r, now = self.rooms.get(e.room), e.now
        if r is None or r.state.final:
            return
        r.commit_reading = False
        if e.error is not None:
            self.fail(r, f"aux row in slot {r.aux_slot} is unreadable: {e.error}", now)
            return
        refusal = self._row_refusal(r, e.row, f"aux row in slot {r.aux_slot}")
        if refusal is not None:
            self.fail(r, refusal, now)
            return
        if self.cfg.verify_digest:
            if r.num_tokens is None:
                self.fail(r, "cannot check page digests: neither init() nor the prefill rank said the token count", now)
                return
            mismatch = digest_mismatch(r, e.digests, self.kinds.specs)
            if mismatch is not None:
                self.fail(r, mismatch, now)
                return
        r.keep_aux_row(e.row, self.aux_schema)
        r.state.advance_to(KVPoll.Success, now=now)
        if self.staging is not None:  # a slot granted with a request that no chunk used
            self.staging.room_done(r.room, self._out)
        self.kinds.succeed(r.room)
        if self.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f committed pages_by_rank=%s aux_owner=cp%d aux_read=%.3fms%s",
                     r.room, self.cfg.rank_label, r.age_ms(now), now, dict(sorted(r.ledger.pages_by_rank.items())),
                     r.ledger.aux_owner, e.read_s * 1e3,
                     "" if r.row_written is None else f" aux_ahead={r.row_written * 1e3:.3f}ms")

    # -- the clock --------------------------------------------------------------

    def _tick(self, e: Tick) -> None:
        """Advance the rooms something happened to; every ``SCAN_S``, every room: deadlines,
        look-ups, retries, pings, liveness, forgetting."""
        now = e.now
        if now < self.next_scan:  # between scans only the rooms something happened to: O(events)
            while self.dirty:
                r = self.rooms.get(self.dirty.pop())
                if r is not None:
                    self._advance(r, now)
            return
        gap = now - self.last_scan if self.last_scan else 0.0
        if gap > self.cfg.peer_timeout / 2:
            # this loop itself was frozen (SIGSTOP, a stalled host): it heard nothing because it
            # listened to nothing, so no peer is blamed for the gap; nor does the gap count toward a
            # room's deadline (what its peers sent meanwhile is unread, its engine starved too)
            self.peers.loop_was_frozen(now)
            for r in self.rooms.values():
                r.spare(gap)
            log.warning("decode rank %s: its loop did not run for %.1fs (a starved process?): no peer blamed, the "
                        "rooms' deadlines spared that long", self.cfg.rank_label, gap)
        self.last_scan = now
        self.next_scan = now + SCAN_S
        self.dirty.clear()
        for r in list(self.rooms.values()):
            self._advance(r, now)
        self._liveness(now)
        if self.staging is not None:
            self.staging.expire(now, self._out)
        for key in self.topologies.refresh_due(now):
            self.topologies.in_flight[key] = now
            self._out.append(Refresh(key))
        for room in list(self.rooms.unowned):
            r = self.rooms.get(room)
            if r is None:
                self.rooms.unowned.discard(room)
            else:
                self._forget_if_quiet(r, now)
        if self.registrations.retired:
            self._out.extend(self.registrations.prune())

    def _lookup_state(self, r: DecodeRoom, now: float) -> str:
        """What the timeout reason adds: the daemon's last answer, or else the look-up still
        unanswered (the client is still retrying a daemon that does not answer: a loaded host can
        end the room before its first attempt fails)."""
        asked = self.topologies.in_flight.get(self._key(r))
        if asked is not None:
            return (f"; no answer yet from {self.daemon} to the look-up asked {now - asked:.1f}s ago (unreachable "
                    f"or overloaded?)" + (f"; last answer before it: {r.lookup_problem}" if r.lookup_problem else ""))
        return f"; last answer: {r.lookup_problem}" if r.lookup_problem else ""

    def _advance(self, r: DecodeRoom, now: float) -> None:
        st = r.state.state
        if st == KVPoll.Bootstrapping:
            if r.waited(now) > self.cfg.bootstrap_timeout:
                self.fail(r, f"no prefill topology for instance {r.prefill_instance!r} within "
                             f"{self.cfg.bootstrap_timeout:.1f}s (bootstrap timeout)" + self._lookup_state(r, now), now)
            elif not r.lookup_pending and now >= r.next_lookup:
                key = self._key(r)
                cached = self.topologies.cached(key, now)
                if cached is not None:
                    self.topology_ready(r, cached, now)
                elif self.topologies.refusal(r.prefill_instance, now) is not None:
                    self._refuse(r, now)
                elif key not in self.topologies.in_flight:  # one look-up per DP group at a time
                    r.lookup_pending = True
                    self.topologies.in_flight[key] = now
                    self._out.append(LookUp(r.room, r.prefill_instance, r.dp_rank, key))
        elif st == KVPoll.WaitingForInput:
            if r.initialised:
                self._request(r, now)
            elif r.release_reason is not None:
                self._send_release(r, now)
            elif r.waited(now) > self.cfg.waiting_timeout:
                self.fail(r, f"init() not called within {self.cfg.waiting_timeout:.1f}s (waiting timeout)", now)
        elif st == KVPoll.Transferring and r.ask_again and min(r.ask_again.values()) <= now \
                and r.waited(now) <= self.cfg.transfer_timeout:
            due = [e for e, at in r.ask_again.items() if at <= now]
            for endpoint in due:
                del r.ask_again[endpoint]
            self._send_requests(r, set(due))
        elif st == KVPoll.Transferring and r.waited(now) > self.cfg.transfer_timeout:
            stages = r.ledger.missing_stages() if r.ledger.staged else []
            self.fail(r, f"not complete within {self.cfg.transfer_timeout:.1f}s (transfer timeout); "
                         f"missing {r.ledger.missing()}{'' if r.ledger.aux_done else ' and the aux row'}"
                         + (f", of the kind pools {self.kinds.missing(r.room)}" if self.kinds.missing(r.room) else "")
                         + (f" from pipeline stage(s) {', '.join(f'pp{s}' for s in stages)}" if stages else ""), now)
        elif st == KVPoll.Failed and not r.pages_releasable and now - r.last_abort >= ABORT_RESEND_S:
            r.abort_sent.clear()  # aborts are idempotent: ask again until every rank is quiet
            self._send_aborts(r, now)

    def _request(self, r: DecodeRoom, now: float) -> None:
        """Ask every sender of the prefill DP group: each CP rank, and in it each TP rank of this
        rank's TP route, for the pools that route takes from it (``_send_requests``)."""
        if self.staging is not None and self.staging_mode != "never":
            r.staged_only = self.staging_mode == "always"
        self._send_requests(r, None)
        # the books while the requests travel (the shell sends them with the lock held: no report of
        # this room is handled before they are written)
        r.start_ledger(self.pools)
        self.kinds.start(r.room, r.num_tokens, r.placement.stages,
                         {p: r.route.sources_of(p) for p in self.kinds.specs} if r.route is not None else None)
        for key, s, _ in r.placement.asks:
            peer = self.peers.peer(s, r.prefill_instance, now)
            if not self._any_active(peer):  # liveness restarts now: a quiet spell between rooms is no death
                peer.last_seen = max(peer.last_seen, now)
            peer.rooms.add(r.room)
            peer.last_room = now  # (keepalive's window starts again)
            r.requested.add(key)
        r.state.to(KVPoll.Transferring, now=now)
        if self.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f requested from (cp, tp, pp) ranks %s", r.room, self.cfg.rank_label,
                     r.age_ms(now), now, sorted(r.requested))

    def _send_requests(self, r: DecodeRoom, only: set[str] | None) -> None:
        """The room's TransferRequests to every sender (``only``: to these endpoints), one Send per
        pool set (the CP ranks of one TP source get the same request, encoded once), and per slot
        granted with it (``DecodeStaging.grant_with_request``: each sender's own)."""
        page_ids = r.page_ids.astype("<i4").tobytes()  # init() checked them inside int32 (registered pages)
        staging: dict[str, Any] = {}
        if self.staging is not None and self.staging_mode != "never":
            area = self.staging.area
            staging = dict(staging_slots=area.num_slots, staging_slot_bytes=area.slot_bytes,
                           staging_base=self.staging.base, staging_only=r.staged_only)
        grants = bool(staging) and self.staging.area.reserved > 0  # a slot granted with the request (staging.py)
        by_pools: dict[tuple[tuple[str, ...], tuple[int, ...]], list[str]] = {}
        for key, s, pools in r.placement.asks:
            if only is None or s.control_endpoint in only:
                granted = tuple(self.staging.grant_with_request(r.room, key, only is not None)) if grants else ()
                by_pools.setdefault((pools, granted), []).append(s.control_endpoint)
                r.asked_as[s.control_endpoint] = self.registration  # where its target's connection is
        for (pools, granted), endpoints in by_pools.items():
            self._out.append(Send(tuple(endpoints), wire.TransferRequest(
                room=r.room, decode_rank=self.cfg.rank_label, decode_rank_id=self.registration, page_ids=page_ids,
                first_page=r.first_page, pools=list(pools), aux_slot=r.aux_slot, num_tokens=r.num_tokens or 0,
                deadline_ms=int(self.cfg.transfer_timeout * 1000), want_digest=self.cfg.verify_digest,
                fingerprint=r.topology.fingerprint, num_decode_ranks=self.cfg.tp_size, binding=r.binding,
                kind_units=self.kinds.request_units(r.room, pools), aux_inline=self.aux_inline,
                aux_ahead=self.aux_ahead, staging_granted=list(granted), **staging,
            )))

    # -- liveness ---------------------------------------------------------------

    def _any_active(self, p: PrefillPeer) -> bool:
        """A room toward this peer may still see writes from it (stops at the first)."""
        rooms = self.rooms
        return any(k in rooms and not rooms[k].pages_releasable for k in p.rooms)

    def _active(self, p: PrefillPeer) -> list[DecodeRoom]:
        """Rooms toward this peer that may still see writes from it."""
        rooms = self.rooms
        return [rooms[k] for k in p.rooms if k in rooms and not rooms[k].pages_releasable]

    def _liveness(self, now: float) -> None:
        found = self.peers.tick(now, self._active, self.registrations.retired_at() if self.retired else None)
        self._out.extend(found.actions)
        for p in found.newly_dead:
            self.topologies.forget_instance(p.instance)
        for p, rooms in found.dead:
            for r in rooms:
                self.fail(r, p.dead, now)
        for p, rooms in found.quiet:
            for r in rooms:
                r.quiet.update(k for k, s in r.senders.items() if s.control_endpoint == p.endpoint)


def _label(msg: Any, endpoint: str, key: SenderKey | None, r: DecodeRoom) -> str:
    tp = f"/tp{key[1]}" if key is not None and key[1] else ""
    staged = r.placement is not None and r.placement.aux_stage > 0  # a pipeline-parallel instance: name the stage
    pp = f"/pp{key[2]}" if key is not None and staged else ""
    return f"prefill cp rank {getattr(msg, 'cp_rank', '?')}{tp}{pp} ({endpoint})"


_HANDLERS: dict[type, Callable[[DecodeRooms, Any], None]] = {
    Registered: DecodeRooms._registered, SetStaging: DecodeRooms._set_staging, Init: DecodeRooms._init,
    AbortRoom: DecodeRooms._abort, CloseRoom: DecodeRooms._close, Shutdown: DecodeRooms._shutdown,
    Message: DecodeRooms._message, LookedUp: DecodeRooms._looked_up, Refreshed: DecodeRooms._refreshed,
    LeaseChecked: DecodeRooms._lease_checked, Scattered: DecodeRooms._scattered,
    ScatterFailed: DecodeRooms._scatter_failed, CommitRead: DecodeRooms._commit_read,
    AuxRowWritten: DecodeRooms._aux_row_written, Tick: DecodeRooms._tick,
    Release: DecodeRooms._release,
}


def _init_kinds(self: DecodeRooms, e: InitKinds) -> None:
    """KVReceiver.init(kind_units=), checked by the shell: the room's units of its window,
    compressed and state pools kept, its state slot claimed (a failed room's slot is taken back
    once its pages are releasable)."""
    held = {room: (r is None or (r.state.state == KVPoll.Failed and r.pages_releasable))
            for room in self.kinds.draining() for r in (self.rooms.get(room),)}
    self.kinds.claim(e.room.room, e.units, held)


_HANDLERS[InitKinds] = _init_kinds
assert set(_HANDLERS) == set(EVENTS), "every event type of events.py has its handler here"
