"""Mooncake transfer engine adapter (imported only by ``create_engine``).

What the Python binding (mooncake-transfer-engine 0.3.13) does, measured here:

    batch_transfer_async_write(session, srcs, dsts, lens) -> batch id; 0 (or 2**64-1) = refused
    get_batch_transfer_status([id]) -> 0 done | -1 failed or timed out.  BLOCKS: it spins,
        GIL released, until the batch finishes or MC_TRANSFER_TIMEOUT (30 s) + 1 ns/byte
        passes. There is no "pending" code. It frees the batch id.
    transfer_check_status(id) -> 1 done | 0 pending | -1 failed | -2 timeout. Non-blocking,
        but it looks at the batch's FIRST slice only and frees the id once that one is
        done: useless for batches, and calling both on one id is a use-after-free.
    register_memory -> 0 | -7 overlapping region;  unregister_memory -> 0 | -3 unknown
    A write outside the peer's registered memory: that slice fails (-1), the other
    slices of the batch still land. A dead peer: -1 within about a second.
    More than ~2,048 slices queued per (engine, peer) - in one call or several async
    calls - overflows the TCP lane queue ("queue-full"); every batch then times out
    after 30 s and the peer is unusable meanwhile.

Hence the design: ``submit_write`` only queues batches of at most
``max_slices_per_call`` slices and returns a handle; one pump thread per engine
posts them, keeping at most ``max_slices_per_call`` slices in flight per
destination session, and waits for them oldest first with the blocking status
call, then reports through the notify callback (so a completion reaches the
endpoint without another hop). ``poll`` is a dict look-up, so a loop can carry
many rooms on one thread. One pump means waits are serial: a batch to a slow or
dead peer delays the *completion bookkeeping* of later batches (not their
transfer) by up to its own timeout. Posting every write from the caller was tried:
``batch_transfer_async_write`` of 247 slices costs the caller about 0.3 ms, as
much as the hand-off it saves, and the intra-node NVLink transport copies inside
that call, a synchronous ``cudaMemcpy`` per slice. So only a *small* write (at
most ``DIRECT_MAX_SLICES`` slices and ``DIRECT_MAX_BYTES``; over TCP, where a post
only queues the slices, up to ``DIRECT_MAX_SLICES_TCP`` slices of any size; no
source event still pending) to a session with nothing queued or in flight is posted by the
caller, saving the pump's wake-up on the room's path; the pump still waits for it
and reports it (``direct_posts`` counts them). Source events (``after``) are waited for on the
pump thread, before posting.

Security: Mooncake's handshake and data listeners bind every interface and
accept anyone; keep these engines on trusted networks (tests use 127.0.0.1 only).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import EngineError
from kvbridge.transfer.engine.base import is_ready, wait_ready
from kvbridge.transfer.engine.jobs import U64_MAX, Job, JobEngine, JobTable, Regions, as_int, check_write
from kvbridge.transfer.engine.native_logs import quiet_native_logs

log = logging.getLogger(__name__)

CLOSE_JOIN_S = 40.0  # longer than Mooncake's own 30 s transfer timeout
DIRECT_MAX_SLICES = 64  # a write this small to an idle session is posted by the caller (``_direct``)
DIRECT_MAX_BYTES = 16 << 20
# Over TCP a post only queues the slices for Mooncake's workers: measured here after 5 ms idle,
# 49 us for 10 slices, 161 us for 123, 196 us for 247 (668 us for 1,024), against about 90 us
# for the pump's wake-up, so the caller posts any write of up to this many slices, whatever its size.
DIRECT_MAX_SLICES_TCP = 256


@dataclass
class _Batch:
    job: Job
    index: int  # 0-based within the job
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    after: Any = None  # events the source bytes wait on: the pump waits for them before posting
    batch_id: int = 0
    posted: float = 0.0  # when batch_transfer_async_write returned (monotonic; the trace's)

    @property
    def num_slices(self) -> int:
        return int(self.src.size)

    def describe(self, session: str) -> str:
        return (
            f"write {self.job.handle} batch {self.index + 1}/{self.job.num_batches} to session {session} "
            f"({self.num_slices} slices, {int(self.length.sum())} bytes)"
        )


class MooncakeEngine(JobEngine):
    transport = "mooncake"

    def __init__(self, *, host: str, protocol: str, device: str, max_slices_per_call: int) -> None:
        try:
            from mooncake.engine import TransferEngine as _Mooncake
        except ImportError as exc:  # pragma: no cover - create_engine checks first
            raise EngineError(f"the Mooncake transfer engine does not import: {exc}") from exc
        if max_slices_per_call < 1:
            raise EngineError(f"max_slices_per_call must be positive, got {max_slices_per_call}", field="max_slices_per_call")
        self.max_slices_per_call = max_slices_per_call
        with quiet_native_logs():  # its start-up lines go to our DEBUG log, not stderr
            self._mc = _Mooncake()
            rc = self._mc.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise EngineError(f"mooncake initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, {device!r}) returned {rc}")
        self._session = f"{host}:{self._mc.get_rpc_port()}"
        # what carries the bytes: MC_FORCE_TCP (set at all) makes Mooncake use TCP whatever was asked
        self.protocol = "tcp" if "MC_FORCE_TCP" in os.environ else protocol
        # Mooncake installs its intra-node NVLink transport for rdma when MC_INTRANODE_NVLINK is set (at all):
        # a synchronous cudaMemcpy per slice inside the post (layerwise.layerwise_slower reads this)
        self.intranode_nvlink = self.protocol == "rdma" and "MC_INTRANODE_NVLINK" in os.environ
        self._who = f"mooncake engine {self._session}"
        self._regions = Regions()
        self._regions_lock = threading.Lock()
        self._jobs = JobTable(self._who)
        self._cond = threading.Condition()
        self._queued: dict[str, deque[_Batch]] = {}  # per destination session, not yet posted
        self._inflight_slices: dict[str, int] = {}
        self._inflight: deque[tuple[str, _Batch]] = deque()  # posted, oldest first (pump thread only)
        self._closed = False
        self.direct_posts = 0  # writes posted by the caller, not the pump (``_direct``)
        tcp = self.protocol == "tcp"
        self._direct_max_slices = min(DIRECT_MAX_SLICES_TCP if tcp else DIRECT_MAX_SLICES, max_slices_per_call)
        self._direct_max_bytes = None if tcp else DIRECT_MAX_BYTES
        self._posting = 0  # direct posts under way: the pump does not exit meanwhile
        self._trace = os.environ.get("KVBRIDGE_TRACE") == "1"  # a line per batch posted and per batch final
        self._pump = threading.Thread(target=self._run, name=f"mooncake-pump-{self._session}", daemon=True)
        self._pump.start()

    @property
    def session_id(self) -> str:
        return self._session

    @property
    def stats(self) -> dict[str, int]:
        """``direct_posts``: writes the caller posted itself (small, to an idle session)."""
        return {"direct_posts": self.direct_posts}

    # ---- memory -----------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        ptr, nbytes = as_int(ptr, self._who), as_int(nbytes, self._who)
        with self._regions_lock:
            self._check_open()
            self._regions.add(ptr, nbytes, self._who)
            rc = self._mc.register_memory(ptr, nbytes)
            if rc != 0:
                self._regions.remove(ptr, self._who)
                raise EngineError(f"{self._who}: mooncake register_memory({ptr:#x}, {nbytes}) returned {rc}")

    def unregister(self, ptr: int) -> None:
        ptr = as_int(ptr, self._who)
        with self._regions_lock:
            self._check_open()
            self._regions.remove(ptr, self._who)
            rc = self._mc.unregister_memory(ptr)
            if rc != 0:
                raise EngineError(f"{self._who}: mooncake unregister_memory({ptr:#x}) returned {rc}")

    # ---- writes -----------------------------------------------------------------------------
    def submit_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
                     after: Any = None) -> int:
        self._check_open()
        src, dst, length = check_write(self._who, session, src, dst, length, self._regions, self._regions_lock)
        if src.size == 0:
            self._check_open()
            return self._jobs.open(session, 0, 0).handle
        cap = self.max_slices_per_call
        starts = range(0, src.size, cap)
        with self._cond:
            self._check_open()
            job = self._jobs.open(session, len(starts), int(src.size))
            if not self._direct(session, src, length, after):
                queue = self._queued.setdefault(session, deque())
                for i, a in enumerate(starts):
                    queue.append(_Batch(job, i, src[a : a + cap], dst[a : a + cap], length[a : a + cap], after))
                self._cond.notify()
                return job.handle
            self._inflight_slices[session] = int(src.size)  # reserved: the session's cap, and the pump
            self._posting += 1  # stays until the post is in
            self.direct_posts += 1
        # a small write to an idle session is posted here, one thread wake-up before the pump would
        # post it; the pump waits for it in order and reports it. Outside the lock: a refused post
        # reports at once, and the engine's callback may take the caller's locks
        try:
            self._post(session, _Batch(job, 0, src, dst, length))
        finally:
            with self._cond:
                self._posting -= 1
                self._cond.notify()
        return job.handle

    def route(self, session: str) -> str:
        """``mooncake/<protocol>``: the registry's route of a write to any peer (its staging
        thresholds are the transport's: ``registry.staging_thresholds``)."""
        return f"mooncake/{self.protocol}"

    def reads(self, session: str) -> bool:
        return True

    def probe_read(self, session: str, dst: np.ndarray, src: np.ndarray, length: np.ndarray,
                   timeout: float = 5.0) -> None:
        """The ownership proof's read: each slice with ``transfer_sync_read`` (a few, small)."""
        self._check_open()
        dst, src, length = check_write(self._who, session, dst, src, length, self._regions, self._regions_lock)
        for d, s, n in zip(dst.tolist(), src.tolist(), length.tolist()):
            rc = self._mc.transfer_sync_read(session, d, s, n)
            if rc != 0:
                raise EngineError(f"{self._who}: read of {n} bytes at {s:#x} from session {session} failed (rc {rc})",
                                  field="src")

    def _direct(self, session: str, src: np.ndarray, length: np.ndarray, after: Any) -> bool:
        """Post from the caller (lock held): a write of few slices and bytes, with no source event
        still to wait for (an aux row's copy has completed by the room's last send: its write is
        posted here, not after the pump's wake-up), to a session with nothing queued or in flight. Larger writes go to the pump: the
        intra-node transports copy inside the post call, which must not hold up the caller."""
        return ((after is None or is_ready(after)) and src.size <= self._direct_max_slices
                and session not in self._queued and session not in self._inflight_slices
                and (self._direct_max_bytes is None or int(length.sum()) <= self._direct_max_bytes))

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped = [b for q in self._queued.values() for b in q]
            self._queued.clear()
            self._cond.notify_all()
        for batch in dropped:
            self._jobs.batch_finished(batch.job, f"{self._who} closed before posting {batch.describe(batch.job.session)}")
        self._pump.join(CLOSE_JOIN_S)
        if self._pump.is_alive():  # never free the engine under a running status call
            log.error("%s: pump still waiting on Mooncake after %.0fs; engine leaked", self._who, CLOSE_JOIN_S)
            return
        with self._regions_lock:
            for ptr in self._regions.starts():
                self._regions.remove(ptr, self._who)
                self._mc.unregister_memory(ptr)
        self._mc = None  # the binding's destructor stops its listeners (about 1 s)

    # ---- pump thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                # a direct post under way (``_posting``) will want collecting, even when closing
                while not self._inflight and not self._submittable() and not (self._closed and not self._posting):
                    self._cond.wait()
                if self._closed and not self._inflight and not self._posting:
                    return
                to_post, skipped = self._take()
            for _, batch in skipped:
                self._jobs.batch_finished(batch.job)
            for session, batch in to_post:
                self._post(session, batch)
            if self._inflight:
                self._collect(*self._inflight.popleft())

    def _submittable(self) -> bool:
        cap = self.max_slices_per_call
        return any(q and self._inflight_slices.get(s, 0) + q[0].num_slices <= cap for s, q in self._queued.items())

    def _take(self) -> tuple[list[tuple[str, _Batch]], list[tuple[str, _Batch]]]:
        """Batches to post now (within each session's in-flight cap) and batches of failed jobs to skip."""
        cap = self.max_slices_per_call
        to_post: list[tuple[str, _Batch]] = []
        skipped: list[tuple[str, _Batch]] = []
        for session in list(self._queued):
            queue = self._queued[session]
            while queue:
                batch = queue[0]
                if batch.job.failed:  # an earlier batch failed: do not post the rest
                    skipped.append((session, queue.popleft()))
                    continue
                inflight = self._inflight_slices.get(session, 0)
                if inflight + batch.num_slices > cap:
                    break
                self._inflight_slices[session] = inflight + batch.num_slices
                to_post.append((session, queue.popleft()))
            if not queue:
                del self._queued[session]
        return to_post, skipped

    def _post(self, session: str, batch: _Batch) -> None:
        try:
            wait_ready(batch.after)  # the producer's events, on this (the pump's) thread
            batch_id = self._mc.batch_transfer_async_write(
                session, batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()
            )
        except Exception as exc:  # the binding's own errors become this batch's failure reason
            self._fail(session, batch, f"batch_transfer_async_write raised {exc!r}")
            return
        if batch_id in (0, U64_MAX) or batch_id < 0:
            self._fail(session, batch, f"batch_transfer_async_write returned {batch_id} (peer unreachable or refused)")
            return
        batch.batch_id = batch_id
        if self._trace:  # (the intra-node NVLink transport has copied by now: it copies inside the call)
            batch.posted = time.monotonic()
            log.info("trace engine=mooncake write=%d batch=%d -> %s slices=%d bytes=%d posted @%.6f", batch.job.handle,
                     batch.index, session, batch.num_slices, int(batch.length.sum()), batch.posted)
        self._inflight.append((session, batch))

    def _collect(self, session: str, batch: _Batch) -> None:
        try:
            rc = self._mc.get_batch_transfer_status([batch.batch_id])
        except Exception as exc:  # the binding's own errors become this batch's failure reason
            self._fail(session, batch, f"get_batch_transfer_status raised {exc!r}")
            return
        if rc != 0:
            self._fail(
                session,
                batch,
                f"get_batch_transfer_status returned {rc} (a slice outside the peer's registered memory, "
                "a dead peer, or a timeout)",
            )
            return
        self._trace_final(batch, "done")
        self._jobs.batch_finished(batch.job)
        self._settle_slices(session, batch.num_slices)

    def _trace_final(self, batch: _Batch, how: str) -> None:
        if self._trace:
            now = time.monotonic()
            log.info("trace engine=mooncake write=%d batch=%d %s +%.2fms @%.6f", batch.job.handle, batch.index, how,
                     (now - batch.posted) * 1000 if batch.posted else 0.0, now)

    def _fail(self, session: str, batch: _Batch, what: str) -> None:
        reason = f"{self._who}: mooncake {what}: {batch.describe(session)}"
        log.warning("%s", reason)
        self._trace_final(batch, "failed")
        self._jobs.batch_finished(batch.job, reason)
        self._settle_slices(session, batch.num_slices)

    def _settle_slices(self, session: str, num_slices: int) -> None:
        with self._cond:
            left = self._inflight_slices.get(session, 0) - num_slices
            if left > 0:
                self._inflight_slices[session] = left
            else:
                self._inflight_slices.pop(session, None)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self._who} is closed")
