"""PrefillEndpoint: one prefill rank's shell around its rooms' state machine.

The shell owns what the machine (``prefill/machine.py``) must not: the loop thread, the
lock, the control server, the transfer engine, one thread that reads decode ranks'
registrations from the daemon, the aux rows in memory and the lease. It feeds the
machine events and carries out the actions it returns (``Send``, ``PostWrite``,
``Resolve``, ``ReleaseAux``, ``FreeRoom``). The loop reads like ``step()``:

    receive control messages -> feed each  ->  apply registrations read  ->  collect
    completions (write_final)  ->  tick(now): post, settle, deadlines  ->  carry out

Fewest hops: a request is parsed, checked, planned and posted in the loop turn that
receives it; ``send()`` posts from the engine's thread when the request is already
here; a write that becomes final is reported from the engine's completion callback
(its thread), not by waking the loop:

    decode init() --request--> loop: check, plan, post --engine--> callback: report --> decode

Threads: the loop, the engine's own, the bootstrap lease keeper and the registration
reader; never one per room.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract, fingerprint
from kvbridge.errors import ConfigError, KVBridgeError, LayoutError, TransferError, UnknownInstance
from kvbridge.layout import AuxSchema, OwnerLanes, PoolSpec, stage_specs
from kvbridge.transfer.actions import FreeRoom, Send
from kvbridge.transfer.aux_rows import AuxBuffers, AuxStaging
from kvbridge.transfer.channel import ControlServer
from kvbridge.transfer.checks import check_against_contract
from kvbridge.transfer.digest import page_digests
from kvbridge.transfer.engine import TransferEngine, WriteState
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.identity import WriteNonce
from kvbridge.transfer.prefill.peers import Resolve
from kvbridge.transfer.prefill.machine import PostWrite, PrefillRooms, ReleaseAux
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.prefill.staged import PostChunk
from kvbridge.transfer.prefill.sender import KVSender
from kvbridge.transfer.registration import EndpointBuffers, register_rank, unregister_quietly
from kvbridge.transfer.rooms import open_waiting
from kvbridge.transfer.scratch import Scratch
from kvbridge.transfer.staging_buffer import StagingBuffer
from kvbridge.transfer.staging_settings import STAGING_MODES

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["PrefillConfig", "PrefillEndpoint"]


def _stage_specs(config: PrefillConfig, specs: Mapping[str, PoolSpec], num_target_layers: int) -> dict[str, PoolSpec]:
    """The specs of this rank's pipeline stage: every pool cut to the stage's layers (all of them
    without ``pp_layers``). The last stage's layers end at the model's last target layer."""
    if config.pp_layers is None:
        return dict(specs)
    start, end = config.pp_layers
    if end > num_target_layers:
        raise ConfigError(f"pp_layers [{start}, {end}) reach past the contract's {num_target_layers} target layers",
                          rank=config.rank_label, field="pp_layers")
    if config.last_stage != (end == num_target_layers):
        raise ConfigError(f"pipeline stage pp{config.pp_rank} of {config.pp_size} declares layers [{start}, {end}): "
                          f"{'the last' if config.last_stage else 'only the last'} stage's layers end at the model's "
                          f"last target layer ({num_target_layers}); it holds the draft layers and the aux row",
                          rank=config.rank_label, field="pp_layers")
    return stage_specs(specs, (start, end), num_target_layers)


class PrefillEndpoint:
    """One prefill rank. ``bootstrap`` is required: the rank registers there, and reads each
    decode rank's registered buffers from it. ``aux_buffer`` (optional): the engine's own aux
    rows, packed uint8 ``[rows, row_bytes]`` or ``{region: tensor[rows, ...]}``, registered so
    that ``send(..., aux_slot=i)`` writes row ``i`` without a copy; ``send(..., aux=row)`` uses
    kvbridge's staging rows. Specs, aux schema and lane rule are checked against the contract
    here (ConfigError naming the field). A pipeline stage (``config.pp_layers``) takes the whole
    model's specs and contract but buffers of its own layers only (``stage_specs``,
    docs/pipeline.md)."""

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
        # a pipeline stage registers, pairs and sends its own layers only (kvbridge.layout.stages)
        self.specs = _stage_specs(config, specs, contract.model.target_layers)
        self.buffers = EndpointBuffers(self.specs, buffers, rank=rank)
        # the contract as this rank holds it: on its engine's transport (decode ranks on another are refused)
        self.contract = contract = contract.with_transport(engine.transport)
        self.fingerprint = fingerprint(contract)
        self.bootstrap = bootstrap
        self.aux_schema = aux_schema
        self.aux_staging = AuxStaging(aux_schema, config.aux_slots, rank=rank, device=config.aux_device)
        self.aux_buffers = None if aux_buffer is None else AuxBuffers(aux_schema, aux_buffer, rank=rank)
        self.page_size = next(iter(self.specs.values())).page_size
        self.trace = config.trace or os.environ.get("KVBRIDGE_TRACE") == "1"
        # the gather buffer staged writes leave from (docs/staging.md)
        self.gather = StagingBuffer.for_buffers(self.buffers.tensors, config.staging, config.staging_bytes,
                                                config.staging_slot_bytes, rank=rank, role="prefill",
                                                engine=self.engine)
        self.machine = PrefillRooms(
            config, self.specs, self.buffers.descs, aux_schema, self.fingerprint, aux_source=self._aux_source,
            page_digests=lambda pools, pages, local, n: page_digests(self.specs, self.buffers.tensors, pools, pages,
                                                                     local, n),
            hello_of=self._hello_of, digests_readable=self.buffers.readable, trace=self.trace,
            gather=None if self.gather is None else self.gather.area, engine_kind=self._engine_kind,
        )  # fmt: skip
        # advertised for `kvbridge doctor`; its private tail is the source of our ownership nonces
        self.scratch = Scratch(device=config.aux_device)
        self._lock = _OwnedLock()
        self._room_freed = threading.Condition(self._lock)  # notified when a room id is forgotten
        self._results: deque[Callable[[], Any]] = deque()  # registration answers: events for the loop to feed
        self._released: deque[PrefillRoom] = deque()  # dropped KVSenders (appended without the lock)
        self._final_while_posting = False  # a write became final inside submit_write: collect after posting
        self._resolver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvb-resolve")
        self._server: ControlServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lease: LeaseKeeper | None = None

    # -- life cycle -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise KVBridgeError("endpoint not started", rank=self.config.rank_label)
        return self._server.endpoint

    @property
    def lanes(self) -> OwnerLanes:
        """The instance's owner lanes (which CP rank holds which logical page)."""
        return self.machine.lanes

    @property
    def counters(self) -> dict[str, int]:
        """Rooms ok/failed, bytes and slices posted since start."""
        return self.machine.counters

    def health(self) -> dict[str, Any]:
        """A snapshot for metrics and operators, read under the endpoint's lock: ``staging``
        (the staged-transfer counters, the paths chosen among them), ``control`` (the control
        channel's message counts)."""
        with self._lock:
            staging = dict(self.machine.stage.counters)
        return {"staging": staging, "control": {} if self._server is None else self._server.stats.counts()}

    def start(self) -> None:
        self.buffers.register(self.engine)
        self.scratch.register(self.engine)
        self.aux_staging.register(self.engine)
        if self.aux_buffers is not None:
            self.aux_buffers.register(self.engine)
        if self.gather is not None:
            self.gather.register(self.engine)
        self._server = ControlServer(self.config.host, self.config.control_port, secret=self.config.secret)
        self.engine.set_notify(self._write_final)
        self._thread = threading.Thread(target=self._run, name=f"kvb-prefill-{self.config.cp_rank}", daemon=True)
        self._thread.start()
        self._lease = register_rank(
            self.bootstrap, self.config, "prefill", self.endpoint, self.engine.session_id,
            self.buffers.descs, self.aux_buffers or self.aux_staging, self.contract, self.config.lease_ttl,
            scratch=self.scratch.descriptor, engine_metadata=self.engine.metadata,
        )
        log.info("prefill rank %s serving %s (session %s)", self.config.rank_label, self.endpoint, self.engine.session_id)

    def close(self, timeout: float = 5.0) -> None:
        """Let in-flight rooms finish for up to ``timeout`` s, fail the rest, deregister."""
        with self._lock:
            self.machine.closing = True
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.locked(lambda: self.machine.busy):
            time.sleep(0.02)
        with self._lock:
            self._carry_out(self.machine.shutdown(f"prefill rank {self.config.rank_label} is shutting down",
                                                  time.monotonic()))
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.machine.writes:
            time.sleep(0.02)
        self._stop.set()
        if self._server is not None:
            self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._resolver.shutdown(wait=False, cancel_futures=True)
        if self._lease is not None:
            self._lease.stop(deregister=True)
        if self._server is not None:
            self._server.close()
        self.engine.set_notify(None)
        # the engine may outlive this endpoint: withdraw our memory before the caller frees it
        unregister_quietly(self.engine, self.buffers, self.aux_staging, self.aux_buffers, self.scratch, self.gather)

    def __enter__(self) -> PrefillEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        if self._server is not None:
            self._server.wakeup.post()

    # -- engine-facing (any thread) -------------------------------------------

    def sender(self, room: int, *, wait: float = 0.0) -> KVSender:
        """A KVSender for ``room``. RoomInUse while a previous room of that id is open, or draining
        (its writes still in flight) for longer than ``wait`` seconds (``RoomInUse.draining``)."""
        with self._lock:
            r = open_waiting(lambda: self._open(room), self._room_freed, wait)
        return KVSender(self, r)

    def _open(self, room: int) -> PrefillRoom:
        """(lock held) Close the rooms of dropped handles first: a dropped KVSender holds its room
        no more, so its id is draining or free now, never "still held" (and ``wait`` applies)."""
        self._close_released(time.monotonic())
        return self.machine.open(room, time.monotonic())

    def _close_released(self, now: float) -> None:
        while self._released:
            self._carry_out(self.machine.close(self._released.popleft(), now))

    def set_staging(self, mode: str) -> None:
        """Change the staging override (auto, always, never) for targets not yet planned (the
        bench compares the paths on one set of ranks)."""
        if mode not in STAGING_MODES:
            raise ConfigError(f"staging must be one of {STAGING_MODES}, got {mode!r}", rank=self.config.rank_label,
                              field="staging")
        if mode != "never" and self.gather is None:
            raise ConfigError("this rank has no gather buffer (staging 'never' at start, GPU pages on a direct-only "
                              "engine, or pages on several devices)", rank=self.config.rank_label, field="staging")
        with self._lock:
            self.machine.stage.mode = mode

    def locked(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the endpoint's lock held (what a handle reads)."""
        with self._lock:
            return fn()

    def init_room(self, r: PrefillRoom, num_tokens: int | None, num_pages: int | None, first_page: int = 0) -> None:
        with self._lock:
            self._carry_out(self.machine.engine_init(r, num_tokens, num_pages, time.monotonic(), first_page))

    def send_chunk(self, r: PrefillRoom, logical: Any, local: Any, num_tokens_ready: int | None, is_last: bool,
                   aux: Any, aux_slot: int | None, ready_event: Any = None) -> None:
        """KVSender.send(): the engine's input checked, the chunk queued, and posted from this thread
        when the decode ranks already asked (no loop turn); completions are reported from the
        engine's callback."""
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
            self.machine.chunk(r, logical, local_arr, num_tokens_ready, is_last, row, aux_slot, ready_event)
            if row is not None:  # staged now (a device copy is queued, not waited for), off the request's path
                try:
                    self.aux_staging.stage(r.room, row, after=ready_event)
                except KVBridgeError as exc:
                    self._carry_out(self.machine.abort(r, f"aux row of room {r.room} cannot be staged: {exc}",
                                                       time.monotonic()))
                    raise
            self._carry_out(self.machine.post(r, time.monotonic()))

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

    def release(self, r: PrefillRoom) -> None:
        """The engine dropped its sender: the room closes at the next housekeeping.
        Runs from a GC finalizer, possibly on a thread that holds the lock: no locking here."""
        self._released.append(r)

    def close_room(self, r: PrefillRoom) -> None:
        with self._lock:
            self._carry_out(self.machine.close(r, time.monotonic()))
        self._wake()

    def abort_room(self, r: PrefillRoom, reason: str) -> None:
        with self._lock:
            self._carry_out(self.machine.abort(r, reason, time.monotonic()))
        self._wake()

    # -- carrying out actions (lock held) ---------------------------------------

    def _carry_out(self, actions: Iterable[Any]) -> None:
        for a in actions:
            if type(a) is PostWrite:
                self._post(a)
            elif type(a) is PostChunk:
                self._post_chunk(a)
            elif type(a) is Send:
                for ident in a.to:
                    self._reply(ident, a.msg)
            elif type(a) is ReleaseAux:
                self.aux_staging.release(a.room)
            elif type(a) is FreeRoom:
                self._room_freed.notify_all()  # sender(room, wait=...) may open it now
            elif type(a) is Resolve:
                self._resolver.submit(self._resolve, a)
            elif type(a) is WriteNonce:
                self._resolver.submit(self._write_nonce, a)
            else:
                raise TypeError(f"prefill endpoint cannot carry out {a!r}")
        if self._final_while_posting:  # every handle is registered now
            self._final_while_posting = False
            self._collect()

    def _post(self, a: PostWrite) -> None:
        if not a.target.active:  # its target failed since the write was planned: nothing to post
            self._carry_out(self.machine.post_failed(a, None, time.monotonic()))
            return
        try:
            handle = self.engine.submit_write(a.session, a.src, a.dst, a.length, after=a.after)
        except KVBridgeError as exc:
            self._carry_out(self.machine.post_failed(a, str(exc), time.monotonic()))
            return
        except Exception as exc:  # a bug must fail this target, not the engine thread or the loop that called us
            log.exception("room %d on %s: posting to %s failed", a.room, self.config.rank_label, a.target.decode_rank)
            reason = f"internal error posting room {a.room} to {a.target.decode_rank}: {type(exc).__name__}: {exc}"
            self._carry_out(self.machine.post_failed(a, reason, time.monotonic()))
            return
        self.machine.posted(a, handle, time.monotonic())

    def _post_chunk(self, a: PostChunk) -> None:
        """Gather a staged chunk into our gather slot, then write the slot's pieces into the decode
        slot it was granted (the write waits for the gather: ``after`` on the GPU, at once on the host)."""
        if not a.target.active:
            self._carry_out(self.machine.chunk_post_failed(a, None, time.monotonic()))
            return
        try:
            stager, local = self.gather.stager, self.gather.slot_addr(a.local_slot)
            if a.chunk == 0 and a.after is not None:
                stager.wait_for(a.after)  # the source pages are whole
            event = stager.gather(a.staged, a.chunk, local)
            src, dst, length = a.staged.wire(a.chunk, local, a.remote_addr)
            handle = self.engine.submit_write(a.session, src, dst, length, after=event)
        except KVBridgeError as exc:
            self._carry_out(self.machine.chunk_post_failed(a, str(exc), time.monotonic()))
            return
        except Exception as exc:  # a bug must fail this target, not the thread that called us
            log.exception("room %d on %s: staging a chunk to %s failed", a.room, self.config.rank_label,
                          a.target.decode_rank)
            reason = f"internal error staging room {a.room} to {a.target.decode_rank}: {type(exc).__name__}: {exc}"
            self._carry_out(self.machine.chunk_post_failed(a, reason, time.monotonic()))
            return
        self.machine.chunk_posted(a, handle, len(length), int(a.staged.chunk_bytes[a.chunk]), time.monotonic())

    def _engine_kind(self, session: str) -> str:
        """The kind of engine a write to ``session`` goes through (choose_path's ``engine``)."""
        route = getattr(self.engine, "route", None)
        if route is not None:
            kind = route(session)
        else:
            name = type(self.engine).__name__.lower()
            kind = next((k for k in ("ipc", "mooncake", "local") if k in name), "mooncake")
        # pages on a GPU stage against thresholds of their own (layout/staging.py)
        return f"{kind}-gpu" if kind == "mooncake" and self.gather is not None and self.gather.on_gpu else kind

    def _aux_source(self, room: int, row: np.ndarray | None, aux_slot: int | None, after: Any) -> tuple:
        """Where room ``room``'s aux row is written from: kvbridge's staging row (staged by send();
        its device copy is one more event to wait on) or the engine's own aux rows."""
        if row is not None:
            slot = self.aux_staging.stage(room, row, after=after)
            return self.aux_staging.regions, slot, self.aux_staging.row_base, \
                self.aux_staging.ready_event(room) or after
        return self.aux_buffers.regions, aux_slot, self.aux_buffers.row_base, after

    def _reply(self, ident: bytes, msg: Any) -> None:
        try:
            self._server.send(ident, msg)
        except TransferError as exc:  # the decode rank went away; liveness fails its targets
            log.warning("cannot reach decode peer %s: %s", ident.hex(), exc)

    def _write_final(self) -> None:
        """Engine callback, a write became final: report it from this thread (no loop turn).
        Inside submit_write (a write refused at once) the poster holds the lock and collects."""
        if self._lock.held_here():
            self._final_while_posting = True
            return
        with self._lock:
            self._collect()

    def _collect(self) -> None:
        """Feed the writes that became final (the loop, or the engine's callback thread)."""
        final = self.engine.take_final()
        handles = self.machine.handles
        for handle in list(handles) if final is None else [h for h in final if h in handles]:
            status = self.engine.poll(handle)
            if status.state is WriteState.PENDING:
                continue
            self._carry_out(self.machine.write_final(handle, status, time.monotonic()))

    def _resolve(self, a: Resolve) -> None:
        """Resolver thread: read a decode rank's registration, hand the answer to the loop."""
        try:
            detail, problem = self.bootstrap.rank(a.rank_id), None
        except UnknownInstance:
            detail, problem = None, (f"decode rank {a.label} (registration {a.rank_id}) is not registered with the "
                                     "bootstrap daemon (never, or its lease expired): its buffers cannot be checked")
        except KVBridgeError as exc:
            detail, problem = None, f"cannot read decode rank {a.label}'s registration {a.rank_id}: {exc}"
        if detail is not None:  # what the engine must know before writing there (NIXL: the agent's metadata)
            try:
                self.engine.add_peer(detail.session_id, base64.b64decode(detail.engine_metadata, validate=True))
            except (KVBridgeError, ValueError) as exc:  # binascii.Error is a ValueError
                detail, problem = None, (f"decode rank {a.label}'s registration {a.rank_id}: its transfer engine's "
                                         f"metadata does not load: {exc}")
        self._results.append(lambda: self.machine.resolved(a.rank_id, detail, problem, time.monotonic()))
        self._wake()

    def _write_nonce(self, a: WriteNonce) -> None:
        """Resolver thread: the ownership nonce into a decode rank's scratch region (one at a
        time: this one thread is the only user of the nonce source)."""
        try:
            self.scratch.set_source(a.nonce)
            self.engine.probe_write(a.session, np.array([self.scratch.source], np.uint64), np.array([a.dst], np.uint64),
                              np.array([len(a.nonce)], np.uint64), timeout=self.config.peer_timeout)
            problem = None
        except KVBridgeError as exc:
            problem = f"session {a.session}: {exc}"
        except Exception as exc:  # a bug refuses this connection, never the resolver thread
            log.exception("nonce write to %s failed", a.session)
            problem = f"session {a.session}: {type(exc).__name__}: {exc}"
        self._results.append(lambda: self.machine.nonce_written(a.ident, problem, time.monotonic()))
        self._wake()

    def _hello_of(self, ident: bytes) -> str | None:
        hello = self._server.hello_of(ident) if self._server is not None else None
        return None if hello is None else hello.peer

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
                        self._close_released(now)
                        self._carry_out(self.machine.gc(now))
            except Exception:  # a bug must not kill the rank's only control loop
                log.exception("prefill loop step failed")
                time.sleep(0.05)

    def _step(self) -> None:
        # write completions wake the loop through the engine's notify callback: no busy polling
        for ident, msg in self._server.recv_ready(50):
            with self._lock:
                self._carry_out(self.machine.message(ident, msg, time.monotonic()))
        with self._lock:
            while self._results:
                self._carry_out(self._results.popleft()())
            self._collect()
            self._carry_out(self.machine.tick(time.monotonic()))


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

