"""PrefillEndpoint: one prefill rank's control loop and data path.

One loop thread owns the control socket and every room's state; engine threads
only queue work under the lock and wake it. The loop reads like ``step()``:

    receive control messages  ->  post writes for new chunks and new targets
    ->  collect completions  ->  report (PagesDone / AuxDone / AbortAck)  ->  deadlines

Threads: the loop, the engine's own, and the bootstrap lease keeper; never one
per room.
"""

from __future__ import annotations

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
from kvbridge.layout import AuxRow, AuxSchema, OwnerLanes, PoolSpec
from kvbridge.transfer import wire
from kvbridge.transfer.channel import ControlServer
from kvbridge.transfer.engine import TransferEngine
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.registration import AuxStaging, EndpointBuffers, register_rank, unregister_quietly
from kvbridge.transfer.prefill_rooms import SendBook
from kvbridge.transfer.sender import KVSender

log = logging.getLogger(__name__)


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
    housekeeping_interval: float = 0.5  # how often final rooms are forgotten (heartbeats answer decode pings)
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
        self._book = SendBook(self)
        self._server: ControlServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closing = False
        self._lease: LeaseKeeper | None = None

    # -- life cycle -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise KVBridgeError("endpoint not started", rank=self.config.rank_label)
        return self._server.endpoint

    @property
    def counters(self) -> dict[str, int]:
        """Rooms ok/failed, bytes and slices posted since start."""
        return self._book.counters

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
            for room in self._book.rooms.values():
                self._book.fail_room(room, f"prefill rank {self.config.rank_label} is shutting down")
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._book.handles:
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
        # the engine may outlive this endpoint: withdraw our memory before the caller frees it
        unregister_quietly(self.engine, self.buffers, self.aux)

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
            return any(not r.state.final for r in self._book.rooms.values())

    # -- engine-facing (any thread) -------------------------------------------

    def sender(self, room: int) -> KVSender:
        with self._lock:
            if self._closing:
                raise KVBridgeError("prefill rank is shutting down", room=room, rank=self.config.rank_label)
            self._book.room(room)
        return KVSender(self, room)

    def _init_room(self, room: int, num_tokens: int) -> None:
        with self._lock:
            self._book.room(room).set_num_tokens(num_tokens, "init()")
            self._book.dirty.add(room)
        self._wake()

    def _send(self, room: int, logical: Any, local: Any, is_last: bool, aux: AuxRow | np.ndarray | None) -> None:
        with self._lock:
            r = self._book.room(room)
            if r.state.final:  # failed meanwhile (abort, peer loss): poll() tells the engine; nothing to send
                log.debug("send() on room %d ignored: %s %s", room, r.state.state.name, r.state.reason)
                return
            row = None if aux is None else self._pack_aux(room, aux)
            local_arr = np.asarray(local, dtype=np.int64).reshape(-1)
            if local_arr.size and (local_arr.min() < 0 or local_arr.max() >= self.buffers.min_capacity):
                raise LayoutError(f"local pages must lie in [0, {self.buffers.min_capacity})", room=room,
                                  rank=self.config.rank_label, field="local_pages")
            r.add_chunk(logical, local_arr, is_last, row)
            self._book.post_room(r)  # post now when the decode ranks already asked; the loop reports
            self._book.dirty.add(room)
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
            r = self._book.rooms.get(room)
            return KVPoll.Failed if r is None else r.state.state

    def _release(self, room: int) -> None:
        """The engine dropped its sender: the room may go once it is final and quiet.
        Runs from a GC finalizer, possibly on a thread that holds the lock: no locking here."""
        self._book.released.append(room)

    def _stats(self, room: int) -> dict[str, int]:
        with self._lock:
            r = self._book.rooms.get(room)
            return {} if r is None else {"slices": r.num_slices, "bytes": r.num_bytes}

    def _reason(self, room: int) -> str | None:
        with self._lock:
            r = self._book.rooms.get(room)
            return None if r is None else r.state.reason

    def _abort(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._book.rooms.get(room)
            if r is not None:
                self._book.fail_room(r, reason)
        self._wake()

    # -- the loop -------------------------------------------------------------

    def _run(self) -> None:
        next_housekeeping = 0.0
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # a bug must not kill the rank's only control loop
                log.exception("prefill loop step failed")
                time.sleep(0.05)
            now = time.monotonic()
            if now >= next_housekeeping:
                next_housekeeping = now + self.config.housekeeping_interval
                with self._lock:
                    self._book.gc(now)

    def _step(self) -> None:
        # write completions wake the loop through the engine's notify callback: no busy polling
        for ident, msg in self._server.recv_ready(50):
            self._on_message(ident, msg)
        with self._lock:
            self._book.collect()
            self._book.pump()
            self._book.deadlines()

    def _on_message(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, KVBridgeError):
            log.warning("bad control message from %r: %s", ident, msg)
            return  # the channel counted it (stats.malformed / unauthenticated) and replied or dropped it
        if isinstance(msg, wire.Ping):
            self._reply(ident, wire.Heartbeat(cp_rank=self.config.cp_rank, seq=msg.seq))
        elif isinstance(msg, wire.TransferRequest):
            with self._lock:
                self._book.on_request(ident, msg)
        elif isinstance(msg, wire.Abort):
            with self._lock:
                self._book.on_abort(ident, msg)
        else:
            self._reply(ident, wire.ErrorReply(ref_type=msg.TAG, room=getattr(msg, "room", None),
                                                     reason=f"a prefill rank does not accept {type(msg).__name__}"))

