"""Physical-page allocator of a worker's pools (one mapping shared by every pool).

A page is in exactly one state:

    free --allocate--> owned(room) --free--> free
                          |
                          +--hold--> held(room) --release--> free

``held`` is for the pages of a failed or aborted decode room that a prefill
rank may still write (hard rule 6): they return to the free list only when the
receiver says ``pages_releasable``. ``allocate`` prefers one contiguous run
(long runs coalesce into long transfer slices) and falls back to the lowest
free pages.
"""

from __future__ import annotations

import numpy as np

from kvbridge.errors import KVBridgeError


class OutOfPages(KVBridgeError):
    """Not enough free pages for a room (a worker's capacity, not a peer's fault)."""


class PageAllocator:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._free = np.ones(capacity, dtype=bool)
        self._owned: dict[int, np.ndarray] = {}
        self._held: dict[int, np.ndarray] = {}

    @property
    def num_free(self) -> int:
        return int(np.count_nonzero(self._free))

    @property
    def num_held(self) -> int:
        return sum(len(p) for p in self._held.values())

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, room: int, num_pages: int) -> np.ndarray:
        """``num_pages`` free pages for ``room`` (int32, contiguous when a run is long enough)."""
        if room in self._owned or room in self._held:
            raise KVBridgeError("room already holds pages", room=room, field="room")
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if not self.can_allocate(num_pages):
            raise OutOfPages(
                f"{num_pages} pages wanted, {self.num_free} free of {self.capacity} ({self.num_held} held)",
                room=room,
                field="pages",
            )
        pages = self._contiguous(num_pages)
        if pages is None:
            pages = np.flatnonzero(self._free)[:num_pages]
        pages = pages.astype(np.int32)
        self._free[pages] = False
        self._owned[room] = pages
        return pages

    def _contiguous(self, n: int) -> np.ndarray | None:
        """First free run of at least ``n`` pages (first fit), or None."""
        if n == 0:
            return np.empty(0, dtype=np.int64)
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        fits = np.flatnonzero(ends - starts >= n)
        if not len(fits):
            return None
        start = int(starts[fits[0]])
        return np.arange(start, start + n)

    def pages_of(self, room: int) -> np.ndarray:
        return self._owned[room]

    def free(self, room: int) -> None:
        """Return a room's pages: only when no write can reach them any more."""
        pages = self._owned.pop(room, None)
        if pages is None:
            raise KVBridgeError("room holds no pages", room=room, field="room")
        self._free[pages] = True

    def hold(self, room: int) -> None:
        """Park a room's pages until ``release``: a peer may still write them."""
        pages = self._owned.pop(room, None)
        if pages is None:
            raise KVBridgeError("room holds no pages", room=room, field="room")
        self._held[room] = pages

    def release(self, room: int) -> None:
        pages = self._held.pop(room)
        self._free[pages] = True

    def free_pages(self) -> np.ndarray:
        return np.flatnonzero(self._free)

    def held_pages(self, room: int) -> np.ndarray:
        return self._held[room]

    def held_rooms(self) -> list[int]:
        return list(self._held)
