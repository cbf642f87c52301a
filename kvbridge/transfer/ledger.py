"""Exactly-once page ledger of one room on a decode rank.

Every (pool, logical page) of the request from ``first_page`` on must be
reported written exactly once, by the CP rank that owns it under the owner-lane
plan; the aux row exactly once, by the owner of the last valid token. Pages
below ``first_page`` are the decode prefix: already here, never written. A room
commits only when the ledger is complete. Anything else is a LedgerError naming
the room, the reporting rank, the pool and the page.

    pools x pages bitmap        page:  0 1 | 2 3 4 5     first_page 2
      target                            p p | x . x x     . = not yet reported, p = prefix
      index                             p p | x . x x
      draft                             p p | x . x .
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbridge.errors import LedgerError
from kvbridge.layout import OwnerLanes


class PageLedger:
    def __init__(self, room: int, pools: Sequence[str], num_pages: int, lanes: OwnerLanes, aux_owner: int,
                 first_page: int = 0) -> None:
        self.room = room
        self.pools = tuple(pools)
        self.num_pages = num_pages
        self.first_page = first_page
        self.aux_owner = aux_owner
        self._pool_index = {p: i for i, p in enumerate(self.pools)}
        self._owner, _ = lanes.owners(np.arange(num_pages, dtype=np.int64), num_pages)
        self._seen = np.zeros((len(self.pools), num_pages), dtype=bool)
        self._seen[:, :first_page] = True  # the decode prefix is already here
        self.aux_done = False
        self.pages_by_rank: dict[int, int] = {}

    def record(self, cp_rank: int, pools: Sequence[str], logical_pages: np.ndarray) -> None:
        """Mark pages written by ``cp_rank``; checks everything before marking anything."""
        pages = np.asarray(logical_pages, dtype=np.int64)
        rank = f"cp{cp_rank}"
        if pages.size == 0:
            return
        bad = (pages < 0) | (pages >= self.num_pages)
        if bad.any():
            raise LedgerError(
                f"cp rank {cp_rank} reported logical page {int(pages[bad][0])}, outside the request's "
                f"{self.num_pages} pages",
                room=self.room, rank=rank, field="logical_pages",
            )
        if (pages < self.first_page).any():
            raise LedgerError(
                f"cp rank {cp_rank} reported logical page {int(pages[pages < self.first_page][0])}, below the decode "
                f"prefix (first_page {self.first_page}): decode already holds it",
                room=self.room, rank=rank, field="logical_pages",
            )
        if np.unique(pages).size != pages.size:
            raise LedgerError(f"cp rank {cp_rank} reported a page twice in one message", room=self.room, rank=rank,
                              field="logical_pages")
        wrong = self._owner[pages] != cp_rank
        if wrong.any():
            page = int(pages[wrong][0])
            raise LedgerError(
                f"logical page {page} reported by cp rank {cp_rank}, but cp rank {int(self._owner[page])} owns it",
                room=self.room, rank=rank, field="logical_pages",
            )
        rows = []
        for pool in pools:
            if pool not in self._pool_index:
                raise LedgerError(f"pages reported for pool {pool!r}, which this room does not receive",
                                  room=self.room, rank=rank, field="pools")
            rows.append(self._pool_index[pool])
        seen = self._seen[np.asarray(rows)[:, None], pages[None, :]]
        if seen.any():
            r, c = np.argwhere(seen)[0]
            raise LedgerError(
                f"page {int(pages[c])} of pool {self.pools[rows[r]]!r} reported twice",
                room=self.room, rank=rank, field="logical_pages",
            )
        self._seen[np.asarray(rows)[:, None], pages[None, :]] = True
        self.pages_by_rank[cp_rank] = self.pages_by_rank.get(cp_rank, 0) + int(pages.size)

    def record_aux(self, cp_rank: int) -> None:
        if cp_rank != self.aux_owner:
            raise LedgerError(
                f"aux row reported by cp rank {cp_rank}, but cp rank {self.aux_owner} owns the last valid token",
                room=self.room, rank=f"cp{cp_rank}", field="aux",
            )
        if self.aux_done:
            raise LedgerError("aux row reported twice", room=self.room, rank=f"cp{cp_rank}", field="aux")
        self.aux_done = True

    @property
    def pages_complete(self) -> bool:
        return bool(self._seen.all())

    @property
    def complete(self) -> bool:
        return self.pages_complete and self.aux_done

    def missing(self) -> dict[str, list[int]]:
        """Logical pages not yet reported, per pool (first few), for error messages."""
        return {p: np.flatnonzero(~self._seen[i])[:8].tolist() for i, p in enumerate(self.pools) if not self._seen[i].all()}
