"""Same-host engine: writes straight into a peer process's GPU memory over CUDA IPC.

    engine = create_engine("ipc")                      # both sides, on one host
    engine.register(*tensor_region(kv_buffer))         # exported to same-host peers
    handle = engine.submit_write(peer.session_id, src, dst, length)

A write of tens of thousands of scattered pages is one kernel launch
(``slicecopy``), not one transfer per page:

    submit_write(session, src, dst, length)
      1. src must lie in our registered regions, every dst in a region the peer
         registered (its table comes over the side channel, ``ipc.channel``, and
         is fetched again once on a miss); otherwise the write FAILS and nothing
         of it is written (hard rule 5 against what the peer registered)
      2. dst -> an address valid here: the peer's allocation opened once per
         process (CUDA IPC), or the address itself when the peer is this process
      3. copies enqueued on the engine's stream: device -> device slices by the
         slice kernel (``direct_min_bytes`` and longer by cudaMemcpyAsync, the copy
         engines), slices with host memory on one side by cudaMemcpyAsync,
         host -> host (same process only) by numpy on the pump thread
      4. an event after the batch; the handle stays PENDING until the pump thread
         saw it complete, so "final" means "nothing of it can still land"

The region tables (ours as exported, each peer's as learnt) and their side-channel
messages are in ``ipc.tables``. Withdrawal: ``unregister(ptr)`` tells every writer
that learnt the region; each forgets it (new writes into it fail), waits for its
copies into it to complete, closes its mapping and confirms; only then does
``unregister`` return. A peer never writes into memory after the owner withdrew it.

Host memory registers too (aux rows, tests), but only a writer in the same
process can reach it: a host destination in another process fails the write
with a reason (use device memory, or the ``auto`` engine, which sends those
slices through Mooncake). On a machine without CUDA the engine moves host
memory within one process: how CI tests the protocol.

Faults (``engine.faults``, as the local engine's, counted over batches): fail
(first half lands, FAILED), corrupt (first byte of the first slice flipped after
landing, DONE), delay_s and gate (the batch is launched only once due / the gate
is set: writes held in flight).

``stats`` counts writes, slices, bytes and how they went (kernel launches,
kernel slices and pieces, direct copies, host slices, refusals); with
``KVBRIDGE_TRACE=1`` each write logs a ``trace engine=ipc`` line when posted and
when final.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import EngineError
from kvbridge.transfer.engine.base import wait_ready
from kvbridge.transfer.engine.ipc.channel import Channel, Conn
from kvbridge.transfer.engine.ipc.tables import DEVICE, Export, IpcTables, Peer, PeerRegion
from kvbridge.transfer.engine.jobs import Job, JobTable, Regions, SubmittingJobEngine, check_slices, locate
from kvbridge.transfer.engine.local import Faults
from kvbridge.transfer.engine.slicecopy import DIRECT_MIN_BYTES, copy_slices

log = logging.getLogger("kvbridge.transfer.engine.ipc")  # one logger for the engine and its tables

_sessions = itertools.count()


@dataclass
class _Batch:
    job: Job
    number: int
    index: int
    src: np.ndarray
    dst: np.ndarray  # translated: valid in this process
    length: np.ndarray
    device_src: np.ndarray  # bool per slice
    device_dst: np.ndarray
    regions: list[PeerRegion]
    peer: Peer
    after: Any = None  # events the source bytes wait on (the copy stream waits on the GPU)
    due: float = 0.0
    held: bool = False  # launched by the pump thread (faults), not by submit_write
    event: Any = None
    counts: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    posted: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        return (f"write {self.job.handle} batch {self.index + 1}/{self.job.num_batches} to session {self.job.session} "
                f"({self.src.size} slices, {int(self.length.sum())} bytes)")


class IpcEngine(IpcTables, SubmittingJobEngine):
    direct_only = True  # one kernel launch per write copies scattered slices (slicecopy.py)
    transport = "ipc"  # its sessions are side-channel names on this host: its peers are IPC engines

    def __init__(self, *, session: str | None = None, max_slices_per_call: int = 1 << 20, device: int | None = None,
                 direct_min_bytes: int = DIRECT_MIN_BYTES, copier_options: dict[str, int] | None = None) -> None:
        if max_slices_per_call < 1:
            raise EngineError(f"max_slices_per_call must be positive, got {max_slices_per_call}", field="max_slices_per_call")
        from kvbridge.transfer.engine._cuda import cuda_available

        self.max_slices_per_call = max_slices_per_call
        self.faults = Faults()
        self.stats: Counter[str] = Counter()
        self._session = session or f"ipc:{socket.gethostname()}:{os.getpid()}:{next(_sessions)}:{uuid.uuid4().hex[:6]}"
        self._who = f"ipc engine {self._session}"
        self._trace = os.environ.get("KVBRIDGE_TRACE") == "1"
        self._has_cuda = cuda_available()
        self._device = device
        self._direct_min_bytes = direct_min_bytes
        self._copier_options = copier_options or {}
        self._copier: Any = None  # slicecopy.CudaCopier, made on the first device write
        self._lock = threading.Lock()  # regions, exports, peers, in-flight counts
        self._regions = Regions()
        self._kinds: dict[int, str] = {}  # own region start -> kind
        self._own_device = np.zeros(0, dtype=bool)  # per region of _regions, in sorted order
        self._exports: dict[int, Export] = {}
        self._peers: dict[str, Peer] = {}
        self._acks = threading.Condition(self._lock)
        self._revoking: dict[int, set[Conn]] = {}  # seq -> accepted conns yet to confirm
        self._seqs = itertools.count(1)
        self._jobs = JobTable(self._who)
        self._cond = threading.Condition()
        self._queue: deque[_Batch] = deque()  # pump thread: batches to finish, oldest first
        self._batches = 0  # batches posted so far: the next one's number (what faults count)
        self._closed = False
        self._channel = Channel(self._session, self._on_message, self._on_closed)
        self._pump = threading.Thread(target=self._run, name=f"kvb-ipc-pump-{self._session}", daemon=True)
        self._pump.start()

    @property
    def session_id(self) -> str:
        return self._session

    @property
    def batches_posted(self) -> int:
        """Batches posted so far; the next batch has this number (as ``faults`` count them)."""
        return self._batches


    # ---- writes -----------------------------------------------------------------------------
    def _submit(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, after: Any, *,
                probe: bool) -> int:
        self._check_open()
        if not isinstance(session, str) or not session:
            raise EngineError(f"{self._who}: session must be a non-empty string, got {session!r}", field="session")
        src, dst, length = check_slices(src, dst, length)
        with self._lock:
            own = self._regions.locate(src, length)
            bad = np.flatnonzero(own < 0)
            device_src = self._own_device[own] if not bad.size else None
        if bad.size:
            i = int(bad[0])
            raise EngineError(f"{self._who}: slice {i} source [{int(src[i]):#x}, +{int(length[i])}) is not inside "
                              "memory registered with this engine", field="src")
        if src.size == 0:
            return self._jobs.open(session, 0, 0).handle
        cap = self.max_slices_per_call
        cuts = [(a, min(a + cap, src.size)) for a in range(0, src.size, cap)]
        job = self._jobs.open(session, len(cuts), int(src.size))
        self.stats["writes"] += 1
        self.stats["slices"] += int(src.size)
        self.stats["bytes"] += int(length.sum())
        try:
            peer, dst_here, device_dst, used = self._translate(session, dst, length, cuts)
        except EngineError as exc:
            self.stats["refused"] += 1
            for _ in cuts:
                self._jobs.batch_finished(job, f"{exc}: write {job.handle} ({src.size} slices, "
                                               f"{int(length.sum())} bytes), nothing written")
            return job.handle
        for i, (a, b) in enumerate(cuts):
            self._post(job, i, peer, src[a:b], dst_here[a:b], length[a:b], device_src[a:b], device_dst[a:b], used[i],
                       after, probe=probe)
        return job.handle

    def _translate(self, session: str, dst: np.ndarray, length: np.ndarray, cuts: list[tuple[int, int]]
                   ) -> tuple[Peer, np.ndarray, np.ndarray, list[list[PeerRegion]]]:
        """Check every dst against the regions the peer registered (its table fetched once more on a
        miss), map them here, count each batch in flight on its regions: under one lock, so a
        withdrawal either comes first (the write fails) or waits for these batches."""
        peer = self._peer(session)
        for attempt in (0, 1):
            with self._lock:
                idx = locate(peer.starts, peer.ends, dst, length)
                why = self._why_outside(peer, dst, length, idx)
                if why is None:
                    per_batch = [self._used(peer, idx[a:b]) for a, b in cuts]
                    for region in {id(r): r for rs in per_batch for r in rs}.values():
                        if not region.local:
                            self._open(peer, region)
                            peer.shift = None
                    device_dst = peer.device[idx]
                    dst_here = (dst.astype(np.int64) + peer.shifts()[idx]).astype(np.uint64)
                    for regions in per_batch:
                        for region in regions:
                            region.inflight += 1
                    return peer, dst_here, device_dst, per_batch
            if attempt == 0:  # registered since we asked? ask once more
                peer = self._peer(session, refresh=True)
        raise EngineError(why, field="dst")


    def _post(self, job: Job, index: int, peer: Peer, src: np.ndarray, dst_here: np.ndarray, length: np.ndarray,
              device_src: np.ndarray, device_dst: np.ndarray, used: list[PeerRegion], after: Any = None, *,
              probe: bool = False) -> None:
        """Launch one batch (translated and counted in flight by _translate) and queue it for the pump.
        A probe (``probe_write``) takes no fault and no batch number: fault plans count KV writes."""
        if probe:
            number, faults = -1, Faults()
        else:
            with self._lock:
                number, self._batches = self._batches, self._batches + 1
            faults = self.faults
        reason = ""
        if number in faults.fail_batches:
            keep = (src.size + 1) // 2
            src, dst_here, length = src[:keep], dst_here[:keep], length[:keep]
            device_src, device_dst = device_src[:keep], device_dst[:keep]
            reason = f"{self._who}: injected failure of batch {number}: write {job.handle} to session {job.session}"
        batch = _Batch(job, number, index, src, dst_here, length, device_src, device_dst, used, peer, after,
                       due=time.monotonic() + faults.delay_s, reason=reason)
        batch.held = faults.holding
        num_host = int((~device_src & ~device_dst).sum())
        if num_host:  # copied by the pump thread
            batch.counts["host_slices"] = num_host
            self.stats["host_slices"] += num_host
        if not batch.held:
            self._launch(batch)
        if self._trace:
            log.info("trace engine=ipc write=%d batch=%d -> %s slices=%d bytes=%d %s @%.6f", job.handle, index,
                     job.session, src.size, int(length.sum()),
                     " ".join(f"{k}={v}" for k, v in batch.counts.items()) or "held", time.monotonic())
        with self._cond:
            self._queue.append(batch)
            self._cond.notify()


    def _launch(self, batch: _Batch) -> None:
        """Enqueue the batch's device copies (the host -> host part runs on the pump thread)."""
        cuda_part = batch.device_src | batch.device_dst
        if not cuda_part.any():
            return
        try:
            copier = self._copier_for(batch)
            copier.wait_for(batch.after)  # the producer's work first, on the GPU: the host does not block
            both = batch.device_src & batch.device_dst
            if both.all():  # every slice device to device (a room of GPU pools): no selection copies
                counts = copier.launch(batch.src, batch.dst, batch.length)
            else:
                counts = copier.launch(batch.src[both], batch.dst[both], batch.length[both]) if both.any() else {}
            mixed = cuda_part & ~both
            for s, d, n in zip(batch.src[mixed].tolist(), batch.dst[mixed].tolist(), batch.length[mixed].tolist()):
                copier.copy_async(d, s, n)
            batch.event = copier.record()
            counts["host_device_slices"] = int(mixed.sum())
            counts = {k: v for k, v in counts.items() if v}
            batch.counts.update(counts)
            self.stats.update(counts)
        except Exception as exc:  # a CUDA or Triton error fails this batch with its cause
            batch.reason = batch.reason or f"{self._who}: launching {batch.describe()} failed: {exc!r}"
            batch.event = None

    def _copier_for(self, batch: _Batch) -> Any:
        if self._copier is None:
            from kvbridge.transfer.engine.slicecopy import CudaCopier

            device = self._device if self._device is not None else next(
                (r.device for r in batch.regions if r.kind == DEVICE), 0)
            self._copier = CudaCopier(device, direct_min_bytes=self._direct_min_bytes, **self._copier_options)
        return self._copier

    # ---- pump thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue[0]
            if batch.held and not self._hold(batch):
                batch.reason = f"{self._who} closed before {batch.describe()} landed"
            else:
                self._land(batch)
            with self._cond:
                self._queue.popleft()
            self._settle(batch)

    def _hold(self, batch: _Batch) -> bool:
        """Wait until the batch is due and its gate is open, then launch it; False when closed first."""
        if not self.faults.hold(batch.due, self._cond, lambda: self._closed):
            return False
        self._launch(batch)
        return True

    def _land(self, batch: _Batch) -> None:
        host = ~batch.device_src & ~batch.device_dst
        try:
            if host.any():
                wait_ready(batch.after)
                copy_slices(batch.src[host], batch.dst[host], batch.length[host])
            if batch.event is not None:
                batch.event.synchronize()
            if batch.number in self.faults.corrupt_batches and batch.src.size:
                self._flip_first_byte(batch)
        except Exception as exc:  # the batch fails with its cause; the engine goes on
            batch.reason = batch.reason or f"{self._who}: landing {batch.describe()} failed: {exc!r}"

    def _flip_first_byte(self, batch: _Batch) -> None:
        addr = int(batch.dst[0])
        if not batch.device_dst[0]:
            byte = ctypes.c_uint8.from_address(addr)
            byte.value ^= 0xFF
            return
        cell = np.zeros(1, np.uint8)
        self._copier.copy_bytes(cell.ctypes.data, addr, 1)
        cell[0] ^= 0xFF
        self._copier.copy_bytes(addr, cell.ctypes.data, 1)

    def _settle(self, batch: _Batch) -> None:
        done = []
        with self._lock:
            for region in batch.regions:
                region.inflight -= 1
                if region.inflight == 0 and region.revoke_seq is not None:
                    done.append(region)
        if self._trace:
            log.info("trace engine=ipc write=%d batch=%d %s +%.2fms @%.6f", batch.job.handle, batch.index,
                     "failed" if batch.reason else "done", (time.monotonic() - batch.posted) * 1000, time.monotonic())
        self._jobs.batch_finished(batch.job, batch.reason)
        for region in done:  # after the handle is final: a withdrawal that waited for it sees it final
            self._release(batch.peer, region)

    # ---- life cycle -------------------------------------------------------------------------
    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._pump.join()
        with self._lock:
            starts = list(self._regions.starts())
        for ptr in starts:
            try:
                self.unregister(ptr)
            except EngineError as exc:
                log.warning("%s: %s", self._who, exc)
        self._channel.close()
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            for region in peer.regions:
                region.revoke_seq = None
                self._release(peer, region)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self._who} is closed")
