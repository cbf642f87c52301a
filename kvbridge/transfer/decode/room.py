"""One room on a decode rank: its state, read and written by the machine (``machine.py``).

    Bootstrapping     waiting for the prefill topology (LookUp; 409 -> Failed with the diff)
    WaitingForInput   topology known (wait_bootstrapped() returns the owner lanes), waiting for
                      init(page_ids, aux_slot, num_tokens=None, first_page=...)
    Transferring      TransferRequest sent to every CP rank; the ledger fills up
    Success           every (pool, page >= first_page) once, from every pipeline stage that holds layers
                      of the pool, + the aux row's room echo (+ digests, when asked)
    Failed            reason kept; pages released only once every CP rank that was
                      asked is quiet: acked the abort, reported failure, or is dead (hard rule 6)

Pages and tokens. ``num_tokens`` counts the request's valid tokens; it has
``ceil(num_tokens / page_size)`` logical pages. With a decode prefix, pages
``[0, first_page)`` are already here (a prefix cache hit) and ``page_ids`` maps
pages ``[first_page, num_pages)`` only:

    num_tokens 21, page_size 4, first_page 2      logical page  0 1 | 2  3  4  5
                                                                held | page_ids[0..3]

An engine that knows only pages (SGLang) leaves ``num_tokens`` out: the request then
has ``first_page + len(page_ids)`` pages, and the prefill rank that writes the aux row
says the token count in the ``PagesDone`` that reports it.

**The ledger** (``PageLedger``). Exactly-once page ledger of one room on a decode rank.

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

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.errors import LedgerError
from kvbridge.layout import AuxRow, AuxSchema, OwnerLanes, TPRoute, has_repeats
from kvbridge.transfer.decode.topologies import Placement, SenderKey
from kvbridge.transfer.poll import KVPoll, RoomState
from kvbridge.transfer.rooms import Life

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse


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
        if has_repeats(pages):
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


class DecodeRoom:
    """Everything a decode rank knows about one room."""

    def __init__(self, room: int, prefill_instance: str, dp_rank: int | None, now: float) -> None:
        self.room = room
        self.prefill_instance = prefill_instance
        self.dp_rank = dp_rank
        self.state = RoomState(now)
        self.life = Life()
        self.created = now
        self.booted = False  # the topology is known, or the room failed (mark_bootstrapped)
        self._boot: threading.Event | None = None  # made by the first wait_bootstrapped() that must wait
        self.placement: Placement | None = None
        self.topology: LookupResponse | None = None
        self.lanes: OwnerLanes | None = None
        self.senders: dict[SenderKey, Any] = {}  # (cp_rank, tp_rank, pp_rank) -> SenderRank
        self.by_endpoint: dict[str, SenderKey] = {}  # a sender's control endpoint -> (cp_rank, tp_rank, pp_rank)
        self.route: TPRoute | None = None  # which prefill TP ranks send what to this decode rank
        self.page_ids: np.ndarray | None = None  # physical pages of logical pages [first_page, num_pages)
        self.first_page = 0
        self.aux_slot = -1
        self.num_tokens: int | None = None  # None until known (init(), or the PagesDone of the aux row)
        self.binding = b""  # the request's digest, presented with every claim (transfer/binding.py)
        self.release_reason: str | None = None  # release(): the engine needs nothing of the room (wire.Release)
        self.ledger: PageLedger | None = None
        self.requested: set[SenderKey] = set()  # (cp, tp, pp) ranks a TransferRequest went to
        # sender endpoint -> the registration our request there named: the connection its target is bound
        # to, where everything of the room to that sender goes (machine.py, "Re-registration")
        self.asked_as: dict[str, str | None] = {}
        self.quiet: set[SenderKey] = set()  # (cp, tp, pp) ranks that will write nothing more (hard rule 6)
        self.abort_sent: set[SenderKey] = set()
        self.last_abort = 0.0
        self._aux_row: tuple[np.ndarray, AuxSchema] | None = None  # the committed row, decoded when first read
        self._aux: AuxRow | None = None
        self._aux_regions: dict[str, np.ndarray] | None = None
        self.mismatch: list[Any] = []  # field diff when the contract was refused
        self.digests: list[tuple[np.ndarray, np.ndarray, Any, tuple[str, ...]]] = []  # (logical pages, digests, sender, pools) per PagesDone
        self.kind_digests: list[tuple[str, np.ndarray, np.ndarray, Any]] = []  # (pool, logical units, digests, sender) per PagesDone
        self.lookup_pending = False
        self.next_lookup = 0.0
        self.lookup_problem = ""  # the daemon's last 503 (which sender ranks are missing), for the timeout reason
        self.bytes_expected = 0
        self.staged_only = False  # every page arrives through staging: its pages free at once on failure
        self.scatters = 0  # scatters out of staging slots into its pages started, not yet completed
        self.spared: tuple[KVPoll | None, float] = (None, 0.0)  # (state, seconds of it the loop did not run)
        self.commit_reading = False  # its aux row (and digests) are being read for the commit (ReadForCommit)
        self.inline_row: Any = None  # the aux row as its report carried it (checked; written at the commit)
        self.row_writing = False  # that row is being written into its slot ahead of the commit (WriteAuxRow)
        self.row_written: float | None = None  # it is there: the seconds its write took
        self.proof_retries: dict[str, int] = {}  # sender endpoint -> its refusals of our proof asked past (machine.py)
        self.ask_again: dict[str, float] = {}  # sender endpoint -> when its TransferRequest goes out again

    def spare(self, gap: float) -> None:
        """This rank's loop did not run for ``gap`` seconds (a starved process): they do not count
        toward the deadline of the room's current state (``waited``)."""
        state, before = self.spared
        self.spared = (self.state.state, gap + (before if state == self.state.state else 0.0))

    def waited(self, now: float) -> float:
        """Seconds in the current state that count toward its deadline: those its loop ran."""
        state, gap = self.spared
        return self.state.since(now) - (gap if state == self.state.state else 0.0)

    def mark_bootstrapped(self) -> None:
        """The topology is known or the room failed (endpoint lock held)."""
        self.booted = True
        if self._boot is not None:
            self._boot.set()

    def boot_waiter(self) -> threading.Event | None:
        """An event set by ``mark_bootstrapped``; None when it already ran (endpoint lock held)."""
        if self.booted:
            return None
        if self._boot is None:
            self._boot = threading.Event()
        return self._boot

    @property
    def initialised(self) -> bool:
        return self.page_ids is not None

    @property
    def num_pages(self) -> int:
        """Logical pages of the request (prefix included)."""
        return 0 if self.page_ids is None else self.first_page + int(self.page_ids.size)

    @property
    def drain_reason(self) -> str:
        return "a prefill rank may still write its pages (hard rule 6)"

    @property
    def pages_releasable(self) -> bool:
        """True when no write of this room can still land (hard rule 6), remote, the local
        scatter out of a staging slot, or its aux row's write into its slot (``WriteAuxRow``: on a
        GPU a copy the loop polls; the slot is the engine's again once the room is forgotten)."""
        if self.scatters or self.row_writing:
            return False
        if self.state.state == KVPoll.Success:
            return True
        # staged only: remote writes land in staging slots (quarantined on failure), never in the pages
        return self.state.state == KVPoll.Failed and (self.staged_only or self.requested <= self.quiet)

    def age_ms(self, now: float) -> float:
        return (now - self.created) * 1000

    def set_topology(self, placement: Placement) -> None:
        """Use a look-up answer, placed for this decode rank's TP route."""
        self.placement = placement
        self.topology = placement.topology
        self.dp_rank = placement.topology.dp_rank
        self.lanes = placement.lanes
        self.route = placement.route
        self.senders = placement.senders
        self.by_endpoint = placement.by_endpoint

    def keep_aux_row(self, row: np.ndarray, schema: AuxSchema) -> None:
        """The committed aux row (checked by ``schema.head``): decoded when first read, not on the
        commit's path (the endpoint's lock serialises readers)."""
        self._aux_row = (row, schema)

    @property
    def aux(self) -> AuxRow | None:
        if self._aux is None and self._aux_row is not None and self._aux_row[1].is_standard:
            self._aux = self._aux_row[1].unpack(self._aux_row[0])
        return self._aux

    @property
    def aux_regions(self) -> dict[str, np.ndarray] | None:
        if self._aux_regions is None and self._aux_row is not None:
            self._aux_regions = self._aux_row[1].unpack_regions(self._aux_row[0])
        return self._aux_regions

    def start_ledger(self, pools: list[str]) -> None:
        last = self.num_pages - 1  # the last valid token lies in the last page, whatever the count
        aux_owner = self.lanes.owner_of_page(last, self.num_pages)
        p = self.placement
        self.ledger = PageLedger(self.room, pools, self.num_pages, self.lanes, aux_owner, first_page=self.first_page,
                                 route=self.route, stages=p.stages if p is not None else None,
                                 aux_stage=p.aux_stage if p is not None else 0)

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "room": self.room,
            "state": self.state.state.name,
            "num_tokens": self.num_tokens,
            "first_page": self.first_page,
            "bytes": self.bytes_expected if self.state.state == KVPoll.Success else 0,
            "pages_by_rank": dict(self.ledger.pages_by_rank) if self.ledger else {},
            **({"pages_by_stage": dict(self.ledger.pages_by_stage)} if self.ledger and self.ledger.staged else {}),
            "seconds": self.state.durations(),
            "total_s": round(now - self.created, 6),
        }
