"""Prefill's staged writes: a sans-I/O book of chunks, slots and grants.

A target whose decode rank offered a staging area (``TransferRequest.staging_slots``) may be
*staged* (``choose_path``, or the ``staging`` override on either side). The area offered must
be the one the decode rank registered with the daemon, slot for slot (``registered_offer``,
hard rule 5): the request only says that this room may use it. A staged write is the
same write the direct path would post (its pages, one report), cut by ``stage_plan`` into
chunks that each pass through one slot of our gather buffer and one slot of the decode rank's
staging area:

    chunk k:  gather slot (ours, FIFO)  ->  Gather: the shell gathers pages -> gather slot now
              (on a GPU queued on the stager's stream), while  --SlotRequest-->  decode
              <--SlotGrant(slot)--  decode (FIFO: back-pressure when its area is full)
              PostChunk: the shell writes the gathered slot's pieces -> decode slot (on a GPU the
              write waits for the gather's event, not this thread)
              write final  --ChunkLanded(scatter list)-->  decode scatters slot -> pages

Credits: a rank has as many chunks asking for (or holding) a decode slot as it has gather
slots, and each is gathered before its grant comes back, so a grant is written the turn it
arrives; decode grants every free slot at once and each slot again the turn its scatter
completes. A grant that is not for a chunk of ours waiting for one (granted twice, or after
the write ended), or for a slot outside the registered area, is refused by name.
    every chunk landed: the write's PagesDone (after its ChunkLanded, on the same connection)

Remote writes land only in granted decode slots. A write is in flight (for the room's abort
ack and failure report, hard rule 6) until every chunk posted is final and no more will be
posted. The aux row rides in the last chunk's write as on the direct path, so it is staged too
(decode checks it lands in the room's own aux slot): nothing of a staged target writes anywhere
on decode but its staging slots.
No socket, clock or engine call here: the machine (``machine.py``) calls it under the shell's lock.
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
from kvbridge.transfer.staging import Grant, StagingArea
from kvbridge.transfer.prefill.peers import DecodePeer
from kvbridge.transfer.prefill.targets import Target

__all__ = ["Gather", "Offer", "PostChunk", "StagedWrite", "StagedWrites", "registered_offer"]


@dataclass(frozen=True)
class Offer:
    """A decode rank's staging area, as it registered it (``registered_offer``), and whether its
    request takes staged writes only."""

    slots: int
    slot_bytes: int
    base: int
    only: bool

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
    if not req.staging_slots:
        return None
    ctx = dict(room=req.room, rank=req.decode_rank)
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
    return Offer(nbytes // slot_bytes, slot_bytes, base, req.staging_only)


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
    remote: dict[int, int] = field(default_factory=dict)  # chunk -> decode slot granted
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
    ``PrefillRooms.chunk_posted(action, handle, now)`` or ``chunk_post_failed(action, reason, now)``."""

    write: int
    room: int
    chunk: int
    target: Target
    session: str
    staged: StagedPlan
    local_slot: int
    remote_addr: int
    after: Any


