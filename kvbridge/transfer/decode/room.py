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
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.layout import AuxRow, AuxSchema, OwnerLanes, TPRoute
from kvbridge.transfer.decode.ledger import PageLedger
from kvbridge.transfer.decode.topologies import Placement, SenderKey
from kvbridge.transfer.poll import KVPoll, RoomState
from kvbridge.transfer.rooms import Life

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse





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
        self.ledger: PageLedger | None = None
        self.requested: set[SenderKey] = set()  # (cp, tp, pp) ranks a TransferRequest went to
        self.quiet: set[SenderKey] = set()  # (cp, tp, pp) ranks that will write nothing more (hard rule 6)
        self.abort_sent: set[SenderKey] = set()
        self.last_abort = 0.0
        self._aux_row: tuple[np.ndarray, AuxSchema] | None = None  # the committed row, decoded when first read
        self._aux: AuxRow | None = None
        self._aux_regions: dict[str, np.ndarray] | None = None
        self.mismatch: list[Any] = []  # field diff when the contract was refused
        self.digests: list[tuple[np.ndarray, np.ndarray, Any, tuple[str, ...]]] = []  # (logical pages, digests, sender, pools) per PagesDone
        self.lookup_pending = False
        self.next_lookup = 0.0
        self.lookup_problem = ""  # the daemon's last 503 (which sender ranks are missing), for the timeout reason
        self.bytes_expected = 0
        self.staged_only = False  # every page arrives through staging: its pages free at once on failure
        self.scatters = 0  # scatters out of staging slots into its pages started, not yet completed

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
        """True when no write of this room can still land (hard rule 6), remote or the local
        scatter out of a staging slot."""
        if self.scatters:
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
