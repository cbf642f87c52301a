"""DecodeEndpoint: one decode rank's control loop.

One loop thread owns every socket and room; bootstrap look-ups run on a small
bounded pool (results cached per prefill DP group for a moment), so 1,000 rooms
in flight are 1,000 dict entries, not 1,000 threads. The loop reads like ``step()``:

    receive (PagesDone / AuxDone / AbortAck / Heartbeat)  ->  apply look-ups
    ->  send TransferRequests  ->  commit complete rooms  ->  pings, liveness, deadlines
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.schemas import RankIdentity
from kvbridge.bootstrap.topology import AuxDescriptor
from kvbridge.errors import (
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    LayoutError,
    PageRangeError,
    TransferError,
)
from kvbridge.layout import AuxSchema, PoolSpec
from kvbridge.transfer.channel import PeerSet
from kvbridge.transfer.decode_rooms import RoomBook
from kvbridge.transfer.engine import TransferEngine
from kvbridge.transfer.receiver import KVReceiver, RecvRoom
from kvbridge.transfer.registration import EndpointBuffers, register_rank, unregister_quietly

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DecodeConfig:
    instance: str
    dp_rank: int = 0
    tp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    host: str = "127.0.0.1"
    secret: bytes | None = None
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 60.0
    transfer_timeout: float = 120.0
    peer_timeout: float = 5.0
    ping_interval: float = 0.5
    lease_ttl: float = 10.0
    topology_ttl: float = 2.0  # how long one look-up answer serves other rooms of the same DP group
    lookup_threads: int = 4
    verify_digest: bool = False
    trace: bool = False

    @property
    def rank_label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/tp{self.tp_rank}"


class DecodeEndpoint:
    def __init__(
        self,
        config: DecodeConfig,
        engine: TransferEngine,
        specs: Mapping[str, PoolSpec],
        buffers: Mapping[tuple[str, int], Any],
        contract: RuntimeContract,
        bootstrap: BootstrapClient,
        aux_buffer: Any,
        aux_schema: AuxSchema,
    ) -> None:
        self.config = config
        self.engine = engine
        self.specs = dict(specs)
        self.buffers = EndpointBuffers(self.specs, buffers, rank=config.rank_label)
        self.contract = contract
        self.bootstrap = bootstrap
        self.aux_schema = aux_schema
        if str(aux_buffer.dtype).removeprefix("torch.") != "uint8" or aux_buffer.ndim != 2 \
                or aux_buffer.shape[1] != aux_schema.row_bytes:
            raise LayoutError(f"aux buffer must be uint8 [rows, {aux_schema.row_bytes}], got {aux_buffer.dtype} "
                              f"{tuple(aux_buffer.shape)}", rank=config.rank_label, field="aux_buffer")
        self.aux_buffer = aux_buffer
        self.identity = RankIdentity(instance=config.instance, role="decode", dp_size=config.dp_size,
                                     tp_size=config.tp_size, dp_rank=config.dp_rank, tp_rank=config.tp_rank)
        self.trace = config.trace or os.environ.get("KVBRIDGE_TRACE") == "1"
        self._lock = threading.Lock()
        self._book = RoomBook(self)
        self._peers: PeerSet | None = None
        self._pool = ThreadPoolExecutor(max_workers=config.lookup_threads, thread_name_prefix="kvb-lookup")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lease: LeaseKeeper | None = None

    # -- life cycle -----------------------------------------------------------

    @functools.cached_property
    def aux_desc(self) -> AuxDescriptor:
        from kvbridge.transfer.engine import tensor_region

        ptr, _ = tensor_region(self.aux_buffer)
        return AuxDescriptor(base=ptr, capacity_rows=int(self.aux_buffer.shape[0]), row_bytes=self.aux_schema.row_bytes)

    def start(self) -> None:
        from kvbridge.transfer.engine import tensor_region

        self.buffers.register(self.engine)
        self.buffers.register_extra(self.engine, *tensor_region(self.aux_buffer))
        self._peers = PeerSet(secret=self.config.secret)
        self._thread = threading.Thread(target=self._run, name=f"kvb-decode-{self.config.tp_rank}", daemon=True)
        self._thread.start()
        self._lease = register_rank(self.bootstrap, self.config, "decode", f"tcp://{self.config.host}:0",
                                    self.engine.session_id, self.buffers.descs, self.aux_desc, self.contract,
                                    self.config.lease_ttl)
        log.info("decode rank %s up (session %s)", self.config.rank_label, self.engine.session_id)

    def close(self, timeout: float = 5.0) -> None:
        """Abort rooms still in flight, wait (bounded) for their acks, deregister."""
        with self._lock:
            for r in self._book.rooms.values():
                self._book.fail(r, f"decode rank {self.config.rank_label} is shutting down")
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._book.unquiet():
            time.sleep(0.02)
        self._stop.set()
        if self._peers is not None:
            self._peers.wakeup.post()
        if self._thread is not None:
            self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._lease is not None:
            self._lease.stop(deregister=True)
        if self._peers is not None:
            self._peers.close()
        # a prefill rank that never acknowledged can no longer write into these pages
        unregister_quietly(self.engine, self.buffers)

    # -- engine-facing (any thread) -------------------------------------------

    def receiver(self, room: int, prefill_instance: str, dp_rank: int | None = None) -> KVReceiver:
        with self._lock:
            self._book.open(room, prefill_instance, dp_rank)
        self._wake()
        return KVReceiver(self, room)

    def _init_room(self, room: int, page_ids: Any, aux_slot: int, num_tokens: int) -> None:
        pages = np.asarray(page_ids).reshape(-1)
        ctx = dict(room=room, rank=self.config.rank_label)
        if not np.issubdtype(pages.dtype, np.integer):
            raise LayoutError(f"page ids must be integers, got {pages.dtype}", field="page_ids", **ctx)
        page_size = next(iter(self.specs.values())).page_size
        if num_tokens <= 0 or pages.size != -(-num_tokens // page_size):
            raise LayoutError(f"{pages.size} pages for {num_tokens} tokens at page size {page_size}",
                              field="page_ids", **ctx)
        if pages.min() < 0 or pages.max() >= self.buffers.min_capacity:
            raise PageRangeError(f"page ids must lie in [0, {self.buffers.min_capacity}) (registered capacity)",
                                 field="page_ids", **ctx)
        if not 0 <= aux_slot < self.aux_buffer.shape[0]:
            raise PageRangeError(f"aux slot {aux_slot} outside [0, {self.aux_buffer.shape[0]})", field="aux_slot", **ctx)
        with self._lock:
            self._book.init(room, pages.astype(np.int64), aux_slot, num_tokens)
        self._wake()

    def _with_room(self, room: int, fn: Callable[[RecvRoom], T], default: T) -> T:
        with self._lock:
            r = self._book.rooms.get(room)
            return default if r is None else fn(r)

    def _release(self, room: int) -> None:
        """The engine dropped its receiver: the room may go once it is final and quiet.
        Runs from a GC finalizer, possibly on a thread that holds the lock: no locking here."""
        self._book.released.append(room)

    def _abort(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._book.rooms.get(room)
            if r is not None:
                self._book.fail(r, reason)
        self._wake()

    def _wake(self) -> None:
        if self._peers is not None:
            self._peers.wakeup.post()

    # -- look-ups (pool threads) ----------------------------------------------

    def lookup_async(self, r: RecvRoom) -> None:
        """Ask the daemon on a pool thread; the answer is applied by the loop thread
        (``apply_lookup``), never under a lock taken from the pool thread: a future that
        is already done runs its callback inline, on the loop thread that holds the lock."""
        r.lookup_pending = True
        key = self._book.lookup_key(r)
        self._book.lookups_in_flight.add(key)
        fut: Future = self._pool.submit(self.bootstrap.lookup, r.prefill_instance, r.room, self.contract,
                                        self.identity, r.dp_rank)
        fut.add_done_callback(lambda f, room=r.room: self.hand_to_loop(lambda: self.apply_lookup(room, key, f)))

    def hand_to_loop(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the loop thread, with the lock held (safe from any thread)."""
        self._book.results.append(work)
        self._wake()

    def apply_lookup(self, room: int, key: tuple[str, int | None], fut: Future) -> None:
        self._book.lookups_in_flight.discard(key)
        self._book.wake_waiting(key[0])  # rooms that waited for this look-up use its answer now
        r = self._book.rooms.get(room)
        if r is None or r.state.final:
            return
        r.lookup_pending = False
        exc = fut.exception()
        if exc is None:
            self._book.topology_ready(r, fut.result())
        elif isinstance(exc, ContractMismatch):
            fields = ", ".join(getattr(d, "path", str(d)) for d in exc.diff[:6])
            reason = f"contract mismatch with prefill instance {r.prefill_instance!r} (fields: {fields}); nothing transferred"
            # a definitive answer: other rooms toward this instance are refused without asking again for a while
            self._book.refusals[r.prefill_instance] = (time.monotonic(), reason, list(exc.diff))
            self._book.refuse(r)
        elif isinstance(exc, InstanceIncomplete):
            r.next_lookup = time.monotonic() + 0.1  # the instance is still coming up: ask again
            r.lookup_problem = str(exc)
        elif isinstance(exc, KVBridgeError):
            self._book.fail(r, f"bootstrap look-up failed: {exc}")
        else:
            self._book.fail(r, f"bootstrap look-up failed: {type(exc).__name__}: {exc}")

    # -- the loop -------------------------------------------------------------

    def send(self, endpoint: str, msg: Any) -> None:
        try:
            self._peers.send(endpoint, msg)
        except TransferError as exc:  # liveness fails the rooms of a peer that stays unreachable
            log.warning("cannot reach prefill peer %s: %s", endpoint, exc)

    def drop_peer(self, endpoint: str) -> None:
        """Close the connection to a prefill rank that is gone (loop thread only)."""
        self._peers.drop(endpoint)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # a bug must not kill the rank's only control loop
                log.exception("decode loop step failed")
                time.sleep(0.05)

    def _step(self) -> None:
        for endpoint, msg in self._peers.recv_ready(20):
            with self._lock:
                self._book.on_message(endpoint, msg)
        with self._lock:
            self._book.tick(time.monotonic())
