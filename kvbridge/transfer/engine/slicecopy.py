"""Many ``(src, dst, length)`` byte slices copied at once: the IPC engine's data path.

A room's pages are scattered on both sides, so a write is tens of thousands of
41 KB slices. Posting each as its own copy costs microseconds of overhead per
slice (that is where one-slice-per-page Mooncake loses 95% of the link); here
they are split into *pieces* of at most ``chunk`` bytes and copied by one
kernel launch:

    slices   [s0: 41,984 B][s1: 41,984 B][s2: 2,686,976 B (a run of 64 pages)] ...
    pieces   [s0         ][s1         ][s2 0:128K][s2 128K:256K] ... [s2 2.5M:2.56M]
    kernel   program p copies pieces p, p + P, p + 2P, ...   (P = programs, a few per SM)

Inside the kernel a piece whose source, destination and length are multiples of
16 moves as 16-byte vectors; any other piece (the scale bytes of a partial
index-K page, an aux row) byte by byte. Addresses travel as signed offsets from
one small tensor on the copying device, so any address the device can reach,
a peer's included, is ``base + offset``.

``copy_slices`` is the same copy for host memory in this process (numpy, vectorised): the
engine's host regions, and the staging area's gathers and scatters where it is host memory.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

CHUNK = 128 * 1024  # bytes per piece: pages are one piece; long runs spread over many programs
# Slices this long go to the copy engines (cudaMemcpyAsync) instead: on one H200, 43 MB slices moved at
# 1,760 GB/s that way against 1,423 GB/s through the kernel (scripts/gpu_bench.py --ceilings).
DIRECT_MIN_BYTES = 8 << 20
# bytes per fancy-indexed step: bounds the temporary array numpy makes of the step's rows, small enough
# that the allocator reuses it (a temporary handed back as fresh pages is a page fault every 4 KiB of
# every step; docs/engines.md, "Mooncake TCP: staged from 64 slices")
BATCH_BYTES = 256 << 10
ROW_MIN_BYTES = 4096  # slices at least this long copy as 2-D uint8 rows; shorter ones as one void item each
# slices at least this long (pages of a latent cache, runs of pages) are one memmove each: from about
# this length a memmove per slice costs less than the fancy-indexed copy, which also copies every
# byte twice (into its temporary, then into place)
RUN_MIN_BYTES = 16 << 10
_MAX_VIEW = 1 << 62  # rows x row length of a window view must stay inside numpy's sizes
# A launch of at most this many slices (an aux row, a layer-wise room's last write) goes as plain
# cudaMemcpyAsync calls on the copier's stream through the runtime's C API: no piece table, no Triton
# launch, no torch device or stream context (on one H100 host those cost a launch of one slice about
# as much Python as a page table's; docs/performance.md "Issue 33, round 14")
FEW_SLICES = 8
TABLE_SLOTS = 4  # piece tables a copier cycles through (a launch fills one while the last copies run)
# rows each piece table starts with, every table made with the copier (``_warm``): a 256 MiB staging
# chunk of a random V3.2 room is 7,800-19,000 pieces, so a room's gather or scatter finds its table
# made and never allocates pinned host memory on the loop that launches it; 768 KiB host + 768 KiB
# device each
MIN_TABLE_ROWS = 32768


def plan_pieces(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, chunk: int = CHUNK
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split each slice into pieces of at most ``chunk`` bytes (``chunk`` a multiple of 16, so
    pieces of an aligned slice stay aligned); returns ``(src, dst, length)`` of the pieces, uint64."""
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"chunk must be a positive multiple of 16, got {chunk}")
    src, dst, length = (np.asarray(a, dtype=np.uint64) for a in (src, dst, length))
    if length.size == 0 or int(length.max()) <= chunk:  # every slice is one piece (pages)
        return src, dst, length
    per_slice = (length + np.uint64(chunk - 1)) // np.uint64(chunk)
    owner = np.repeat(np.arange(length.size), per_slice.astype(np.int64))
    first = np.cumsum(per_slice) - per_slice
    offset = (np.arange(owner.size, dtype=np.uint64) - first[owner]) * np.uint64(chunk)
    return src[owner] + offset, dst[owner] + offset, np.minimum(length[owner] - offset, np.uint64(chunk))


