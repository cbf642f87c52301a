"""DecodeEndpoint: one decode rank's shell around its rooms' state machine.

The shell (``transfer/shell.py``: the loop, the lock, the event queue) owns what the
machine (``decode/machine.py``) must not: the control channel (a reconnecting client per prefill rank), a small bounded
pool for bootstrap look-ups and lease checks, and the aux rows in memory. It feeds the
machine events and carries out the actions it returns. 1,000 rooms in flight are 1,000
dict entries, not 1,000 threads. The loop reads like ``step()``:

    receive (PagesDone, with the aux row / AbortAck / Heartbeat / ChunkLanded)  ->  feed each
    ->  feed queued events (look-up answers, scatters done)  ->  close dropped receivers
    ->  tick(now)  ->  carry out

Fewest hops: ``init()`` of a room whose topology is known sends its requests from the
engine's thread, under the lock, with no turn of the loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.schemas import RankIdentity
from kvbridge.errors import ConfigError, KVBridgeError, LayoutError, PageRangeError, TransferError, UnknownInstance
from kvbridge.layout import AuxSchema, PoolSpec
from kvbridge.layout.kinds import kind_specs
from kvbridge.transfer.actions import FreeRoom, Send, Shutdown, Tick
from kvbridge.transfer.channel import wire
from kvbridge.transfer.aux_rows import AuxBuffers
from kvbridge.transfer.channel import PeerSet
from kvbridge.transfer.checks import check_against_contract
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.peers import CheckLease, DropPeer
from kvbridge.transfer.decode.receiver import KVReceiver
from kvbridge.transfer.decode.events import (AuxRowWritten, CommitRead, DropRegistration, EchoScratch, Init,
                                             LeaseChecked, LookedUp, LookUp, Message, ReadForCommit, Refresh,
                                             Refreshed, Registered, Release, Rename, Scattered, ScatterFailed,
                                             SetStaging, WriteAuxRow, WriteProof)
from kvbridge.transfer.decode.machine import DecodeRooms
from kvbridge.transfer.decode.events import InitKinds, KindDigestRead
from kvbridge.transfer.decode.room import DecodeRoom
from kvbridge.transfer.decode.staging import DecodeStaging, Scatter
from kvbridge.transfer.digest import kind_unit_digests, page_digests
from kvbridge.transfer.engine import TransferEngine, tensor_region
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.registration import EndpointBuffers, check_kind_config, register_rank, unregister_quietly
from kvbridge.transfer.rooms import open_waiting
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.scratch import Scratch, device_of
from kvbridge.transfer.shell import EndpointShell
from kvbridge.transfer.staging import HostStager, StagingBuffer, copy_slices

log = logging.getLogger(__name__)

__all__ = ["DecodeConfig", "DecodeEndpoint"]


class DecodeEndpoint(EndpointShell):
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
        super().__init__()
        self._loop_name = "decode"
        rank = config.rank_label
        if bootstrap is None:
            raise ConfigError("a DecodeEndpoint needs a BootstrapClient: it registers there and looks prefill "
                              "instances up", rank=rank, field="bootstrap")
        check_against_contract(specs, aux_schema, contract, rank=rank, tp_size=config.tp_size,
                               tp_rank=config.tp_rank)
        self.config = config
        self.engine = engine
        self.specs = dict(specs)
        check_kind_config(self.specs, rank=rank)
        self.buffers = EndpointBuffers(self.specs, buffers, rank=rank)
        # the contract as this rank holds it: on its engine's transport (prefill on another refuses it)
        self.contract = contract.with_transport(engine.transport)
        self.bootstrap = bootstrap
        self.aux_schema = aux_schema
        self.aux = AuxBuffers(aux_schema, aux_buffer, rank=rank)
        if not self.aux.readable:
            raise ConfigError("aux rows given as device-memory RawBuffers: a decode rank reads each room's aux row "
                              "back (the room echo, hard rule 4), so give them as tensors or host memory", rank=rank,
                              field="aux_buffer")
        unreadable = self.buffers.unreadable() if config.verify_digest else ""
        if unreadable:  # refused here, not at the first room's digest read
            raise ConfigError(f"verify_digest is on, but the digests are read from this rank's pools and {unreadable}: "
                              "give the pools as tensors or whole host pages, or turn verify_digest off", rank=rank,
                              field="verify_digest")
        self.aux_buffer = aux_buffer
        # registered and advertised: prefill writes a nonce here that only this process can read back,
        # the proof that this rank holds the memory it registers (kvbridge doctor probes it too)
        self.scratch = Scratch(device=device_of(self.aux.tensors.values()))
        self.proof_key = ProofKey()  # its public half goes into the registration (transfer/ownership.py)
        self.identity = RankIdentity(instance=config.instance, role="decode", dp_size=config.dp_size,
                                     tp_size=config.tp_size, dp_rank=config.dp_rank, tp_rank=config.tp_rank)
        self.trace = config.trace or os.environ.get("KVBRIDGE_TRACE") == "1"
        # the staging area remote writes of staged targets land in (docs/staging.md)
        self.staging = StagingBuffer.for_buffers(self.buffers.tensors, config.staging, config.staging_bytes,
                                                 config.staging_slot_bytes, rank=rank, role="decode",
                                                 engine=self.engine, reserved=config.staging_granted_slots)
        self.machine = DecodeRooms(
            config, self.specs, aux_schema, proof_key=self.proof_key, trace=self.trace,
            staging=None if self.staging is None else DecodeStaging(self.staging.area, self.staging.base,
                                                                    self.buffers.descs, rank,
                                                                    aux_ranges=self._aux_ranges,
                                                                    kind_specs=kind_specs(self.specs),
                                                                    kernel_ranges=getattr(self.staging.stager,
                                                                                          "ranges", None),
                                                                    registered=[tensor_region(t) for t in
                                                                                self.buffers.tensors.values()]),
            kind_buffers=self.buffers.descs, aux_inline=config.aux_inline and self.aux.writable,
            aux_ahead=self.aux.on_device if config.aux_ahead is None else config.aux_ahead,
            daemon=bootstrap.where,
        )  # fmt: skip
        self._peers: PeerSet | None = None
        self._scattering: deque[tuple[Any, Scatter]] = deque()  # GPU scatters queued: (event, action)
        self._row_writes: deque[tuple[Any, int, float]] = deque()  # aux rows' GPU writes queued: (write, room, start)
        self._pool = ThreadPoolExecutor(max_workers=config.lookup_threads, thread_name_prefix="kvb-lookup")
        self._lease: LeaseKeeper | None = None

    # -- life cycle -----------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """A snapshot for metrics and operators, read under the endpoint's lock: ``peers``
        (prefill ranks alive / dead), ``staging`` (None without a staging area; else its
        counters, its slots by state and the chunks waiting for one), ``control`` (the control
        channel's message counts)."""
        with self._lock:
            found = self.machine.health()
        staging = found.pop("staging")
        return {"peers": found, "staging": staging,
                "control": {} if self._peers is None else self._peers.stats.counts()}

    @property
    def aux_inline(self) -> bool:
        """This rank takes each room's aux row in the report that carries it and writes it into the
        slot itself (``DecodeConfig.aux_inline`` and rows kvbridge can write): no write carries it."""
        return self.machine.aux_inline

    @property
    def aux_ahead(self) -> bool:
        """It takes that row in a report of its own, sent once the pages' write is posted, and writes
        it while they land (rows in device memory: ``AuxBuffers.on_device``)."""
        return self.machine.aux_ahead

    @property
    def rank_id(self) -> str | None:
        """This rank's registration at the daemon (requests name it; it changes on re-registration)."""
        return None if self._lease is None else self._lease.registration.rank_id

    def start(self) -> None:
        self.buffers.register(self.engine)
        self.aux.register(self.engine)
        self.scratch.register(self.engine)
        if self.staging is not None:
            self.staging.register(self.engine)
        self._lease = register_rank(self.bootstrap, self.config, "decode", f"tcp://{self.config.host}:0",
                                    self.engine.session_id, self.buffers.descs, self.aux, self.contract,
                                    self.config.lease_ttl, scratch=self.scratch.descriptor,
                                    staging=None if self.staging is None else self.staging.descriptor,
                                    proof_key=self.proof_key.public_hex,
                                    engine_metadata=self.engine.metadata,
                                    proof_signature=self.proof_key.sign_claim)
        # every connection's Hello names our registration: prefill acts on a message only for the
        # registration of the connection it came on
        self._peers = PeerSet(secret=self.config.secret, name=self.rank_id or "")
        self._start_loop(f"kvb-decode-{self.config.tp_rank}")
        log.info("decode rank %s up (session %s)", self.config.rank_label, self.engine.session_id)

    def close(self, timeout: float = 5.0) -> None:
        """Abort rooms still in flight, wait (bounded) for their acks, deregister."""
        with self._lock:
            self._feed_event(Shutdown(f"decode rank {self.config.rank_label} is shutting down", time.monotonic()))
        end = time.monotonic() + timeout
        while time.monotonic() < end and self._locked_unquiet():
            time.sleep(0.02)
        self._stop_loop(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._lease is not None:
            self._lease.stop(deregister=True)
        if self._peers is not None:
            self._peers.close()
        # a prefill rank that never acknowledged can no longer write into these pages
        unregister_quietly(self.engine, self.buffers, self.aux, self.scratch, self.staging)

    def _aux_ranges(self, slot: int) -> list[tuple[int, int]]:
        """The byte ranges of aux row ``slot`` (where a staged aux row may be scattered)."""
        if not 0 <= slot < self.aux.capacity_rows:
            return []
        if self.aux.row_base is not None:  # one packed store: the row is written whole (aux_slices)
            start = self.aux.row_base + slot * self.aux_schema.row_bytes
            return [(start, start + self.aux_schema.row_bytes)]
        sizes = {r.name: r.nbytes for r in self.aux_schema.regions}
        merged: list[tuple[int, int]] = []  # adjacent regions as one range (a scatter entry may span them)
        for start, end in sorted((a.at(slot), a.at(slot) + sizes[name]) for name, a in self.aux.regions.items()):
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        return merged

    def _read_for_commit(self, a: ReadForCommit) -> None:
        """The memory reads a room's commit needs: its aux row (one copy to the host; or, when its
        report carried it, one write into its slot) and the digests of its pages; the answer is
        queued for the machine (fed before the next message)."""
        start = time.monotonic()
        try:
            if a.row is not None:  # a report carried it (checked): written into the room's slot
                if not a.row_written:  # (not already, ahead of the commit: _write_aux_row)
                    self.aux.write_row(a.aux_slot, a.row)
                row = a.row
            else:
                row = self.aux.read_row(a.aux_slot)
            read_s = time.monotonic() - start
            digests = tuple(kind_unit_digests(self.specs[d.pool], self.buffers.tensors, d.logical, d.units,
                                              d.num_tokens, d.layers) if type(d) is KindDigestRead else
                            page_digests(self.specs, self.buffers.tensors, d.pools, d.pages, d.physical,
                                         d.num_tokens, d.layers) for d in a.digests)
            error = None
        except KVBridgeError as exc:
            row, read_s, digests, error = None, 0.0, (), str(exc)
        self._queue(CommitRead(a.room, row, read_s, digests, error, time.monotonic()))

    def _write_aux_row(self, a: WriteAuxRow) -> None:
        """A room's aux row, carried by a report before its last pages landed, written into its
        slot now (the commit then has nothing to write); the answer is queued for the machine.
        Rows in device memory: the copy is queued and its event polled by the loop (no
        synchronise on this thread, which serves every room); ``AuxRowWritten`` is fed the turn
        it completes, and the room keeps its slot until then (``DecodeRoom.pages_releasable``)."""
        start = time.monotonic()
        try:
            write = self.aux.write_row_async(a.aux_slot, a.row)
            error = None
        except KVBridgeError as exc:
            write, error = None, str(exc)
        if write is not None:
            self._row_writes.append((write, a.room, start))
            return
        now = time.monotonic()
        self._queue(AuxRowWritten(a.room, now - start, error, now))

    def _poll_row_writes(self) -> None:
        """(lock held) Feed ``AuxRowWritten`` for every queued aux row write that completed (one
        stream: in order)."""
        while self._row_writes:
            write, room, start = self._row_writes[0]
            try:
                if not write.done():
                    return
                error = None
            except KVBridgeError as exc:  # (the event's query failed: the room fails by name, the loop goes on)
                error = str(exc)
            self._row_writes.popleft()
            now = time.monotonic()
            self._feed_event(AuxRowWritten(room, now - start, error, now))

    def _echo_scratch(self, a: EchoScratch) -> None:
        """A prefill rank's Challenge: echo the nonce it wrote into our scratch region."""
        try:
            nonce = self.scratch.read(a.offset)
        except KVBridgeError as exc:
            log.warning("prefill %s challenged %s at a bad offset: %s", a.endpoint, self.config.rank_label, exc)
            return
        self._carry(Send((a.endpoint,), wire.ChallengeEcho(nonce=nonce), via=a.via))

    def _write_proof(self, a: WriteProof) -> None:
        """A prefill rank's Challenge with a nonce: our proof into our own scratch region, then the
        echo naming what we wrote (the prefill rank reads it back: proof by read)."""
        try:
            self.scratch.write(a.offset, a.proof)
        except KVBridgeError as exc:
            log.warning("prefill %s challenged %s at a bad offset: %s", a.endpoint, self.config.rank_label, exc)
            return
        self._carry(Send((a.endpoint,), wire.ChallengeEcho(nonce=hashlib.sha256(a.proof).digest()), via=a.via))

    def _feed_event(self, event: Any) -> None:
        """(lock held) Feed one event; first this rank's registration id when the lease keeper
        changed it (requests, aborts and pings name it)."""
        rank_id = self.rank_id
        if rank_id != self.machine.registration:
            self._feed(self.machine.feed(Registered(rank_id)))
        self._feed(self.machine.feed(event))

    def _locked_unquiet(self) -> bool:
        with self._lock:
            return self.machine.unquiet()

    # -- engine-facing (any thread) -------------------------------------------

    def receiver(self, room: int, prefill_instance: str, dp_rank: int | None = None, *,
                 wait: float = 0.0) -> KVReceiver:
        """A KVReceiver for ``room``. RoomInUse while a previous room of that id is open, or draining
        (a prefill rank may still write its pages) for longer than ``wait`` seconds."""
        with self._lock:
            r = open_waiting(lambda: self._open(room, prefill_instance, dp_rank), self._room_freed, wait)
            looking_up = r.state.state == KVPoll.Bootstrapping
        if looking_up:  # a cached topology leaves the loop nothing to do before init()
            self._wake()
        return KVReceiver(self, r)

    def _open(self, room: int, prefill_instance: str, dp_rank: int | None) -> DecodeRoom:
        """(lock held) Close the rooms of dropped handles first: a dropped KVReceiver holds its room
        no more, so its id is draining or free now, never "still held" (and ``wait`` applies)."""
        self._close_released()
        return self.machine.open(room, prefill_instance, dp_rank, time.monotonic())

    def init_room(self, r: DecodeRoom, page_ids: Any, aux_slot: int, num_tokens: int | None, first_page: int,
                  binding: bytes = b"", kind_units: Any = None) -> None:
        """KVReceiver.init(): the engine's input checked here (nothing kept when it is bad)."""
        pages = page_ids if type(page_ids) is np.ndarray and page_ids.ndim == 1 else np.asarray(page_ids).reshape(-1)
        ctx = dict(room=r.room, rank=self.config.rank_label)
        if pages.size and pages.dtype.kind not in "iu":
            raise LayoutError(f"page ids must be integers, got {pages.dtype}", field="page_ids", **ctx)
        page_size = self.machine.page_size
        if not isinstance(first_page, (int, np.integer)) or isinstance(first_page, bool) or first_page < 0:
            raise LayoutError(f"first_page must be a non-negative integer, got {first_page!r}", field="first_page",
                              **ctx)
        if num_tokens is None:  # only the pages are known: first_page + len(page_ids) of them
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
        if not isinstance(binding, bytes) or len(binding) > 64:
            raise LayoutError(f"binding must be at most 64 bytes, got {binding!r:.80}", field="binding", **ctx)
        kinds = self.machine.kinds.check_units(r.room, kind_units, num_tokens, first_page)
        with self._lock:
            if self.machine.kinds:
                self._feed_event(InitKinds(r, kinds))  # (raises, keeping nothing, when its state slot is taken)
            r.binding = binding
            # (a copy: the engine may reuse its array); topology known (cached or looked up): the
            # requests go out from this thread, no hop to the loop
            self._feed_event(Init(r, pages.astype(np.int64), int(aux_slot),
                                  None if num_tokens is None else int(num_tokens), int(first_page), time.monotonic()))
            sent = r.state.state == KVPoll.Transferring
        if not sent:
            self._wake()

    def release_room(self, r: DecodeRoom, binding: bytes, reason: str) -> None:
        """KVReceiver.release(): checked here; the Release goes out from this thread when the
        topology is known, else from the loop once it is."""
        if not isinstance(binding, bytes) or len(binding) > 64:
            raise LayoutError(f"binding must be at most 64 bytes, got {binding!r:.80}", field="binding", room=r.room,
                              rank=self.config.rank_label)
        with self._lock:
            if not r.initialised and r.release_reason is None:
                r.binding = binding
            self._feed_event(Release(r, str(reason), time.monotonic()))
            sent = r.state.final
        if not sent:
            self._wake()

    def set_staging(self, mode: str) -> None:
        """Change what rooms requested from now on offer (auto, always, never: docs/staging.md) on a
        rank that has its staging area (the bench compares the paths on one set of ranks)."""
        self._check_staging_mode(mode, self.staging, "staging area")
        with self._lock:
            self._feed_event(SetStaging(mode))

    def _wake(self) -> None:
        if self._peers is not None:
            self._peers.wakeup.post()

    # -- carrying out actions (lock held) ---------------------------------------

    def _carry(self, a: Any) -> None:
        if type(a) is Send:
            frame = self._peers.encode(a.msg)  # one encoding for every rank it goes to
            for endpoint in a.to:
                self._send_frame(endpoint, frame, a.via)
        elif type(a) is Scatter:
            self._scatter(a)
        elif type(a) is FreeRoom:
            self._room_freed.notify_all()  # receiver(room, ..., wait=...) may open it now
        elif type(a) is LookUp:
            self._look_up(a)
        elif type(a) is Refresh:
            self._refresh(a)
        elif type(a) is CheckLease:
            self._pool.submit(self._check_lease, a)
        elif type(a) is DropPeer:
            self._peers.drop(a.endpoint)
        elif type(a) is ReadForCommit:
            self._read_for_commit(a)
        elif type(a) is WriteAuxRow:
            self._write_aux_row(a)
        elif type(a) is EchoScratch:
            self._echo_scratch(a)
        elif type(a) is WriteProof:
            self._write_proof(a)
        elif type(a) is Rename:  # registered again: new connections say the new id, rooms asked keep theirs
            self._peers.rename(a.rank_id, a.keep)
        elif type(a) is DropRegistration:
            self._peers.drop_name(a.rank_id)
        else:
            raise TypeError(f"decode endpoint cannot carry out {a!r}")

    def _scatter(self, a: Scatter) -> None:
        """Empty a landed staging slot into the room's pages (checked by the machine). Host
        memory: copied here, and ``scattered`` is fed before the next message is read. GPU: the
        kernel is queued on the stager's stream and its event polled by the loop (no synchronise
        on this thread); ``scattered`` is fed the turn it completes, and the slot's credit goes
        back to the next waiter then. The room commits only once its scatters completed."""
        stager = self.staging.stager
        try:
            if isinstance(stager, HostStager):
                copy_slices(a.src, a.dst, a.length)
                event = None
            else:  # the kernel for pages, a plain copy for an aux row in host memory
                stager.copy(a.src, a.dst, a.length, unproven=a.unproven)  # (the machine's proof: Scatter)
                event = stager.copier.record()
        except Exception as exc:  # nothing runs: fail the room (never commit unwritten pages), then free the slot
            log.exception("room %d on %s: scatter out of staging slot %d failed", a.room, self.config.rank_label,
                          a.slot)
            reason = f"scatter out of staging slot {a.slot} failed: {type(exc).__name__}: {exc}"
            self._queue(ScatterFailed(a.room, a.slot, reason, time.monotonic()))
            return
        if event is None:
            self._queue(Scattered(a.room, a.slot, time.monotonic()))
        else:
            self._scattering.append((event, a))

    def _poll_scatters(self) -> None:
        """(lock held) Feed ``scattered`` for every GPU scatter whose event completed (one stream:
        they complete in order)."""
        while self._scattering and self._scattering[0][0].query():
            a = self._scattering.popleft()[1]
            self._feed_event(Scattered(a.room, a.slot, time.monotonic()))

    def _send_frame(self, endpoint: str, frame: bytes, via: str | None = None) -> None:
        try:
            self._peers.send_frame(endpoint, frame, via)
        except TransferError as exc:  # liveness fails the rooms of a peer that stays unreachable
            log.warning("cannot reach prefill peer %s: %s", endpoint, exc)

    def _look_up(self, a: LookUp) -> None:
        """Ask the daemon on a pool thread; the answer is fed by the loop thread, never under a lock
        taken from the pool thread: a future that is already done runs its callback inline, on the
        loop thread that holds the lock."""
        fut: Future = self._pool.submit(self.bootstrap.lookup, a.instance, a.room, self.contract, self.identity,
                                        a.dp_rank)

        def done(f: Future) -> None:
            if f.cancelled():  # the pool was shut down with the endpoint: its rooms were failed by shutdown
                return
            error = f.exception()
            topo = f.result() if error is None else None
            self._queue(LookedUp(a.room, a.key, topo, error, time.monotonic()))

        fut.add_done_callback(done)

    def _refresh(self, a: Refresh) -> None:
        instance, dp = a.key
        fut: Future = self._pool.submit(self.bootstrap.lookup, instance, dp, self.contract, self.identity, dp)

        def done(f: Future) -> None:
            if f.cancelled():  # the pool was shut down with the endpoint
                return
            topo = None if f.exception() is not None else f.result()
            self._queue(Refreshed(a.key, topo, time.monotonic()))

        fut.add_done_callback(done)

    def _check_lease(self, a: CheckLease) -> None:
        """Pool thread: is the dead rank's lease gone?"""
        try:
            view = self.bootstrap.instance(a.instance)
            gone = all(rk.rank_id != a.rank_id for rk in view.ranks)
        except UnknownInstance:  # the whole instance is gone
            gone = True
        except KVBridgeError:  # daemon unreachable: cannot tell, so keep waiting (safe)
            gone = False
        self._queue(LeaseChecked(a.endpoint, a.rank_id, gone, time.monotonic()))

    # -- the loop -------------------------------------------------------------

    def _step(self) -> None:
        # a GPU scatter or aux row write in flight: poll its event every turn (no wait); else wait for input
        for endpoint, via, msg in self._peers.recv_named(0 if self._scattering or self._row_writes else 20):
            with self._lock:
                self._feed_event(Message(endpoint, msg, time.monotonic(), via))
                self._feed_queued()  # a chunk's scatter is done before the next message is read
        with self._lock:
            self._poll_scatters()
            self._poll_row_writes()
            self._feed_queued()
            self._close_released()
            self._feed_event(Tick(time.monotonic()))
            self._feed_queued()
