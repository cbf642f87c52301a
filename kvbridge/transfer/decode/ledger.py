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

With a decode TP size other than the prefill's, a head-sharded pool's page comes
in head slices, one from each prefill TP rank of the decode rank's TP route
(``kvbridge.layout.tp_route``): the bitmap has a row per (pool, source TP rank),
and a page counts only once every slice of it arrived. Replicated pools and the
aux row come from the route's first source alone.

    route p 2 -> d 1 (4 heads)  page:  0 1 2
      k  from tp 0                      x x .
      k  from tp 1                      x . .      page 1 of k is not complete yet

With pipeline-parallel prefill each stage sends its own layer range of a pool
(``kvbridge.layout.stages``): the bitmap has a row per (pool, source TP rank, stage)
for the stages that hold layers of the pool, and a page counts only once every stage
sent it. The aux row comes from the last stage alone.

    pp 3, draft on pp2          page:  0 1 2
      target  pp0 [0, 4)                x x x
      target  pp1 [4, 7)                x . x      page 1 of target is not complete yet
      target  pp2 [7, 10)               x x x
      draft   pp2                       x x .
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.errors import LedgerError
from kvbridge.layout import OwnerLanes, TPRoute


class PageLedger:
    def __init__(self, room: int, pools: Sequence[str], num_pages: int, lanes: OwnerLanes, aux_owner: int,
                 first_page: int = 0, route: TPRoute | None = None,
                 stages: Mapping[str, Sequence[int]] | None = None, aux_stage: int = 0) -> None:
        self.room = room
        self.pools = tuple(pools)
        self.num_pages = num_pages
        self.first_page = first_page
        self.lanes = lanes
        self.aux_owner = aux_owner
        self.aux_tp = route.first_source if route is not None else 0
        self.aux_stage = aux_stage
        self.staged = stages is not None and any(tuple(st) != (0,) for st in stages.values())
        # one bitmap row per (pool, source tp rank, pipeline stage): a head-sharded pool has one per
        # head slice, a pool split across stages one per stage's layer range
        self._slots = [(p, tp, pp) for p in self.pools for tp in (route.sources_of(p) if route is not None else (0,))
                       for pp in (stages.get(p, (0,)) if stages is not None else (0,))]
        self._slot_index = {slot: i for i, slot in enumerate(self._slots)}
        self._pool_names = {p for p, _, _ in self._slots}
        self._seen = np.zeros((len(self._slots), num_pages), dtype=bool)
        self._seen[:, :first_page] = True  # the decode prefix is already here
        self._left = len(self._slots) * (num_pages - first_page)  # cells not yet reported
        self._touched: dict[int, int] = {}  # cp rank -> bit mask of the bitmap rows it reported anything in
        self._shares: dict[int, np.ndarray] = {}  # cp rank -> the pages it owns from first_page on
        self._rows: dict[tuple[tuple[str, ...], int, int], tuple[list[int], Any, int]] = {}  # (pools, tp, pp) -> rows
        self.aux_done = False
        self.pages_by_rank: dict[int, int] = {}  # page reports per CP rank (one per head slice and stage)
        self.pages_by_stage: dict[int, int] = {}  # page reports per pipeline stage

    def record(self, cp_rank: int, pools: Sequence[str], logical_pages: np.ndarray, tp_rank: int = 0,
               pp_rank: int = 0) -> None:
        """Mark pages written by ``(cp_rank, tp_rank, pp_rank)``; checks everything before marking anything.
        A rank's first report of its whole share (every page it owns, in order: one write per
        room) is checked by one comparison; any other report page by page."""
        pages = logical_pages if type(logical_pages) is np.ndarray else np.asarray(logical_pages, dtype=np.int64)
        if pages.size == 0:
            return
        key = (tuple(pools), tp_rank, pp_rank)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = self._rows_of(key[0], tp_rank, pp_rank, cp_rank)
        row_list, index, mask = rows
        share = self._shares.get(cp_rank)
        if share is None:
            share = self._share(cp_rank)
        # the whole share: owned by cp_rank, inside the request, each page once, and unseen (only
        # cp_rank may report its pages, and it reported none of these rows yet)
        touched = self._touched.get(cp_rank, 0)
        if touched & mask or pages.size != share.size or not (pages == share).all():
            self._check_pages(cp_rank, row_list, pages, self._rank(cp_rank, tp_rank, pp_rank))
        self._seen[index, pages] = True
        self._touched[cp_rank] = touched | mask
        self._left -= len(row_list) * int(pages.size)
        self.pages_by_rank[cp_rank] = self.pages_by_rank.get(cp_rank, 0) + int(pages.size)
        if self.staged:
            self.pages_by_stage[pp_rank] = self.pages_by_stage.get(pp_rank, 0) + int(pages.size)

    def _rank(self, cp_rank: int, tp_rank: int, pp_rank: int = 0) -> str:
        return f"cp{cp_rank}" + (f"/tp{tp_rank}" if tp_rank else "") + (f"/pp{pp_rank}" if self.staged else "")

    def _rows_of(self, pools: tuple[str, ...], tp_rank: int, pp_rank: int, cp_rank: int) -> tuple[list[int], Any, int]:
        """The bitmap rows of ``pools`` from ``(tp_rank, pp_rank)``: as a list, as an index of the
        bitmap's first axis (a slice when they are consecutive), and as a bit mask."""
        rank = self._rank(cp_rank, tp_rank, pp_rank)
        rows = [self._row(pool, tp_rank, pp_rank, rank) for pool in pools]
        if len(set(rows)) != len(rows):  # (each row's pages count once: a pool named twice would count twice)
            raise LedgerError(f"pools {list(pools)} name a pool twice in one report", room=self.room, rank=rank,
                              field="pools")
        consecutive = rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
        index = slice(rows[0], rows[0] + len(rows)) if rows and consecutive else np.asarray(rows, dtype=np.int64)[:, None]
        return rows, index, sum(1 << row for row in set(rows))

    def _row(self, pool: str, tp_rank: int, pp_rank: int, rank: str) -> int:
        row = self._slot_index.get((pool, tp_rank, pp_rank))
        if row is not None:
            return row
        if pool not in self._pool_names:
            raise LedgerError(f"pages reported for pool {pool!r}, which this room does not receive",
                              room=self.room, rank=rank, field="pools")
        if not any(p == pool and pp == pp_rank for p, _, pp in self._slots):
            raise LedgerError(f"pages of pool {pool!r} reported by pipeline stage pp{pp_rank}, which holds no layer "
                              "of it", room=self.room, rank=rank, field="pools")
        raise LedgerError(f"pages of pool {pool!r} reported by tp rank {tp_rank}, which this decode rank's TP "
                          f"route does not draw it from", room=self.room, rank=rank, field="pools")

    def _share(self, cp_rank: int) -> np.ndarray:
        share = self._shares.get(cp_rank)
        if share is None:
            share = self.lanes.owned_pages(cp_rank, self.num_pages) if 0 <= cp_rank < self.lanes.cp_size \
                else np.zeros(0, np.int64)
            if self.first_page:
                share = share[share >= self.first_page]
            self._shares[cp_rank] = share
        return share

    def _check_pages(self, cp_rank: int, rows: list[int], pages: np.ndarray, rank: str) -> None:
        """Every page inside the request, past the prefix, once, owned by ``cp_rank``, not yet seen."""
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
        owner, _ = self.lanes.owners(pages, self.num_pages)
        wrong = owner != cp_rank
        if wrong.any():
            page = int(pages[wrong][0])
            raise LedgerError(
                f"logical page {page} reported by cp rank {cp_rank}, but cp rank {int(owner[wrong][0])} owns it",
                room=self.room, rank=rank, field="logical_pages",
            )
        seen = self._seen[np.asarray(rows)[:, None], pages[None, :]]
        if seen.any():
            r, c = np.argwhere(seen)[0]
            pool, tp, pp = self._slots[rows[r]]
            what = f"pool {pool!r}"
            if len({slot[:2] for slot in self._slots}) != len(self.pools):
                what += f" (head slice of tp {tp})"
            if self.staged:
                what += f" (layers of stage pp{pp})"
            raise LedgerError(
                f"page {int(pages[c])} of {what} reported twice",
                room=self.room, rank=rank, field="logical_pages",
            )

    def record_aux(self, cp_rank: int, tp_rank: int = 0, pp_rank: int = 0) -> None:
        rank = self._rank(cp_rank, tp_rank, pp_rank)
        if pp_rank != self.aux_stage:
            raise LedgerError(f"aux row reported by pipeline stage pp{pp_rank}; the last stage pp{self.aux_stage} "
                              "writes it", room=self.room, rank=rank, field="aux")
        if cp_rank != self.aux_owner:
            raise LedgerError(
                f"aux row reported by cp rank {cp_rank}, but cp rank {self.aux_owner} owns the last valid token",
                room=self.room, rank=rank, field="aux",
            )
        if tp_rank != self.aux_tp:
            raise LedgerError(f"aux row reported by tp rank {tp_rank}; this decode rank's first source is tp rank "
                              f"{self.aux_tp}", room=self.room, rank=rank, field="aux")
        if self.aux_done:
            raise LedgerError("aux row reported twice", room=self.room, rank=rank, field="aux")
        self.aux_done = True

    @property
    def pages_complete(self) -> bool:
        return self._left == 0

    @property
    def complete(self) -> bool:
        return self._left == 0 and self.aux_done

    def missing(self) -> dict[str, list[int]]:
        """Logical pages not yet complete, per pool (first few), for error messages; with
        pipeline stages per pool and stage (``"target@pp1"``), naming the stage that did not send."""
        out = {}
        for pool in self.pools:
            stages = sorted({pp for p, _, pp in self._slots if p == pool})
            for stage in stages:
                rows = [i for i, (p, _, pp) in enumerate(self._slots) if p == pool and pp == stage]
                done = self._seen[rows].all(axis=0)
                if not done.all():
                    out[f"{pool}@pp{stage}" if self.staged else pool] = np.flatnonzero(~done)[:8].tolist()
        return out

    def missing_stages(self) -> list[int]:
        """Pipeline stages that still owe pages (or, the last one, the aux row)."""
        left = ~self._seen.all(axis=1)
        stages = {self._slots[i][2] for i in np.flatnonzero(left)}
        if not self.aux_done:
            stages.add(self.aux_stage)
        return sorted(stages)
