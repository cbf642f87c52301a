"""PrefillEndpoint: one prefill rank's control loop and data path.

One loop thread owns the control socket and every room's state; engine threads
only queue work under the lock and wake it. The loop reads like ``step()``:

    receive control messages  ->  post writes for new chunks and new targets
    ->  collect completions  ->  report (PagesDone / AuxDone / AbortAck)  ->  deadlines

Threads: the loop, the engine's own, and the bootstrap lease keeper; never one
per room.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract, fingerprint
from kvbridge.errors import KVBridgeError, LayoutError, TransferError
from kvbridge.layout import AuxRow, AuxSchema, OwnerLanes, PoolSpec, plan_transfer
from kvbridge.transfer import wire
from kvbridge.transfer.channel import ControlServer
from kvbridge.transfer.digest import page_digests
from kvbridge.transfer.engine import TransferEngine, WriteState
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.registration import AuxStaging, EndpointBuffers, register_rank
from kvbridge.transfer.sender import KVSender, SendRoom, Target
from kvbridge.transfer.targets import target_from_request

log = logging.getLogger(__name__)

ROOM_RETENTION_S = 60.0  # a final room no one polls is forgotten after this


@dataclass(frozen=True)
class PrefillConfig:
    instance: str
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    lane_rule: str = "interleaved"
    host: str = "127.0.0.1"
    control_port: int = 0
    secret: bytes | None = None
    heartbeat_interval: float = 0.5
    lease_ttl: float = 10.0
    target_timeout: float = 60.0  # how long a room waits for its decode ranks to ask
    max_slices_per_call: int = 1024
    aux_slots: int = 1024
    aux_device: str = "cpu"  # aux staging rows; "cuda:N" for transports that move device memory only (NVLink)
    trace: bool = False

    @property
    def rank_label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/cp{self.cp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"


class PrefillEndpoint:
    def __init__(
        self,
        config: PrefillConfig,
        engine: TransferEngine,
        specs: Mapping[str, PoolSpec],
        buffers: Mapping[tuple[str, int], Any],
        contract: RuntimeContract,
        bootstrap: BootstrapClient | None,
        aux_schema: AuxSchema,
    ) -> None:
        self.config = config
        self.engine = engine
        self.specs = dict(specs)
        self.buffers = EndpointBuffers(self.specs, buffers, rank=config.rank_label)
        self.contract = contract
        self.fingerprint = fingerprint(contract)
        self.bootstrap = bootstrap
        self.aux_schema = aux_schema
        self.aux = AuxStaging(aux_schema, config.aux_slots, device=config.aux_device)
        self.lanes = OwnerLanes(config.cp_size, config.lane_rule)
        self.page_size = next(iter(self.specs.values())).page_size
        self.trace = config.trace or os.environ.get("KVBRIDGE_TRACE") == "1"
        self._lock = threading.Lock()
        self._rooms: dict[int, SendRoom] = {}
        self._handles: dict[int, tuple[SendRoom, Target]] = {}
        self._released: collections.deque[int] = collections.deque()  # rooms whose KVSender was dropped
        self._server: ControlServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closing = False
        self._lease: LeaseKeeper | None = None
        self.counters = {"rooms_ok": 0, "rooms_failed": 0, "bytes": 0, "slices": 0, "bad_messages": 0}

    # -- life cycle -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise KVBridgeError("endpoint not started", rank=self.config.rank_label)
        return self._server.endpoint

    def start(self) -> None:
        self.buffers.register(self.engine)
        self.aux.register(self.engine)
        self._server = ControlServer(self.config.host, self.config.control_port, secret=self.config.secret)
        self.engine.set_notify(self._server.wakeup.post)
        self._thread = threading.Thread(target=self._run, name=f"kvb-prefill-{self.config.cp_rank}", daemon=True)
        self._thread.start()
        if self.bootstrap is not None:
            self._lease = register_rank(
                self.bootstrap, self.config, "prefill", self.endpoint, self.engine.session_id,
                self.buffers.descs, self.aux.desc, self.contract, self.config.lease_ttl,
            )
        log.info("prefill rank %s serving %s (session %s)", self.config.rank_label, self.endpoint, self.engine.session_id)

    def close(self, timeout: float = 5.0) -> None:
        """Let in-flight rooms finish for up to ``timeout`` s, fail the rest, deregister."""
        with self._lock:
            self._closing = True
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._busy():
            time.sleep(0.02)
        with self._lock:
            for room in self._rooms.values():
                self._fail_room(room, f"prefill rank {self.config.rank_label} is shutting down")
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._handles:
            time.sleep(0.02)
        self._stop.set()
        if self._server is not None:
            self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._lease is not None:
            self._lease.stop(deregister=True)
        if self._server is not None:
            self._server.close()
        self.engine.set_notify(None)

    def _wake(self) -> None:
        if self._server is not None:
            self._server.wakeup.post()

    def _reply(self, ident: bytes, msg: Any) -> None:
        try:
            self._server.send(ident, msg)
        except TransferError as exc:  # the decode rank went away; its rooms time out there
            log.warning("cannot reach decode peer %s: %s", ident.hex(), exc)

    def _busy(self) -> bool:
        with self._lock:
            return any(not r.state.final for r in self._rooms.values())

    # -- engine-facing (any thread) -------------------------------------------

    def sender(self, room: int) -> KVSender:
        with self._lock:
            if self._closing:
                raise KVBridgeError("prefill rank is shutting down", room=room, rank=self.config.rank_label)
            self._room(room)
        return KVSender(self, room)

    def _room(self, room: int) -> SendRoom:
        r = self._rooms.get(room)
        if r is None:
            r = self._rooms[room] = SendRoom(room, self.config.cp_rank, self.lanes, self.page_size)
        return r

    def _init_room(self, room: int, num_tokens: int) -> None:
        with self._lock:
            self._room(room).set_num_tokens(num_tokens, "init()")
        self._wake()

    def _send(self, room: int, logical: Any, local: Any, is_last: bool, aux: AuxRow | np.ndarray | None) -> None:
        with self._lock:
            r = self._room(room)
            if r.state.final:  # failed meanwhile (abort, peer loss): poll() tells the engine; nothing to send
                log.debug("send() on room %d ignored: %s %s", room, r.state.state.name, r.state.reason)
                return
            row = None if aux is None else self._pack_aux(room, aux)
            local_arr = np.asarray(local, dtype=np.int64).reshape(-1)
            if local_arr.size and (local_arr.min() < 0 or local_arr.max() >= self.buffers.min_capacity):
                raise LayoutError(f"local pages must lie in [0, {self.buffers.min_capacity})", room=room,
                                  rank=self.config.rank_label, field="local_pages")
            r.add_chunk(logical, local_arr, is_last, row)
        self._wake()

    def _pack_aux(self, room: int, aux: AuxRow | np.ndarray) -> np.ndarray:
        """An AuxRow, or a row already packed with this rank's aux schema."""
        if isinstance(aux, np.ndarray):
            if aux.dtype != self.aux_schema.dtype or aux.size != 1:
                raise LayoutError(f"packed aux row of dtype {aux.dtype}, expected the schema's {self.aux_schema.dtype}",
                                  room=room, field="aux")
            row, echoed = aux.reshape(1), int(aux.reshape(-1)[0]["room"])
        else:
            echoed = aux.room
            row = self.aux_schema.pack(
                room=aux.room, first_token=aux.first_token, num_cached_tokens=aux.num_cached_tokens,
                hidden_is_cp_local=aux.hidden_is_cp_local, hidden=aux.hidden,
                topk_ids=aux.topk_ids, topk_probs=aux.topk_probs,
            )
        if echoed != room:
            raise LayoutError(f"aux row carries room {echoed}", room=room, rank=self.config.rank_label, field="aux.room")
        return row

    def _poll(self, room: int) -> KVPoll:
        with self._lock:
            r = self._rooms.get(room)
            return KVPoll.Failed if r is None else r.state.state

    def _release(self, room: int) -> None:
        """The engine dropped its sender: the room may go once it is final and quiet.
        Runs from a GC finalizer, possibly on a thread that holds the lock: no locking here."""
        self._released.append(room)

    def _stats(self, room: int) -> dict[str, int]:
        with self._lock:
            r = self._rooms.get(room)
            return {} if r is None else {"slices": r.num_slices, "bytes": r.num_bytes}

    def _reason(self, room: int) -> str | None:
        with self._lock:
            r = self._rooms.get(room)
            return None if r is None else r.state.reason

    def _abort(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is not None:
                self._fail_room(r, reason)
        self._wake()

    # -- the loop -------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # a bug must not kill the rank's only control loop
                log.exception("prefill loop step failed")
                time.sleep(0.05)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.config.heartbeat_interval
                self._gc(now)

    def _step(self) -> None:
        # write completions wake the loop through the engine's notify callback: no busy polling
        for ident, msg in self._server.recv_ready(50):
            self._on_message(ident, msg)
        with self._lock:
            self._collect()
            self._pump()
            self._deadlines()

    def _on_message(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, KVBridgeError):
            self.counters["bad_messages"] += 1
            log.warning("bad control message from %r: %s", ident, msg)
            return  # the channel already replied with ErrorReply, or dropped a bad MAC
        if isinstance(msg, wire.Ping):
            self._reply(ident, wire.Heartbeat(cp_rank=self.config.cp_rank, seq=msg.seq))
        elif isinstance(msg, wire.TransferRequest):
            with self._lock:
                self._on_request(ident, msg)
        elif isinstance(msg, wire.Abort):
            with self._lock:
                self._on_abort(ident, msg)
        else:
            self._reply(ident, wire.ErrorReply(ref_type=msg.TAG, room=getattr(msg, "room", None),
                                                     reason=f"a prefill rank does not accept {type(msg).__name__}"))

    def _on_request(self, ident: bytes, req: wire.TransferRequest) -> None:
        rank = self.config.rank_label
        if self._closing:
            self._reply_failed(ident, req.room, f"prefill rank {rank} is shutting down")
            return
        if req.fingerprint != self.fingerprint:
            self._reply_failed(ident, req.room, f"contract fingerprint {req.fingerprint} differs from prefill rank "
                                                f"{rank}'s {self.fingerprint}; nothing transferred (hard rule 7)")
            if req.room in self._rooms:
                self._fail_room(self._rooms[req.room], f"decode rank {req.decode_rank} has a different contract")
            return
        r = self._room(req.room)
        if r.state.final:
            self._reply_failed(ident, req.room, f"room already {r.state.state.name} on {rank}: {r.state.reason}")
            return
        try:
            r.set_num_tokens(req.num_tokens, f"decode rank {req.decode_rank}")
            target = target_from_request(req, ident, self.specs, self.buffers.descs, self.aux_schema, r.num_pages)
        except KVBridgeError as exc:  # nothing was posted for this target: safe to refuse
            self._reply_failed(ident, req.room, str(exc))
            self._fail_room(r, f"decode rank {req.decode_rank}'s request refused: {exc}")
            return
        if req.decode_rank in r.targets:
            self._reply_failed(ident, req.room, f"decode rank {req.decode_rank} asked twice for this room")
            return
        r.targets[req.decode_rank] = target
        r.num_expected_targets = req.num_decode_ranks
        if r.state.state == KVPoll.Bootstrapping and len(r.targets) >= r.num_expected_targets:
            r.state.to(KVPoll.WaitingForInput)
        if self.trace:
            log.info("trace room=%d rank=%s target %s pages=%d pools=%s", req.room, rank, req.decode_rank,
                     target.dst_pages.size, ",".join(target.pools))

    def _on_abort(self, ident: bytes, msg: wire.Abort) -> None:
        r = self._rooms.get(msg.room)
        t = r.targets.get(msg.decode_rank) if r else None
        if t is None or t.closed:  # nothing of this room is, or will be, in flight to that rank
            self._reply(ident, wire.AbortAck(room=msg.room, cp_rank=self.config.cp_rank))
            return
        t.abort_reason = t.abort_reason or msg.reason or "aborted by decode"
        self._fail_room(r, f"decode rank {msg.decode_rank} aborted: {t.abort_reason}")

    def _reply_failed(self, ident: bytes, room: int, reason: str) -> None:
        log.warning("room %d refused on %s: %s", room, self.config.rank_label, reason)
        self._reply(ident, wire.PagesDone(room=room, cp_rank=self.config.cp_rank, status="failed", reason=reason,
                                                pools=[], logical_pages=b"", digests=None))

    # -- posting and collecting (lock held) -----------------------------------

    def _pump(self) -> None:
        for r in self._rooms.values():
            if r.state.final or r.num_tokens is None:
                continue
            for t in r.targets.values():
                if not t.active:
                    continue
                while t.posted < len(r.chunks):
                    self._post_chunk(r, t, *r.chunks[t.posted])
                    t.posted += 1
                    if not t.active:
                        break
                if t.active and r.is_last and r.aux_row is not None and not t.aux_posted:
                    self._post_aux(r, t)
            if r.state.state == KVPoll.WaitingForInput and any(t.posted or t.aux_posted for t in r.targets.values()):
                r.state.to(KVPoll.Transferring)
            self._settle(r)

    def _post_chunk(self, r: SendRoom, t: Target, logical: np.ndarray, local: np.ndarray) -> None:
        try:
            plan = plan_transfer(self.specs, self.buffers.descs, t.dst_bufs, logical, local, t.dst_pages[logical],
                                 r.num_tokens, pools=t.pools, room=r.room, rank=self.config.rank_label)
            handle = self.engine.submit_write(t.session, plan.src, plan.dst, plan.length)
        except KVBridgeError as exc:
            t.failure = str(exc)
            return
        t.inflight[handle] = logical
        self._handles[handle] = (r, t)
        self.counters["bytes"] += plan.num_bytes
        self.counters["slices"] += plan.num_slices
        r.num_bytes += plan.num_bytes
        r.num_slices += plan.num_slices
        if self.trace:
            log.info("trace room=%d rank=%s -> %s pages=%s slices=%d bytes=%d", r.room, self.config.rank_label,
                     t.decode_rank, logical.tolist(), plan.num_slices, plan.num_bytes)

    def _post_aux(self, r: SendRoom, t: Target) -> None:
        t.aux_posted = True
        try:
            src = self.aux.stage(r.room, r.aux_row)
            handle = self.engine.submit_write(t.session, np.array([src], np.uint64), np.array([t.aux_addr], np.uint64),
                                              np.array([self.aux_schema.row_bytes], np.uint64))
        except KVBridgeError as exc:
            t.failure = f"aux row: {exc}"
            return
        t.inflight[handle] = None
        self._handles[handle] = (r, t)

    def _collect(self) -> None:
        for handle in list(self._handles):
            status = self.engine.poll(handle)
            if status.state is WriteState.PENDING:
                continue
            r, t = self._handles.pop(handle)
            pages = t.inflight.pop(handle)
            if status.state is WriteState.FAILED:
                t.failure = t.failure or f"write to {t.decode_rank} ({t.session}) failed: {status.reason}"
            elif t.active and pages is None:
                t.aux_done = True
                self._reply(t.ident, wire.AuxDone(room=r.room, cp_rank=self.config.cp_rank, status="ok", reason=""))
            elif t.active:
                t.num_pages_done += pages.size
                digests = None
                if t.want_digest:
                    local = self._local_pages_of(r, pages)
                    digests = page_digests(self.specs, self.buffers.tensors, t.pools, pages, local, r.num_tokens).tobytes()
                self._reply(t.ident, wire.PagesDone(room=r.room, cp_rank=self.config.cp_rank, status="ok",
                                                          reason="", pools=list(t.pools),
                                                          logical_pages=wire.pack_pages(pages), digests=digests))
            self._settle(r)

    @staticmethod
    def _local_pages_of(r: SendRoom, pages: np.ndarray) -> np.ndarray:
        logical = np.concatenate([c[0] for c in r.chunks])
        local = np.concatenate([c[1] for c in r.chunks])
        order = np.argsort(logical)
        return local[order[np.searchsorted(logical[order], pages)]]

    def _settle(self, r: SendRoom) -> None:
        """Send final reports for quiet targets and move the room to its final state."""
        for t in r.targets.values():
            if t.closed or t.inflight:
                continue
            if t.abort_reason is not None:
                self._reply(t.ident, wire.AbortAck(room=r.room, cp_rank=self.config.cp_rank))
                t.closed = True
            elif t.failure is not None:
                self._reply(t.ident, wire.PagesDone(room=r.room, cp_rank=self.config.cp_rank, status="failed",
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
        self.aux.release(r.room)
        self.counters["rooms_ok" if r.state.state == KVPoll.Success else "rooms_failed"] += 1
        if self.trace or r.state.state == KVPoll.Failed:
            log.log(logging.INFO if r.state.state == KVPoll.Success else logging.WARNING,
                    "room %d on %s: %s %s", r.room, self.config.rank_label, r.state.state.name, r.state.reason or "")

    def _fail_room(self, r: SendRoom, reason: str) -> None:
        """Stop posting; the room turns Failed once nothing of it is in flight."""
        for t in r.targets.values():
            if t.active:
                t.failure = reason
        if not r.targets and not r.state.final:
            r.state.to(KVPoll.Failed, reason)
            self.aux.release(r.room)
            self.counters["rooms_failed"] += 1
        else:
            self._settle(r)

    def _deadlines(self) -> None:
        now = time.monotonic()
        for r in self._rooms.values():
            if r.state.final:
                continue
            if r.state.state == KVPoll.Bootstrapping and now - r.created > self.config.target_timeout:
                self._fail_room(r, f"no decode rank asked for room {r.room} within {self.config.target_timeout:.1f}s")
            for t in r.targets.values():
                if t.active and now > t.deadline:
                    t.failure = f"decode rank {t.decode_rank}'s deadline passed before the room was written"
            self._settle(r)

    def _gc(self, now: float) -> None:
        with self._lock:
            while self._released:
                r = self._rooms.get(self._released.popleft())
                if r is not None:
                    r.engine_done = True
            for room in [k for k, r in self._rooms.items() if r.state.final and not r.num_inflight
                         and (r.engine_done or now - r.state.entered[r.state.state] > ROOM_RETENTION_S)]:
                del self._rooms[room]
