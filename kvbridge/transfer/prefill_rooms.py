"""The prefill rank's rooms, driven by the PrefillEndpoint loop: decode requests
and aborts in, writes posted and collected, reports out. Every method runs with
the endpoint's lock held; replies go through ``ep._reply``. Lifecycles (open,
draining, closed, tombstones) follow ``transfer/lifecycle.py``."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.errors import KVBridgeError, RoomInUse
from kvbridge.transfer import wire
from kvbridge.transfer.aux_rows import aux_slices
from kvbridge.transfer.digest import page_digests
from kvbridge.transfer.engine import WriteState
from kvbridge.transfer.rooms import Stage, Tombstones
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.sender import SendRoom, Target
from kvbridge.transfer.targets import plan_target, target_from_request

if TYPE_CHECKING:
    from kvbridge.transfer.decode_peers import DecodePeers
    from kvbridge.transfer.prefill import PrefillEndpoint

log = logging.getLogger(__name__)

DEADLINE_SCAN_S = 0.02  # deadlines are checked on this period, not on every step


class SendBook:
    def __init__(self, ep: PrefillEndpoint, peers: DecodePeers) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.peers = peers
        self.rooms: dict[int, SendRoom] = {}
        self.unowned: set[int] = set()  # rooms no handle holds (UNATTACHED or DRAINING): closed once quiet
        self.tombstones = Tombstones()
        self.handles: dict[int, tuple[SendRoom, Target]] = {}
        self.released: collections.deque[SendRoom] = collections.deque()  # dropped KVSenders (appended without lock)
        self.results: collections.deque[Callable[[], None]] = collections.deque()  # pool-thread results for the loop
        self.counters = {"rooms_ok": 0, "rooms_failed": 0, "bytes": 0, "slices": 0}
        self.dirty: set[int] = set()  # rooms with new chunks or targets: posted and settled at the next step
        self.next_deadline_scan = 0.0
        self.final_while_posting = False  # a write became final inside submit_write: collect after posting

    # -- rooms from the engine ------------------------------------------------

    def open(self, room: int) -> SendRoom:
        """The room for a new KVSender: fresh, or the one a decode rank asked for first."""
        r = self.rooms.get(room)
        if r is not None and r.life.stage == Stage.UNATTACHED:
            r.life.to(Stage.OPEN)
            self.unowned.discard(room)
            return r
        if r is not None:
            what = ("open: a KVSender still holds it" if r.life.stage == Stage.OPEN
                    else f"draining: {r.num_inflight} write(s) of the previous room still in flight")
            raise RoomInUse(f"room {room} is {what} ({r.state.state.name}); close() the old sender and wait "
                            "(sender(room, wait=...)), or use a new room id", draining=r.life.stage == Stage.DRAINING,
                            room=room, rank=self.cfg.rank_label, field="room")
        self.tombstones.discard(room)
        r = self.rooms[room] = SendRoom(room, self.cfg.cp_rank, self.ep.lanes, self.ep.page_size)
        return r

    def close(self, r: SendRoom) -> None:
        """The engine let go of the room: fail it if unfinished; forget it once quiet."""
        if r.life.stage != Stage.OPEN:
            return
        r.life.to(Stage.DRAINING)
        self.unowned.add(r.room)
        if not r.state.final:
            self.fail_room(r, f"the engine closed room {r.room}'s sender on {self.cfg.rank_label} before it finished")
        self.forget_if_quiet(r)

    def forget_if_quiet(self, r: SendRoom) -> None:
        """Close a room no handle holds once it is final and quiet. One decode asked for first
        that failed before the engine attached stays ``target_timeout`` longer, so that the
        engine's sender() still finds it and reads why."""
        if not r.state.final or r.num_inflight or r.life.stage not in (Stage.UNATTACHED, Stage.DRAINING):
            return
        if r.life.stage == Stage.UNATTACHED and r.state.since() < self.cfg.target_timeout:
            return
        self.flush_replies(r)
        r.life.to(Stage.CLOSED)
        if self.rooms.get(r.room) is r:
            del self.rooms[r.room]
        self.unowned.discard(r.room)
        self.ep._room_freed.notify_all()  # sender(room, wait=...) may open it now
        outcome = r.state.state.name + (f": {r.state.reason}" if r.state.reason else "")
        self.tombstones.add(r.room, outcome)

    # -- decode requests --------------------------------------------------------

    def on_request(self, ident: bytes, req: wire.TransferRequest) -> None:
        rank = self.cfg.rank_label
        if self.ep.trace:
            log.info("trace room=%d rank=%s @%.6f request from %s pages=%d", req.room, rank, time.monotonic(),
                     req.decode_rank, len(req.page_ids) // 4)
        if self.ep._closing:
            self.reply_failed(ident, req.room, f"prefill rank {rank} is shutting down")
            return
        if req.fingerprint != self.ep.fingerprint:
            self.refuse(ident, req, f"contract fingerprint {req.fingerprint} differs from prefill rank {rank}'s "
                                    f"{self.ep.fingerprint}; nothing transferred (hard rule 7)")
            return
        if self.peers.get(req.decode_rank_id) is None:
            self.peers.wait_for(ident, req)  # read its registration off the loop, then deliver()
        else:
            self.deliver(ident, req)

    def deliver(self, ident: bytes, req: wire.TransferRequest) -> None:
        """A request whose decode registration is known: check it into a Target."""
        rank = self.cfg.rank_label
        peer = self.peers.get(req.decode_rank_id)
        if peer is None:  # evicted meanwhile: read it again
            self.peers.wait_for(ident, req)
            return
        r = self.rooms.get(req.room)
        if r is None:
            closed = self.tombstones.get(req.room)
            if closed is not None:
                self.reply_failed(ident, req.room, f"room {req.room} was already closed on prefill rank {rank} "
                                                   f"({closed}) when decode rank {req.decode_rank} asked")
                return
            r = self.rooms[req.room] = SendRoom(req.room, self.cfg.cp_rank, self.ep.lanes, self.ep.page_size,
                                                Stage.UNATTACHED)
            self.unowned.add(req.room)
        if r.state.final:
            reason = f": {r.state.reason}" if r.state.reason else ""
            self.reply_failed(ident, req.room, f"room {req.room} already ended on {rank} ({r.state.state.name}{reason})")
            return
        failing = next((t.failure or t.abort_reason for t in r.targets.values() if not t.active), None)
        if r.life.stage == Stage.DRAINING or failing is not None:  # no new target for a room on its way out
            why = failing or "its sender was closed"
            self.reply_failed(ident, req.room, f"room {req.room} is failing on {rank} ({why})")
            return
        if peer.fingerprint != self.ep.fingerprint:
            self.refuse(ident, req, f"decode rank {peer.label} registered contract {peer.fingerprint}, prefill rank "
                                    f"{rank} has {self.ep.fingerprint}; nothing transferred (hard rule 7)")
            return
        if req.want_digest and not self.ep.buffers.readable:
            self.refuse(ident, req, f"decode rank {req.decode_rank} wants page digests, but prefill rank {rank}'s "
                                    "buffers are device memory given as addresses (RawBuffer), which kvbridge cannot "
                                    "read: turn verify_digest off on decode")
            return
        try:
            # num_tokens 0: the decode rank knows only its pages (first_page + page ids)
            r.set_length(f"decode rank {req.decode_rank}", num_tokens=req.num_tokens or None,
                         num_pages=None if req.num_tokens else req.first_page + len(req.page_ids) // 4)
            target = target_from_request(req, ident, self.ep.specs, self.ep.buffers.descs, self.ep.aux_schema, r, peer,
                                         tp=(self.cfg.tp_size, self.cfg.tp_rank))
        except KVBridgeError as exc:  # nothing was posted for this target: safe to refuse
            self.refuse(ident, req, str(exc))
            return
        if req.decode_rank in r.targets:
            self.reply_failed(ident, req.room, f"decode rank {req.decode_rank} asked twice for this room")
            return
        r.targets[req.decode_rank] = target
        r.num_expected_targets = target.num_decode_targets  # the decode ranks whose TP route runs through us
        self.dirty.add(r.room)
        if r.state.state == KVPoll.Bootstrapping and len(r.targets) >= r.num_expected_targets:
            r.state.to(KVPoll.WaitingForInput)
        if self.ep.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f target %s pages=%d first_page=%d pools=%s", req.room, rank,
                     r.age_ms, time.monotonic(), req.decode_rank, target.dst_pages.size, target.first_page,
                     ",".join(target.pools))

    def refuse(self, ident: bytes, req: wire.TransferRequest, reason: str) -> None:
        """Refuse a request (nothing of it was posted) and fail its room here."""
        r = self.rooms.get(req.room)
        if r is not None and not r.state.final:
            self.fail_room(r, f"decode rank {req.decode_rank}'s request refused: {reason}")
        self.reply_failed(ident, req.room, reason)

    def on_abort(self, ident: bytes, msg: wire.Abort) -> None:
        """A decode rank aborts: its target (if any) stops, and so does the room for every decode
        rank, since a decode instance's TP ranks give up a request together. The ack waits until
        nothing of the room is in flight (``reply_when_quiet``)."""
        r = self.rooms.get(msg.room)
        t = r.targets.get(msg.decode_rank) if r else None
        if t is not None and not t.closed:
            t.abort_reason = t.abort_reason or msg.reason or "aborted by decode"
            self.fail_room(r, f"decode rank {msg.decode_rank} aborted: {t.abort_reason}")
            return  # settle() acks once the room is quiet
        if r is not None and not r.state.final:
            self.fail_room(r, f"decode rank {msg.decode_rank} aborted: {msg.reason or 'aborted by decode'}")
        self.reply_when_quiet(msg.room, ident, wire.AbortAck(room=msg.room, cp_rank=self.cfg.cp_rank))

    def reply_failed(self, ident: bytes, room: int, reason: str) -> None:
        log.warning("room %d refused on %s: %s", room, self.cfg.rank_label, reason)
        self.reply_when_quiet(room, ident, wire.PagesDone(room=room, cp_rank=self.cfg.cp_rank, status="failed",
                                                          reason=reason, pools=[], logical_pages=b"", digests=None))

    def reply_when_quiet(self, room: int, ident: bytes, msg: wire.PagesDone | wire.AbortAck) -> None:
        """Send a failure report or abort ack once no write of ``room`` is in flight to *any* decode
        rank. Either one tells the decode rank it may free the room's pages (hard rule 6), and the
        TP ranks of a decode instance free together (SGLang all-reduces their poll states with
        MIN): one rank's go-ahead must mean no write can land in another's pages either."""
        r = self.rooms.get(room)
        if r is not None and r.num_inflight:
            r.pending_replies.append((ident, msg))
        else:
            self.ep._reply(ident, msg)

    def flush_replies(self, r: SendRoom) -> None:
        while r.pending_replies and not r.num_inflight:
            self.ep._reply(*r.pending_replies.pop(0))

    # -- posting and collecting (lock held) -----------------------------------

    def pump(self) -> None:
        """Post and settle the rooms something happened to since the last step (O(events),
        not O(rooms): a rank with 1,000 rooms in flight does not rescan them per message)."""
        while self.dirty:
            r = self.rooms.get(self.dirty.pop())
            if r is not None:
                self.post_and_settle(r)

    def post_and_settle(self, r: SendRoom) -> None:
        self.post_room(r)
        self.settle(r)

    def post_room(self, r: SendRoom) -> None:
        """Post every queued chunk (and the aux row) to every active target. No socket
        I/O: the engine thread calls this from send() too, to save a hop to the loop."""
        if r.state.final or not r.length_known:
            return
        for t in r.targets.values():
            while t.active and t.posted < len(r.chunks):
                last_chunk = t.posted == len(r.chunks) - 1
                # the aux row rides in the last chunk's batch: one write, one completion
                with_aux = last_chunk and r.is_last and r.has_aux and t.aux_source and not t.aux_posted
                self.post_chunk(r, t, *r.chunks[t.posted], with_aux=with_aux, after=r.chunk_events[t.posted])
                t.posted += 1
            if t.active and r.is_last and r.has_aux and t.aux_source and not t.aux_posted:
                self.post_chunk(r, t, np.zeros(0, np.int64), np.zeros(0, np.int64), with_aux=True,
                                after=r.last_event)
        if r.state.state == KVPoll.WaitingForInput and any(t.posted or t.aux_posted for t in r.targets.values()):
            r.state.to(KVPoll.Transferring)
        if self.final_while_posting:  # every handle is registered now
            self.final_while_posting = False
            self.collect()

    def post_chunk(self, r: SendRoom, t: Target, logical: np.ndarray, local: np.ndarray, with_aux: bool,
                   after: Any = None) -> None:
        if t.first_page:  # the decode rank already holds pages below its prefix
            keep = logical >= t.first_page
            logical, local = logical[keep], local[keep]
        if not logical.size and not with_aux:
            return
        try:
            aux = None
            if with_aux:
                t.aux_posted = True
                if r.aux_row is not None:  # staged by send(); its device copy is one more event to wait on
                    source, slot = self.ep.aux_staging, self.ep.aux_staging.stage(r.room, r.aux_row, after=after)
                    after = self.ep.aux_staging.ready_event(r.room) or after
                else:
                    source, slot = self.ep.aux_buffers, r.aux_slot
                aux = aux_slices(self.ep.aux_schema, source.regions, slot, t.aux_dst, t.aux_slot,
                                 src_base=source.row_base, dst_base=t.aux_row_base)
            if logical.size:  # the aux row rides in the same write, after the pages' slices
                plan = plan_target(self.ep.specs, self.ep.buffers.descs, t, logical, local, r.plan_tokens,
                                   room=r.room, rank=self.cfg.rank_label, extra=aux)
                src, dst, length = plan.src, plan.dst, plan.length
            else:
                src, dst, length = (np.asarray(a, dtype=np.uint64) for a in aux)
            handle = self.ep.engine.submit_write(t.session, src, dst, length, after=after)
        except KVBridgeError as exc:
            t.failure = f"{'aux row: ' if with_aux and not logical.size else ''}{exc}"
            return
        except Exception as exc:  # a bug must fail this target, not the engine thread or the loop that called us
            log.exception("room %d on %s: posting to %s failed", r.room, self.cfg.rank_label, t.decode_rank)
            t.failure = f"internal error posting room {r.room} to {t.decode_rank}: {type(exc).__name__}: {exc}"
            return
        t.inflight[handle] = (logical, with_aux)
        self.handles[handle] = (r, t)
        if r.first_post is None:
            r.first_post = time.monotonic()
        num_bytes, num_slices = int(length.sum()), len(length)
        self.counters["bytes"] += num_bytes
        self.counters["slices"] += num_slices
        r.num_bytes += num_bytes
        r.num_slices += num_slices
        if self.ep.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.6f -> %s pages=%s%s slices=%d bytes=%d", r.room,
                     self.cfg.rank_label, r.age_ms, time.monotonic(), t.decode_rank, _pages_text(logical),
                     " +aux" if with_aux else "", num_slices, num_bytes)

    def collect(self) -> None:
        """Report the writes that became final (the loop, or the engine's callback thread)."""
        final = self.ep.engine.take_final()
        for handle in list(self.handles) if final is None else [h for h in final if h in self.handles]:
            status = self.ep.engine.poll(handle)
            if status.state is WriteState.PENDING:
                continue
            r, t = self.handles.pop(handle)
            pages, with_aux = t.inflight.pop(handle)
            if self.ep.trace:
                log.info("trace room=%d rank=%s +%.2fms @%.6f write of %d pages%s to %s %s", r.room,
                         self.cfg.rank_label, r.age_ms, time.monotonic(), pages.size, " +aux" if with_aux else "",
                         t.decode_rank, status.state.value)
            if status.state is WriteState.FAILED:
                t.failure = t.failure or f"write to decode rank {t.decode_rank} ({t.session}) failed: {status.reason}"
            elif t.active:
                digests = None
                if pages.size:
                    t.num_pages_done += pages.size
                    if t.want_digest:
                        local = self.local_pages_of(r, pages)
                        digests = page_digests(self.ep.specs, self.ep.buffers.tensors, t.pools, pages, local,
                                               r.plan_tokens).tobytes()
                if with_aux:
                    t.aux_done = True
                # one report per write: its pages and, when it carried it, the aux row
                self.ep._reply(t.ident, wire.PagesDone(room=r.room, cp_rank=self.cfg.cp_rank, status="ok", reason="",
                                                       pools=list(t.pools) if pages.size else [],
                                                       logical_pages=pages.astype("<i4").tobytes(), digests=digests,
                                                       aux=with_aux, num_tokens=(r.num_tokens or 0) if with_aux else 0))
            self.settle(r)
            self.forget_if_quiet(r)

    @staticmethod
    def local_pages_of(r: SendRoom, pages: np.ndarray) -> np.ndarray:
        logical = np.concatenate([c[0] for c in r.chunks])
        local = np.concatenate([c[1] for c in r.chunks])
        order = np.argsort(logical)
        return local[order[np.searchsorted(logical[order], pages)]]

    def settle(self, r: SendRoom) -> None:
        """Send final reports and move the room to its final state. A failure report or abort ack
        goes out only once nothing of the room is in flight to any decode rank (see
        ``reply_when_quiet``)."""
        quiet = not r.num_inflight
        for t in r.targets.values():
            if t.closed or not quiet and not t.active or t.inflight:
                continue
            if t.abort_reason is not None:
                self.ep._reply(t.ident, wire.AbortAck(room=r.room, cp_rank=self.cfg.cp_rank))
                t.closed = True
            elif t.failure is not None:
                self.ep._reply(t.ident, wire.PagesDone(room=r.room, cp_rank=self.cfg.cp_rank, status="failed",
                                                       reason=t.failure, pools=[], logical_pages=b"", digests=None))
                t.closed = True
            elif r.target_complete(t):
                t.closed = True
        if not quiet:
            return
        self.flush_replies(r)
        if r.state.final:
            return
        failures = [t.failure or f"decode rank {t.decode_rank} aborted: {t.abort_reason}"
                    for t in r.targets.values() if not t.active]
        if failures:
            r.state.to(KVPoll.Failed, failures[0])
        elif (r.num_expected_targets is not None and len(r.targets) >= r.num_expected_targets
              and all(r.target_complete(t) for t in r.targets.values())):
            r.state.advance_to(KVPoll.Success)
        else:
            return
        self.ep.aux_staging.release(r.room)
        self.counters["rooms_ok" if r.state.state == KVPoll.Success else "rooms_failed"] += 1
        if self.ep.trace or r.state.state == KVPoll.Failed:
            log.log(logging.INFO if r.state.state == KVPoll.Success else logging.WARNING,
                    "room %d on %s: %s %s", r.room, self.cfg.rank_label, r.state.state.name, r.state.reason or "")

    def fail_room(self, r: SendRoom, reason: str) -> None:
        """Stop posting; the room turns Failed once nothing of it is in flight."""
        for t in r.targets.values():
            if t.active:
                t.failure = reason
        if not r.targets and not r.state.final:
            r.state.to(KVPoll.Failed, reason)
            self.ep.aux_staging.release(r.room)
            self.counters["rooms_failed"] += 1
        else:
            self.settle(r)

    def deadlines(self) -> None:
        now = time.monotonic()
        if now < self.next_deadline_scan:
            return
        self.next_deadline_scan = now + DEADLINE_SCAN_S
        for r in list(self.rooms.values()):
            if r.state.final:
                continue
            if r.state.state == KVPoll.Bootstrapping and now - r.created > self.cfg.target_timeout:
                asked = f"only {len(r.targets)} of {r.num_expected_targets}" if r.targets else "no"
                self.fail_room(r, f"{asked} decode ranks asked for room {r.room} within {self.cfg.target_timeout:.1f}s")
            for t in r.targets.values():
                if not t.active or t.closed:
                    continue
                silent = self.peers.silent_for(t.ident, now, t.created)
                if silent > self.cfg.peer_timeout:  # the decode rank pings while it has rooms here
                    t.failure = (f"decode rank {t.decode_rank} ({t.session}) sent nothing for {silent:.1f}s "
                                 f"(peer timeout {self.cfg.peer_timeout:.1f}s): presumed dead")
                elif now > t.deadline:
                    t.failure = f"decode rank {t.decode_rank}'s deadline passed before the room was written"
            self.settle(r)
            self.forget_if_quiet(r)

    def gc(self, now: float) -> None:
        """Close rooms whose handle was dropped; forget quiet ones; prune tombstones and peers."""
        while self.released:
            self.close(self.released.popleft())
        for room in list(self.unowned):
            r = self.rooms.get(room)
            if r is None:
                self.unowned.discard(room)
            else:
                self.forget_if_quiet(r)
        self.tombstones.prune(now)
        in_use = {t.ident for r in self.rooms.values() for t in r.targets.values() if not t.closed}
        self.peers.prune(now, in_use, horizon=10 * self.cfg.peer_timeout)


def _pages_text(pages: np.ndarray) -> str:
    """A trace line's page list: in full when short, else its count and ends."""
    if pages.size <= 8:
        return str(pages.tolist())
    return f"{pages.size}[{int(pages[0])}..{int(pages[-1])}]"