class StagedWrites:
    """The staged writes of one prefill rank, its gather slots, and the decode offers."""

    def __init__(self, mode: str, gather: StagingArea | None, engine_kind: Callable[[str], str], cp_rank: int,
                 rank: str) -> None:
        self.mode = mode
        self.gather = gather  # None: no gather buffer, every target direct
        self.engine_kind = engine_kind
        self.cp_rank = cp_rank
        self.rank = rank
        self.offers: dict[tuple[int, str], Offer] = {}  # (room, decode rank) -> its staging area
        self.offered_at: dict[tuple[int, str], float] = {}
        self.paths: dict[tuple[int, str], str] = {}  # (room, decode rank) -> "direct" / "staged"
        self.next_chunk: dict[tuple[int, str], int] = {}
        self.writes: dict[int, StagedWrite] = {}
        self.by_chunk: dict[tuple[int, str, int], tuple[int, int]] = {}  # (room, rank, wire chunk) -> (write, k)
        self.counters = {"staged_writes": 0, "chunks": 0, "bytes_staged": 0, "plan_slices": 0, "gather_waits": 0,
                         "direct_targets": 0, "staged_targets": 0, "grants_refused": 0}

    # ---- the choice --------------------------------------------------------------------------
    def offered(self, room: int, decode_rank: str, offer: Offer | None, now: float) -> None:
        """A target's staging area (``registered_offer``: checked against the decode rank's
        registration), kept until its room is forgotten."""
        if offer is not None:
            key = (room, decode_rank)
            self.offers[key] = offer
            self.offered_at[key] = now

    def path(self, room: int, t: Target, plan: TransferPlan) -> str:
        """The target's path, chosen on its first plan and kept (LayoutError when the decode rank
        wants staging only and this rank cannot stage)."""
        key = (room, t.decode_rank)
        found = self.paths.get(key)
        if found is not None:
            return found
        offer = self.offers.get(key)
        if offer is None:
            path = "direct"
        elif offer.only:
            if self.gather is None or self.mode == "never":
                raise LayoutError(f"decode rank {t.decode_rank} takes staged writes only, but this rank stages "
                                  f"nothing (staging {self.mode!r}, gather buffer "
                                  f"{'none' if self.gather is None else 'present'})", room=room, rank=self.rank,
                                  field="staging")
            path = "staged"
        elif self.gather is None or self.mode == "never":
            path = "direct"
        elif self.mode == "always":
            path = "staged"
        else:
            path = choose_path(plan, staging_thresholds(self.engine_kind(t.session)))
        self.paths[key] = path
        self.counters[f"{path}_targets"] += 1
        return path

    # ---- events ------------------------------------------------------------------------------
    def start(self, w: int, room: int, t: Target, plan: TransferPlan, after: Any, out: list[Any]) -> StagedWrite:
        """Stage write ``w``: its chunks queue for our gather slots; each slot taken asks decode for one."""
        key = (room, t.decode_rank)
        offer = self.offers[key]
        slot_bytes = min(self.gather.slot_bytes, offer.slot_bytes) & ~15
        staged = stage_plan(plan, slot_bytes, room=room, rank=self.rank)
        first = self.next_chunk.get(key, 0)
        self.next_chunk[key] = first + staged.num_chunks
        sw = StagedWrite(w, room, t, offer, staged, first, after)
        self.writes[w] = sw
        for k in range(staged.num_chunks):
            self.by_chunk[(room, t.decode_rank, first + k)] = (w, k)
        self.counters["staged_writes"] += 1
        self.counters["plan_slices"] += staged.num_plan_slices
        for k in range(staged.num_chunks):
            grant = self.gather.acquire(w, k)
            if grant is None:
                self.counters["gather_waits"] += 1
            else:
                self._gather_granted(grant, out)
        return sw

    def _gather_granted(self, g: Grant, out: list[Any]) -> None:
        sw = self.writes.get(g.room)
        if sw is None or sw.failed or not sw.target.active:  # (the write ended while its chunk waited)
            self._free_gather(g.slot, out)
            return
        sw.local[g.chunk] = g.slot
        out.append(Gather(sw.write, sw.room, g.chunk, sw.staged, g.slot, sw.after))
        out.append(Send((sw.target.ident,), wire.SlotRequest(
            room=sw.room, cp_rank=self.cp_rank, chunk=sw.first_chunk + g.chunk,
            num_bytes=int(sw.staged.chunk_span[g.chunk]))))

    def _free_gather(self, slot: int, out: list[Any]) -> None:
        """Our gather slot is free again (its chunk's write is final, or was never posted)."""
        self.gather.landed(slot, *self.gather.owner(slot))
        for g in self.gather.release(slot):
            self._gather_granted(g, out)

    def granted(self, ident: bytes, msg: wire.SlotGrant, out: list[Any]) -> PostChunk | None:
        """Decode granted a slot: the chunk's PostChunk, or (the write ended meanwhile, or the grant is
        not ours) a ChunkLanded "failed" that frees the decode slot at once (nothing was posted)."""
        found = self.by_chunk.get((msg.room, msg.decode_rank, msg.chunk))
        sw = self.writes.get(found[0]) if found else None
        if sw is not None and sw.target.ident == ident and found[1] in sw.remote:
            # granted twice: refused by name. The same slot again must not be answered "failed" (that
            # would free a slot our write may still land in): the target fails, and its abort settles it
            self.counters["grants_refused"] += 1
            held = sw.remote[found[1]]
            why = (f"decode rank {msg.decode_rank} granted chunk {msg.chunk} twice (slot {msg.slot}; it holds slot "
                   f"{held}) [room={msg.room} rank={msg.decode_rank} field=slot]")
            if msg.slot == held:
                sw.target.failure = sw.target.failure or why
            else:
                out.append(Send((ident,), _landed_failed(msg, self.cp_rank, why)))
            return None
        if sw is None or sw.target.ident != ident or found[1] not in sw.local:
            # (the write ended, or its chunk gave its gather slot up: nothing will be posted)
            self.counters["grants_refused"] += 1
            out.append(Send((ident,), _landed_failed(msg, self.cp_rank, "no chunk of this rank waits for that slot")))
            return None
        k = found[1]
        if msg.slot >= sw.offer.slots:  # (the offer is the registered area: a slot inside it lies inside it)
            sw.target.failure = sw.target.failure or (
                f"decode rank {msg.decode_rank} granted slot {msg.slot} outside its {sw.offer.slots} staging slots "
                f"(registered area [{sw.offer.base:#x}, {sw.offer.end:#x})); nothing written [room={msg.room} "
                f"rank={msg.decode_rank} field=slot]")
        if sw.failed or not sw.target.active:
            out.append(Send((ident,), _landed_failed(msg, self.cp_rank, sw.target.failure or "target failed")))
            self._free_gather(sw.local.pop(k), out)
            return None
        sw.remote[k] = msg.slot
        return PostChunk(sw.write, sw.room, k, sw.target, sw.target.session, sw.staged, sw.local[k],
                         sw.offer.slot_addr(msg.slot), sw.after)

    def posted(self, a: PostChunk, handle: int) -> None:
        self.writes[a.write].posted[handle] = a.chunk

    def chunk_final(self, sw: StagedWrite, k: int, ok: bool, reason: str, out: list[Any]) -> None:
        """Chunk ``k``'s write is final (or failed to post): report it to decode, free our slot."""
        t = sw.target
        if ok:
            off, dst, length = sw.staged.scatter(k, 0)
            msg = wire.ChunkLanded(room=sw.room, cp_rank=self.cp_rank, chunk=sw.first_chunk + k, slot=sw.remote[k],
                                   status="ok", reason="", scatter=wire.pack_scatter(off, dst, length))
            sw.done += 1
            self.counters["chunks"] += 1
            self.counters["bytes_staged"] += int(sw.staged.chunk_bytes[k])
        else:
            sw.failed = True
            msg = wire.ChunkLanded(room=sw.room, cp_rank=self.cp_rank, chunk=sw.first_chunk + k, slot=sw.remote[k],
                                   status="failed", reason=reason, scatter=b"")
        out.append(Send((t.ident,), msg))
        self._free_gather(sw.local.pop(k), out)

    def settled(self, sw: StagedWrite) -> bool:
        """Nothing of the write is in flight and nothing more will be posted: every chunk landed, or
        it failed (its target too) and its posted chunks are final. Chunks that still wait for a
        slot leave our queue (a grant that comes later is answered "failed")."""
        if sw.done == sw.num_chunks:
            return True
        if not (sw.failed or not sw.target.active) or sw.posted:
            return False
        sw.failed = True
        self.gather.withdraw(sw.write)  # chunks waiting for a gather slot leave the FIFO
        return True

    def cancel(self, sw: StagedWrite, out: list[Any]) -> None:
        """The write failed: gather slots of chunks asked for but not granted are free (nothing was
        posted from them; a grant that comes later is answered "failed")."""
        for k in [k for k in sw.local if k not in sw.remote]:
            self._free_gather(sw.local.pop(k), out)

    def forget(self, sw: StagedWrite) -> None:
        self.writes.pop(sw.write, None)
        for k in range(sw.num_chunks):
            self.by_chunk.pop((sw.room, sw.target.decode_rank, sw.first_chunk + k), None)

    def forget_room(self, room: int) -> None:
        for book in (self.offers, self.offered_at, self.paths, self.next_chunk):
            for key in [key for key in book if key[0] == room]:
                del book[key]

    def prune(self, known: Callable[[int], bool], now: float, horizon: float) -> None:
        """Drop what is kept of rooms the machine does not hold: an offer once it is ``horizon``
        seconds old (kept with its target; a room forgotten without ``forget_room`` leaves one)."""
        for key in [key for key in self.offers if not known(key[0]) and now - self.offered_at[key] > horizon]:
            del self.offers[key], self.offered_at[key]
        for book in (self.paths, self.next_chunk):
            for key in [key for key in book if not known(key[0])]:
                del book[key]


def _landed_failed(msg: wire.SlotGrant, cp_rank: int, reason: str) -> wire.ChunkLanded:
    return wire.ChunkLanded(room=msg.room, cp_rank=cp_rank, chunk=msg.chunk, slot=msg.slot, status="failed",
                            reason=reason, scatter=b"")

