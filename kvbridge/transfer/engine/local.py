"""In-process transfer engine: ``ctypes.memmove`` between regions of one LocalFabric.

Used by tests *in addition to* Mooncake, for what Mooncake cannot be made to
do on demand (fail the Nth batch, hold a write in flight, corrupt a page).
It follows Mooncake's rules, measured on these machines:

- a slice whose destination is not inside memory the destination session
  registered is refused; the other slices of its batch still land; the batch
  FAILS with a reason naming the slice, the session and the call;
- a session that is not (or no longer) on the fabric is a dead peer: FAILED;
- batches of at most ``max_slices_per_call`` slices, completed by a worker
  thread in submission order, so completions arrive from another thread.

It is stricter in one way: every *source* slice must lie in memory this engine
registered (RDMA requires it; Mooncake's TCP transport does not check).
Only host memory: the copy is a plain memmove.

Faults (``engine.faults``), counted per engine over batches in submission
order from 0:

    fail_batches={1}     batch 1 writes its first half of slices, then FAILS
    corrupt_batches={0}  batch 0 lands with the first byte of its first slice flipped, reports DONE
    delay_s=0.2          each batch lands 0.2 s after it was submitted
    gate=threading.Event()  batches land only once the event is set (writes held in flight)
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import EngineError
from kvbridge.transfer.engine.base import wait_ready
from kvbridge.transfer.engine.jobs import Job, JobTable, Regions, SubmittingJobEngine, check_slices

_GATE_POLL_S = 0.02


class LocalFabric:
    """The registered regions of every local engine, by session id. Pass one fabric to engines that talk."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._regions: dict[str, Regions] = {}
        self._ids = itertools.count()
        self.name = uuid.uuid4().hex[:8]  # sessions of two fabrics never collide

    def attach(self) -> str:
        with self.lock:
            session = f"local:{self.name}:{next(self._ids)}"
            self._regions[session] = Regions()
            return session

    def detach(self, session: str) -> None:
        with self.lock:
            self._regions.pop(session, None)

    def regions(self, session: str) -> Regions | None:
        """The session's regions (hold ``lock`` while using them), or None for an unknown session."""
        return self._regions.get(session)

    def sessions(self) -> list[str]:
        with self.lock:
            return list(self._regions)


@dataclass
class Faults:
    fail_batches: set[int] = field(default_factory=set)
    corrupt_batches: set[int] = field(default_factory=set)
    delay_s: float = 0.0
    gate: threading.Event | None = None

    @property
    def holding(self) -> bool:
        return self.gate is not None or self.delay_s > 0

    def hold(self, due: float, cond: threading.Condition, closed: Callable[[], bool]) -> bool:
        """Wait until monotonic ``due`` (on ``cond``, notified at close) and until the gate is open;
        False when ``closed()`` turned true first."""
        if self.gate is None and due <= time.monotonic():  # (no fault holds it: no lock, no wait)
            return not closed()
        with cond:
            while not closed() and time.monotonic() < due:
                cond.wait(due - time.monotonic())
        gate = self.gate
        while gate is not None and not gate.wait(_GATE_POLL_S):
            if closed():
                return False
        return not closed()


@dataclass
class _Batch:
    job: Job
    number: int  # per engine, submission order, from 0
    index: int  # within the job
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    due: float  # monotonic time it may land
    after: Any = None  # events the source bytes wait on (the worker waits before landing)
    probe: bool = False  # a control-plane write (probe_write): no fault applies to it

    def describe(self) -> str:
        return (
            f"write {self.job.handle} batch {self.index + 1}/{self.job.num_batches} to session {self.job.session} "
            f"({self.src.size} slices, {int(self.length.sum())} bytes)"
        )


