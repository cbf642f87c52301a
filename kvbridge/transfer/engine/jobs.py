"""The base most engines extend (``JobEngine``) and what it keeps: slice validation, registered
regions, the job table. Public: an engine adapter outside this package extends ``JobEngine``.

A *job* is what one ``submit_write`` returns a handle for; it is carried out as
one or more *batches* of at most ``max_slices_per_call`` slices:

    submit_write(3,000 slices, cap 1,024) -> job 7 = batches [0:1024) [1024:2048) [2048:3000)

The job becomes final when its last batch has finished (or was skipped because
an earlier one failed), so a final job has nothing in flight.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import EngineError, TransferTimeout
from kvbridge.transfer.engine.base import TransferEngine, WriteStatus

__all__ = ["Job", "JobEngine", "JobTable", "Regions", "SubmittingJobEngine", "U64_MAX", "as_int", "check_slices", "check_write", "locate"]

log = logging.getLogger(__name__)

U64_MAX = 2**64 - 1
_U64 = np.dtype(np.uint64)


def check_slices(src: object, dst: object, length: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and return ``(src, dst, length)`` as uint64 arrays, or raise EngineError naming the field."""
    arrays = []
    for name, value in (("src", src), ("dst", dst), ("length", length)):
        if type(value) is np.ndarray and value.dtype == _U64 and value.ndim == 1:  # a planner's: as it is
            arrays.append(value)
            continue
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise EngineError(f"{name} must be a 1-D array, got shape {arr.shape}", field=name)
        if arr.size and arr.dtype.kind not in "iu":
            raise EngineError(f"{name} must hold integers, got dtype {arr.dtype}", field=name)
        if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
            raise EngineError(f"{name} holds a negative value {int(arr.min())}", field=name)
        arrays.append(arr.astype(np.uint64, copy=False))
    src_u, dst_u, len_u = arrays
    if not (src_u.size == dst_u.size == len_u.size):
        raise EngineError(
            f"src, dst and length differ in size ({src_u.size}, {dst_u.size}, {len_u.size})", field="length"
        )
    if not len_u.size:
        return src_u, dst_u, len_u
    if int(len_u.min()) == 0:
        raise EngineError(f"slice {int(np.argmin(len_u))} has length 0", field="length")
    longest = int(len_u.max())
    for name, addr in (("src", src_u), ("dst", dst_u)):
        if int(addr.max()) + longest <= U64_MAX:  # no slice can pass 2**64: one reduction, not one test per slice
            continue
        over = np.flatnonzero(addr > np.uint64(U64_MAX) - len_u)
        if over.size:
            raise EngineError(f"slice {int(over[0])}: {name} + length passes 2**64", field=name)
    return src_u, dst_u, len_u


