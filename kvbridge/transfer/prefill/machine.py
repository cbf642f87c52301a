"""Prefill's room machine: request -> target -> post -> report -> settle, events in, actions out.

One :class:`PrefillRoom` per room (``room.py``), and :class:`PrefillRooms`, the side's machine
that drives them all through one door, ``feed(event)``: the event records and the actions are
``events.py`` (``EVENTS`` lists every type it takes). Each step of the walk is a module of
its own that answers in plain data:

    request   admission.py (a small machine: the connection's ownership proof -> Admitted /
              Refused / actions), then intake.py (binding, first claim, contract, the room's
              state, request_target -> a Refusal, or the Target and its staging offer); a claim
              on a room not yet decided here waits for the decider's RoomTicket (tickets.py)
    target    PrefillRoom.add_target; the registration read off the loop (targets.py: Resolve)
    post      writes.py (the writes in flight: plans -> PostWrite, or StageWrite to staged.py,
              a small machine: chunks, gather slots, grants -> Started / ChunkCounted /
              WriteEnded / actions)
    report    writes.py (a final write -> PagesDone / SendDigested)
    settle    here: final reports, the room's final state, forgetting it once quiet

No socket, thread, lock, clock, engine call, memory touch or callable inside: the
time comes with each event, the aux row's source comes in as plain data (``AuxFrom``), the
pages to digest go out as plain data (``SendDigested``), and an engine's result (a write
posted, refused, final) is an event the shell feeds on its loop's next turn. A staged chunk
larger than one slot is planned in slot-sized groups, one per tick (``later``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.layout import AuxSchema, BufferDesc, OwnerLanes, PoolSpec
from kvbridge.transfer.channel import wire
from kvbridge.transfer.staging.cycle import trace_cycle
from kvbridge.transfer.actions import AbortRoom, CloseRoom, FreeRoom, Send, Shutdown, Tick
from kvbridge.transfer.engine import WriteStatus
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.staging import StagingArea
from kvbridge.transfer.prefill.admission import (Admission, Admitted, Arrived, EchoGiven, Forget, KeyProofGiven,
                                                 NonceWritten, Overdue, Proof, ProofRead, Refused,
                                                 RegistrationRead)
from kvbridge.transfer.prefill.targets import DecodePeer, DecodePeers
from kvbridge.transfer.prefill.events import (EVENTS, Chunk, Closing, EngineInit, Gc, Message, Post, PostFailed,
                                              Posted, ProofReadBack, ReleaseAux, Resolved, Serving, WriteFinal)
from kvbridge.transfer.prefill.staged import (ChunkCounted, ChunkFinal, ChunkPostFailed, ChunkPosted, GrantIn, Prune,
                                              RoomGone, SetMode, Settle, StagedWrites, Started, WriteEnded)
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.prefill.intake import ERROR, HOLD, NOW, REFUSED, Intake, Refusal
from kvbridge.transfer.prefill.tickets import DeciderRead, RegisteredAs, Tickets
from kvbridge.transfer.prefill.writes import Writes, trace_room
from kvbridge.transfer.prefill.kinds import KindWrites, token_page_size
from kvbridge.transfer.prefill.events import KindUnits
from kvbridge.transfer.rooms import Rooms, Stage

log = logging.getLogger(__name__)

_NONE: tuple = ()  # what an event that asks for nothing returns
DEADLINE_SCAN_S = 0.02  # deadlines are checked on this period, not on every step


_BOUND = (wire.TransferRequest, wire.Abort, wire.Ping, wire.RoomTicket, wire.Release)  # what acts for a registration: bound and proven first


class PrefillRooms:
    """The prefill rank's rooms and what drives them: one door, ``feed(event)`` (``EVENTS``,
    ``events.py``), and a few read-only queries for the shell (``busy``, ``writing``,
    ``wants_turn``, ``pending``, ``staging_counters``; ``open`` hands the engine's handle its
    room record)."""

    def __init__(self, config: PrefillConfig, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc],
                 aux_schema: AuxSchema, fingerprint: str, *,
                 digests_readable: bool = True, trace: bool = False, gather: StagingArea | None = None,
                 target_layers: int | None = None, proof_key: ProofKey | None = None) -> None:
        """``target_layers``: the model's target layer count (the contract's; default: one past the
        largest layer id of ``specs``), which places the draft layers of a layer-range send.
        ``proof_key``: the key this rank's room tickets are signed with (``tickets.py``; None: each
        rank decides its rooms alone, as a machine tested on its own)."""
        self.cfg = config
        self.specs = dict(specs)
        self.num_target_layers = target_layers if target_layers is not None else 1 + max(
            (max(s.layer_ids) for s in self.specs.values() if s.layer_ids), default=0)
        # the target layers this rank holds: its pipeline stage's, or all
        self.layer_span = config.pp_layers if config.pp_layers is not None else (0, self.num_target_layers)
        self.trace = trace
        self.lanes = OwnerLanes(config.cp_size, config.lane_rule)
        self.page_size = token_page_size(self.specs)  # the room's page mapping (window pools share it)
        self.rooms: Rooms[PrefillRoom] = Rooms(config.rank_label, "KVSender", "sender(room, wait=...)")
        self.peers = DecodePeers()
        self.endpoint = ""  # our control endpoint as decode ranks dial it (``Serving``)
        self.admission = Admission(config.rank_label, timeout=config.peer_timeout)
        self.intake = Intake(config, self.specs, src_bufs, aux_schema, fingerprint, digests_readable)
        self.tickets = Tickets(config, proof_key)  # one decision per room across the instance's ranks
        self.num_rooms = {"rooms_ok": 0, "rooms_failed": 0}
        self.releases = {"rooms_released": 0, "releases_refused": 0}  # decode needed nothing (wire.Release)
        # staged writes (``staged.py``): ``gather`` is our gather buffer's slots (None: direct only)
        self.stage = StagedWrites(config.staging, gather, config.cp_rank, config.rank_label, tuple(src_bufs),
                                  senders=config.cp_size * config.tp_size * config.pp_size)
        # the writes in flight, direct and staged (``writes.py``)
        # the window, compressed and state pools' share of each write (``kinds.py``)
        self.kinds = KindWrites(self.specs, src_bufs, lanes=self.lanes, cp_rank=config.cp_rank,
                                tp_size=config.tp_size, tp_rank=config.tp_rank, rank=config.rank_label,
                                num_target_layers=self.num_target_layers)
        self.intake.kinds = self.kinds
        self.writes = Writes(self.specs, src_bufs, aux_schema, self.num_target_layers, self.stage,
                             cp_rank=config.cp_rank, rank=config.rank_label, trace=trace, kinds=self.kinds)
        self.dirty: set[int] = set()  # rooms with new chunks or targets: posted and settled at the next tick
        self.later: set[int] = set()  # rooms with a staged chunk's next group to plan: posted at the next tick
        self.next_deadline_scan = 0.0
        self.last_scan = 0.0  # when deadlines were last looked at (a longer gap: this loop was frozen)
        self.closing = False
        self.granted = False  # a RoomTicket left in this event's actions (the room is posted at the Tick)
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
            raise TypeError(f"the prefill room machine does not take {type(event).__name__}")
        handler(self, event)
        out = self._actions()
        if self.trace:
            trace_cycle(self.cfg.rank_label, event, out)
        return out

    # -- read-only queries for the shell ----------------------------------------------

    @property
    def busy(self) -> bool:
        """Some room is not final yet (close() waits for them, bounded)."""
        return any(not r.state.final for r in self.rooms.values())

    @property
    def writing(self) -> bool:
        """Some write is in flight (close() waits for them before it stops the loop)."""
        return len(self.writes) > 0

    @property
    def wants_turn(self) -> bool:
        """A staged chunk's next group waits to be planned: the loop takes its next turn at once."""
        return bool(self.later)

    def pending(self, final: Any = None) -> list[int]:
        """The engine handles of writes in flight (among ``final``, when the engine said which)."""
        return self.writes.pending(final)

    def is_proven(self, ident: bytes) -> bool:
        """Whether connection ``ident`` proved its registration (the channel never displaces it)."""
        c = self.admission.conns.get(ident)
        return c is not None and c.state is Proof.PROVEN

    def knows_rank(self, rank_id: str) -> bool:
        """Whether the registration of decode rank ``rank_id`` has been read here."""
        return self.peers.entries.get(rank_id) is not None

    @property
    def counters(self) -> dict[str, int]:
        """Rooms ok/failed, bytes and slices posted since start."""
        return {**self.num_rooms, **self.releases, "bytes": self.writes.num_bytes, "slices": self.writes.num_slices}

    def staging_counters(self) -> dict[str, int]:
        return dict(self.stage.counters)

    # -- events from the engine -------------------------------------------------

    def open(self, room: int, now: float) -> PrefillRoom:
        """The room for a new KVSender: fresh, or the one a decode rank asked for first."""
        if self.closing:
            raise KVBridgeError("prefill rank is shutting down", room=room, rank=self.cfg.rank_label)
        return self.rooms.open(room, lambda: self._new_room(room, Stage.OPEN, now))

    def _new_room(self, room: int, stage: Stage, now: float) -> PrefillRoom:
        return PrefillRoom(room, self.cfg.cp_rank, self.lanes, self.page_size, stage, now=now,
                           pp=(self.cfg.pp_rank, self.cfg.pp_size), layer_span=self.layer_span)

    def _engine_init(self, e: EngineInit) -> None:
        e.room.engine_init(e.num_tokens, e.num_pages, e.first_page, e.binding)
        self._post_and_settle(e.room, e.now)  # a rank with nothing to send completes here if decode asked

    def _chunk(self, e: Chunk) -> None:
        """Queue a checked chunk (raises, keeping nothing, when it is bad); ``Post`` sends it."""
        e.room.add_chunk(e.logical, e.local, e.num_tokens_ready, e.is_last, e.aux_row, e.aux_slot, e.ready_event,
                         e.layers)

    def _post(self, e: Post) -> None:
        """Post what the room has queued to the decode ranks that asked (from the engine's thread
        in send(): no loop turn)."""
        if e.aux is not None:
            e.room.aux_from = e.aux
        self._post_and_settle(e.room, e.now)

    def _abort(self, e: AbortRoom) -> None:
        if not e.room.state.final:
            self.fail_room(e.room, e.reason, e.now)

    def _close(self, e: CloseRoom) -> None:
        """The engine let go of the room: fail it if unfinished; forget it once quiet."""
        r = e.room
        if self.rooms.close(r):
            if not r.state.final:
                self.fail_room(r, f"the engine closed room {r.room}'s sender on {self.cfg.rank_label} before it "
                                  "finished", e.now)
            self._forget_if_quiet(r, e.now)

    def _shutdown(self, e: Shutdown) -> None:
        """Fail every room (the endpoint closes; ``Closing`` already refuses new ones)."""
        for r in list(self.rooms.values()):
            self.fail_room(r, e.reason, e.now)

    # -- messages from decode ranks ---------------------------------------------

    def _message(self, e: Message) -> None:
        """A message on connection ``ident`` (or the channel's error for a bad one)."""
        ident, msg, said, now = e.ident, e.msg, e.hello, e.now
        self.peers.heard_from(ident, now)  # any message: the decode rank is alive
        if isinstance(msg, _BOUND):  # delivered, refused, or held until the connection proves its registration
            self._admit(self.admission.feed(Arrived(ident, msg, said, self.peers.get(said) if said else None, now)),
                        now)
        else:
            self._dispatch(ident, msg, now)

    def _dispatch(self, ident: bytes, msg: Any, now: float) -> None:
        if isinstance(msg, wire.TransferRequest):  # the room's path: checked, planned and posted now
            self.granted = False
            self._on_request(ident, msg, now)
            if self.granted:  # the decider: its ticket goes out first; the room is planned and posted at
                self.granted = False  # this turn's Tick, while the other ranks' wait for the ticket runs
                return
            self._pump(now)
        elif isinstance(msg, wire.SlotGrant):
            self._stage(self.stage.feed(GrantIn(ident, msg)), now)
        elif isinstance(msg, KVBridgeError):
            log.warning("bad control message from %r: %s", ident, msg)
            # the channel counted it (stats.malformed / unauthenticated) and replied or dropped it
        elif isinstance(msg, wire.Ping):
            self._out.append(Send((ident,), wire.Heartbeat(cp_rank=self.cfg.cp_rank, seq=msg.seq)))
        elif isinstance(msg, wire.Abort):
            self._on_abort(ident, msg, now)
        elif isinstance(msg, wire.RoomTicket):
            self._on_ticket(ident, msg, now)
        elif isinstance(msg, wire.Release):
            self._on_release(ident, msg, now)
        elif isinstance(msg, wire.KeyProof):
            peer = self._proving(ident)
            self._admit(self.admission.feed(KeyProofGiven(ident, msg, peer, self.endpoint, now)), now)
        elif isinstance(msg, wire.ChallengeEcho):
            self._admit(self.admission.feed(EchoGiven(ident, msg, self._proving(ident), now)), now)
        else:
            self._error(ident, msg, f"a prefill rank does not accept {type(msg).__name__}")

    def _proving(self, ident: bytes) -> DecodePeer | None:
        """The registration connection ``ident`` is proving, as known here (None: none, or not read)."""
        rank_id = self.admission.rank_of(ident)
        return None if rank_id is None else self.peers.get(rank_id)

    def _error(self, ident: bytes, msg: Any, reason: str) -> None:
        """Refuse ``msg`` with an ErrorReply. A refused request leaves only once nothing of its room
        is in flight: decode frees a room's pages on it, for every rank of its instance (hard rule 6)."""
        room = getattr(msg, "room", None)
        reply = wire.ErrorReply(ref_type=msg.TAG, room=room, reason=reason)
        if isinstance(msg, wire.TransferRequest):
            self._reply_when_quiet(room, ident, reply)
        else:
            self._out.append(Send((ident,), reply))

    # -- who is on a connection (prefill/admission.py) -----------------------------

    def _admit(self, out: list[Any], now: float) -> None:
        """Carry out what the admission machine answered: deliver, refuse, or pass on."""
        for a in out:
            if type(a) is Admitted:
                self._dispatch(a.ident, a.msg, now)
            elif type(a) is Refused:
                if isinstance(a.msg, wire.Release):  # a release from a connection that is not its registration
                    self.releases["releases_refused"] += 1
                self._error(a.ident, a.msg, a.why)
            else:
                self._out.append(a)

    def _instance_of(self, ident: bytes, rank_id: str) -> str | None:
        """The decode instance registration ``rank_id`` belongs to (kept with the connection that
        proved it, so a registration evicted from the cache still answers)."""
        instance = self.admission.instance_of(ident, rank_id)
        if instance is not None:
            return instance
        peer = self.peers.get(rank_id)
        return peer.instance if peer is not None else None

    def _proof_read(self, e: ProofReadBack) -> None:
        """The shell's answer to a ``ReadProof``: the bytes read, or why not (admission checks them)."""
        self._admit(self.admission.feed(ProofRead(e.ident, e.data, e.problem, self._proving(e.ident), self.endpoint,
                                                  e.now)), e.now)

    def _resolved(self, e: Resolved) -> None:
        """The daemon's answer to a ``Resolve``: the requests that waited are delivered or refused.
        ``by_read``: our engine reads the registration's session (its memory is proven by read)."""
        rank_id, now = e.rank_id, e.now
        waiters, problem = self.peers.resolved(rank_id, e.detail, e.problem, e.engine_kind, e.by_read)
        self._admit(self.admission.feed(RegistrationRead(rank_id, self.peers.get(rank_id), problem, now)), now)
        for ident, req in waiters:
            if problem is None:
                self._deliver(ident, req, now)
            else:
                self._refuse(ident, req, problem, now)

    def _on_request(self, ident: bytes, req: wire.TransferRequest, now: float, held: bool = False) -> None:
        """A decode rank asks for a room: checked (``intake.py``), then delivered now or once its
        registration is read (``Resolved``). ``held``: a claim that waited for the room's decision
        (``tickets.py``), taken up again (traced when it came)."""
        if self.trace and not held:
            log.info("trace room=%d rank=%s @%.6f request from %s pages=%d", req.room, self.cfg.rank_label, now,
                     req.decode_rank, len(req.page_ids) // 4)
        if self.closing:
            self._reply_failed(ident, req.room, f"prefill rank {self.cfg.rank_label} is shutting down")
            return
        refusal = self._claim(ident, req) or self.intake.contract(req)
        if refusal is not None:
            self._answer(ident, req, refusal, now)
        elif self.peers.get(req.decode_rank_id) is None:
            self._wait_for_peer(ident, req, now)  # its registration is read off the loop, then delivered
        else:
            self._deliver(ident, req, now)

    def _wait_for_peer(self, ident: bytes, req: wire.TransferRequest, now: float) -> None:
        ask = self.peers.wait_for(ident, req)
        if ask is False:
            self._refuse(ident, req, f"{self.peers.max_waiting} requests already wait for decode registrations", now)
        elif ask is not None:
            self._out.append(ask)

    def _deliver(self, ident: bytes, req: wire.TransferRequest, now: float) -> None:
        """A request whose decode registration is known: checked into a Target of its room."""
        peer = self.peers.get(req.decode_rank_id)
        if peer is None:  # evicted meanwhile: read it again
            self._wait_for_peer(ident, req, now)
            return
        r = self.rooms.get(req.room)
        if r is None:
            closed = self.rooms.tombstones.get(req.room)
            if closed is not None:
                self._answer(ident, req, self.intake.closed(req, closed), now)
                return
            r = self.rooms.add_unattached(self._new_room(req.room, Stage.UNATTACHED, now))
        answer = self._claim(ident, req) or self.intake.target(ident, req, r, peer, now)
        if isinstance(answer, Refusal):
            self._answer(ident, req, answer, now)
            return
        target, offer = answer
        r.add_target(target, req.binding, now)
        ticket = self.tickets.grant(r.room, req.decode_rank_id, r.holder, r.claimed_binding) if r.holder else None
        if ticket is not None:  # the decider: this claim's instance holds the room on every rank of the column
            self._out.append(Send((ident,), ticket))
            self.granted = True
        self.stage.offered(req.room, req.decode_rank, offer, now)
        self.dirty.add(r.room)
        if self.trace:
            trace_room(r, self.cfg.rank_label, now, "target %s pages=%d first_page=%d pools=%s", req.decode_rank,
                       target.dst_pages.size, target.first_page, ",".join(target.pools))

    def _claim(self, ident: bytes, req: wire.TransferRequest) -> Refusal | None:
        """The request presents its room's binding, then claims the room: first claim wins at the
        room's decider; elsewhere the claim waits for its decision (``tickets.py``)."""
        r = self.rooms.get(req.room)
        if self.tickets.waits(None if r is None else r.holder, self.rooms.tombstones.get(req.room) is not None):
            return self.intake.bound(r, req) or Refusal(HOLD, "")
        return self.intake.bound(r, req) or self.intake.claim(r, self._instance_of(ident, req.decode_rank_id), req)

    def _answer(self, ident: bytes, req: wire.TransferRequest, refusal: Refusal, now: float) -> None:
        """Answer a request the intake refused, as ``refusal.how`` says (``intake.py``)."""
        if refusal.how == NOW:
            log.warning("%s", refusal.reason)
            self._out.append(Send((ident,), wire.ErrorReply(ref_type=req.TAG, room=req.room, reason=refusal.reason)))
        elif refusal.how == ERROR:
            self._error(ident, req, refusal.reason)
        elif refusal.how == REFUSED:
            self._refuse(ident, req, refusal.reason, now)
        elif refusal.how == HOLD:
            instance = self._instance_of(ident, req.decode_rank_id) or ""
            if not self.tickets.hold(ident, req, instance, now):
                self._reply_failed(ident, req.room, f"{self.tickets.max_held} claims already wait on prefill rank "
                                                    f"{self.cfg.rank_label} for their rooms' decisions")
                return
            early = self.tickets.unpark(req.room, instance)  # a sibling decode rank's ticket came first
            if early is not None:
                self._ticket_checked(early[0], early[1], self.tickets.check(*early), now)
        else:
            self._reply_failed(ident, req.room, refusal.reason)

    def _refuse(self, ident: bytes, req: wire.TransferRequest, reason: str, now: float) -> None:
        """Refuse a request (nothing of it was posted) and fail its room here."""
        r = self.rooms.get(req.room)
        if r is not None and not r.state.final and r.held_by(self._instance_of(ident, req.decode_rank_id)):
            self.fail_room(r, f"decode rank {req.decode_rank}'s request refused: {reason}", now)
        self._reply_failed(ident, req.room, reason)

    def _on_abort(self, ident: bytes, msg: wire.Abort, now: float) -> None:
        """A decode rank aborts: its target (if any) stops, and so does the room for every decode
        rank, since a decode instance's TP ranks give up a request together. The ack waits until
        nothing of the room is in flight (``_reply_when_quiet``)."""
        r = self.rooms.get(msg.room)
        instance = self._instance_of(ident, msg.decode_rank_id)
        if self.tickets.waits(None if r is None else r.holder, False):  # not decided here: it withdraws its claims
            self.tickets.withdraw(msg.room, instance)
            self._reply_when_quiet(msg.room, ident, wire.AbortAck(room=msg.room, cp_rank=self.cfg.cp_rank))
            return
        refusal = None if r is None else self.intake.abort(r, instance, msg)
        if refusal is not None:
            self._error(ident, msg, refusal.reason)
            return
        t = r.targets.get(msg.decode_rank) if r else None
        if t is not None and not t.closed:
            t.abort_reason = t.abort_reason or msg.reason or "aborted by decode"
            self.fail_room(r, f"decode rank {msg.decode_rank} aborted: {t.abort_reason}", now)
            return  # settle() acks once the room is quiet
        # a bound room nobody claimed is not another request's to end (its refused claim aborts too)
        if r is not None and not r.state.final and (r.holder is not None or not r.binding):
            self.fail_room(r, f"decode rank {msg.decode_rank} aborted: {msg.reason or 'aborted by decode'}", now)
        self._reply_when_quiet(msg.room, ident, wire.AbortAck(room=msg.room, cp_rank=self.cfg.cp_rank))

    # -- one decision per room (tickets.py) ----------------------------------------

    def _on_ticket(self, ident: bytes, t: wire.RoomTicket, now: float) -> None:
        """A decode rank hands on its room's ticket (on its own proven connection, admission.py)."""
        instance = self._instance_of(ident, t.decode_rank_id)
        if instance != t.instance:
            self._error(ident, t, f"a RoomTicket for decode instance {t.instance} came from a connection of decode "
                                  f"instance {instance}: an instance hands on its own tickets only; nothing done")
            return
        verdict = self.tickets.check(ident, t)
        if verdict is None:  # no claim of its instance waits here (yet): kept for one, if undecided here
            r = self.rooms.get(t.room)
            if self.tickets.waits(None if r is None else r.holder, self.rooms.tombstones.get(t.room) is not None):
                self.tickets.park(ident, t, now)
            return
        self._ticket_checked(ident, t, verdict, now)

    def _ticket_checked(self, ident: bytes, t: wire.RoomTicket, verdict: Any, now: float) -> None:
        if verdict is True:
            self._decide(t, now)
        elif isinstance(verdict, str):  # refused: the instance's claims that waited on it are refused too
            reason = f"prefill rank {self.cfg.rank_label} refused a RoomTicket: {verdict}; nothing written"
            self._error(ident, t, reason)
            for h in self.tickets.withdraw(t.room, t.instance):
                self._reply_failed(h.ident, t.room, reason)
        elif verdict is not None and verdict is not False:
            self._out.append(verdict)  # ReadDecider: checked once the decider's key is read

    def _decider_read(self, e: DeciderRead) -> None:
        waiting, problem = self.tickets.decider_read(e)
        for ident, t in waiting:
            self._ticket_checked(ident, t, problem if problem is not None else self.tickets.check(ident, t), e.now)

    def _decide(self, t: wire.RoomTicket, now: float) -> None:
        """The decider's ticket: ``t.instance`` holds the room here; the held claims go on (its
        own) or are refused by name (every other instance's)."""
        r = self.rooms.get(t.room)
        if r is None and self.rooms.tombstones.get(t.room) is None:
            r = self.rooms.add_unattached(self._new_room(t.room, Stage.UNATTACHED, now))
        if r is not None and r.holder is None:
            r.claim(t.instance, t.decode_rank)
            if t.binding and r.claimed_binding is None:
                r.claimed_binding = t.binding  # the winning claim's digest: the engine's init() must agree
        if self.trace:
            log.info("trace room=%d rank=%s @%.6f decided for %s by %s", t.room, self.cfg.rank_label, now, t.instance,
                     t.decider)
        self.tickets.unpark(t.room, None)  # decided: tickets that came early for it are moot
        for h in self.tickets.take(t.room):
            self._on_request(h.ident, h.req, now, held=True)
        self._pump(now)

    def _undecided(self, now: float) -> None:
        """Held claims whose room ended here, or that no decision reached in time, are refused;
        early tickets that no claim followed in time are dropped."""
        self.tickets.expire(now, self.cfg.target_timeout)
        for room in list(self.tickets.held):
            r, closed = self.rooms.get(room), self.rooms.tombstones.get(room)
            if r is not None and r.state.final:
                why = f"room {room} ended on prefill rank {self.cfg.rank_label} ({r.state.reason or r.state.state.name})"
            elif r is None and closed is not None:
                why = f"room {room} was closed on prefill rank {self.cfg.rank_label} ({closed})"
            elif room in self.tickets.overdue(now, self.cfg.target_timeout):
                why = (f"no decision on room {room} reached prefill rank {self.cfg.rank_label} within "
                       f"{self.cfg.target_timeout:.1f}s: its decider {self.tickets.decider_label} granted this claim's "
                       "decode instance no RoomTicket; nothing written")
            else:
                continue
            for h in self.tickets.take(room):
                self._reply_failed(h.ident, room, why)

    def _registered_as(self, e: RegisteredAs) -> None:
        self.tickets.rank_id = e.rank_id
    def _on_release(self, ident: bytes, msg: wire.Release, now: float) -> None:
        """A decode instance needs nothing of the room (``wire.Release``): it ends now, Success with
        nothing written (the engine frees its pages at once), when the release presents the room's
        binding from the instance that may claim it; refused (ErrorReply) and counted otherwise. A
        room its ranks already asked for fails instead (acked to them once quiet, hard rule 6);
        one already ended, or closed, is left as it is (another rank of the instance released it)."""
        r = self.rooms.get(msg.room)
        if r is None and self.rooms.tombstones.get(msg.room) is not None:
            return
        refusal = self.intake.release(r, self._instance_of(ident, msg.decode_rank_id), msg)
        if refusal is not None:
            self.releases["releases_refused"] += 1
            log.warning("%s (%d refused so far)", refusal.reason, self.releases["releases_refused"])
            self._error(ident, msg, refusal.reason)
            return
        if r.state.final:
            return
        why = f"decode rank {msg.decode_rank} released the room: {msg.reason or 'it needs nothing'}"
        r.released = why
        if r.targets:
            self.fail_room(r, why, now)
            return
        r.state.advance_to(KVPoll.Success, now=now)
        self._out.append(ReleaseAux(r.room))
        self.releases["rooms_released"] += 1
        if self.trace:
            log.info("room %d on %s: %s", r.room, self.cfg.rank_label, why)
        self._forget_if_quiet(r, now)

    def _reply_failed(self, ident: bytes, room: int, reason: str) -> None:
        log.warning("room %d refused on %s: %s", room, self.cfg.rank_label, reason)
        self._reply_when_quiet(room, ident, wire.PagesDone(room=room, cp_rank=self.cfg.cp_rank, status="failed",
                                                           reason=reason, pools=[], logical_pages=b"", digests=None))

    def _reply_when_quiet(self, room: int, ident: bytes, msg: wire.PagesDone | wire.AbortAck | wire.ErrorReply) -> None:
        """Send a failure report or abort ack once no write of ``room`` is in flight to *any* decode
        rank. Either one tells the decode rank it may free the room's pages (hard rule 6), and the
        TP ranks of a decode instance free together (SGLang all-reduces their poll states with
        MIN): one rank's go-ahead must mean no write can land in another's pages either."""
        r = self.rooms.get(room)
        if r is None or not r.reply_when_quiet(ident, msg):
            self._out.append(Send((ident,), msg))

    def _flush_replies(self, r: PrefillRoom) -> None:
        self._out.extend(Send((ident,), msg) for ident, msg in r.quiet_replies())

    # -- posting and collecting -------------------------------------------------

    def _pump(self, now: float) -> None:
        """Post and settle the rooms something happened to since the last step (O(events),
        not O(rooms): a rank with 1,000 rooms in flight does not rescan them per message)."""
        while self.dirty:
            r = self.rooms.get(self.dirty.pop())
            if r is not None:
                self._post_and_settle(r, now)

    def _post_and_settle(self, r: PrefillRoom, now: float) -> None:
        self._post_room(r, now)
        self._settle(r, now)

    def _post_room(self, r: PrefillRoom, now: float) -> None:
        """Every queued chunk (and the aux row) to every active target (``writes.py``)."""
        if r.state.final or not r.length_known:
            return
        out, more = self.writes.post(r)
        if more:
            self.later.add(r.room)  # one staged group started: the next is planned on the next tick
        self._stage(out, now)
        if r.state.state == KVPoll.WaitingForInput and any(t.posted or t.aux_posted or t.inflight
                                                           for t in r.targets.values()):
            r.state.to(KVPoll.Transferring, now=now)

    def _stage(self, out: list[Any], now: float) -> None:
        """Carry out what the staged-writes machine answered: book, report, or pass on."""
        for a in out:
            kind = type(a)
            if kind is WriteEnded:
                self._write_done(a.write, WriteStatus.DONE if a.ok else WriteStatus.failed(a.reason), now)
            elif kind is ChunkCounted or kind is Started:
                self.writes.counted(a)
            else:
                self._out.append(a)

    def _chunk_posted(self, e: ChunkPosted) -> None:
        """The shell gathered chunk ``a`` and submitted its wire pieces: the engine's ``handle``."""
        self.writes.chunk_posted(e)
        self._stage(self.stage.feed(e), e.now)

    def _posted(self, e: Posted) -> None:
        """The shell submitted write ``a``: the engine's ``handle`` reports it."""
        self.writes.posted(e)

    def _post_failed(self, e: PostFailed) -> None:
        """Write ``a`` was refused at submission, or not submitted: nothing of it is in flight."""
        r = self.writes.failed(e.action.write, e.reason)
        self._settle(r, e.now)
        self._forget_if_quiet(r, e.now)

    def _write_final(self, e: WriteFinal) -> None:
        """A posted write is done or failed: report it (one report per write)."""
        w = self.writes.take(e.handle)
        if w is None:
            return
        if self.stage.holds(w):
            self._stage(self.stage.feed(ChunkFinal(w, e.handle, e.status)), e.now)
        else:
            self._write_done(w, e.status, e.now)

    def _write_done(self, w: int, status: WriteStatus, now: float) -> None:
        """Write ``w`` (direct, or every chunk of a staged one) is final: its report, then settle."""
        r, report = self.writes.end(w, status, now)
        self._out.extend(report)
        self._settle(r, now)
        self._forget_if_quiet(r, now)

    def _settle(self, r: PrefillRoom, now: float) -> None:
        """Send final reports and move the room to its final state. A failure report or abort ack
        goes out only once nothing of the room is in flight to any decode rank (see
        ``_reply_when_quiet``)."""
        if any(not t.active and t.inflight for t in r.targets.values()):
            for w in [w for t in r.targets.values() if not t.active for w in t.inflight]:
                if self.stage.holds(w):
                    self._stage(self.stage.feed(Settle(w)), now)  # (re-enters _settle once it ends)
        quiet = not r.num_inflight
        for t in r.targets.values():
            if t.closed or not quiet and not t.active or t.inflight:
                continue
            if t.abort_reason is not None:
                self._out.append(Send((t.ident,), wire.AbortAck(room=r.room, cp_rank=self.cfg.cp_rank)))
                t.closed = True
            elif t.failure is not None:
                self._out.append(Send((t.ident,), wire.PagesDone(
                    room=r.room, cp_rank=self.cfg.cp_rank, status="failed", reason=t.failure, pools=[],
                    logical_pages=b"", digests=None)))
                t.closed = True
            elif r.target_complete(t):
                t.closed = True
        if not quiet:
            return
        self._flush_replies(r)
        if r.state.final:
            return
        failures = [t.failure or f"decode rank {t.decode_rank} aborted: {t.abort_reason}"
                    for t in r.targets.values() if not t.active]
        if failures:
            r.state.to(KVPoll.Failed, failures[0], now=now)
        elif (r.num_expected_targets is not None and len(r.targets) >= r.num_expected_targets
              and all(r.target_complete(t) for t in r.targets.values())):
            r.state.advance_to(KVPoll.Success, now=now)
        else:
            return
        self._out.append(ReleaseAux(r.room))
        self.num_rooms["rooms_ok" if r.state.state == KVPoll.Success else "rooms_failed"] += 1
        if self.trace or r.state.state == KVPoll.Failed:
            log.log(logging.INFO if r.state.state == KVPoll.Success else logging.WARNING,
                    "room %d on %s: %s %s", r.room, self.cfg.rank_label, r.state.state.name, r.state.reason or "")

    def fail_room(self, r: PrefillRoom, reason: str, now: float) -> None:
        """Stop posting; the room turns Failed once nothing of it is in flight."""
        for t in r.targets.values():
            if t.active:
                t.failure = reason
        if not r.targets and not r.state.final:
            r.state.to(KVPoll.Failed, reason, now=now)
            self._out.append(ReleaseAux(r.room))
            self.num_rooms["rooms_failed"] += 1
        else:
            self._settle(r, now)

    def _forget_if_quiet(self, r: PrefillRoom, now: float) -> None:
        """Close a room no handle holds once it is final and quiet. One decode asked for first
        that failed before the engine attached stays ``target_timeout`` longer, so that the
        engine's sender() still finds it and reads why."""
        if not r.state.final or r.num_inflight or r.life.stage not in (Stage.UNATTACHED, Stage.DRAINING):
            return
        if r.life.stage == Stage.UNATTACHED and r.state.since(now) < self.cfg.target_timeout:
            return
        self._flush_replies(r)
        self.tickets.forget(r.room)
        self.rooms.forget(r, now, tombstone=True)
        self._stage(self.stage.feed(RoomGone(r.room)), now)
        self.kinds.forget(r.room)
        self._out.append(FreeRoom(r.room))  # sender(room, wait=...) may open it now

    # -- the clock --------------------------------------------------------------

    def _tick(self, e: Tick) -> None:
        """Post what events queued (and the next group of each staged chunk started in groups);
        every ``DEADLINE_SCAN_S``, deadlines and silent peers."""
        now = e.now
        if self.later:
            self.dirty |= self.later
            self.later.clear()
        self._pump(now)
        if now >= self.next_deadline_scan:
            gap = now - self.last_scan if self.last_scan else 0.0
            # (half the shorter of the two deadlines a gap could wrongly run out: a peer's silence, or a
            # room's decode ranks asking and its decision coming)
            frozen = gap > min(self.cfg.peer_timeout, self.cfg.target_timeout) / 2
            self.last_scan, self.next_deadline_scan = now, now + DEADLINE_SCAN_S
            if frozen:  # this loop itself did not run (a starved process, a loaded host): it heard nothing
                # because it listened to nothing, so no peer is blamed for the gap, and what arrived
                # meanwhile is read before any deadline is looked at again
                for ident, heard in self.peers.heard.items():
                    self.peers.heard[ident] = max(heard, now)
                # nor is a room's decode rank blamed for not asking yet: its request may be unread here,
                # or not sent (a loaded host starves it too): target_timeout counts again from now
                for r in self.rooms.values():
                    r.asked_since = max(r.asked_since, now)
                # nor is the decider blamed for a RoomTicket that may sit unread in this rank's socket
                self.tickets.restart(now)
                log.warning("prefill rank %s: its loop did not run for %.1fs (a starved process?): no peer blamed",
                            self.cfg.rank_label, gap)
            else:
                self._deadlines(now)

    def _deadlines(self, now: float) -> None:
        self._admit(self.admission.feed(Overdue(now)), now)
        if self.tickets.held or self.tickets.early:
            self._undecided(now)
        for r in list(self.rooms.values()):
            if r.state.final:
                continue
            if r.state.state == KVPoll.Bootstrapping and now - r.asked_since > self.cfg.target_timeout:
                asked = f"only {len(r.targets)} of {r.num_expected_targets}" if r.targets else "no"
                self.fail_room(r, f"{asked} decode ranks asked for room {r.room} within {self.cfg.target_timeout:.1f}s",
                               now)
            for t in r.targets.values():
                if t.active and not t.closed:  # (active: no failure yet)
                    t.failure = t.overdue(self.peers.silent_for(t.ident, now, t.created), self.cfg.peer_timeout, now)
            self._settle(r, now)
            self._forget_if_quiet(r, now)

    def _gc(self, e: Gc) -> None:
        """Forget quiet rooms no handle holds; prune tombstones and silent connections."""
        now = e.now
        for room in list(self.rooms.unowned):
            r = self.rooms.get(room)
            if r is None:
                self.rooms.unowned.discard(room)
            else:
                self._forget_if_quiet(r, now)
        self.rooms.tombstones.prune(now)
        self._stage(self.stage.feed(Prune(frozenset(self.rooms), now, 2 * self.cfg.target_timeout)), now)
        in_use = {t.ident for r in self.rooms.values() for t in r.targets.values() if not t.closed}
        self.peers.prune(now, in_use, horizon=10 * self.cfg.peer_timeout)
        self._admit(self.admission.feed(Forget(frozenset(self.peers.heard))), now)

    def _pass_on(self, e: Any) -> None:
        """An event for a small machine of its own that the room machine only passes on."""
        if type(e) is NonceWritten:
            self._admit(self.admission.feed(e), e.now)
        else:
            self._stage(self.stage.feed(e), getattr(e, "now", 0.0))

    def _serving(self, e: Serving) -> None:
        self.endpoint = e.endpoint

    def _closing(self, e: Closing) -> None:
        self.closing = True


_HANDLERS: dict[type, Callable[[PrefillRooms, Any], None]] = {
    Serving: PrefillRooms._serving, Closing: PrefillRooms._closing, EngineInit: PrefillRooms._engine_init,
    Chunk: PrefillRooms._chunk, Post: PrefillRooms._post, AbortRoom: PrefillRooms._abort,
    CloseRoom: PrefillRooms._close, Shutdown: PrefillRooms._shutdown, Message: PrefillRooms._message,
    Resolved: PrefillRooms._resolved, NonceWritten: PrefillRooms._pass_on, ProofReadBack: PrefillRooms._proof_read,
    Posted: PrefillRooms._posted, PostFailed: PrefillRooms._post_failed, ChunkPosted: PrefillRooms._chunk_posted,
    ChunkPostFailed: PrefillRooms._pass_on, WriteFinal: PrefillRooms._write_final, SetMode: PrefillRooms._pass_on,
    Tick: PrefillRooms._tick, Gc: PrefillRooms._gc,
    RegisteredAs: PrefillRooms._registered_as, DeciderRead: PrefillRooms._decider_read,
}


def _kind_units(self: PrefillRooms, e: KindUnits) -> None:
    """The engine's units of the room's compressed, state and ring pools (checked; raises,
    keeping nothing, when they are bad)."""
    self.kinds.engine_units(e.room.room, e.units)


_HANDLERS[KindUnits] = _kind_units
assert set(_HANDLERS) == set(EVENTS), "every event type of events.py has its handler here"
