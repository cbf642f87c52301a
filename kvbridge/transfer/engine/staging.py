"""Executing staged plans (``kvbridge.layout.staging``): gather, wire, scatter.

    sender                                  wire (engine)                 receiver
    pages --gather--> send slot  ==== pieces of the slot ====>  recv slot --scatter--> pages

Stagers copy between pages and a slot on one side:

- :class:`HostStager`: host memory, vectorised numpy (:func:`copy_slices`): the slices are
  grouped by length and each group of short slices is one fancy-indexed copy over a byte
  window of the process's memory (rows of one length at any byte offset), in batches of a few
  MiB; runs of pages (64 KiB and more: few, long) one ``memmove`` each;
- :class:`CudaStager`: device memory, the slice kernel of ``slicecopy.CudaCopier`` (torch and
  Triton imported only when one is made).

:class:`StagedWriter` moves a room's chunks through the slots of both sides over a
``TransferEngine``, pipelined: chunk ``k + 1`` is gathered while chunk ``k`` is on the wire,
and a chunk is scattered as soon as its write is done. Slots are taken from each side's
:class:`~kvbridge.transfer.engine.staging_area.StagingArea` (FIFO back-pressure: a chunk
waits for a slot, never fails for one). It runs both sides in one process (tests, the
bench); the endpoints split it at the wire, the receiver scattering when the sender reports
the chunk's write.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import EngineError, TransferError, TransferTimeout
from kvbridge.layout.staging import StagedPlan
from kvbridge.transfer.engine.base import TransferEngine, WriteState, wait_ready
from kvbridge.transfer.engine.staging_area import Grant, StagingArea

__all__ = ["AddressRanges", "CudaStager", "HostStager", "StagedStats", "StagedWriter", "copy_slices"]

BATCH_BYTES = 4 << 20  # bytes per fancy-indexed step: bounds the temporary copy numpy makes
ROW_MIN_BYTES = 4096  # slices at least this long copy as 2-D uint8 rows; shorter ones as one void item each
RUN_MIN_BYTES = 64 << 10  # slices at least this long (runs of pages: few, long) are one memmove each
_MAX_VIEW = 1 << 62  # rows x row length of a window view must stay inside numpy's sizes


def copy_slices(src: np.ndarray, dst: np.ndarray, length: np.ndarray, batch_bytes: int = BATCH_BYTES) -> None:
    """Copy host slices of this process: ``length[i]`` bytes from ``src[i]`` to ``dst[i]``.

    Slices are grouped by length; a group of short slices (pages, rows, scale ranges) is copied
    as ``window[dst_offsets] = window[src_offsets]`` over a view of the bytes from the lowest to
    the highest address involved whose rows are ``L`` bytes long and start at every byte
    (stride 1), in batches of about ``batch_bytes``; a slice of ``RUN_MIN_BYTES`` or more is one
    ``memmove``. Only the slices' bytes are touched; the caller checked they lie in memory it
    owns (registered regions). Slices of one call must not overlap each other."""
    src, dst, length = (np.asarray(a, dtype=np.uint64).reshape(-1) for a in (src, dst, length))
    if length.size == 0:
        return
    lo = int(min(src.min(), dst.min()))
    hi = int(max((src + length).max(), (dst + length).max()))
    s_off = (src - np.uint64(lo)).astype(np.int64)
    d_off = (dst - np.uint64(lo)).astype(np.int64)
    sizes, inverse, counts = np.unique(length, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(counts)))
    buf = None
    for j, size in enumerate(sizes.tolist()):  # one step per distinct length, not per slice
        members = order[bounds[j] : bounds[j + 1]]
        if size >= RUN_MIN_BYTES or (hi - lo) * size >= _MAX_VIEW:
            for s, d in zip((src[members]).tolist(), (dst[members]).tolist()):
                ctypes.memmove(d, s, size)
            continue
        if buf is None:
            buf = (ctypes.c_uint8 * (hi - lo)).from_address(lo)
        if size >= ROW_MIN_BYTES:
            window = np.ndarray((hi - lo - size + 1, size), dtype=np.uint8, buffer=buf, strides=(1, 1))
        else:
            window = np.ndarray((hi - lo - size + 1,), dtype=np.dtype((np.void, size)), buffer=buf, strides=(1,))
        step = max(1, batch_bytes // size)
        for a in range(0, len(members), step):
            m = members[a : a + step]
            window[d_off[m]] = window[s_off[m]]


class HostStager:
    """Gather and scatter in host memory; the copy is done when the call returns."""

    def gather(self, staged: StagedPlan, chunk: int, slot_addr: int) -> None:
        copy_slices(*staged.gather(chunk, slot_addr))
        return None

    def scatter(self, staged: StagedPlan, chunk: int, slot_addr: int) -> None:
        copy_slices(*staged.scatter(chunk, slot_addr))
        return None

    @staticmethod
    def synchronize(event: Any) -> None:
        return None

    @staticmethod
    def wait_for(after: Any) -> None:
        """Block until the producer's events (``after``) completed: the pages are whole."""
        wait_ready(after)


