"""Prefill's staged writes: a sans-I/O book of chunks, slots and grants.

A target whose decode rank offered a staging area (``TransferRequest.staging_slots``) may be
*staged* (``choose_path``, or the ``staging`` override on either side). The area offered must
be the one the decode rank registered with the daemon, slot for slot (``registered_offer``,
hard rule 5): the request only says that this room may use it. A staged write is the
same write the direct path would post (its pages, one report), cut by ``stage_plan`` into
chunks that each pass through one slot of our gather buffer and one slot of the decode rank's
staging area:

    chunk k:  gather slot (ours, FIFO)  ->  --SlotRequest(scatter list)-->  decode (which checks the
              list now), then Gather: the shell gathers pages -> gather slot now (on a GPU queued on
              the stager's stream) while it travels
              <--SlotGrant(slot)--  decode (FIFO: back-pressure when its area is full)
              PostChunk: the shell writes the gathered slot's pieces -> decode slot (on a GPU the
              write waits for the gather's event, not this thread)
              write final  --ChunkLanded-->  decode scatters slot -> pages by the list it checked

Granted with the request: a decode rank that keeps slots for it names one in its TransferRequest
for our first chunks of the room (``TransferRequest.staging_granted``, checked inside the
registered area by ``registered_offer``). Such a chunk holds its decode slot from the start (as a
grant that came ahead, ``StagedWrite.ahead``): it is gathered and written the turn it takes a
gather slot, its SlotRequest (the scatter list decode checks) sent before the write is posted, on
the connection its ChunkLanded follows, and no SlotGrant comes for it. A granted slot no write of
ours uses (the target went direct, or had fewer chunks) is decode's to free when the room commits.

Credits: a chunk asks for its decode slot when it takes a gather slot, and the chunks next in
line for our gather slots ask ahead of it (``StagedWrites.ahead``: what is left of our fair
share of decode's slots once each gather slot holds one), so a chunk that takes a gather slot
freed by a landed write may hold its grant already and is gathered and written in the same turn
(the grant's round trip is off the gather slot's cycle); a grant that comes first waits for its
chunk's gather slot (``StagedWrite.ahead``), and is given back ("failed", nothing written) if
the write ends first. Decode grants every free slot at once and each slot again the turn its
scatter completes. A grant that is not for a chunk of ours waiting for one (granted twice, or
after the write ended), or for a slot outside the registered area, is refused by name.
    every chunk landed: the write's PagesDone (after its ChunkLanded, on the same connection)

Remote writes land only in granted decode slots. A write is in flight (for the room's abort
ack and failure report, hard rule 6) until every chunk posted is final and no more will be
posted. The aux row rides in the last chunk's write as on the direct path, so it is staged too
(decode checks it lands in the room's own aux slot): nothing of a staged target writes anywhere
on decode but its staging slots.
**The machine.** :class:`StagedWrites` takes the events below through ``feed(event)``
(``StageWrite``, ``GrantIn``, ``ChunkPosted``, ``ChunkPostFailed``, ``ChunkFinal``, ``Settle``,
``RoomGone``, ``Prune``, ``SetMode``) and returns what follows: the shell's actions (``Gather``,
``PostChunk``, ``Send``) and, for the room machine, ``Started`` (a write's plan),
``ChunkCounted`` (a chunk landed) and ``WriteEnded`` (every chunk final: report it like a direct
write). The room machine (``machine.py``) feeds it under the shell's lock; what it knows of a
write comes in with ``StageWrite`` (its ``Target``, the room's record of that decode rank: the
room machine fails it, this machine reads whether it is active and names why a grant failed it).
No socket, clock, engine call or callable here.

    chunk k, as a table (per chunk; a write is the sum of its chunks):
      queued for a gather slot  --slot free-->            gathered, SlotRequest sent   (Gather, Send)
      gathered                  --GrantIn-->              posted                       (PostChunk)
      gathered                  --GrantIn, write failed-> given up                     (Send ChunkLanded failed)
      posted                    --ChunkPosted-->          in flight
      posted                    --ChunkPostFailed-->      final, failed                (Send ChunkLanded failed)
      in flight                 --ChunkFinal-->           final                        (Send ChunkLanded)
      write with every chunk final, or failed and nothing in flight            -->    WriteEnded
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import LayoutError, PageRangeError
from kvbridge.layout.plan import TransferPlan
from kvbridge.layout.staging import StagedPlan, choose_path, stage_plan
from kvbridge.transfer.engine.registry import staging_thresholds
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.layout import BufferDesc
from kvbridge.transfer.engine import WriteState, WriteStatus
from kvbridge.transfer.staging import Grant, StagingArea
from kvbridge.transfer.prefill.targets import DecodePeer
from kvbridge.transfer.prefill.targets import Target

__all__ = [
    "EVENTS", "ChunkCounted", "ChunkFinal", "ChunkPostFailed", "ChunkPosted", "Gather", "GrantIn", "Offer",
    "PostChunk", "Prune", "RoomGone", "SetMode", "Settle", "StageWrite", "StagedWrite", "StagedWrites", "Started",
    "WriteEnded", "registered_offer",
]
GROUP_MIN_SLICES = 4096  # a staged chunk's first group has at least this many slices (see group_size)
ALIGN_SLACK = 16  # per slice: stage_plan aligns each slice's slot offset to 16 bytes


@dataclass(frozen=True)
class Offer:
    """A decode rank's staging area, as it registered it (``registered_offer``), and whether its
    request takes staged writes only."""

    slots: int
    slot_bytes: int
    base: int
    only: bool
    engine_kind: str = "local"  # the kind of engine a write to that rank goes through (choose_path's ``engine``)
    granted: tuple[int, ...] = ()  # decode slots granted with the request to our chunks 0, 1, ... of the room

    def slot_addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    @property
    def end(self) -> int:
        return self.base + self.slots * self.slot_bytes


def registered_offer(req: wire.TransferRequest, peer: DecodePeer) -> Offer | None:
    """The staging area ``req`` offers (None: none), checked against the area its decode rank
    registered (hard rule 5: a remote write lands only inside memory the daemon says that rank
    registered). A request is authenticated, but its sender may be wrong about its own area or
    name another's memory: any field that differs from the registration refuses the request,
    naming the field; nothing is written."""
    ctx = dict(room=req.room, rank=req.decode_rank)
    if not req.staging_slots:
        if req.staging_granted:
            raise PageRangeError(f"decode rank {peer.label} granted staging slots {list(req.staging_granted)} with a "
                                 "request that offers no staging area; nothing written", field="staging_granted",
                                 **ctx)
        return None
    if peer.staging is None:
        raise PageRangeError(f"decode rank {peer.label} offers a staging area of {req.staging_slots} slots at "
                             f"{req.staging_base:#x} but registered none; nothing written", field="staging_slots",
                             **ctx)
    base, nbytes, slot_bytes = peer.staging
    for name, asked, registered in (("staging_base", req.staging_base, base),
                                    ("staging_slot_bytes", req.staging_slot_bytes, slot_bytes),
                                    ("staging_slots", req.staging_slots, nbytes // slot_bytes)):
        if asked != registered:
            shown = (f"{asked:#x}", f"{registered:#x}") if name == "staging_base" else (asked, registered)
            raise PageRangeError(f"the request's {name} {shown[0]} differs from the {shown[1]} decode rank "
                                 f"{peer.label} registered (staging area [{base:#x}, {base + nbytes:#x}) in "
                                 f"{slot_bytes}-byte slots); nothing written", field=name, **ctx)
    slots = nbytes // slot_bytes
    granted = tuple(req.staging_granted)
    if granted and (max(granted) >= slots or len(set(granted)) != len(granted)):
        raise PageRangeError(f"decode rank {peer.label} granted slots {list(granted)} with its request: each must be "
                             f"one of its {slots} staging slots, none twice; nothing written",
                             field="staging_granted", **ctx)
    return Offer(slots, slot_bytes, base, req.staging_only, peer.engine_kind, granted)


@dataclass
class StagedWrite:
    """One staged write (the machine's write id ``write``) to ``target``."""

    write: int
    room: int
    target: Target
    offer: Offer
    staged: StagedPlan
    first_chunk: int  # its chunk k travels as chunk first_chunk + k (numbered per room and target)
    after: Any
    local: dict[int, int] = field(default_factory=dict)  # chunk -> our gather slot (held)
    remote: dict[int, int] = field(default_factory=dict)  # chunk -> decode slot granted (and held in ``local``)
    asked: set[int] = field(default_factory=set)  # chunks whose SlotRequest was sent
    ahead: dict[int, int] = field(default_factory=dict)  # chunk -> decode slot granted before its gather slot
    with_request: set[int] = field(default_factory=set)  # chunks whose ``ahead`` slot came with the request
    posted: dict[int, int] = field(default_factory=dict)  # engine handle -> chunk, in flight
    done: int = 0
    failed: bool = False

    @property
    def num_chunks(self) -> int:
        return self.staged.num_chunks


@dataclass(frozen=True, slots=True)
class Gather:
    """Gather chunk ``chunk`` of write ``write`` into our gather slot ``local_slot`` now, ahead of
    its decode slot's grant, after the source pages' events ``after``. Nothing to answer: the
    chunk's ``PostChunk`` (same write, chunk and slot) writes what was gathered."""

    write: int
    room: int
    chunk: int
    staged: StagedPlan
    local_slot: int
    after: Any


@dataclass(frozen=True, slots=True)
class PostChunk:
    """Write the wire pieces of chunk ``chunk`` of write ``write``, gathered into our gather slot
    ``local_slot`` (its ``Gather``), into the decode slot at ``remote_addr``. Answer with
    the event ``ChunkPosted`` (its engine handle) or ``ChunkPostFailed``, fed to the room machine."""

    write: int
    room: int
    chunk: int
    target: Target
    session: str
    staged: StagedPlan
    local_slot: int
    remote_addr: int
    after: Any


# -- events in (frozen plain data) -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StageWrite:
    """Stage write ``write`` (the room machine's id) of room ``room`` to ``target``: ``plan``'s
    slices, after the events ``after``."""

    write: int
    room: int
    target: Target
    plan: TransferPlan
    after: Any


@dataclass(frozen=True, slots=True)
class GrantIn:
    """A SlotGrant on connection ``ident``."""

    ident: bytes
    msg: wire.SlotGrant


@dataclass(frozen=True, slots=True)
class ChunkPosted:
    """The shell's answer to a ``PostChunk``: gathered and submitted; the engine's ``handle``."""

    action: PostChunk
    handle: int
    num_slices: int
    num_bytes: int
    now: float


@dataclass(frozen=True, slots=True)
class ChunkPostFailed:
    """The shell's answer to a ``PostChunk``: not submitted (gather or submission refused:
    ``reason``; or its target failed meanwhile: None); nothing of it is in flight."""

    action: PostChunk
    reason: str | None
    now: float


@dataclass(frozen=True, slots=True)
class ChunkFinal:
    """The engine's write ``handle`` of staged write ``write`` is final."""

    write: int
    handle: int
    status: WriteStatus


@dataclass(frozen=True, slots=True)
class Settle:
    """Write ``write``'s target failed: give up what is not posted; end it once nothing is in flight."""

    write: int


@dataclass(frozen=True, slots=True)
class RoomGone:
    """Room ``room`` was forgotten: its offers, paths and chunk numbers go."""

    room: int


@dataclass(frozen=True, slots=True)
class Prune:
    """Drop what is kept of rooms not among ``known``: an offer once ``horizon`` seconds old."""

    known: frozenset[int]
    now: float
    horizon: float


@dataclass(frozen=True, slots=True)
class SetMode:
    """The staging override (auto, always, never) for targets not yet planned."""

    mode: str


EVENTS = (StageWrite, GrantIn, ChunkPosted, ChunkPostFailed, ChunkFinal, Settle, RoomGone, Prune, SetMode)


# -- what comes out for the room machine, besides the shell's actions ----------------------------

@dataclass(frozen=True, slots=True)
class Started:
    """Write ``write`` was cut into ``num_chunks`` chunks of ``plan_slices`` slices, ``num_bytes``."""

    write: int
    num_chunks: int
    plan_slices: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class ChunkCounted:
    """A chunk of write ``write`` landed: ``num_bytes`` staged."""

    write: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class WriteEnded:
    """Write ``write`` is final: every chunk landed (``ok``), or it failed (``reason``) and nothing
    of it is in flight. Report it like a direct write."""

    write: int
    ok: bool
    reason: str


class StagedWrites:
    """The staged writes of one prefill rank, its gather slots, and the decode offers.
    ``gather``: our gather buffer's slots (None: no gather buffer, every target direct);
    ``src_bufs``: our registered buffers (a staged chunk's group size)."""

    def __init__(self, mode: str, gather: StagingArea | None, cp_rank: int, rank: str,
                 src_bufs: tuple[BufferDesc, ...] = (), senders: int = 1) -> None:
        self.mode = mode
        self.senders = max(1, senders)  # prefill ranks that may share a decode rank's area (its fair share)
        self.gather = gather
        self.cp_rank = cp_rank
        self.rank = rank
        self.src_bufs = tuple(src_bufs)
        self.offers: dict[tuple[int, str], Offer] = {}  # (room, decode rank) -> its staging area
        self.offered_at: dict[tuple[int, str], float] = {}
        self.paths: dict[tuple[int, str], str] = {}  # (room, decode rank) -> "direct" / "staged"
        self.next_chunk: dict[tuple[int, str], int] = {}
        # (room, decode rank) -> {our chunk of the room: the decode slot granted with the request}, until used
        self.pre_granted: dict[tuple[int, str], dict[int, int]] = {}
        self.writes: dict[int, StagedWrite] = {}
        self.by_chunk: dict[tuple[int, str, int], tuple[int, int]] = {}  # (room, rank, wire chunk) -> (write, k)
        self.counters = {"staged_writes": 0, "chunks": 0, "bytes_staged": 0, "plan_slices": 0, "gather_waits": 0,
                         "direct_targets": 0, "staged_targets": 0, "grants_refused": 0,
                         "grants_ahead_used": 0, "grants_with_request_used": 0}
        self._out: list[Any] = []

    # ---- the door ----------------------------------------------------------------------------
    def feed(self, event: Any) -> list[Any]:
        """One event in; the shell's actions and ``Started`` / ``ChunkCounted`` / ``WriteEnded`` out."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"the staged-writes machine does not take {type(event).__name__}")
        handler(self, event)
        out, self._out = self._out, []
        return out

    # ---- read-only queries -------------------------------------------------------------------
    def holds(self, write: int) -> bool:
        """Write ``write`` is a staged one not yet ended."""
        return write in self.writes

    def group_size(self, room: int, t: Target, num_pages: int) -> int | None:
        """How many of ``num_pages`` to plan and stage first when a staged chunk is larger than
        one slot (None: plan it whole). A group fills about one slot, and holds enough pages for
        at least ``GROUP_MIN_SLICES`` slices, so that the path chosen on the first group is the one
        the whole chunk would get (``choose_path``'s thresholds are far below it)."""
        if num_pages <= -(-GROUP_MIN_SLICES // max(len(self.src_bufs), 1)):
            return None  # within any group's least page count (the target's pools are among src_bufs')
        key = (room, t.decode_rank)
        offer = self.offers.get(key)
        if self.gather is None or self.mode == "never" or offer is None or self.paths.get(key) == "direct":
            return None
        if self._path_without_plan(room, t, offer) == "direct":
            return None  # a route auto never stages (IPC): the chunk is planned once, whole
        bufs = [b for b in self.src_bufs if b.pool in t.pools]
        if not bufs:
            return None
        slot = min(self.gather.slot_bytes, offer.slot_bytes)
        page_bytes = sum(b.bytes_per_page for b in bufs) + ALIGN_SLACK * len(bufs)
        group = max(slot // page_bytes, -(-GROUP_MIN_SLICES // len(bufs)), 1)
        return group if num_pages > group else None

    # ---- the choice (a decision kept once made) ----------------------------------------------
    def offered(self, room: int, decode_rank: str, offer: Offer | None, now: float) -> None:
        """A target's staging area (``registered_offer``: checked against the decode rank's
        registration), kept until its room is forgotten."""
        if offer is not None:
            key = (room, decode_rank)
            self.offers[key] = offer
            self.offered_at[key] = now
            if offer.granted:
                self.pre_granted[key] = dict(enumerate(offer.granted))

    def path(self, room: int, t: Target, plan: TransferPlan) -> str:
        """The target's path, chosen on its first plan and kept (LayoutError when the decode rank
        wants staging only and this rank cannot stage)."""
        key = (room, t.decode_rank)
        found = self.paths.get(key)
        if found is not None:
            return found
        offer = self.offers.get(key)
        path = self._path_without_plan(room, t, offer)
        if path is None:
            path = choose_path(plan, staging_thresholds(offer.engine_kind))
        self.paths[key] = path
        self.counters[f"{path}_targets"] += 1
        return path

    def _path_without_plan(self, room: int, t: Target, offer: Offer | None) -> str | None:
        """The target's path where no plan decides it: direct without an offer, without staging
        here, or over a route auto never stages (its engine copies any number of slices at once);
        staged for a staging-only offer or staging ``always``; None when the slices of its first
        plan decide (``choose_path``). LayoutError when the decode rank wants staging only and this
        rank cannot stage."""
        if offer is None:
            return "direct"
        if offer.only:
            if self.gather is None or self.mode == "never":
                raise LayoutError(f"decode rank {t.decode_rank} takes staged writes only, but this rank stages "
                                  f"nothing (staging {self.mode!r}, gather buffer "
                                  f"{'none' if self.gather is None else 'present'})", room=room, rank=self.rank,
                                  field="staging")
            return "staged"
        if self.gather is None or self.mode == "never":
            return "direct"
        if self.mode == "always":
            return "staged"
        return "direct" if staging_thresholds(offer.engine_kind) is None else None

    # ---- handlers ----------------------------------------------------------------------------
    def _start(self, e: StageWrite) -> None:
        """Stage write ``w``: its chunks queue for our gather slots; each slot taken asks decode for one."""
        w, room, t = e.write, e.room, e.target
        key = (room, t.decode_rank)
        offer = self.offers[key]
        slot_bytes = min(self.gather.slot_bytes, offer.slot_bytes) & ~15
        staged = stage_plan(e.plan, slot_bytes, room=room, rank=self.rank)
        first = self.next_chunk.get(key, 0)
        self.next_chunk[key] = first + staged.num_chunks
        sw = StagedWrite(w, room, t, offer, staged, first, e.after)
        pre = self.pre_granted.get(key)
        if pre:  # our chunks granted a slot with the request: held from the start, as a grant that came ahead
            for c in [c for c in pre if first <= c < first + staged.num_chunks]:
                sw.ahead[c - first] = pre.pop(c)
                sw.with_request.add(c - first)
            if not pre:
                del self.pre_granted[key]
        self.writes[w] = sw
        for k in range(staged.num_chunks):
            self.by_chunk[(room, t.decode_rank, first + k)] = (w, k)
        self.counters["staged_writes"] += 1
        self.counters["plan_slices"] += staged.num_plan_slices
        self._out.append(Started(w, staged.num_chunks, staged.num_plan_slices, staged.num_bytes))
        for k in range(staged.num_chunks):
            grant = self.gather.acquire(w, k)
            if grant is None:
                self.counters["gather_waits"] += 1
            else:
                self._gather_granted(grant)
        if not staged.num_chunks:  # an empty plan: nothing to land, the write ends now
            self._settle(sw)
        self._ask_ahead()

    def _grant(self, e: GrantIn) -> None:
        a = self._granted(e.ident, e.msg)
        if a is not None:
            self._out.append(a)
            return
        found = self.by_chunk.get((e.msg.room, e.msg.decode_rank, e.msg.chunk))
        if found is not None and found[0] in self.writes:
            self._settle(self.writes[found[0]])

    def _posted(self, e: ChunkPosted) -> None:
        self.writes[e.action.write].posted[e.handle] = e.action.chunk

    def _post_failed(self, e: ChunkPostFailed) -> None:
        a = e.action
        sw = self.writes[a.write]
        if e.reason is not None:
            a.target.failure = a.target.failure or e.reason
        self._chunk_final(sw, a.chunk, False, e.reason or "target failed")
        self._settle(sw)

    def _final(self, e: ChunkFinal) -> None:
        sw = self.writes[e.write]
        k = sw.posted.pop(e.handle)
        t = sw.target
        ok = e.status.state is not WriteState.FAILED
        if not ok:
            t.failure = t.failure or f"write to decode rank {t.decode_rank} ({t.session}) failed: {e.status.reason}"
        ok = ok and t.active  # (a chunk of a target that failed meanwhile is reported failed: nothing scatters)
        self._chunk_final(sw, k, ok, e.status.reason if e.status.reason else (t.failure or ""))
        if ok:
            self._out.append(ChunkCounted(sw.write, int(sw.staged.chunk_bytes[k])))
        self._settle(sw)

    def _settle_event(self, e: Settle) -> None:
        sw = self.writes.get(e.write)
        if sw is not None:
            self._settle(sw)

    def _room_gone(self, e: RoomGone) -> None:
        for book in (self.offers, self.offered_at, self.paths, self.next_chunk, self.pre_granted):
            for key in [key for key in book if key[0] == e.room]:
                del book[key]

    def _prune(self, e: Prune) -> None:
        """Drop what is kept of rooms the machine does not hold: an offer once it is ``horizon``
        seconds old (kept with its target; a room forgotten without ``RoomGone`` leaves one)."""
        for key in [key for key in self.offers if key[0] not in e.known and e.now - self.offered_at[key] > e.horizon]:
            del self.offers[key], self.offered_at[key]
        for book in (self.paths, self.next_chunk, self.pre_granted):
            for key in [key for key in book if key[0] not in e.known]:
                del book[key]

    def _set_mode(self, e: SetMode) -> None:
        self.mode = e.mode

    # ---- steps -------------------------------------------------------------------------------
    def _gather_granted(self, g: Grant) -> None:
        sw = self.writes.get(g.room)
        if sw is None or sw.failed or not sw.target.active:  # (the write ended while its chunk waited)
            self._free_gather(g.slot)
            return
        k = g.chunk
        sw.local[k] = g.slot
        if k in sw.ahead:  # its decode slot came while it waited for ours: written the turn it is gathered
            with_request = k in sw.with_request
            self._ask(sw, k)  # (granted with the request: its list goes now, ahead of the write; else a no-op)
            self._out.append(Gather(sw.write, sw.room, k, sw.staged, g.slot, sw.after))
            sw.remote[k] = sw.ahead.pop(k)
            self.counters["grants_with_request_used" if with_request else "grants_ahead_used"] += 1
            self._out.append(PostChunk(sw.write, sw.room, k, sw.target, sw.target.session, sw.staged, g.slot,
                                       sw.offer.slot_addr(sw.remote[k]), sw.after))
        else:  # the SlotRequest first: the grant's round trip runs while the shell gathers
            self._ask(sw, k)
            self._out.append(Gather(sw.write, sw.room, k, sw.staged, g.slot, sw.after))

    def _ask(self, sw: StagedWrite, k: int) -> None:
        """Ask decode for a slot for chunk ``k`` (once)."""
        if k in sw.asked:
            return
        sw.asked.add(k)
        off, dst, length = sw.staged.scatter(k, 0)  # (decode checks it now, not when the chunk lands)
        self._out.append(Send((sw.target.ident,), wire.SlotRequest(
            room=sw.room, cp_rank=self.cp_rank, chunk=sw.first_chunk + k, num_bytes=int(sw.staged.chunk_span[k]),
            scatter=wire.pack_scatter(off, dst, length))))

    def ahead(self, offer: Offer) -> int:
        """How many chunks waiting for our gather slots may ask a decode rank with ``offer`` ahead:
        what is left of our fair share of its slots (its slots over ``senders``) once every gather
        slot of ours holds one, at most as many as we have gather slots. 0 where the area has no
        more than that (a slot granted ahead would sit idle while another rank's chunk waits)."""
        n = self.gather.num_slots
        return max(0, min(n, offer.slots // self.senders - n))

    def _ask_ahead(self) -> None:
        """Credits ahead: the chunks next in line for our gather slots (``ahead``) ask decode for
        their slots now, so that a grant's round trip is not on a gather slot's cycle. Only the head
        of our gather queue asks, in its order, and the pass stops at the first chunk that may not:
        every chunk that holds a gather slot asked before any chunk that waits for one, so with
        decode's FIFO grants a chunk granted ahead never holds a decode slot that one of ours
        holding a gather slot waits for (no deadlock, however many ranks share decode's area)."""
        for i, (w, k) in enumerate(self.gather.next_waiting(self.gather.num_slots)):
            sw = self.writes.get(w)
            if sw is None or sw.failed or not sw.target.active:  # (leaves the queue when its write settles)
                continue
            if i >= self.ahead(sw.offer):
                return
            self._ask(sw, k)

    def _free_gather(self, slot: int) -> None:
        """Our gather slot is free again (its chunk's write is final, or was never posted)."""
        self.gather.landed(slot, *self.gather.owner(slot))
        for g in self.gather.release(slot):
            self._gather_granted(g)
        self._ask_ahead()

    def _granted(self, ident: bytes, msg: wire.SlotGrant) -> PostChunk | None:
        """Decode granted a slot: the chunk's PostChunk, or (the write ended meanwhile, or the grant is
        not ours) a ChunkLanded "failed" that frees the decode slot at once (nothing was posted)."""
        found = self.by_chunk.get((msg.room, msg.decode_rank, msg.chunk))
        sw = self.writes.get(found[0]) if found else None
        if sw is not None and sw.target.ident == ident and (found[1] in sw.remote or found[1] in sw.ahead):
            # granted twice: refused by name. The same slot again must not be answered "failed" (that
            # would free a slot our write may still land in): the target fails, and its abort settles it
            self.counters["grants_refused"] += 1
            held = sw.remote.get(found[1], sw.ahead.get(found[1]))
            why = (f"decode rank {msg.decode_rank} granted chunk {msg.chunk} twice (slot {msg.slot}; it holds slot "
                   f"{held}) [room={msg.room} rank={msg.decode_rank} field=slot]")
            if msg.slot == held:
                sw.target.failure = sw.target.failure or why
            else:
                self._out.append(Send((ident,), _landed_failed(msg, self.cp_rank, why)))
            return None
        if sw is None or sw.target.ident != ident or found[1] not in sw.asked:
            # (the write ended, or the chunk never asked: nothing will be posted)
            self.counters["grants_refused"] += 1
            self._out.append(Send((ident,), _landed_failed(msg, self.cp_rank,
                                                           "no chunk of this rank waits for that slot")))
            return None
        k = found[1]
        if msg.slot >= sw.offer.slots:  # (the offer is the registered area: a slot inside it lies inside it)
            sw.target.failure = sw.target.failure or (
                f"decode rank {msg.decode_rank} granted slot {msg.slot} outside its {sw.offer.slots} staging slots "
                f"(registered area [{sw.offer.base:#x}, {sw.offer.end:#x})); nothing written [room={msg.room} "
                f"rank={msg.decode_rank} field=slot]")
        if sw.failed or not sw.target.active:
            self._out.append(Send((ident,), _landed_failed(msg, self.cp_rank, sw.target.failure or "target failed")))
            if k in sw.local:
                self._free_gather(sw.local.pop(k))
            return None
        if k not in sw.local:  # asked ahead: kept until the chunk takes a gather slot (``_gather_granted``)
            sw.ahead[k] = msg.slot
            return None
        sw.remote[k] = msg.slot
        return PostChunk(sw.write, sw.room, k, sw.target, sw.target.session, sw.staged, sw.local[k],
                         sw.offer.slot_addr(msg.slot), sw.after)

    def _chunk_final(self, sw: StagedWrite, k: int, ok: bool, reason: str) -> None:
        """Chunk ``k``'s write is final (or failed to post): report it to decode, free our slot."""
        if ok:
            msg = wire.ChunkLanded(room=sw.room, cp_rank=self.cp_rank, chunk=sw.first_chunk + k, slot=sw.remote[k],
                                   status="ok", reason="")
            sw.done += 1
            self.counters["chunks"] += 1
            self.counters["bytes_staged"] += int(sw.staged.chunk_bytes[k])
        else:
            sw.failed = True
            msg = wire.ChunkLanded(room=sw.room, cp_rank=self.cp_rank, chunk=sw.first_chunk + k, slot=sw.remote[k],
                                   status="failed", reason=reason)
        self._out.append(Send((sw.target.ident,), msg))
        self._free_gather(sw.local.pop(k))

    def _settle(self, sw: StagedWrite) -> None:
        """A staged write whose chunks are all landed ends ok; one that failed ends (not in flight
        any more) once its posted chunks are final: gather slots of chunks asked for but not
        granted are free (a grant that comes later is answered "failed"), chunks that still wait
        for a gather slot leave our queue."""
        if not sw.target.active:
            for k in [k for k in sw.local if k not in sw.remote]:
                self._free_gather(sw.local.pop(k))
        if sw.ahead and (sw.failed or not sw.target.active):  # decode slots granted ahead: nothing will be posted
            reason = sw.target.failure or "target failed"
            for k, slot in sw.ahead.items():
                self._out.append(Send((sw.target.ident,), wire.ChunkLanded(
                    room=sw.room, cp_rank=self.cp_rank, chunk=sw.first_chunk + k, slot=slot, status="failed",
                    reason=reason)))
            sw.ahead.clear()
        if sw.done != sw.num_chunks:
            if not (sw.failed or not sw.target.active) or sw.posted:
                return
            sw.failed = True
            self.gather.withdraw(sw.write)
        self.writes.pop(sw.write, None)
        for k in range(sw.num_chunks):
            self.by_chunk.pop((sw.room, sw.target.decode_rank, sw.first_chunk + k), None)
        ok = sw.done == sw.num_chunks and sw.target.active
        self._out.append(WriteEnded(sw.write, ok, "" if ok else (sw.target.failure or "staged write failed")))


_HANDLERS: dict[type, Callable[[StagedWrites, Any], None]] = {
    StageWrite: StagedWrites._start, GrantIn: StagedWrites._grant, ChunkPosted: StagedWrites._posted,
    ChunkPostFailed: StagedWrites._post_failed, ChunkFinal: StagedWrites._final, Settle: StagedWrites._settle_event,
    RoomGone: StagedWrites._room_gone, Prune: StagedWrites._prune, SetMode: StagedWrites._set_mode,
}


def _landed_failed(msg: wire.SlotGrant, cp_rank: int, reason: str) -> wire.ChunkLanded:
    return wire.ChunkLanded(room=msg.room, cp_rank=cp_rank, chunk=msg.chunk, slot=msg.slot, status="failed",
                            reason=reason)

