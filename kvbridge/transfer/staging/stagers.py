"""Stagers: the copies between a side's pages and its staging slots (``kvbridge.layout.staging``'s
gather and scatter lists).

    sender                                  wire (engine)                 receiver
    pages --gather--> send slot  ==== pieces of the slot ====>  recv slot --scatter--> pages

Stagers copy between pages and a slot on one side:

- :class:`HostStager`: host memory, ``slicecopy.copy_slices`` (vectorised numpy: slices grouped
  by length, each group of short slices one fancy-indexed copy, slices of 16 KiB and more one
  ``memmove`` each);
- :class:`CudaStager`: device memory, the slice kernel of ``slicecopy.CudaCopier`` (torch and
  Triton imported only when one is made).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.layout.staging import StagedPlan
from kvbridge.transfer.engine.base import wait_ready
from kvbridge.transfer.engine.slicecopy import copy_slices

__all__ = ["AddressRanges", "CudaStager", "HostStager", "copy_slices"]

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
        """The chunk's entries into the slot at ``slot_addr``; only those whose sources the plan did
        not prove inside its source buffers (the aux row; ``StagedPlan.gather_unproven``) are looked
        up in the ranges (issue 33 round 23: the look-up of a 256 MiB chunk's 10,000-19,000 sources
        was 0.30 ms p50 of prefill's 0.81 ms gather turn on one H100 host)."""
        src, dst, length = staged.gather(chunk, slot_addr)
        self.copy(src, dst, length, unproven=staged.gather_unproven(chunk))
        return self.copier.record()

    def scatter(self, staged: StagedPlan, chunk: int, slot_addr: int) -> Any:
        self.copy(*staged.scatter(chunk, slot_addr))
        return self.copier.record()

    def copy(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray, unproven: np.ndarray | None = None) -> None:
        """Enqueue the slices: device to device by the kernel (one launch), the rest (few: aux
        rows) one plain copy each, all on the copier's stream.

        ``unproven``: None (any caller without a proof): every slice is looked up in the ranges.
        Else the indices of the only slices that may lie outside them; the caller proved every
        other slice's source and destination inside the ranges, so the look-up would answer True
        for them: they go to the kernel unasked. Decode's ``DecodeStaging.landed``
        (``Scatter.unproven``): the slot, and a page buffer whose extent it checked inside one
        region. Prefill's gather (``gather``): the slot, and pages the planner checked inside the
        registered page buffers (hard rule 5), whose tensors are the ranges; a run of pages merged
        across two of them adjacent in memory is one the look-up answers True for too."""
        src, dst, length = (np.asarray(a, dtype=np.uint64).reshape(-1) for a in (src, dst, length))
        if self.ranges is not None and length.size and (unproven is None or len(unproven)):
            if unproven is None:
                other = np.flatnonzero(~(self.ranges.hold(src, length) & self.ranges.hold(dst, length)))
            else:
                ask = np.asarray(unproven, dtype=np.int64).reshape(-1)
                n = length[ask]
                other = ask[~(self.ranges.hold(src[ask], n) & self.ranges.hold(dst[ask], n))]
            if other.size:
                for s, d, n in zip(src[other].tolist(), dst[other].tolist(), length[other].tolist()):
                    self.copier.copy_async(d, s, n)
                keep = np.ones(length.size, dtype=bool)
                keep[other] = False
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
        plain copy across two allocations would be refused by the driver.

        When every slice lies in one region (a staging slot's side of a scatter list: one check,
        not a binary search per slice; issue 33 round 12b timed the per-slice look-ups at about
        0.2 ms of decode's 1 ms turn per landed chunk) the answer is all True at once. Otherwise
        one binary search per slice, of its first byte: a slice whose last byte lies in the same
        region (every page slice of a gather list the plan did not prove, whose sources are pages
        of the registered buffers) is answered by one compare, and only the others (past their region's end) have their last
        byte looked up too (issue 33 round 22, ``scripts/landing_cost.py`` on the 2-core CPU host:
        prefill's gather of a 256 MiB chunk, list and checks, 0.18-0.19 ms p50 with two searches
        per slice, 0.10-0.14 ms with this)."""
        last = addr + np.maximum(length, 1) - 1
        if addr.size and self._one_region(int(addr.min()), int(last.max())):
            return np.ones(addr.shape, dtype=bool)
        i = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        end = self.ends[np.maximum(i, 0)]
        first = (i >= 0) & (addr < end)
        held = first & (last < end)
        across = np.flatnonzero(first & ~held)  # (rare: a run into the next region, or past the last)
        if across.size:
            held[across] = self._inside(last[across])
        return held

    def within(self, start: int, end: int) -> bool:
        """Do the bytes ``[start, end)`` all lie inside one region (an empty range: its start does)?"""
        return self._one_region(start, max(start, end - 1))

    def _one_region(self, lo: int, hi: int) -> bool:
        """Do the bytes ``[lo, hi]`` all lie inside one region?"""
        i = int(np.searchsorted(self.starts, np.uint64(lo), side="right")) - 1
        return i >= 0 and hi < int(self.ends[i])

    def _inside(self, addr: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        found = i >= 0
        return found & (addr < self.ends[np.maximum(i, 0)])
