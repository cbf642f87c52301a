"""StagedWriter: both sides of a staged room in one process (tests, the bench).

It moves a room's chunks through the slots of both sides over a ``TransferEngine``,
pipelined: chunk ``k + 1`` is gathered while chunk ``k`` is on the wire, and a chunk is
scattered as soon as its write is done. Slots are taken from each side's
:class:`~kvbridge.transfer.staging.area.StagingArea` (FIFO back-pressure: a chunk waits for a
slot, never fails for one). The endpoints split the same walk at the wire, the receiver
scattering when the sender reports the chunk's write.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import EngineError, TransferError, TransferTimeout
from kvbridge.layout.staging import StagedPlan
from kvbridge.transfer.engine.base import TransferEngine, WriteState
from kvbridge.transfer.staging.area import Grant, StagingArea

__all__ = ["StagedStats", "StagedWriter"]


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
        self.recv.area.scatter(entry.recv_slot)
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