def check_write(who: str, session: object, src: object, dst: object, length: object, regions: Regions,
                lock: threading.Lock) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What an engine checks before posting a write: the session, the slice arrays, and every
    source slice inside memory registered with it (``regions``, read under ``lock``)."""
    if not isinstance(session, str) or not session:
        raise EngineError(f"{who}: session must be a non-empty string, got {session!r}", field="session")
    src_u, dst_u, len_u = check_slices(src, dst, length)
    with lock:
        bad = regions.first_outside(src_u, len_u)
    if bad >= 0:
        raise EngineError(f"{who}: slice {bad} source [{int(src_u[bad]):#x}, +{int(len_u[bad])}) is not inside "
                          "memory registered with this engine", field="src")
    return src_u, dst_u, len_u


class Regions:
    """Non-overlapping registered ``[start, end)`` byte ranges; not thread-safe on its own."""

    def __init__(self) -> None:
        self._regions: dict[int, int] = {}  # start -> nbytes
        self._starts = np.zeros(0, np.uint64)
        self._ends = np.zeros(0, np.uint64)
        self._ends_after = np.zeros(1, np.uint64)

    def add(self, ptr: int, nbytes: int, who: str) -> None:
        ptr, nbytes = as_int(ptr, who), as_int(nbytes, who)
        if ptr <= 0 or nbytes <= 0:
            raise EngineError(f"{who}: register needs a positive address and size, got ({ptr!r}, {nbytes!r})")
        if ptr + nbytes > U64_MAX:
            raise EngineError(f"{who}: region {ptr:#x} + {nbytes} passes 2**64")
        for start, size in self._regions.items():
            if ptr < start + size and start < ptr + nbytes:
                what = "already registered" if (start, size) == (ptr, nbytes) else "overlaps registered region"
                raise EngineError(f"{who}: region {ptr:#x}+{nbytes} {what} {start:#x}+{size}")
        self._regions[ptr] = nbytes
        self._rebuild()

    def remove(self, ptr: int, who: str) -> int:
        ptr = as_int(ptr, who)
        if ptr not in self._regions:
            raise EngineError(f"{who}: no registered region starts at {ptr:#x}")
        nbytes = self._regions.pop(ptr)
        self._rebuild()
        return nbytes

    def starts(self) -> list[int]:
        return list(self._regions)

    def inside(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Boolean mask: slice ``i`` lies inside one region."""
        return self.locate(addr, length) >= 0

    def locate(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Index into ``sorted_starts`` of the region holding slice ``i``, or -1 when none holds it whole."""
        return locate(self._starts, self._ends, addr, length)

    @property
    def sorted_starts(self) -> np.ndarray:
        return self._starts

    def first_outside(self, addr: np.ndarray, length: np.ndarray) -> int:
        """Index of the first slice not inside one region, or -1 when all are inside."""
        # region i - 1 (0: none) is the last one starting at or before the slice; ends_after[i] its end
        bad = addr + length > self._ends_after[np.searchsorted(self._starts, addr, side="right")]
        if not bad.any():
            return -1
        return int(np.flatnonzero(bad)[0])

    def _rebuild(self) -> None:
        starts = sorted(self._regions)
        self._starts = np.array(starts, dtype=np.uint64)
        self._ends = np.array([s + self._regions[s] for s in starts], dtype=np.uint64)
        self._ends_after = np.concatenate((np.zeros(1, np.uint64), self._ends))  # [0] = 0: no region holds it


def locate(starts: np.ndarray, ends: np.ndarray, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """For sorted, disjoint ``[starts[j], ends[j])``: the ``j`` holding ``[addr[i], addr[i] + length[i])``, or -1."""
    if starts.size == 0:
        return np.full(addr.size, -1, dtype=np.int64)
    idx = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
    end = ends[np.maximum(idx, 0)]
    return np.where((idx >= 0) & (addr + length <= end), idx, -1)


def as_int(value: object, who: str) -> int:
    """``value`` as a Python int (numpy integers too), or EngineError."""
    try:
        return operator.index(value)  # int and numpy integers; floats are refused
    except TypeError:
        raise EngineError(f"{who}: memory addresses and sizes must be integers, got {value!r}") from None


@dataclass
class Job:
    handle: int
    session: str
    num_batches: int
    num_slices: int
    finished: int = 0
    reason: str = ""  # first failure; empty while all is well

    @property
    def failed(self) -> bool:
        return bool(self.reason)


class JobTable:
    """Thread-safe handle -> job map with blocking and non-blocking completion."""

    def __init__(self, who: str) -> None:
        self._who = who
        self._cond = threading.Condition()
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._notify: Callable[[], None] | None = None
        self._final: list[int] = []  # handles final since the last take_final() (while a callback is set)

    def set_notify(self, callback: Callable[[], None] | None) -> None:
        with self._cond:
            self._notify = callback
            if callback is None:
                self._final.clear()

    def take_final(self) -> list[int]:
        """Handles that became final since the last call (recorded while a callback is set)."""
        with self._cond:
            out, self._final = self._final, []
        return out

    def open(self, session: str, num_batches: int, num_slices: int) -> Job:
        with self._cond:
            job = Job(next(self._ids), session, num_batches, num_slices)
            self._jobs[job.handle] = job
            if num_batches == 0 and self._notify is not None:
                self._final.append(job.handle)
        if num_batches == 0:
            self._wake()
        return job

    def batch_finished(self, job: Job, reason: str = "") -> None:
        """Count one batch of ``job`` as finished (failed when ``reason``); wakes waiters when final."""
        with self._cond:
            job.finished += 1
            if reason and not job.reason:
                job.reason = reason
            final = job.finished >= job.num_batches
            if final:
                self._cond.notify_all()
                if self._notify is not None:
                    self._final.append(job.handle)
        if final:
            self._wake()

    def poll(self, handle: int) -> WriteStatus:
        with self._cond:
            job = self._get(handle)
            if job.finished < job.num_batches:
                return WriteStatus.PENDING
            del self._jobs[handle]
        return WriteStatus.failed(job.reason) if job.failed else WriteStatus.DONE

    def wait(self, handle: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            job = self._get(handle)
            while job.finished < job.num_batches:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(
                        f"{self._who}: write {handle} to {job.session} ({job.num_slices} slices) "
                        f"still in flight after {timeout:g}s",
                        field="timeout",
                    )
                self._cond.wait(left)
            del self._jobs[handle]
        if job.failed:
            raise EngineError(job.reason)

    def pending(self) -> int:
        with self._cond:
            return sum(1 for j in self._jobs.values() if j.finished < j.num_batches)

    def _get(self, handle: int) -> Job:
        job = self._jobs.get(handle)
        if job is None:
            raise EngineError(f"{self._who}: unknown write handle {handle} (never issued, or already collected)")
        return job

    def _wake(self) -> None:
        callback = self._notify
        if callback is None:
            return
        try:
            callback()
        except Exception:  # a caller's callback must not kill the engine thread; it is logged
            log.exception("%s: notify callback failed", self._who)


class JobEngine(TransferEngine):
    """An engine whose writes are tracked in ``self._jobs`` (a JobTable): poll, wait and
    completion callbacks are the table's."""

    _jobs: JobTable

    def poll(self, handle: int) -> WriteStatus:
        return self._jobs.poll(handle)

    def wait(self, handle: int, timeout: float) -> None:
        self._jobs.wait(handle, timeout)

    def set_notify(self, callback: Callable[[], None] | None) -> None:
        self._jobs.set_notify(callback)

    def take_final(self) -> list[int] | None:
        return self._jobs.take_final()

    def writes_in_flight(self) -> int:
        """Writes posted and not yet complete (for metrics)."""
        return self._jobs.pending()


class SubmittingJobEngine(JobEngine):
    """A JobEngine whose writes and probes are one ``_submit`` (the IPC and local engines): a
    probe is a submitted write waited on, marked ``probe`` for the engine's own accounting."""

    def _submit(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, after: Any, *,
                probe: bool) -> int:
        raise NotImplementedError

    def submit_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
                     after: Any = None) -> int:
        return self._submit(session, src, dst, length, after, probe=False)

    def probe_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
                    timeout: float = 5.0) -> None:
        self.wait(self._submit(session, src, dst, length, None, probe=True), timeout)
