"""Prefill's rooms as a state machine: events in, actions out.

One :class:`PrefillRoom` per room, and :class:`PrefillRooms`, the side's machine that
drives them all. Events are method calls (open, engine init, chunk, message from a decode
rank, registration resolved, write posted / failed to post, write final, abort, close,
tick, gc); each returns the actions for the endpoint's shell to carry out, in order
(``Send``, ``SendDigested``, ``PostWrite``, ``Gather``, ``PostChunk``, ``Resolve``, ``ReleaseAux``,
``FreeRoom``). No socket, thread, lock, clock, engine call or memory touch inside, and no
callback into memory (``hello_of`` and ``engine_kind`` read the channel's and the engine's
books): the time is passed in, the aux row's source comes in as plain data
(``AuxFrom``, with ``post``), and the pages to digest go out as plain data
(``SendDigested``): the shell does every memory touch. An engine's result (a write
posted, refused, final) is an event the shell feeds on its loop's next turn, never a call
back into the machine from inside a post.

A staged chunk larger than one slot is planned and staged in slot-sized groups of pages, one
group per tick (``later``), so its first gather starts after one group's planning.

The rooms themselves (chunks, held pages, targets) are ``room.py``; a connection's
identity proof ``admission.py`` (a machine of its own); staged writes ``staged.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.layout import AuxSchema, BufferDesc, OwnerLanes, PoolSpec, layer_range_specs
from kvbridge.layout.plan import TransferPlan
from kvbridge.transfer.channel import wire
from kvbridge.transfer.actions import FreeRoom, Send
from kvbridge.transfer.aux_rows import RegionAddr, aux_slices
from kvbridge.transfer.engine import WriteState, WriteStatus
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.staging import StagingArea
from kvbridge.transfer.prefill.admission import (
    Admission,
    Admitted,
    Arrived,
    EchoGiven,
    Forget,
    KeyProofGiven,
    NonceWritten,
    Overdue,
    ProofRead,
    Refused,
    RegistrationRead,
)
from kvbridge.transfer.prefill.peers import DecodePeer, DecodePeers, Resolve
from kvbridge.transfer.prefill.staged import PostChunk, StagedWrite, StagedWrites, registered_offer
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.prefill.targets import Target, plan_target, target_from_request
from kvbridge.transfer.rooms import Rooms, Stage

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)
_NONE: tuple = ()  # what an event that asks for nothing returns
DEADLINE_SCAN_S = 0.02  # deadlines are checked on this period, not on every step
GROUP_MIN_SLICES = 4096  # a staged chunk's first group has at least this many slices (see _group_pages)
ALIGN_SLACK = 16  # per slice: stage_plan aligns each slice's slot offset to 16 bytes


@dataclass(frozen=True, slots=True)
class PostWrite:
    """Submit write ``write`` (the machine's id) of room ``room`` to ``target`` (its session):
    ``src``/``dst``/``length`` slices, after the events ``after``. Answer with
    ``PrefillRooms.posted(action, handle, now)``, or ``post_failed(action, reason, now)``; a
    write of a target that failed meanwhile is not submitted (``post_failed(action, None)``)."""

    write: int
    room: int
    target: Target
    session: str
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    after: Any


@dataclass(frozen=True, slots=True)
class AuxFrom:
    """Where a room's aux row is written from (the shell staged it, or it is a slot of the
    engine's own registered rows): the rows' regions, the slot, the packed row base (None: by
    region), and the events the row's write waits on besides the chunk's (None: none)."""

    regions: Mapping[str, RegionAddr]
    slot: int
    row_base: int | None = None
    after: Any = None


@dataclass(frozen=True, slots=True)
class SendDigested:
    """Send ``msg`` (a PagesDone) to connection ``to`` with ``digests`` filled in: the digests
    of ``pages`` (logical) held in our ``local`` pages of ``pools``, over ``num_tokens``."""

    to: bytes
    msg: wire.PagesDone
    pools: tuple[str, ...]
    pages: np.ndarray
    local: np.ndarray
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ReleaseAux:
    """The room is final: its aux staging slot may be reused."""

    room: int


_BOUND = (wire.TransferRequest, wire.Abort, wire.Ping)  # what acts for a registration: bound and proven first


class PrefillRooms:
    """The prefill rank's rooms and what drives them. ``hello_of(connection)``: the
    registration the connection named in its Hello (None: none), a read of the channel's
    books (no memory); ``endpoint()``: our control endpoint, as decode ranks dial it (what their
    KeyProofs sign)."""

    def __init__(self, config: PrefillConfig, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc],
                 aux_schema: AuxSchema, fingerprint: str, *,
                 hello_of: Callable[[bytes], str | None] = lambda ident: None, digests_readable: bool = True,
                 trace: bool = False, gather: StagingArea | None = None,
                 engine_kind: Callable[[str], str] = lambda session: "local",
                 endpoint: Callable[[], str] = lambda: "", target_layers: int | None = None) -> None:
        """``target_layers``: the model's target layer count (the contract's; default: one past the
        largest layer id of ``specs``), which places the draft layers of a layer-range send."""
        self.cfg = config
        self.specs = dict(specs)
        self.num_target_layers = target_layers if target_layers is not None else 1 + max(
            (max(s.layer_ids) for s in self.specs.values() if s.layer_ids), default=0)
        # the target layers this rank holds: its pipeline stage's, or all
        self.layer_span = config.pp_layers if config.pp_layers is not None else (0, self.num_target_layers)
        self._cut_specs: dict[tuple[int, int], dict[str, PoolSpec]] = {}  # layer range -> its pools' cut
        self.src_bufs = src_bufs
        self.aux_schema = aux_schema
        self.fingerprint = fingerprint
        self.digests_readable = digests_readable
        self.trace = trace
        self.lanes = OwnerLanes(config.cp_size, config.lane_rule)
        self.page_size = next(iter(self.specs.values())).page_size
        self.rooms: Rooms[PrefillRoom] = Rooms(config.rank_label, "KVSender", "sender(room, wait=...)")
        self.peers = DecodePeers()
        self.hello_of = hello_of
        self.endpoint = endpoint
        self.admission = Admission(config.rank_label, timeout=config.peer_timeout)
        self.writes: dict[int, tuple[PrefillRoom, Target]] = {}  # write id -> its room and target (in flight)
        self.handles: dict[int, int] = {}  # engine handle -> write id
        self.next_write = 0
        self.counters = {"rooms_ok": 0, "rooms_failed": 0, "bytes": 0, "slices": 0}
        # staged writes (``staged.py``): ``gather`` is our gather buffer's slots (None: direct only)
        self.stage = StagedWrites(config.staging, gather, engine_kind, config.cp_rank, config.rank_label)
        self.dirty: set[int] = set()  # rooms with new chunks or targets: posted and settled at the next tick
        self.later: set[int] = set()  # rooms with a staged chunk's next group to plan: posted at the next tick
        self.next_deadline_scan = 0.0
        self.closing = False
        self._out: list[Any] = []

    def _actions(self) -> list[Any] | tuple:
        if not self._out:
            return _NONE
        out, self._out = self._out, []
        return out

    @property
    def busy(self) -> bool:
        """Some room is not final yet."""
        return any(not r.state.final for r in self.rooms.values())

    # -- events from the engine -------------------------------------------------

    def open(self, room: int, now: float) -> PrefillRoom:
        """The room for a new KVSender: fresh, or the one a decode rank asked for first."""
        if self.closing:
            raise KVBridgeError("prefill rank is shutting down", room=room, rank=self.cfg.rank_label)
        return self.rooms.open(room, lambda: PrefillRoom(room, self.cfg.cp_rank, self.lanes, self.page_size, now=now,
                                                            pp=(self.cfg.pp_rank, self.cfg.pp_size), layer_span=self.layer_span))

    def engine_init(self, r: PrefillRoom, num_tokens: int | None, num_pages: int | None, now: float,
                    first_page: int = 0) -> list[Any] | tuple:
        r.engine_init(num_tokens, num_pages, first_page)
        self._post_and_settle(r, now)  # a rank with nothing to send completes here if decode asked
        return self._actions()

    def chunk(self, r: PrefillRoom, logical: Any, local: np.ndarray, num_tokens_ready: int | None, is_last: bool,
              aux_row: np.ndarray | None, aux_slot: int | None, ready_event: Any = None,
              layers: tuple[int, int] | None = None) -> None:
        """Queue a checked chunk (raises, keeping nothing, when it is bad); ``post`` sends it.
        ``layers``: target layers ``[start, end)`` of its pages only (``room.py``)."""
        r.add_chunk(logical, local, num_tokens_ready, is_last, aux_row, aux_slot, ready_event, layers)

    def post(self, r: PrefillRoom, now: float, aux: AuxFrom | None = None) -> list[Any] | tuple:
        """Post what the room has queued to the decode ranks that asked (from the engine's thread
        in send(): no loop turn). ``aux``: where the room's aux row is written from, once the
        shell staged it (the send() that passed it)."""
        if aux is not None:
            r.aux_from = aux
        self._post_and_settle(r, now)
        return self._actions()

    def abort(self, r: PrefillRoom, reason: str, now: float) -> list[Any] | tuple:
        if not r.state.final:
            self.fail_room(r, reason, now)
        return self._actions()

    def close(self, r: PrefillRoom, now: float) -> list[Any] | tuple:
        """The engine let go of the room: fail it if unfinished; forget it once quiet."""
        if self.rooms.close(r):
            if not r.state.final:
                self.fail_room(r, f"the engine closed room {r.room}'s sender on {self.cfg.rank_label} before it "
                                  "finished", now)
            self._forget_if_quiet(r, now)
        return self._actions()

    def shutdown(self, reason: str, now: float) -> list[Any] | tuple:
        """Fail every room (the endpoint closes; ``closing`` already refuses new ones)."""
        for r in list(self.rooms.values()):
            self.fail_room(r, reason, now)
        return self._actions()

    # -- messages from decode ranks ---------------------------------------------

    def message(self, ident: bytes, msg: Any, now: float) -> list[Any] | tuple:
        """A message on connection ``ident`` (or the channel's error for a bad one)."""
        self.peers.heard_from(ident, now)  # any message: the decode rank is alive
        if isinstance(msg, _BOUND):  # delivered, refused, or held until the connection proves its registration
            said = self.hello_of(ident)
            self._admit(self.admission.feed(Arrived(ident, msg, said, self.peers.get(said) if said else None, now)),
                        now)
        else:
            self._dispatch(ident, msg, now)
        return self._actions()

    def _dispatch(self, ident: bytes, msg: Any, now: float) -> None:
        if isinstance(msg, wire.TransferRequest):  # the room's path: checked, planned and posted now
            self._on_request(ident, msg, now)
            self._pump(now)
        elif isinstance(msg, wire.SlotGrant):
            self._on_grant(ident, msg, now)
        elif isinstance(msg, KVBridgeError):
            log.warning("bad control message from %r: %s", ident, msg)
            # the channel counted it (stats.malformed / unauthenticated) and replied or dropped it
        elif isinstance(msg, wire.Ping):
            self._out.append(Send((ident,), wire.Heartbeat(cp_rank=self.cfg.cp_rank, seq=msg.seq)))
        elif isinstance(msg, wire.Abort):
            self._on_abort(ident, msg, now)
        elif isinstance(msg, wire.KeyProof):
            peer = self._proving(ident)
            self._admit(self.admission.feed(KeyProofGiven(ident, msg, peer, self.endpoint(), now)), now)
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

    def proof_read(self, ident: bytes, data: bytes, problem: str | None, now: float) -> list[Any] | tuple:
        """The shell's answer to a ``ReadProof``: the bytes read, or why not."""
        self._admit(self.admission.feed(ProofRead(ident, data, problem, self._proving(ident), self.endpoint(), now)),
                    now)
        return self._actions()

    def nonce_written(self, ident: bytes, problem: str | None, now: float) -> list[Any] | tuple:
        """The shell's answer to a ``WriteNonce``: written (problem None), then challenge; or not."""
        self._admit(self.admission.feed(NonceWritten(ident, problem, now)), now)
        return self._actions()

    def resolved(self, rank_id: str, detail: Any, problem: str | None, now: float,
                 by_read: bool = False) -> list[Any] | tuple:
        """The daemon's answer to a ``Resolve``: the requests that waited are delivered or refused.
        ``by_read``: our engine reads the registration's session (its memory is proven by read)."""
        waiters, problem = self.peers.resolved(rank_id, detail, problem, by_read)
        self._admit(self.admission.feed(RegistrationRead(rank_id, self.peers.get(rank_id), problem, now)), now)
        for ident, req in waiters:
            if problem is None:
                self._deliver(ident, req, now)
            else:
                self._refuse(ident, req, problem, now)
        return self._actions()

    def _on_request(self, ident: bytes, req: wire.TransferRequest, now: float) -> None:
        rank = self.cfg.rank_label
        if self.trace:
            log.info("trace room=%d rank=%s @%.6f request from %s pages=%d", req.room, rank, now,
                     req.decode_rank, len(req.page_ids) // 4)
        if self.closing:
            self._reply_failed(ident, req.room, f"prefill rank {rank} is shutting down")
            return
        if not self._claim(ident, req):
            return
        if req.fingerprint != self.fingerprint:
            self._refuse(ident, req, f"contract fingerprint {req.fingerprint} differs from prefill rank {rank}'s "
                                     f"{self.fingerprint}; nothing transferred (hard rule 7)", now)
            return
        if self.peers.get(req.decode_rank_id) is None:
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
        """A request whose decode registration is known: check it into a Target."""
        rank = self.cfg.rank_label
        peer = self.peers.get(req.decode_rank_id)
        if peer is None:  # evicted meanwhile: read it again
            self._wait_for_peer(ident, req, now)
            return
        r = self.rooms.get(req.room)
        if r is None:
            closed = self.rooms.tombstones.get(req.room)
            if closed is not None:
                self._reply_failed(ident, req.room, f"room {req.room} was already closed on prefill rank {rank} "
                                                    f"({closed}) when decode rank {req.decode_rank} asked")
                return
            r = self.rooms.add_unattached(PrefillRoom(req.room, self.cfg.cp_rank, self.lanes, self.page_size,
                                                      Stage.UNATTACHED, now=now,
                                                      pp=(self.cfg.pp_rank, self.cfg.pp_size), layer_span=self.layer_span))
        if not self._claim(ident, req):
            return
        if r.state.final:
            reason = f": {r.state.reason}" if r.state.reason else ""
            self._reply_failed(ident, req.room, f"room {req.room} already ended on {rank} ({r.state.state.name}{reason})")
            return
        failing = next((t.failure or t.abort_reason for t in r.targets.values() if not t.active), None)
        if r.life.stage == Stage.DRAINING or failing is not None:  # no new target for a room on its way out
            why = failing or "its sender was closed"
            self._reply_failed(ident, req.room, f"room {req.room} is failing on {rank} ({why})")
            return
        if peer.fingerprint != self.fingerprint:
            self._refuse(ident, req, f"decode rank {peer.label} registered contract {peer.fingerprint}, prefill rank "
                                     f"{rank} has {self.fingerprint}; nothing transferred (hard rule 7)", now)
            return
        if req.want_digest and not self.digests_readable:
            self._refuse(ident, req, f"decode rank {req.decode_rank} wants page digests, but prefill rank {rank}'s "
                                     "buffers are device memory given as addresses (RawBuffer), which kvbridge cannot "
                                     "read: turn verify_digest off on decode", now)
            return
        try:
            # num_tokens 0: the decode rank knows only its pages (first_page + page ids)
            r.set_length(f"decode rank {req.decode_rank}", num_tokens=req.num_tokens or None,
                         num_pages=None if req.num_tokens else req.first_page + len(req.page_ids) // 4)
            target = target_from_request(req, ident, self.specs, self.src_bufs, self.aux_schema, r, peer,
                                         tp=(self.cfg.tp_size, self.cfg.tp_rank), now=now,
                                         aux_stage=self.cfg.last_stage)
            offer = registered_offer(req, peer)  # its staging area: the one it registered, or refused
            r.check_prefix(target)  # the engine may already skip pages below its first page
        except KVBridgeError as exc:  # nothing was posted for this target: safe to refuse
            self._refuse(ident, req, str(exc), now)
            return
        if req.decode_rank in r.targets:
            self._reply_failed(ident, req.room, f"decode rank {req.decode_rank} asked twice for this room")
            return
        r.targets[req.decode_rank] = target
        self.stage.offered(req.room, req.decode_rank, offer, now)
        r.num_expected_targets = target.num_decode_targets  # the decode ranks whose TP route runs through us
        self.dirty.add(r.room)
        if r.state.state == KVPoll.Bootstrapping and len(r.targets) >= r.num_expected_targets:
            r.state.to(KVPoll.WaitingForInput, now=now)
        if self.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f target %s pages=%d first_page=%d pools=%s", req.room, rank,
                     r.age_ms(now), now, req.decode_rank, target.dst_pages.size, target.first_page,
                     ",".join(target.pools))

    def _refuse(self, ident: bytes, req: wire.TransferRequest, reason: str, now: float) -> None:
        """Refuse a request (nothing of it was posted) and fail its room here."""
        r = self.rooms.get(req.room)
        if r is not None and not r.state.final and self._holds(r, ident, req.decode_rank_id):
            self.fail_room(r, f"decode rank {req.decode_rank}'s request refused: {reason}", now)
        self._reply_failed(ident, req.room, reason)

    # -- room ids: first claim wins -------------------------------------------------

    def _holds(self, r: PrefillRoom, ident: bytes, rank_id: str) -> bool:
        """The decode instance of registration ``rank_id`` holds room ``r`` (or nobody claimed it yet)."""
        return r.holder is None or r.holder[0] == self._instance_of(ident, rank_id)

    def _claim(self, ident: bytes, req: wire.TransferRequest) -> bool:
        """A room id belongs to the decode instance whose request reached it first: its TP ranks
        share it, any other instance is refused with an ErrorReply naming the holder, and the
        holder's room goes on untouched (served once, to the holder)."""
        r = self.rooms.get(req.room)
        instance = self._instance_of(ident, req.decode_rank_id)
        if r is None or instance is None:
            return True  # no room yet (claimed where it is created), or the registration is being read again
        if r.holder is None:
            r.holder = (instance, req.decode_rank)
            return True
        if r.holder[0] == instance:
            return True
        self._error(ident, req, f"room {req.room} is claimed by decode instance {r.holder[0]} (rank {r.holder[1]}) on "
                                f"prefill rank {self.cfg.rank_label}: decode instance {instance} may not claim it "
                                "(first claim wins); nothing done")
        return False

    def _on_abort(self, ident: bytes, msg: wire.Abort, now: float) -> None:
        """A decode rank aborts: its target (if any) stops, and so does the room for every decode
        rank, since a decode instance's TP ranks give up a request together. The ack waits until
        nothing of the room is in flight (``_reply_when_quiet``)."""
        r = self.rooms.get(msg.room)
        if r is not None and not self._holds(r, ident, msg.decode_rank_id):
            self._error(ident, msg, f"room {msg.room} is claimed by decode instance {r.holder[0]} (rank "
                                    f"{r.holder[1]}) on prefill rank {self.cfg.rank_label}: an abort from decode "
                                    f"instance {self._instance_of(ident, msg.decode_rank_id)} is refused; the room "
                                    "goes on")
            return
        t = r.targets.get(msg.decode_rank) if r else None
        if t is not None and not t.closed:
            t.abort_reason = t.abort_reason or msg.reason or "aborted by decode"
            self.fail_room(r, f"decode rank {msg.decode_rank} aborted: {t.abort_reason}", now)
            return  # settle() acks once the room is quiet
        if r is not None and not r.state.final:
            self.fail_room(r, f"decode rank {msg.decode_rank} aborted: {msg.reason or 'aborted by decode'}", now)
        self._reply_when_quiet(msg.room, ident, wire.AbortAck(room=msg.room, cp_rank=self.cfg.cp_rank))

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
        if r is not None and r.num_inflight:
            r.pending_replies.append((ident, msg))
        else:
            self._out.append(Send((ident,), msg))

    def _flush_replies(self, r: PrefillRoom) -> None:
        while r.pending_replies and not r.num_inflight:
            ident, msg = r.pending_replies.pop(0)
            self._out.append(Send((ident,), msg))

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
        """Every queued chunk (and the aux row) to every active target."""
        if r.state.final or not r.length_known:
            return
        for t in r.targets.values():
            while t.active and t.posted < len(r.chunks):
                last_chunk = t.posted == len(r.chunks) - 1
                # the aux row rides in the last chunk's batch: one write, one completion
                with_aux = last_chunk and r.is_last and r.has_aux and t.aux_source and not t.aux_posted
                if not self._post_chunk(r, t, *r.chunks[t.posted], with_aux=with_aux,
                                        after=r.chunk_events[t.posted], layers=r.chunk_layers[t.posted]):
                    self.later.add(r.room)  # one staged group started: the next is planned on the next tick
                    break
                t.posted += 1
            if t.active and t.posted == len(r.chunks) and r.is_last and r.has_aux and t.aux_source \
                    and not t.aux_posted:
                self._post_chunk(r, t, _EMPTY, _EMPTY, with_aux=True, after=r.last_event)
        if r.state.state == KVPoll.WaitingForInput and any(t.posted or t.aux_posted or t.inflight
                                                           for t in r.targets.values()):
            r.state.to(KVPoll.Transferring, now=now)

    def _post_chunk(self, r: PrefillRoom, t: Target, logical: np.ndarray, local: np.ndarray, with_aux: bool,
                    after: Any = None, layers: tuple[int, int] | None = None) -> bool:
        """Post an engine chunk's pages (and the aux row) to ``t``: True once all of it is posted;
        False when one slot-sized group of a staged chunk was started and the rest waits for the
        next tick (its first gather starts after one group's planning, not the whole room's).
        ``layers``: the chunk carries those target layers of its pages only (planned on the
        pools cut to them; direct or staged alike)."""
        specs = self.specs if layers is None else self._layer_specs(layers)
        num_layers = None if layers is None else layers[1] - layers[0]
        if t.first_page:  # the decode rank already holds pages below its prefix
            keep = logical >= t.first_page
            logical, local = logical[keep], local[keep]
        if t.group_at:
            logical, local = logical[t.group_at:], local[t.group_at:]
        group = self._group_pages(r, t, logical.size)
        if group:
            try:
                part = plan_target(specs, self.src_bufs, t, logical[:group], local[:group], r.plan_tokens,
                                   room=r.room, rank=self.cfg.rank_label, layers=layers)
                path = r.paths[t.decode_rank] = self.stage.path(r.room, t, part)
                if path == "staged":
                    self._stage_write(r, t, logical[:group], False, part, after, num_layers)
                    t.group_at += group
                    return False
            except KVBridgeError as exc:
                t.failure = str(exc)
                t.group_at = 0
                return True
            except Exception as exc:  # a bug must fail this target, not the thread that called us
                log.exception("room %d on %s: planning for %s failed", r.room, self.cfg.rank_label, t.decode_rank)
                t.failure = f"internal error posting room {r.room} to {t.decode_rank}: {type(exc).__name__}: {exc}"
                t.group_at = 0
                return True
            # direct: the whole chunk is one write, planned below
        t.group_at = 0
        if not logical.size and not with_aux:
            return True
        try:
            aux = None
            if with_aux:
                t.aux_posted = True
                src = r.aux_from
                if src is None:
                    raise KVBridgeError("the aux row's source was not given with the chunk that carried it",
                                        room=r.room, rank=self.cfg.rank_label, field="aux")
                after = after if src.after is None else src.after  # (the row's copy waited on the chunk's events)
                aux = aux_slices(self.aux_schema, src.regions, src.slot, t.aux_dst, t.aux_slot,
                                 src_base=src.row_base, dst_base=t.aux_row_base)
            if logical.size:  # the aux row rides in the same write, after the pages' slices
                plan = plan_target(specs, self.src_bufs, t, logical, local, r.plan_tokens, room=r.room,
                                   rank=self.cfg.rank_label, extra=aux, layers=layers)
            else:
                plan = TransferPlan(*aux)
            path = r.paths[t.decode_rank] = self.stage.path(r.room, t, plan)
            if path == "staged":  # the same write through staging slots (the aux row too)
                self._stage_write(r, t, logical, with_aux, plan, after, num_layers)
                return True
            src, dst, length = plan.src, plan.dst, plan.length
        except KVBridgeError as exc:
            t.failure = f"{'aux row: ' if with_aux and not logical.size else ''}{exc}"
            return True
        except Exception as exc:  # a bug must fail this target, not the engine thread or the loop that called us
            log.exception("room %d on %s: planning for %s failed", r.room, self.cfg.rank_label, t.decode_rank)
            t.failure = f"internal error posting room {r.room} to {t.decode_rank}: {type(exc).__name__}: {exc}"
            return True
        w = self.next_write
        self.next_write += 1
        t.inflight[w] = (logical, with_aux, num_layers)  # in flight from here: no report leaves before it is final
        self.writes[w] = (r, t)
        self._out.append(PostWrite(w, r.room, t, t.session, src, dst, length, after))
        return True

    def _layer_specs(self, layers: tuple[int, int]) -> dict[str, PoolSpec]:
        """The pools cut to the layer ids that target layers ``layers`` carry (kept per range)."""
        cut = self._cut_specs.get(layers)
        if cut is None:
            cut = self._cut_specs[layers] = layer_range_specs(self.specs, layers, self.num_target_layers)
        return cut

    def _group_pages(self, r: PrefillRoom, t: Target, num_pages: int) -> int | None:
        """How many of ``num_pages`` to plan and stage first when a staged chunk is larger than
        one slot (None: plan it whole). A group fills about one slot, and holds enough pages for
        at least ``GROUP_MIN_SLICES`` slices, so that the path chosen on the first group is the one
        the whole chunk would get (``choose_path``'s thresholds are far below it)."""
        stage, key = self.stage, (r.room, t.decode_rank)
        offer = stage.offers.get(key)
        if stage.gather is None or stage.mode == "never" or offer is None or stage.paths.get(key) == "direct":
            return None
        bufs = [b for b in self.src_bufs if b.pool in t.pools]
        if not bufs:
            return None
        slot = min(stage.gather.slot_bytes, offer.slot_bytes)
        page_bytes = sum(b.bytes_per_page for b in bufs) + ALIGN_SLACK * len(bufs)
        group = max(slot // page_bytes, -(-GROUP_MIN_SLICES // len(bufs)), 1)
        return group if num_pages > group else None

    def _stage_write(self, r: PrefillRoom, t: Target, logical: np.ndarray, with_aux: bool, plan: TransferPlan,
                     after: Any, num_layers: int | None = None) -> None:
        """A write of ``logical`` pages (and the aux row) through staging: in flight from here,
        reported (one PagesDone, as a direct write) once every chunk landed."""
        w = self.next_write
        self.next_write += 1
        t.inflight[w] = (logical, with_aux, num_layers)
        self.writes[w] = (r, t)
        sw = self.stage.start(w, r.room, t, plan, after, self._out)
        r.staged["plan_slices"] += sw.staged.num_plan_slices
        if self.trace:
            log.info("trace room=%d rank=%s -> %s staged pages=%s chunks=%d plan_slices=%d bytes=%d", r.room,
                     self.cfg.rank_label, t.decode_rank, _pages_text(logical), sw.num_chunks,
                     sw.staged.num_plan_slices, sw.staged.num_bytes)

    def _on_grant(self, ident: bytes, msg: wire.SlotGrant, now: float) -> None:
        a = self.stage.granted(ident, msg, self._out)
        if a is not None:
            self._out.append(a)
            return
        found = self.stage.by_chunk.get((msg.room, msg.decode_rank, msg.chunk))
        if found is not None and found[0] in self.stage.writes:
            self._settle_staged(self.stage.writes[found[0]], now)

    def chunk_posted(self, a: PostChunk, handle: int, num_slices: int, num_bytes: int,
                     now: float) -> list[Any] | tuple:
        """The shell gathered chunk ``a`` and submitted its wire pieces: the engine's ``handle``."""
        self.handles[handle] = a.write
        self.stage.posted(a, handle)
        r, t = self.writes[a.write]
        if r.first_post is None:
            r.first_post = now
        self.counters["bytes"] += num_bytes
        self.counters["slices"] += num_slices
        r.num_bytes += num_bytes
        r.num_slices += num_slices
        if self.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f -> %s chunk %d slot %d slices=%d bytes=%d", r.room,
                     self.cfg.rank_label, r.age_ms(now), now, t.decode_rank, a.chunk,
                     self.stage.writes[a.write].remote[a.chunk], num_slices, num_bytes)
        return self._actions()

    def chunk_post_failed(self, a: PostChunk, reason: str | None, now: float) -> list[Any] | tuple:
        """Chunk ``a`` was not submitted (gather or submission refused: ``reason``; or its target
        failed meanwhile: None): nothing of it is in flight."""
        sw = self.stage.writes[a.write]
        if reason is not None:
            a.target.failure = a.target.failure or reason
        self.stage.chunk_final(sw, a.chunk, False, reason or "target failed", self._out)
        self._settle_staged(sw, now)
        return self._actions()

    def _chunk_final(self, handle: int, sw: StagedWrite, status: WriteStatus, now: float) -> None:
        k = sw.posted.pop(handle)
        t = sw.target
        ok = status.state is not WriteState.FAILED
        if not ok:
            t.failure = t.failure or f"write to decode rank {t.decode_rank} ({t.session}) failed: {status.reason}"
        ok = ok and t.active  # (a chunk of a target that failed meanwhile is reported failed: nothing scatters)
        self.stage.chunk_final(sw, k, ok, status.reason if status.reason else (t.failure or ""), self._out)
        if ok:
            r = self.writes[sw.write][0]
            r.staged["chunks"] += 1
            r.staged["bytes_staged"] += int(sw.staged.chunk_bytes[k])
        self._settle_staged(sw, now)

    def _settle_staged(self, sw: StagedWrite, now: float) -> None:
        """A staged write whose chunks are all landed is reported like a direct write; one that failed
        ends (not in flight any more) once its posted chunks are final."""
        if not sw.target.active:
            self.stage.cancel(sw, self._out)
        if not self.stage.settled(sw):
            return
        self.stage.forget(sw)
        ok = sw.done == sw.num_chunks and sw.target.active
        self._write_done(sw.write, WriteStatus.DONE if ok else WriteStatus.failed(sw.target.failure or
                                                                                  "staged write failed"), now)

    def posted(self, a: PostWrite, handle: int, now: float) -> list[Any] | tuple:
        """The shell submitted write ``a``: the engine's ``handle`` reports it."""
        self.handles[handle] = a.write
        r, t = self.writes[a.write]
        if r.first_post is None:
            r.first_post = now
        num_bytes, num_slices = int(a.length.sum()), len(a.length)
        self.counters["bytes"] += num_bytes
        self.counters["slices"] += num_slices
        r.num_bytes += num_bytes
        r.num_slices += num_slices
        if self.trace:
            logical, with_aux, _ = t.inflight[a.write]
            log.info("trace room=%d rank=%s +%.2fms @%.6f -> %s pages=%s%s slices=%d bytes=%d", r.room,
                     self.cfg.rank_label, r.age_ms(now), now, t.decode_rank, _pages_text(logical),
                     " +aux" if with_aux else "", num_slices, num_bytes)
        return self._actions()

    def post_failed(self, a: PostWrite, reason: str | None, now: float) -> list[Any] | tuple:
        """Write ``a`` was refused at submission (``reason``), or not submitted because its target
        failed meanwhile (None): nothing of it is in flight."""
        r, t = self.writes.pop(a.write)
        t.inflight.pop(a.write, None)
        if reason is not None:
            t.failure = reason
        self._settle(r, now)
        self._forget_if_quiet(r, now)
        return self._actions()

    def write_final(self, handle: int, status: WriteStatus, now: float) -> list[Any] | tuple:
        """A posted write is done or failed: report it (one report per write)."""
        w = self.handles.pop(handle, None)
        if w is None:
            return _NONE
        sw = self.stage.writes.get(w)
        if sw is not None:
            self._chunk_final(handle, sw, status, now)
        else:
            self._write_done(w, status, now)
        return self._actions()

    def _write_done(self, w: int, status: WriteStatus, now: float) -> None:
        """Write ``w`` (direct, or every chunk of a staged one) is final: one report per write."""
        r, t = self.writes.pop(w)
        pages, with_aux, num_layers = t.inflight.pop(w)
        if self.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f write of %d pages%s to %s %s", r.room,
                     self.cfg.rank_label, r.age_ms(now), now, pages.size, " +aux" if with_aux else "",
                     t.decode_rank, status.state.value)
        if status.state is WriteState.FAILED:
            t.failure = t.failure or f"write to decode rank {t.decode_rank} ({t.session}) failed: {status.reason}"
        elif t.active:
            if num_layers is not None and pages.size:  # a layer range: the pages whose every layer reached t
                pages = t.count_layers(pages, num_layers, r.layer_width, r.num_pages)
            if pages.size:
                t.num_pages_done += pages.size
            if with_aux:
                t.aux_done = True
            # one report per write: its pages and, when it carried it, the aux row
            msg = wire.PagesDone(
                room=r.room, cp_rank=self.cfg.cp_rank, status="ok", reason="",
                pools=list(t.pools) if pages.size else [], logical_pages=pages.astype("<i4").tobytes(),
                digests=None, aux=with_aux, num_tokens=(r.num_tokens or 0) if with_aux else 0)
            if pages.size and t.want_digest:  # the shell reads the pages and fills the digests in
                self._out.append(SendDigested(t.ident, msg, tuple(t.pools), pages, r.local_of[pages],
                                              r.plan_tokens))
            else:
                self._out.append(Send((t.ident,), msg))
        self._settle(r, now)
        self._forget_if_quiet(r, now)

    def _settle(self, r: PrefillRoom, now: float) -> None:
        """Send final reports and move the room to its final state. A failure report or abort ack
        goes out only once nothing of the room is in flight to any decode rank (see
        ``_reply_when_quiet``)."""
        if self.stage.writes and any(not t.active and t.inflight for t in r.targets.values()):
            for w in [w for t in r.targets.values() if not t.active for w in t.inflight]:
                if w in self.stage.writes:
                    self._settle_staged(self.stage.writes[w], now)  # (re-enters _settle once it ends)
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
        self.counters["rooms_ok" if r.state.state == KVPoll.Success else "rooms_failed"] += 1
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
            self.counters["rooms_failed"] += 1
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
        self.rooms.forget(r, now, tombstone=True)
        self.stage.forget_room(r.room)
        self._out.append(FreeRoom(r.room))  # sender(room, wait=...) may open it now

    # -- the clock --------------------------------------------------------------

    def tick(self, now: float) -> list[Any] | tuple:
        """Post what events queued (and the next group of each staged chunk started in groups);
        every ``DEADLINE_SCAN_S``, deadlines and silent peers."""
        if self.later:
            self.dirty |= self.later
            self.later.clear()
        self._pump(now)
        if now >= self.next_deadline_scan:
            self.next_deadline_scan = now + DEADLINE_SCAN_S
            self._deadlines(now)
        return self._actions()

    def _deadlines(self, now: float) -> None:
        self._admit(self.admission.feed(Overdue(now)), now)
        for r in list(self.rooms.values()):
            if r.state.final:
                continue
            if r.state.state == KVPoll.Bootstrapping and now - r.created > self.cfg.target_timeout:
                asked = f"only {len(r.targets)} of {r.num_expected_targets}" if r.targets else "no"
                self.fail_room(r, f"{asked} decode ranks asked for room {r.room} within {self.cfg.target_timeout:.1f}s",
                               now)
            for t in r.targets.values():
                if not t.active or t.closed:
                    continue
                silent = self.peers.silent_for(t.ident, now, t.created)
                if silent > self.cfg.peer_timeout:  # the decode rank pings while it has rooms here
                    t.failure = (f"decode rank {t.decode_rank} ({t.session}) sent nothing for {silent:.1f}s "
                                 f"(peer timeout {self.cfg.peer_timeout:.1f}s): presumed dead")
                elif now > t.deadline:
                    t.failure = f"decode rank {t.decode_rank}'s deadline passed before the room was written"
            self._settle(r, now)
            self._forget_if_quiet(r, now)

    def gc(self, now: float) -> list[Any] | tuple:
        """Forget quiet rooms no handle holds; prune tombstones and silent connections."""
        for room in list(self.rooms.unowned):
            r = self.rooms.get(room)
            if r is None:
                self.rooms.unowned.discard(room)
            else:
                self._forget_if_quiet(r, now)
        self.rooms.tombstones.prune(now)
        self.stage.prune(lambda room: self.rooms.get(room) is not None, now, 2 * self.cfg.target_timeout)
        in_use = {t.ident for r in self.rooms.values() for t in r.targets.values() if not t.closed}
        self.peers.prune(now, in_use, horizon=10 * self.cfg.peer_timeout)
        self._admit(self.admission.feed(Forget(frozenset(self.peers.heard))), now)
        return self._actions()


def _pages_text(pages: np.ndarray) -> str:
    """A trace line's page list: in full when short, else its count and ends."""
    if pages.size <= 8:
        return str(pages.tolist())
    return f"{pages.size}[{int(pages[0])}..{int(pages[-1])}]"
