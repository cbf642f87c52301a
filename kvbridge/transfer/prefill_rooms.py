"""The prefill rank's rooms, driven by the PrefillEndpoint loop: decode requests
and aborts in, writes posted and collected, reports out. Every method runs with
the endpoint's lock held; replies go through ``ep._reply``."""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.layout import plan_transfer
from kvbridge.transfer import wire
from kvbridge.transfer.digest import page_digests
from kvbridge.transfer.engine import WriteState
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.sender import SendRoom, Target
from kvbridge.transfer.targets import DestinationCache, target_from_request

if TYPE_CHECKING:
    from kvbridge.transfer.prefill import PrefillEndpoint

log = logging.getLogger(__name__)

ROOM_RETENTION_S = 60.0  # a final room whose KVSender the engine still holds is forgotten after this
DEADLINE_SCAN_S = 0.02  # deadlines are checked on this period, not on every step


class SendBook:
    def __init__(self, ep: PrefillEndpoint) -> None:
        self.ep = ep
        self.cfg = ep.config
        self.rooms: dict[int, SendRoom] = {}
        self.handles: dict[int, tuple[SendRoom, Target]] = {}
        self.released: collections.deque[int] = collections.deque()  # rooms whose KVSender was dropped (no lock)
        self.counters = {"rooms_ok": 0, "rooms_failed": 0, "bytes": 0, "slices": 0}
        self.destinations = DestinationCache()  # decode peers' buffer tables, paired with ours once
        self.dirty: set[int] = set()  # rooms with new chunks or targets: posted and settled at the next step
        self.next_deadline_scan = 0.0

    def room(self, room: int) -> SendRoom:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = SendRoom(room, self.cfg.cp_rank, self.ep.lanes, self.ep.page_size)
        return r

    def on_request(self, ident: bytes, req: wire.TransferRequest) -> None:
        rank = self.cfg.rank_label
        if self.ep._closing:
            self.reply_failed(ident, req.room, f"prefill rank {rank} is shutting down")
            return
        if req.fingerprint != self.ep.fingerprint:
            self.reply_failed(ident, req.room, f"contract fingerprint {req.fingerprint} differs from prefill rank "
                                                f"{rank}'s {self.ep.fingerprint}; nothing transferred (hard rule 7)")
            if req.room in self.rooms:
                self.fail_room(self.rooms[req.room], f"decode rank {req.decode_rank} has a different contract")
            return
        r = self.room(req.room)
        if r.state.final:
            self.reply_failed(ident, req.room, f"room already {r.state.state.name} on {rank}: {r.state.reason}")
            return
        try:
            r.set_num_tokens(req.num_tokens, f"decode rank {req.decode_rank}")
            target = target_from_request(req, ident, self.ep.specs, self.ep.buffers.descs, self.ep.aux_schema, r.num_pages,
                                          self.destinations)
        except KVBridgeError as exc:  # nothing was posted for this target: safe to refuse
            self.reply_failed(ident, req.room, str(exc))
            self.fail_room(r, f"decode rank {req.decode_rank}'s request refused: {exc}")
            return
        if req.decode_rank in r.targets:
            self.reply_failed(ident, req.room, f"decode rank {req.decode_rank} asked twice for this room")
            return
        r.targets[req.decode_rank] = target
        r.num_expected_targets = req.num_decode_ranks
        self.dirty.add(r.room)
        if r.state.state == KVPoll.Bootstrapping and len(r.targets) >= r.num_expected_targets:
            r.state.to(KVPoll.WaitingForInput)
        if self.ep.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.4f target %s pages=%d pools=%s", req.room, rank, r.age_ms, time.monotonic(), req.decode_rank,
                     target.dst_pages.size, ",".join(target.pools))

    def on_abort(self, ident: bytes, msg: wire.Abort) -> None:
        r = self.rooms.get(msg.room)
        t = r.targets.get(msg.decode_rank) if r else None
        if t is None or t.closed:  # nothing of this room is, or will be, in flight to that rank
            self.ep._reply(ident, wire.AbortAck(room=msg.room, cp_rank=self.cfg.cp_rank))
            return
        t.abort_reason = t.abort_reason or msg.reason or "aborted by decode"
        self.fail_room(r, f"decode rank {msg.decode_rank} aborted: {t.abort_reason}")

    def reply_failed(self, ident: bytes, room: int, reason: str) -> None:
        log.warning("room %d refused on %s: %s", room, self.cfg.rank_label, reason)
        self.ep._reply(ident, wire.PagesDone(room=room, cp_rank=self.cfg.cp_rank, status="failed", reason=reason,
                                                pools=[], logical_pages=b"", digests=None))

    # -- posting and collecting (lock held) -----------------------------------

    def pump(self) -> None:
        """Post and settle the rooms something happened to since the last step (O(events),
        not O(rooms): a rank with 1,000 rooms in flight does not rescan them per message)."""
        while self.dirty:
            r = self.rooms.get(self.dirty.pop())
            if r is not None:
                self.post_room(r)
                self.settle(r)

    def post_room(self, r: SendRoom) -> None:
        """Post every queued chunk (and the aux row) to every active target. No socket
        I/O: the engine thread calls this from send() too, to save a hop to the loop."""
        if r.state.final or r.num_tokens is None:
            return
        for t in r.targets.values():
            while t.active and t.posted < len(r.chunks):
                last_chunk = t.posted == len(r.chunks) - 1
                # the aux row rides in the last chunk's batch: one write, one completion
                with_aux = last_chunk and r.is_last and r.aux_row is not None and not t.aux_posted
                self.post_chunk(r, t, *r.chunks[t.posted], with_aux=with_aux)
                t.posted += 1
            if t.active and r.is_last and r.aux_row is not None and not t.aux_posted:
                self.post_chunk(r, t, np.zeros(0, np.int64), np.zeros(0, np.int64), with_aux=True)
        if r.state.state == KVPoll.WaitingForInput and any(t.posted or t.aux_posted for t in r.targets.values()):
            r.state.to(KVPoll.Transferring)

    def post_chunk(self, r: SendRoom, t: Target, logical: np.ndarray, local: np.ndarray, with_aux: bool) -> None:
        try:
            src, dst, length = (), (), ()
            if logical.size:
                plan = plan_transfer(self.ep.specs, self.ep.buffers.descs, t.dst_bufs, logical, local,
                                     t.dst_pages[logical], r.num_tokens, pools=t.pools, room=r.room,
                                     rank=self.cfg.rank_label, paired=t.paired)
                src, dst, length = (plan.src,), (plan.dst,), (plan.length,)
            if with_aux:
                t.aux_posted = True
                aux_src = self.ep.aux.stage(r.room, r.aux_row)
                src += (np.array([aux_src], np.uint64),)
                dst += (np.array([t.aux_addr], np.uint64),)
                length += (np.array([self.ep.aux_schema.row_bytes], np.uint64),)
            src, dst, length = np.concatenate(src), np.concatenate(dst), np.concatenate(length)
            handle = self.ep.engine.submit_write(t.session, src, dst, length)
        except KVBridgeError as exc:
            t.failure = f"{'aux row: ' if with_aux and not logical.size else ''}{exc}"
            return
        t.inflight[handle] = (logical, with_aux)
        self.handles[handle] = (r, t)
        num_bytes, num_slices = int(length.sum()), int(length.size)
        self.counters["bytes"] += num_bytes
        self.counters["slices"] += num_slices
        r.num_bytes += num_bytes
        r.num_slices += num_slices
        if self.ep.trace:
            log.info("trace room=%d rank=%s +%.2fms @%.4f -> %s pages=%s%s slices=%d bytes=%d", r.room,
                     self.cfg.rank_label, r.age_ms, time.monotonic(), t.decode_rank, logical.tolist(),
                     " +aux" if with_aux else "", num_slices, num_bytes)

    def collect(self) -> None:
        for handle in list(self.handles):
            status = self.ep.engine.poll(handle)
            if status.state is WriteState.PENDING:
                continue
            r, t = self.handles.pop(handle)
            pages, with_aux = t.inflight.pop(handle)
            if self.ep.trace:
                log.info("trace room=%d rank=%s +%.2fms @%.4f write of %d pages%s to %s %s", r.room,
                         self.cfg.rank_label, r.age_ms, time.monotonic(), pages.size, " +aux" if with_aux else "",
                         t.decode_rank, status.state.value)
            if status.state is WriteState.FAILED:
                t.failure = t.failure or f"write to {t.decode_rank} ({t.session}) failed: {status.reason}"
            elif t.active:
                if pages.size:
                    t.num_pages_done += pages.size
                    digests = None
                    if t.want_digest:
                        local = self.local_pages_of(r, pages)
                        digests = page_digests(self.ep.specs, self.ep.buffers.tensors, t.pools, pages, local,
                                               r.num_tokens).tobytes()
                    self.ep._reply(t.ident, wire.PagesDone(room=r.room, cp_rank=self.cfg.cp_rank, status="ok",
                                                           reason="", pools=list(t.pools),
                                                           logical_pages=wire.pack_pages(pages), digests=digests))
                if with_aux:
                    t.aux_done = True
                    self.ep._reply(t.ident, wire.AuxDone(room=r.room, cp_rank=self.cfg.cp_rank, status="ok", reason=""))
            self.settle(r)

    @staticmethod
    def local_pages_of(r: SendRoom, pages: np.ndarray) -> np.ndarray:
        logical = np.concatenate([c[0] for c in r.chunks])
        local = np.concatenate([c[1] for c in r.chunks])
        order = np.argsort(logical)
        return local[order[np.searchsorted(logical[order], pages)]]

    def settle(self, r: SendRoom) -> None:
        """Send final reports for quiet targets and move the room to its final state."""
        for t in r.targets.values():
            if t.closed or t.inflight:
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
        if r.state.final or r.num_inflight:
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
        self.ep.aux.release(r.room)
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
            self.ep.aux.release(r.room)
            self.counters["rooms_failed"] += 1
        else:
            self.settle(r)

    def deadlines(self) -> None:
        now = time.monotonic()
        if now < self.next_deadline_scan:
            return
        self.next_deadline_scan = now + DEADLINE_SCAN_S
        for r in self.rooms.values():
            if r.state.final:
                continue
            if r.state.state == KVPoll.Bootstrapping and now - r.created > self.cfg.target_timeout:
                asked = f"only {len(r.targets)} of {r.num_expected_targets}" if r.targets else "no"
                self.fail_room(r, f"{asked} decode ranks asked for room {r.room} within {self.cfg.target_timeout:.1f}s")
            for t in r.targets.values():
                if t.active and now > t.deadline:
                    t.failure = f"decode rank {t.decode_rank}'s deadline passed before the room was written"
            self.settle(r)

    def gc(self, now: float) -> None:
        while self.released:
            r = self.rooms.get(self.released.popleft())
            if r is not None:
                r.engine_done = True
        for room in [k for k, r in self.rooms.items() if r.state.final and not r.num_inflight
                     and (r.engine_done or now - r.state.entered[r.state.state] > ROOM_RETENTION_S)]:
            del self.rooms[room]