class CudaStager:
    """Gather and scatter in device memory with the slice kernel, on the copier's stream: each
    call returns a CUDA event recorded after its copies (pass it as ``after=`` to the write that
    reads the slot; ``synchronize`` it before the slot is reused).

    ``device_ranges``: the ``(address, nbytes)`` regions of device memory the kernel may touch
    (the pages and the slots). A slice with an end outside them (an aux row in host memory) is
    one ``cudaMemcpyAsync`` on the same stream instead: the kernel cannot read or write pageable
    host memory, the copy engine can. Without ranges every slice goes to the kernel."""

    def __init__(self, device: int = 0, copier: Any = None, device_ranges: Any = ()) -> None:
        if copier is None:
            from kvbridge.transfer.engine.slicecopy import CudaCopier

            copier = CudaCopier(device)
        self.copier = copier
        self.ranges = AddressRanges(device_ranges) if len(device_ranges) else None

    def gather(self, staged: StagedPlan, chunk: int, slot_addr: int) -> Any:
        self.copy(*staged.gather(chunk, slot_addr))
        return self.copier.record()

    def scatter(self, staged: StagedPlan, chunk: int, slot_addr: int) -> Any:
        self.copy(*staged.scatter(chunk, slot_addr))
        return self.copier.record()

    def copy(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
        """Enqueue the slices: device to device by the kernel (one launch), the rest (few: aux
        rows) one plain copy each, all on the copier's stream."""
        src, dst, length = (np.asarray(a, dtype=np.uint64).reshape(-1) for a in (src, dst, length))
        if self.ranges is not None and length.size:
            other = ~(self.ranges.hold(src, length) & self.ranges.hold(dst, length))
            if other.any():
                for s, d, n in zip(src[other].tolist(), dst[other].tolist(), length[other].tolist()):
                    self.copier.copy_async(d, s, n)
                keep = ~other
                src, dst, length = src[keep], dst[keep], length[keep]
        if length.size:
            self.copier.launch(src, dst, length)

    @staticmethod
    def synchronize(event: Any) -> None:
        if event is not None:
            event.synchronize()

    def wait_for(self, after: Any) -> None:
        """Make the copier's stream wait for the producer's events (on the GPU, not the host)."""
        self.copier.wait_for(after)


class AddressRanges:
    """Disjoint ``(address, nbytes)`` regions, asked vectorised whether slices lie inside one."""

    def __init__(self, regions: Any) -> None:
        pairs = sorted((int(a), int(n)) for a, n in regions)
        self.starts = np.array([a for a, _ in pairs], dtype=np.uint64)
        self.ends = np.array([a + n for a, n in pairs], dtype=np.uint64)

    def hold(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Per slice: its first and its last byte each lie inside a region. A slice may run from
        one region into the next (a merged run of pages crossing from one pool's tensor into the
        next one's, adjacent in memory): the kernel copies it like any other device slice, while a
        plain copy across two allocations would be refused by the driver."""
        return self._inside(addr) & self._inside(addr + np.maximum(length, 1) - 1)

    def _inside(self, addr: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        found = i >= 0
        return found & (addr < self.ends[np.maximum(i, 0)])


@dataclass
class _InFlight:
    chunk: int
    handle: int
    send_slot: int
    recv_slot: int


@dataclass
class StagedStats:
    """What one room did (for a sender's stats and bench rows)."""

    chunks: int = 0
    wire_pieces: int = 0
    gather_slices: int = 0
    scatter_slices: int = 0
    bytes_staged: int = 0
    slot_waits: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"gather": 0.0, "wait": 0.0, "scatter": 0.0})


@dataclass
class _Side:
    stager: Any
    area: StagingArea
    base: int  # address of the area's slot 0

    def addr(self, slot: int) -> int:
        return self.base + self.area.offset(slot)


class StagedWriter:
    """Moves staged rooms from this process's pages into the receiver's pages through two
    staging areas: ``send_base`` (registered with ``engine``) and ``recv_base`` (registered
    by the peer whose session is ``session``), each cut into slots by its ``StagingArea``."""

    def __init__(self, engine: TransferEngine, session: str, *, send_stager: Any, send_area: StagingArea,
                 send_base: int, recv_stager: Any, recv_area: StagingArea, recv_base: int) -> None:
        if send_area.slot_bytes != recv_area.slot_bytes:
            raise TransferError(
                f"send slots of {send_area.slot_bytes} B and receive slots of {recv_area.slot_bytes} B differ",
                field="slot_bytes")
        self.engine, self.session = engine, session
        self.send = _Side(send_stager, send_area, send_base)
        self.recv = _Side(recv_stager, recv_area, recv_base)

    def write(self, staged: StagedPlan, room: int, timeout: float = 60.0, *, after: Any = None) -> StagedStats:
        """Every chunk of ``staged`` gathered, written and scattered; raises EngineError (after
        every write of the room is final and its slots are free again) when a write fails.
        ``after``: CUDA event(s) the source pages wait on (GPU work still queued), waited for
        before the first gather."""
        if staged.slot_bytes != self.send.area.slot_bytes:
            raise TransferError(f"plan staged for {staged.slot_bytes} B slots, the areas have "
                                f"{self.send.area.slot_bytes} B", room=room, field="slot_bytes")
        stats = StagedStats(chunks=staged.num_chunks, **{k: v for k, v in staged.stats().items() if k in (
            "wire_pieces", "gather_slices", "scatter_slices", "bytes_staged")})
        inflight: deque[_InFlight] = deque()
        deadline = time.monotonic() + timeout
        if after is not None:
            self.send.stager.wait_for(after)
        try:
            for k in range(staged.num_chunks):
                self._finish_landed(staged, room, inflight, stats)
                recv_slot = self._slot(self.recv.area, room, k, staged, inflight, stats, deadline)
                send_slot = self._slot(self.send.area, room, k, staged, inflight, stats, deadline)
                t = time.perf_counter()
                event = self.send.stager.gather(staged, k, self.send.addr(send_slot))
                stats.seconds["gather"] += time.perf_counter() - t
                src, dst, length = staged.wire(k, self.send.addr(send_slot), self.recv.addr(recv_slot))
                handle = self.engine.submit_write(self.session, src, dst, length, after=event)
                inflight.append(_InFlight(k, handle, send_slot, recv_slot))
            while inflight:
                self._finish(staged, room, inflight, stats, deadline)
        except BaseException:
            self._fail(room, inflight, deadline)
            raise
        return stats

    # ---- internals -----------------------------------------------------------------------------
    def _slot(self, area: StagingArea, room: int, chunk: int, staged: StagedPlan, inflight: deque[_InFlight],
              stats: StagedStats, deadline: float) -> int:
        """A slot of ``area`` for the chunk; while none is free, finish the oldest write in flight
        (the only thing that frees one here) until the grant comes."""
        grant: Grant | None = area.acquire(room, chunk)
        if grant is None:
            stats.slot_waits += 1
        while grant is None:
            if not inflight:
                raise TransferError(f"no staging slot frees for chunk {chunk}: the area's slots are held "
                                    "by other rooms", room=room, field="staging")
            grants = self._finish(staged, room, inflight, stats, deadline)
            grant = next((g for g in grants if (g.room, g.chunk) == (room, chunk)), None)
        return grant.slot

    def _finish_landed(self, staged: StagedPlan, room: int, inflight: deque[_InFlight], stats: StagedStats) -> None:
        """Scatter the chunks whose writes are already done (without waiting)."""
        while inflight:
            status = self.engine.poll(inflight[0].handle)
            if not status.is_final:
                return
            entry = inflight.popleft()
            if status.state is WriteState.FAILED:
                raise EngineError(f"chunk {entry.chunk}: {status.reason}", room=room, field="chunk")
            self._landed(staged, room, entry, stats)

    def _finish(self, staged: StagedPlan, room: int, inflight: deque[_InFlight], stats: StagedStats,
                deadline: float) -> list[Grant]:
        """Wait for the oldest write in flight, then scatter its chunk and free its slots."""
        entry = inflight.popleft()
        t = time.perf_counter()
        try:
            self.engine.wait(entry.handle, max(deadline - time.monotonic(), 0.0))
        except EngineError as exc:  # FAILED: final, nothing of it in flight
            raise EngineError(f"chunk {entry.chunk}: {exc.reason}", room=room, field="chunk") from exc
        except BaseException:
            inflight.appendleft(entry)  # still pending: _fail waits for it (or quarantines its slot)
            raise
        finally:
            stats.seconds["wait"] += time.perf_counter() - t
        return self._landed(staged, room, entry, stats)

    def _landed(self, staged: StagedPlan, room: int, entry: _InFlight, stats: StagedStats) -> list[Grant]:
        k = entry.chunk
        self.send.area.landed(entry.send_slot, room, k)
        grants = self.send.area.release(entry.send_slot)
        self.recv.area.landed(entry.recv_slot, room, k)
        t = time.perf_counter()
        self.recv.stager.synchronize(self.recv.stager.scatter(staged, k, self.recv.addr(entry.recv_slot)))
        stats.seconds["scatter"] += time.perf_counter() - t
        self.recv.area.scattered(entry.recv_slot)
        return grants + self.recv.area.release(entry.recv_slot)

    def _fail(self, room: int, inflight: deque[_InFlight], deadline: float) -> None:
        """Wait until no write of the room can land, then free its slots: a write still pending at
        the deadline leaves its receive slot quarantined (hard rule 6)."""
        quiet = True
        for entry in inflight:
            try:
                self.engine.wait(entry.handle, max(deadline - time.monotonic(), 0.0))
            except EngineError:
                continue  # final: FAILED means nothing of the write is still in flight
            except TransferTimeout:
                quiet = False  # still pending: its receive slot stays quarantined
        far = float("inf")
        self.send.area.fail_room(room, far)
        self.recv.area.fail_room(room, far)
        if quiet:
            self.send.area.room_acknowledged(room)
            self.recv.area.room_acknowledged(room)
