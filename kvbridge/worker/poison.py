"""Poisoned free pages: how a decode worker proves that no write lands in a page it
released (hard rule 6), for ``kvbridge chaos`` and burn-in.

With ``--poison-pages``, every page returned to the free list is filled with
``POISON_BYTE`` in every pool and layer, and checked again before it is handed to a
new room (and, on a Stats request, every free page is checked). A page that is no
longer all poison was written after it was released: a *late write*, counted per page
in ``late_writes`` and logged with the page numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from typing import Any

import numpy as np

from kvbridge.worker.synthetic import as_bytes

__all__ = ["POISON_BYTE", "PagePoison"]

POISON_BYTE = 0xA5
log = logging.getLogger(__name__)


class PagePoison:
    def __init__(self, buffers: Mapping[tuple[str, int], Any], rank: str) -> None:
        self.views = [as_bytes(b) for b in buffers.values()]  # [capacity_pages, bytes_per_page] uint8, no copy
        self.rank = rank
        self.late_writes = 0  # pages found written while free
        self.pages_checked = 0
        for v in self.views:
            v.fill(POISON_BYTE)

    def poison(self, pages: np.ndarray) -> None:
        index = np.asarray(pages, dtype=np.int64)
        for v in self.views:
            v[index] = POISON_BYTE

    def check(self, pages: np.ndarray, why: str) -> int:
        """Late-written pages among ``pages`` (counted, logged, then poisoned again)."""
        if len(pages) == 0:
            return 0
        index = np.asarray(pages, dtype=np.int64)
        dirty = np.zeros(len(index), dtype=bool)
        for v in self.views:
            dirty |= (v[index] != POISON_BYTE).any(axis=1)
        self.pages_checked += len(index)
        bad = index[dirty]
        if bad.size:
            self.late_writes += int(bad.size)
            log.error("%s: %d released page(s) written after release (late writes), %s: %s",
                      self.rank, bad.size, why, bad[:16].tolist())
            self.poison(bad)
        return int(bad.size)
