"""PrefillEndpoint: one prefill rank's control loop and data path.

One loop thread owns the control socket and every room's state; engine threads
only queue work under the lock and wake it. The loop reads like ``step()``:

    receive control messages  ->  post writes for new chunks and new targets
    ->  collect completions  ->  report (PagesDone, the aux row in it / AbortAck)  ->  deadlines

Fewest hops: a request is parsed, checked, planned and posted in the loop turn that
receives it; ``send()`` posts from the engine's thread when the request is already
here; a write that becomes final is reported from the engine's completion callback
(its thread), not by waking the loop:

    decode init() --request--> loop: parse, check, plan, post --engine--> callback: report --> decode

Threads: the loop, the engine's own, the bootstrap lease keeper and one thread
that reads decode ranks' registrations from the daemon (``decode_peers.py``);
never one per room.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract, fingerprint
from kvbridge.errors import ConfigError, KVBridgeError, LayoutError, TransferError
from kvbridge.layout import AuxSchema, OwnerLanes, PoolSpec
from kvbridge.transfer import wire
from kvbridge.transfer.aux_rows import AuxBuffers, AuxStaging
from kvbridge.transfer.channel import ControlServer
from kvbridge.transfer.checks import check_against_contract
from kvbridge.transfer.decode_peers import DecodePeers
from kvbridge.transfer.engine import TransferEngine
from kvbridge.transfer.rooms import open_waiting
from kvbridge.transfer.prefill_rooms import SendBook
from kvbridge.transfer.registration import EndpointBuffers, register_rank, unregister_quietly
from kvbridge.transfer.kvsender import KVSender
from kvbridge.transfer.sender import SendRoom

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    housekeeping_interval: float = 0.5  # how often closed, quiet rooms are forgotten
    lease_ttl: float = 10.0
    target_timeout: float = 60.0  # how long a room waits for its decode ranks to ask
    peer_timeout: float = 5.0  # a decode connection silent this long fails its targets (> decode's ping_interval)
    max_slices_per_call: int = 1024
    aux_slots: int = 1024
    aux_device: str = "cpu"  # aux staging rows; "cuda:N" for transports that move device memory only (NVLink)
    trace: bool = False

    @property
    def rank_label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/cp{self.cp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"


class PrefillEndpoint:
    """One prefill rank. ``bootstrap`` is required: the rank registers there, and reads each
    decode rank's registered buffers from it. ``aux_buffer`` (optional): the engine's own aux
    rows, packed uint8 ``[rows, row_bytes]`` or ``{region: tensor[rows, ...]}``, registered so
    that ``send(..., aux_slot=i)`` writes row ``i`` without a copy; ``send(..., aux=row)`` uses
    kvbridge's staging rows. Specs, aux schema and lane rule are checked against the contract
    here (ConfigError naming the field)."""

    def __init__(
        self,
        config: PrefillConfig,
        engine: TransferEngine,
        specs: Mapping[str, PoolSpec],
        buffers: Mapping[tuple[str, int], Any],
        contract: RuntimeContract,
        bootstrap: BootstrapClient,
        aux_schema: AuxSchema,
        *,
        aux_buffer: Any = None,
    ) -> None:
        rank = config.rank_label
        if bootstrap is None:
            raise ConfigError("a PrefillEndpoint needs a BootstrapClient: it registers there and reads each decode "
                              "rank's registered buffers from it before writing", rank=rank, field="bootstrap")
        check_against_contract(specs, aux_schema, contract, rank=rank, lane_rule=config.lane_rule,
                               tp_size=config.tp_size, tp_rank=config.tp_rank)
        self.config = config
        self.engine = engine
        self.specs = dict(specs)
        self.buffers = EndpointBuffers(self.specs, buffers, rank=rank)
        self.contract = contract
        self.fingerprint = fingerprint(contract)
        self.bootstrap = bootstrap
        self.aux_schema = aux_schema
        self.aux_staging = AuxStaging(aux_schema, config.aux_slots, rank=rank, device=config.aux_device)
        self.aux_buffers = None if aux_buffer is None else AuxBuffers(aux_schema, aux_buffer, rank=rank)
        self.lanes = OwnerLanes(config.cp_size, config.lane_rule)
        self.page_size = next(iter(self.specs.values())).page_size
        self.trace = config.trace or os.environ.get("KVBRIDGE_TRACE") == "1"
        self._lock = _OwnedLock()
        self._room_freed = threading.Condition(self._lock)  # notified when a room id is forgotten
        self._peers = DecodePeers(bootstrap, self._hand_to_loop, self._deliver, self._refuse)
        self._book = SendBook(self, self._peers)
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
        self.aux_staging.register(self.engine)
        if self.aux_buffers is not None:
            self.aux_buffers.register(self.engine)
        self._server = ControlServer(self.config.host, self.config.control_port, secret=self.config.secret)
        self.engine.set_notify(self._write_final)
        self._thread = threading.Thread(target=self._run, name=f"kvb-prefill-{self.config.cp_rank}", daemon=True)
        self._thread.start()
        self._lease = register_rank(
            self.bootstrap, self.config, "prefill", self.endpoint, self.engine.session_id,
            self.buffers.descs, self.aux_buffers or self.aux_staging, self.contract, self.config.lease_ttl,
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
        self._peers.close()
        if self._lease is not None:
            self._lease.stop(deregister=True)
        if self._server is not None:
            self._server.close()
        self.engine.set_notify(None)
        # the engine may outlive this endpoint: withdraw our memory before the caller frees it
        unregister_quietly(self.engine, self.buffers, self.aux_staging, self.aux_buffers)

    def __enter__(self) -> PrefillEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        if self._server is not None:
            self._server.wakeup.post()

    def _write_final(self) -> None:
        """Engine callback, a write became final: report it from this thread (no loop turn).
        Inside submit_write (a write refused at once) the poster holds the lock and collects."""
        if self._lock.held_here():
            self._book.final_while_posting = True
            return
        with self._lock:
            self._book.collect()

    def _hand_to_loop(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the loop thread with the lock held (safe from any thread)."""
        self._book.results.append(work)
        self._wake()

    def _deliver(self, ident: bytes, req: wire.TransferRequest) -> None:
        self._book.deliver(ident, req)

    def _refuse(self, ident: bytes, req: wire.TransferRequest, reason: str) -> None:
        self._book.refuse(ident, req, reason)

    def _reply(self, ident: bytes, msg: Any) -> None:
        try:
            self._server.send(ident, msg)
        except TransferError as exc:  # the decode rank went away; liveness fails its targets
            log.warning("cannot reach decode peer %s: %s", ident.hex(), exc)

    def _busy(self) -> bool:
        with self._lock:
            return any(not r.state.final for r in self._book.rooms.values())

    # -- engine-facing (any thread) -------------------------------------------

    def sender(self, room: int, *, wait: float = 0.0) -> KVSender:
        """A KVSender for ``room``. RoomInUse while a previous room of that id is open, or draining
        (its writes still in flight) for longer than ``wait`` seconds (``RoomInUse.draining``)."""
        with self._lock:
            r = open_waiting(lambda: self._open(room), self._room_freed, wait)
        return KVSender(self, r)

    def _open(self, room: int) -> SendRoom:
        if self._closing:
            raise KVBridgeError("prefill rank is shutting down", room=room, rank=self.config.rank_label)
        return self._book.open(room)

    def locked(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return fn()

    def _init_room(self, r: SendRoom, num_tokens: int | None, num_pages: int | None) -> None:
        with self._lock:
            r.engine_init(num_tokens, num_pages)
            self._book.post_and_settle(r)  # a rank with nothing to send completes here if decode asked

    def _send(self, r: SendRoom, logical: Any, local: Any, num_tokens_ready: int | None, is_last: bool,
              aux: Any, aux_slot: int | None, ready_event: Any = None) -> None:
        with self._lock:
            if r.state.final:  # failed meanwhile (abort, peer loss): poll() tells the engine; nothing to send
                log.debug("send() on room %d ignored: %s %s", r.room, r.state.state.name, r.state.reason)
                return
            row = None if aux is None else self.aux_schema.pack_row(aux, r.room)
            if aux_slot is not None:
                self._check_aux_slot(r.room, aux_slot)
            local_arr = np.asarray(local, dtype=np.int64).reshape(-1)
            if local_arr.size and (local_arr.min() < 0 or local_arr.max() >= self.buffers.min_capacity):
                raise LayoutError(f"local pages must lie in [0, {self.buffers.min_capacity})", room=r.room,
                                  rank=self.config.rank_label, field="local_pages")
            r.add_chunk(logical, local_arr, num_tokens_ready, is_last, row, aux_slot, ready_event)
            if row is not None:  # staged now (a device copy is queued, not waited for), off the request's path
                try:
                    self.aux_staging.stage(r.room, row, after=ready_event)
                except KVBridgeError as exc:
                    self._book.fail_room(r, f"aux row of room {r.room} cannot be staged: {exc}")
                    raise
            # post from this thread when the decode ranks already asked (no loop turn); completions
            # are reported from the engine's callback
            self._book.post_and_settle(r)

    def _check_aux_slot(self, room: int, slot: int) -> None:
        if self.aux_buffers is None:
            raise LayoutError("send(aux_slot=...) needs the engine's aux rows: PrefillEndpoint(..., aux_buffer=...)",
                              room=room, rank=self.config.rank_label, field="aux_slot")
        self.aux_buffers.check_slot(slot, room=room)
        if _on_host(self.aux_buffers):
            echoed = self.aux_buffers.read_room(slot)  # host memory: catch a wrong slot here (hard rule 4)
            if echoed != room:
                raise LayoutError(f"aux slot {slot} holds room {echoed}'s row", room=room,
                                  rank=self.config.rank_label, field="aux_slot")

    def release(self, r: SendRoom) -> None:
        """The engine dropped its sender: the room closes at the next housekeeping.
        Runs from a GC finalizer, possibly on a thread that holds the lock: no locking here."""
        self._book.released.append(r)

    def close_room(self, r: SendRoom) -> None:
        with self._lock:
            self._book.close(r)
        self._wake()

    def abort_room(self, r: SendRoom, reason: str) -> None:
        with self._lock:
            if not r.state.final:
                self._book.fail_room(r, reason)
        self._wake()

    # -- the loop -------------------------------------------------------------

    def _run(self) -> None:
        next_housekeeping = 0.0
        while not self._stop.is_set():
            try:
                self._step()
                now = time.monotonic()
                if now >= next_housekeeping:
                    next_housekeeping = now + self.config.housekeeping_interval
                    with self._lock:
                        self._book.gc(now)
            except Exception:  # a bug must not kill the rank's only control loop
                log.exception("prefill loop step failed")
                time.sleep(0.05)

    def _step(self) -> None:
        # write completions wake the loop through the engine's notify callback: no busy polling
        for ident, msg in self._server.recv_ready(50):
            self._on_message(ident, msg)
        with self._lock:
            while self._book.results:
                self._book.results.popleft()()
            self._book.collect()
            self._book.pump()
            self._book.deadlines()

    def _on_message(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, wire.TransferRequest):  # the room's path: checked, planned and posted now
            with self._lock:
                self._peers.heard_from(ident, time.monotonic())
                self._book.on_request(ident, msg)
                self._book.pump()
            return
        with self._lock:
            self._peers.heard_from(ident, time.monotonic())  # any message: the decode rank is alive
        if isinstance(msg, KVBridgeError):
            log.warning("bad control message from %r: %s", ident, msg)
            return  # the channel counted it (stats.malformed / unauthenticated) and replied or dropped it
        if isinstance(msg, wire.Ping):
            self._reply(ident, wire.Heartbeat(cp_rank=self.config.cp_rank, seq=msg.seq))
        elif isinstance(msg, wire.Abort):
            with self._lock:
                self._book.on_abort(ident, msg)
        else:
            self._reply(ident, wire.ErrorReply(ref_type=msg.TAG, room=getattr(msg, "room", None),
                                               reason=f"a prefill rank does not accept {type(msg).__name__}"))


class _OwnedLock:
    """A lock that knows its holder: the engine's completion callback may run on a thread that
    already holds it (inside submit_write), and must not wait for itself there."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def __enter__(self) -> _OwnedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()

    _is_owned = held_here  # what threading.Condition asks


def _on_host(aux: AuxBuffers) -> bool:
    # torch: device.type; numpy (2.x) has a device too, the string "cpu"
    return aux.readable and all(getattr(getattr(t, "device", None), "type", "cpu") == "cpu"
                                for t in aux.tensors.values())