class LocalEngine(SubmittingJobEngine):
    transport = "local"  # sessions of a LocalFabric in this process

    @classmethod
    def create(cls, *, fabric: LocalFabric | None = None, max_slices_per_call: int = 1024) -> LocalEngine:
        """``create_engine("local")``: on ``fabric``, or a fresh one."""
        return cls(fabric if fabric is not None else LocalFabric(), max_slices_per_call=max_slices_per_call)

    def __init__(self, fabric: LocalFabric, *, max_slices_per_call: int = 1024) -> None:
        if max_slices_per_call < 1:
            raise EngineError(f"max_slices_per_call must be positive, got {max_slices_per_call}", field="max_slices_per_call")
        self.max_slices_per_call = max_slices_per_call
        self.fabric = fabric
        self.faults = Faults()
        self._session = fabric.attach()
        self._who = f"local engine {self._session}"
        self._jobs = JobTable(self._who)
        self._cond = threading.Condition()
        self._queue: deque[_Batch] = deque()
        self._numbers = itertools.count()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"local-engine-{self._session}", daemon=True)
        self._worker.start()

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, ptr: int, nbytes: int) -> None:
        self._check_open()
        with self.fabric.lock:
            self._own_regions().add(ptr, nbytes, self._who)

    def unregister(self, ptr: int) -> None:
        self._check_open()
        with self.fabric.lock:
            self._own_regions().remove(ptr, self._who)

    def reads(self, session: str) -> bool:
        return True

    def probe_read(self, session: str, dst: np.ndarray, src: np.ndarray, length: np.ndarray,
                   timeout: float = 5.0) -> None:
        """The peer's registered ``src[i]`` into our registered ``dst[i]``, now (in-process)."""
        self._check_open()
        dst, src, length = check_slices(dst, src, length)
        with self.fabric.lock:
            peer = self.fabric.regions(session)
            if peer is None:
                raise EngineError(f"{self._who}: no session {session} on this fabric", field="session")
            if self._own_regions().first_outside(dst, length) >= 0 or peer.first_outside(src, length) >= 0:
                raise EngineError(f"{self._who}: a read from session {session} outside registered memory",
                                  field="src")
            for d, s, n in zip(dst.tolist(), src.tolist(), length.tolist()):
                ctypes.memmove(d, s, n)

    def _submit(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, after: Any, *,
                probe: bool) -> int:
        self._check_open()
        if not isinstance(session, str) or not session:
            raise EngineError(f"{self._who}: session must be a non-empty string, got {session!r}", field="session")
        src, dst, length = check_slices(src, dst, length)
        with self.fabric.lock:
            bad = self._own_regions().first_outside(src, length)
        if bad >= 0:
            raise EngineError(
                f"{self._who}: slice {bad} source [{int(src[bad]):#x}, +{int(length[bad])}) is not inside "
                "memory registered with this engine",
                field="src",
            )
        cap = self.max_slices_per_call
        starts = range(0, src.size, cap)
        due = time.monotonic() + (0.0 if probe else self.faults.delay_s)
        with self._cond:
            self._check_open()
            job = self._jobs.open(session, 1 if probe else len(starts), int(src.size)) if src.size else None
            if job is not None and probe:  # lands here and now: never queued behind held KV batches
                batch = _Batch(job, -1, 0, src, dst, length, due, None, True)
            elif job is not None:
                for i, a in enumerate(starts):
                    b = slice(a, a + cap)
                    self._queue.append(_Batch(job, next(self._numbers), i, src[b], dst[b], length[b], due, after))
                self._cond.notify()
        if job is not None and probe:
            self._jobs.batch_finished(job, self._land(batch))
        return job.handle if job is not None else self._jobs.open(session, 0, 0).handle

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._worker.join()
        self.fabric.detach(self._session)

    # ---- worker thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    dropped = list(self._queue)
                    self._queue.clear()
                    break
                batch = self._queue.popleft()
            if not self._hold(batch):  # closed while held: the batch never lands
                dropped = [batch]
                with self._cond:
                    dropped += list(self._queue)
                    self._queue.clear()
                break
            try:
                wait_ready(batch.after)
                reason = "" if batch.job.failed else self._land(batch)
            except Exception as exc:  # keep the worker alive; the batch fails with the cause
                reason = f"{self._who}: landing {batch.describe()} raised {exc!r}"
            self._jobs.batch_finished(batch.job, reason)
        for batch in dropped:
            self._jobs.batch_finished(batch.job, f"{self._who} closed before {batch.describe()} landed")

    def _hold(self, batch: _Batch) -> bool:
        """Wait for the batch's delay and the gate; False when the engine closed meanwhile."""
        return self.faults.hold(batch.due, self._cond, lambda: self._closed)

    def _land(self, batch: _Batch) -> str:
        """Copy what may be copied; return the failure reason, or "" when every slice landed."""
        with self.fabric.lock:
            dst_regions = self.fabric.regions(batch.job.session)
            if dst_regions is None:
                return f"{self._who}: no engine with session {batch.job.session} on this fabric (closed?): {batch.describe()}"
            src_ok = self._own_regions().inside(batch.src, batch.length)
            dst_ok = dst_regions.inside(batch.dst, batch.length)
            ok = src_ok & dst_ok
            reason = ""
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                side, addr = ("destination", batch.dst[i]) if not dst_ok[i] else ("source", batch.src[i])
                reason = (
                    f"{self._who}: slice {i} {side} [{int(addr):#x}, +{int(batch.length[i])}) is outside the "
                    f"memory registered by session {batch.job.session if side == 'destination' else self._session}: "
                    f"{batch.describe()}"
                )
            if batch.number in self.faults.fail_batches:
                ok[(batch.src.size + 1) // 2 :] = False
                reason = reason or f"{self._who}: injected failure of batch {batch.number}: {batch.describe()}"
            everything = bool(ok.all())
            for d, s, n in zip(*((a if everything else a[ok]).tolist() for a in (batch.dst, batch.src, batch.length))):
                ctypes.memmove(d, s, n)
            if batch.number in self.faults.corrupt_batches and ok.size and ok[0]:
                byte = ctypes.c_uint8.from_address(int(batch.dst[0]))
                byte.value ^= 0xFF
        return reason

    def _own_regions(self) -> Regions:
        regions = self.fabric.regions(self._session)
        if regions is None:
            raise EngineError(f"{self._who} is closed")
        return regions

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self._who} is closed")
