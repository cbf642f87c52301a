"""DecodeEndpoint: one decode rank's control loop.

One loop thread owns every socket and room; bootstrap look-ups run on a small
bounded pool (results cached per prefill DP group for a moment), so 1,000 rooms
in flight are 1,000 dict entries, not 1,000 threads. The loop reads like ``step()``:

    receive (PagesDone, with the aux row / AbortAck / Heartbeat)  ->  apply look-ups
    ->  send TransferRequests  ->  commit complete rooms  ->  pings, liveness, deadlines
"""

from __future__ import annotations

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
from kvbridge.errors import (
    BootstrapUnavailable,
    ConfigError,
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    LayoutError,
    PageRangeError,
    TransferError,
)
from kvbridge.layout import AuxSchema, PoolSpec
from kvbridge.transfer.aux_rows import AuxBuffers
from kvbridge.transfer.channel import PeerSet
from kvbridge.transfer.checks import check_against_contract
from kvbridge.transfer.decode_rooms import RoomBook
from kvbridge.transfer.engine import TransferEngine
from kvbridge.transfer.lifecycle import open_waiting
from kvbridge.transfer.poll import KVPoll
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
    # (refreshed in the background while the group is in use: rooms do not wait for look-ups)
    # After a silent prefill rank's lease is gone, its rooms' pages stay held this long more
    # (unless it acknowledges the abort): a process that was frozen (SIGSTOP, a paused VM)
    # past its lease still holds queued writes that land the moment it resumes.
    lease_quarantine: float = 30.0
    lookup_threads: int = 4
    verify_digest: bool = False
    trace: bool = False

    @property
    def rank_label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/tp{self.tp_rank}"