def copy_slices(src: np.ndarray, dst: np.ndarray, length: np.ndarray, batch_bytes: int = BATCH_BYTES) -> None:
    """Copy host slices of this process: ``length[i]`` bytes from ``src[i]`` to ``dst[i]``.

    Slices are grouped by length; a group of short slices (pages, rows, scale ranges) is copied
    as ``window[dst_offsets] = window[src_offsets]`` over a view of the bytes from the lowest to
    the highest address involved whose rows are ``L`` bytes long and start at every byte
    (stride 1), in batches of about ``batch_bytes``; a slice of ``RUN_MIN_BYTES`` or more (a page
    of 41,984 B, a run of pages) is one ``memmove``. Only the slices' bytes are touched; the
    caller checked they lie in memory it owns (registered regions). Slices of one call must not
    overlap each other."""
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


class CudaCopier:
    """Copies slices with one Triton kernel per call, on its own stream of ``device``.

    ``launch`` only enqueues: the caller records an event on ``stream`` and treats the
    copy as in flight until the event completes. Slices of at least ``direct_min_bytes``
    go as plain ``cudaMemcpyAsync`` calls on the same stream (the copy engines), when set, and
    so does a launch of at most ``few_slices`` slices (no table, no kernel, no torch context)."""

    def __init__(self, device: int, *, chunk: int = CHUNK, programs_per_sm: int = 4, words: int = 2048,
                 num_warps: int = 4, direct_min_bytes: int = 0, few_slices: int = FEW_SLICES) -> None:
        import torch

        from kvbridge.transfer.engine._cuda import cuda

        self._torch = torch
        self._cuda = cuda()
        self.device = torch.device("cuda", device)
        self.chunk, self.words, self.num_warps = chunk, words, num_warps
        self.direct_min_bytes = direct_min_bytes
        self.few_slices = few_slices
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self._stream_handle = int(self.stream.cuda_stream)
            self._base = torch.zeros(4, dtype=torch.int32, device=self.device)  # offsets are relative to this
        self._base_b = self._base.view(torch.uint8)
        self._base_addr = np.uint64(self._base.data_ptr())
        self._tables: list[_Table | None] = [None] * TABLE_SLOTS
        self._next_table = 0
        self._lock = threading.Lock()  # the tables: one launch at a time fills and posts one
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.max_programs = max(1, sms * programs_per_sm)
        self._warm()

    def _warm(self) -> None:
        """Compile the kernel now (made at an endpoint's start), not inside the first room: a cold
        Triton compile takes seconds on the thread that launches it, and a prefill loop silent that
        long is a dead peer to decode. Triton compiles one variant per piece count class (one, a
        multiple of 16, any other): the two a room uses, on a scratch buffer of this copier."""
        torch = self._torch
        scratch = torch.zeros(64 * 32, dtype=torch.uint8, device=self.device)
        base = np.uint64(scratch.data_ptr())
        for n in (2, 16):
            offs = np.arange(n, dtype=np.uint64) * np.uint64(64)
            self.launch(base + offs, base + np.uint64(1024) + offs, np.full(n, 64, dtype=np.uint64))
        with self._lock:  # every table made now, at its starting size (the launches above made two)
            for _ in range(TABLE_SLOTS):
                self._table(MIN_TABLE_ROWS)
        self.stream.synchronize()

    def launch(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> dict[str, int]:
        """Enqueue the copy of every slice on ``stream``; returns what went how (the piece tables
        are the copier's own: nothing of the launch must be kept alive by the caller)."""
        torch = self._torch
        counts = {"kernel_slices": 0, "kernel_pieces": 0, "kernel_launches": 0, "direct_slices": 0}
        if length.size <= self.few_slices:  # a few slices: the copy engines, straight from here
            self._plain(src, dst, length)
            counts["direct_slices"] = int(length.size)
            return counts
        direct = length >= np.uint64(self.direct_min_bytes) if self.direct_min_bytes else None
        num_direct = 0 if direct is None else int(np.count_nonzero(direct))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if num_direct < length.size:
                small = None if not num_direct else ~direct
                ps, pd, pn = plan_pieces(src, dst, length, self.chunk) if small is None else \
                    plan_pieces(src[small], dst[small], length[small], self.chunk)
                with self._lock:
                    table = self._table(ps.size)
                    rows = table.host[: ps.size]
                    # offsets from the base, written in place (two's complement: they may be negative)
                    np.subtract(ps, self._base_addr, out=rows[:, 0].view(np.uint64))
                    np.subtract(pd, self._base_addr, out=rows[:, 1].view(np.uint64))
                    rows[:, 2] = pn.view(np.int64)
                    handle = self._stream_handle
                    self._cuda.memcpy_async(table.device_addr, table.host.ctypes.data, ps.size * 24, handle)
                    self._cuda.event_record(table.event, handle)  # the host rows may be refilled once it passed
                    table.pending = True
                    grid = (min(ps.size, self.max_programs),)
                    _kernel()[grid](self._base, self._base_b, table.device, ps.size, WORDS=self.words,
                                    BYTES=1024, num_warps=self.num_warps)
                counts.update(kernel_slices=int(length.size - num_direct), kernel_pieces=int(ps.size), kernel_launches=1)
            if num_direct:
                self._plain(src[direct], dst[direct], length[direct])
                counts["direct_slices"] = num_direct
        return counts

    def _table(self, num_rows: int) -> _Table:
        """The next of TABLE_SLOTS piece tables (lock held), its host rows free to fill: the copy of its
        last use to the device has passed (its event). The device rows need no wait: the copies and
        kernels that use them run in order on ``stream``. Grown (doubling) when too small."""
        i = self._next_table
        self._next_table = (i + 1) % TABLE_SLOTS
        table = self._tables[i]
        if table is not None and table.pending:
            self._cuda.event_synchronize(table.event)
            table.pending = False
        if table is None or table.rows < num_rows:
            torch = self._torch
            rows = max(num_rows, MIN_TABLE_ROWS, 2 * table.rows if table is not None else 0)
            event = table.event if table is not None else self._cuda.event_create()
            if table is not None:  # a kernel queued on the stream may still read the old rows
                table.device.record_stream(self.stream)
            host = torch.empty((rows, 3), dtype=torch.int64, pin_memory=True)
            device = torch.empty((rows, 3), dtype=torch.int64, device=self.device)
            table = self._tables[i] = _Table(host, host.numpy(), device, device.data_ptr(), rows, event)
        return table

    def wait_for(self, after: Any) -> None:
        """Make ``stream`` wait for the producer's events (CUDA events, and events that queue their
        own work on first use, ``aux_rows.RowCopy``: on the GPU; others: on the host)."""
        from kvbridge.transfer.engine.base import ready_events

        for ev in ready_events(after):
            if isinstance(ev, self._torch.cuda.Event):
                self.stream.wait_event(ev)
            elif hasattr(ev, "wait_on"):
                ev.wait_on(self._stream_handle)
            else:
                ev.synchronize()

    def _plain(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
        """Slices as plain ``cudaMemcpyAsync`` calls on this copier's stream (the copy engines)."""
        handle = self._stream_handle
        for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
            if n:
                self._cuda.memcpy_async(d, s, n, handle)

    def copy_async(self, dst: int, src: int, nbytes: int) -> None:
        """One plain copy on this copier's stream (either side may be host memory)."""
        self._cuda.memcpy_async(dst, src, nbytes, self._stream_handle)

    def copy_bytes(self, dst: int, src: int, nbytes: int) -> None:
        """A blocking copy on this copier's stream (fault injection)."""
        self.copy_async(dst, src, nbytes)
        self.stream.synchronize()

    def record(self) -> Any:
        """An event after everything enqueued so far; ``synchronize()`` it to know the copies landed."""
        event = self._torch.cuda.Event()
        event.record(self.stream)
        return event


@dataclass
class _Table:
    """One piece table: pinned host rows filled by ``launch``, copied to ``device`` on the stream."""

    pinned: Any  # the torch tensor that owns the host rows
    host: np.ndarray
    device: Any
    device_addr: int
    rows: int
    event: int  # recorded after the last copy of ``host`` to the device
    pending: bool = False


@cache
def _kernel() -> Any:
    """The Triton kernel (its module imports Triton: GPU hosts only)."""
    from kvbridge.transfer.engine._slice_kernel import copy_pieces

    return copy_pieces