class DecodeEndpoint:
    """One decode rank. ``aux_buffer``: where aux rows land, a packed uint8 ``[rows, row_bytes]``
    tensor or ``{region: tensor[rows, ...]}`` (SGLang's metadata buffers). Specs and aux schema
    are checked against the contract here (ConfigError naming the field)."""

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
        rank = config.rank_label
        if bootstrap is None:
            raise ConfigError("a DecodeEndpoint needs a BootstrapClient: it registers there and looks prefill "
                              "instances up", rank=rank, field="bootstrap")
        check_against_contract(specs, aux_schema, contract, rank=rank, tp_size=config.tp_size,
                               tp_rank=config.tp_rank)
        self.config = config
        self.engine = engine
        self.specs = dict(specs)
        self.buffers = EndpointBuffers(self.specs, buffers, rank=rank)
        self.contract = contract
        self.bootstrap = bootstrap
        self.aux_schema = aux_schema
        self.aux = AuxBuffers(aux_schema, aux_buffer, rank=rank)
        if not self.aux.readable:
            raise ConfigError("aux rows given as device-memory RawBuffers: a decode rank reads each room's aux row "
                              "back (the room echo, hard rule 4), so give them as tensors or host memory", rank=rank,
                              field="aux_buffer")
        self.aux_buffer = aux_buffer
        self.identity = RankIdentity(instance=config.instance, role="decode", dp_size=config.dp_size,
                                     tp_size=config.tp_size, dp_rank=config.dp_rank, tp_rank=config.tp_rank)
        self.trace = config.trace or os.environ.get("KVBRIDGE_TRACE") == "1"
        self._lock = threading.Lock()
        self._room_freed = threading.Condition(self._lock)  # notified when a room id is forgotten
        self._book = RoomBook(self)
        self._peers: PeerSet | None = None
        self._pool = ThreadPoolExecutor(max_workers=config.lookup_threads, thread_name_prefix="kvb-lookup")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lease: LeaseKeeper | None = None

    # -- life cycle -----------------------------------------------------------

    @property
    def rank_id(self) -> str | None:
        """This rank's registration at the daemon (requests name it; it changes on re-registration)."""
        return None if self._lease is None else self._lease.registration.rank_id

    def start(self) -> None:
        self.buffers.register(self.engine)
        self.aux.register(self.engine)
        self._peers = PeerSet(secret=self.config.secret)
        self._lease = register_rank(self.bootstrap, self.config, "decode", f"tcp://{self.config.host}:0",
                                    self.engine.session_id, self.buffers.descs, self.aux, self.contract,
                                    self.config.lease_ttl)
        self._thread = threading.Thread(target=self._run, name=f"kvb-decode-{self.config.tp_rank}", daemon=True)
        self._thread.start()
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
        unregister_quietly(self.engine, self.buffers, self.aux)

    def __enter__(self) -> DecodeEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- engine-facing (any thread) -------------------------------------------

    def receiver(self, room: int, prefill_instance: str, dp_rank: int | None = None, *,
                 wait: float = 0.0) -> KVReceiver:
        """A KVReceiver for ``room``. RoomInUse while a previous room of that id is open, or draining
        (a prefill rank may still write its pages) for longer than ``wait`` seconds."""
        with self._lock:
            r = open_waiting(lambda: self._book.open(room, prefill_instance, dp_rank), self._room_freed, wait)
            looking_up = r.state.state == KVPoll.Bootstrapping
        if looking_up:  # a cached topology leaves the loop nothing to do before init()
            self._wake()
        return KVReceiver(self, r)

    def _init_room(self, r: RecvRoom, page_ids: Any, aux_slot: int, num_tokens: int | None, first_page: int) -> None:
        pages = page_ids if type(page_ids) is np.ndarray and page_ids.ndim == 1 else np.asarray(page_ids).reshape(-1)
        ctx = dict(room=r.room, rank=self.config.rank_label)
        if pages.size and pages.dtype.kind not in "iu":
            raise LayoutError(f"page ids must be integers, got {pages.dtype}", field="page_ids", **ctx)
        page_size = self._book.page_size
        if not isinstance(first_page, (int, np.integer)) or isinstance(first_page, bool) or first_page < 0:
            raise LayoutError(f"first_page must be a non-negative integer, got {first_page!r}", field="first_page",
                              **ctx)
        if num_tokens is None:  # only the pages are known: first_page + len(page_ids) of them
            num_pages = int(first_page) + int(pages.size)
            if not pages.size:
                raise LayoutError(f"no page ids after first_page {first_page}, and no num_tokens: the request would "
                                  "have nothing to receive, not even the page of its last token", field="page_ids",
                                  **ctx)
        else:
            if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens <= 0:
                raise LayoutError(f"num_tokens must be a positive integer, got {num_tokens!r}", field="num_tokens",
                                  **ctx)
            num_pages = -(-int(num_tokens) // page_size)
            if not first_page <= num_pages:
                raise LayoutError(f"first_page {first_page!r} outside [0, {num_pages}] ({num_tokens} tokens at page "
                                  f"size {page_size})", field="first_page", **ctx)
            if pages.size != num_pages - first_page:
                raise LayoutError(f"{pages.size} pages for logical pages [{first_page}, {num_pages}) of {num_tokens} "
                                  f"tokens at page size {page_size}", field="page_ids", **ctx)
        # inside every registered buffer, hence int32 on the wire (pages travel packed little-endian int32)
        capacity = min(self.buffers.min_capacity, 2**31)
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= capacity):
            raise PageRangeError(f"page ids must lie in [0, {capacity}) (registered capacity)",
                                 field="page_ids", **ctx)
        self.aux.check_slot(aux_slot, room=r.room)
        with self._lock:
            self._book.init(r, pages.astype(np.int64), int(aux_slot), None if num_tokens is None else int(num_tokens),
                            int(first_page))  # (a copy: the engine may reuse its array)
            # topology known (cached or looked up): the requests go out from this thread, no hop to the loop
            sent = self._book.request_if_ready(r)
        if not sent:
            self._wake()

    def _locked(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return fn()

    def _release(self, r: RecvRoom) -> None:
        """The engine dropped its receiver: the room closes at the next step.
        Runs from a GC finalizer, possibly on a thread that holds the lock: no locking here."""
        self._book.released.append(r)

    def _close_room(self, r: RecvRoom) -> None:
        with self._lock:
            self._book.close(r)
        self._wake()

    def _abort(self, r: RecvRoom, reason: str) -> None:
        with self._lock:
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

    def refresh_async(self, key: tuple[str, int]) -> None:
        """Refresh the cached topology of ``key`` = (instance, DP group) on a pool thread."""
        self._book.lookups_in_flight.add(key)
        instance, dp = key
        fut: Future = self._pool.submit(self.bootstrap.lookup, instance, dp, self.contract, self.identity, dp)

        def done(f: Future) -> None:
            topo = None if f.exception() is not None else f.result()
            self.hand_to_loop(lambda: self._book.refreshed(key, topo))

        fut.add_done_callback(done)

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
            self._book.topology_ready(r, fut.result(), fresh=True)
        elif isinstance(exc, ContractMismatch):
            fields = ", ".join(getattr(d, "path", str(d)) for d in exc.diff[:6])
            reason = f"contract mismatch with prefill instance {r.prefill_instance!r} (fields: {fields}); nothing transferred"
            # a definitive answer: other rooms toward this instance are refused without asking again for a while
            self._book.refusals[r.prefill_instance] = (time.monotonic(), reason, list(exc.diff))
            self._book.refuse(r)
        elif isinstance(exc, BootstrapUnavailable):
            # the daemon is down: a topology it gave us before still names live ranks (liveness
            # pings catch the ones that are not); without one, ask again until the bootstrap timeout
            stale = self._book.stale(r)
            r.lookup_problem = str(exc)
            if stale is not None:
                self._book.topology_ready(r, stale)
            else:
                r.next_lookup = time.monotonic() + 0.25
        elif isinstance(exc, InstanceIncomplete):
            r.next_lookup = time.monotonic() + 0.1  # the instance is still coming up: ask again
            r.lookup_problem = str(exc)
        elif isinstance(exc, KVBridgeError):
            self._book.fail(r, f"bootstrap look-up failed: {exc}")
        else:
            self._book.fail(r, f"bootstrap look-up failed: {type(exc).__name__}: {exc}")

    # -- the loop -------------------------------------------------------------

    def send(self, endpoint: str, msg: Any) -> None:
        self.send_frame(endpoint, self.encode(msg))

    def encode(self, msg: Any) -> bytes:
        """``msg`` as the control channel sends it (sealed with the channel's secret)."""
        return self._peers.encode(msg)

    def send_frame(self, endpoint: str, frame: bytes) -> None:
        """Send an ``encode()``d message (one encoding may go to several ranks)."""
        try:
            self._peers.send_frame(endpoint, frame)
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
