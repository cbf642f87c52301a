"""Decode side of one room: the engine-facing :class:`KVReceiver`, and the
room's state that the :class:`~kvbridge.transfer.decode.DecodeEndpoint` loop drives.

    Bootstrapping     waiting for the prefill topology (bootstrap lookup; 409 -> Failed with the diff)
    WaitingForInput   topology known (wait_bootstrapped() returns the owner lanes), waiting for
                      init(page_ids, aux_slot, num_tokens=None, first_page=...)
    Transferring      TransferRequest sent to every CP rank; the ledger fills up
    Success           every (pool, page >= first_page) once + the aux row's room echo (+ digests, when asked)
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
says the token count in the ``PagesDone`` that reports it; ``receiver.stats["num_tokens"]``
has it from then on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.errors import ContractMismatch, TopologyError, TransferError, TransferTimeout
from kvbridge.layout import AuxRow, AuxSchema, OwnerLanes, TPRoute
from kvbridge.transfer.ledger import PageLedger
from kvbridge.transfer.lifecycle import Life, RoomHandle
from kvbridge.transfer.poll import KVPoll, RoomState

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse
    from kvbridge.transfer.decode import DecodeEndpoint


@dataclass(frozen=True, eq=False)
class Placement:
    """The senders a room of one prefill DP group asks, for this decode rank's TP route: every
    CP rank and, in it, every TP rank of the route, with the pools each sends. Built once per
    look-up answer and shared by the rooms that use it (read-only)."""

    topology: LookupResponse
    route: TPRoute
    lanes: OwnerLanes
    senders: dict[tuple[int, int], Any]  # (cp_rank, tp_rank) -> SenderRank
    by_endpoint: dict[str, tuple[int, int]]  # a sender's control endpoint -> (cp_rank, tp_rank)
    asks: tuple[tuple[tuple[int, int], Any, tuple[str, ...]], ...]  # (key, sender, its pools), by key

    @classmethod
    def of(cls, topo: LookupResponse, route: TPRoute, room: int) -> Placement:
        if any(r.pp_rank for r in topo.ranks):
            raise TopologyError(f"the look-up of prefill instance {topo.instance!r} lists pipeline stages past the "
                                "first; pipeline-parallel prefill is not supported yet", room=room, field="ranks")
        senders = {(r.cp_rank, r.tp_rank): r for r in topo.ranks}
        need = {(cp, tp) for cp in range(topo.plan.cp_size) for tp in route.sources}
        if need - set(senders):
            cp, tp = min(need - set(senders))
            raise TopologyError(f"the look-up of prefill instance {topo.instance!r} lists no sender cp{cp}/tp{tp}, which "
                                f"this decode rank's TP route draws from", room=room, field="ranks")
        chosen = {key: senders[key] for key in sorted(need)}
        return cls(topo, route, OwnerLanes(topo.plan.cp_size, topo.plan.rule), chosen,
                   {s.control_endpoint: key for key, s in chosen.items()},
                   tuple((key, s, tuple(route.pools_from(key[1]))) for key, s in chosen.items()))


class RecvRoom:
    def __init__(self, room: int, prefill_instance: str, dp_rank: int | None) -> None:
        self.room = room
        self.prefill_instance = prefill_instance
        self.dp_rank = dp_rank
        self.state = RoomState()
        self.life = Life()
        self.booted = False  # the topology is known, or the room failed (mark_bootstrapped)
        self._boot: threading.Event | None = None  # made by the first wait_bootstrapped() that must wait
        self.placement: Placement | None = None
        self.topology: LookupResponse | None = None
        self.lanes: OwnerLanes | None = None
        self.senders: dict[tuple[int, int], Any] = {}  # (cp_rank, tp_rank) -> SenderRank
        self.by_endpoint: dict[str, tuple[int, int]] = {}  # a sender's control endpoint -> (cp_rank, tp_rank)
        self.route: TPRoute | None = None  # which prefill TP ranks send what to this decode rank
        self.page_ids: np.ndarray | None = None  # physical pages of logical pages [first_page, num_pages)
        self.first_page = 0
        self.aux_slot = -1
        self.num_tokens: int | None = None  # None until known (init(), or the PagesDone of the aux row)
        self.ledger: PageLedger | None = None
        self.requested: set[tuple[int, int]] = set()  # (cp, tp) ranks a TransferRequest went to
        self.quiet: set[tuple[int, int]] = set()  # (cp, tp) ranks that will write nothing more (hard rule 6)
        self.abort_sent: set[tuple[int, int]] = set()
        self.last_abort = 0.0
        self._aux_row: tuple[np.ndarray, AuxSchema] | None = None  # the committed row, decoded when first read
        self._aux: AuxRow | None = None
        self._aux_regions: dict[str, np.ndarray] | None = None
        self.mismatch: list[Any] = []  # field diff when the contract was refused
        self.digests: list[tuple[np.ndarray, np.ndarray]] = []  # (logical pages, their digests) per PagesDone
        self.lookup_pending = False
        self.next_lookup = 0.0
        self.lookup_problem = ""  # the daemon's last 503 (which sender ranks are missing), for the timeout reason
        self.bytes_expected = 0

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
    def age_ms(self) -> float:
        return (time.monotonic() - self.state.entered[KVPoll.Bootstrapping]) * 1000

    @property
    def pages_releasable(self) -> bool:
        """True when no write of this room can still land (hard rule 6)."""
        if self.state.state == KVPoll.Success:
            return True
        return self.state.state == KVPoll.Failed and self.requested <= self.quiet

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
        """The committed aux row (checked by ``schema.check_row``): decoded when first read, not
        on the commit's path (the endpoint's lock serialises readers)."""
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

    def start_ledger(self, pools: list[str], page_size: int) -> None:
        last = self.num_pages - 1  # the last valid token lies in the last page, whatever the count
        aux_owner = self.lanes.owner_of_page(last, self.num_pages)
        self.ledger = PageLedger(self.room, pools, self.num_pages, self.lanes, aux_owner, first_page=self.first_page,
                                 route=self.route)

    def stats(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "state": self.state.state.name,
            "num_tokens": self.num_tokens,
            "first_page": self.first_page,
            "bytes": self.bytes_expected if self.state.state == KVPoll.Success else 0,
            "pages_by_rank": dict(self.ledger.pages_by_rank) if self.ledger else {},
            "seconds": self.state.durations(),
            "total_s": round(time.monotonic() - self.state.entered[KVPoll.Bootstrapping], 6),
        }


class KVReceiver(RoomHandle):
    """Engine-facing receiver of one room on one decode rank (thread-safe).

    ``close()`` (or leaving a ``with`` block, or dropping the handle) ends the room (one not
    yet final fails, and its prefill ranks are told); until then its final state, failure
    reason and aux row stay readable."""

    _ep: DecodeEndpoint
    _room: RecvRoom

    def init(self, page_ids: Any, aux_slot: int, num_tokens: int | None = None, *, first_page: int = 0) -> None:
        """Where the room goes: ``num_tokens`` valid tokens (None: only the pages are known; the
        request has ``first_page + len(page_ids)`` pages and prefill says the count); this rank
        already holds logical pages ``[0, first_page)``; logical page ``first_page + i`` goes to
        physical page ``page_ids[i]`` (one mapping for every pool); the aux row goes to row
        ``aux_slot`` of the aux buffers."""
        self._ep._init_room(self._room, page_ids, aux_slot, num_tokens, first_page)

    def wait_bootstrapped(self, timeout: float) -> OwnerLanes:
        """Block until the prefill topology is known; its owner lanes (allocate pages lane-major
        with ``lanes.lane_major(n)``). TransferTimeout after ``timeout`` s; ContractMismatch
        (with ``.diff``) or TransferError when the room failed before."""
        r = self._room
        booting = self._ep._locked(r.boot_waiter)
        if booting is not None and not booting.wait(timeout):
            raise TransferTimeout(f"prefill topology of instance {r.prefill_instance!r} not known within "
                                  f"{timeout:.1f}s", room=r.room, rank=self._ep.config.rank_label, field="bootstrap")
        lanes, reason, diff = self._ep._locked(lambda: (r.lanes, r.state.reason, list(r.mismatch)))
        if lanes is not None:
            return lanes
        if diff:
            raise ContractMismatch(reason or "contract mismatch", diff=diff, room=r.room, rank=self._ep.config.rank_label)
        raise TransferError(f"room failed before its topology was known: {reason}", room=r.room,
                            rank=self._ep.config.rank_label)

    @property
    def aux(self) -> AuxRow | None:
        """The decoded standard aux row, after Success (``aux_regions`` for any schema)."""
        return self._ep._locked(lambda: self._room.aux)

    @property
    def aux_regions(self) -> dict[str, np.ndarray] | None:
        """Every region of the received aux row (stored form), after Success."""
        return self._ep._locked(lambda: self._room.aux_regions)

    @property
    def lanes(self) -> OwnerLanes | None:
        """The prefill instance's owner lanes, once the topology is known (see wait_bootstrapped)."""
        return self._ep._locked(lambda: self._room.lanes)

    @property
    def mismatch(self) -> list[Any]:
        """The field diff when the prefill instance's contract differed (hard rule 7)."""
        return self._ep._locked(lambda: list(self._room.mismatch))

    @property
    def pages_releasable(self) -> bool:
        return self._ep._locked(lambda: self._room.pages_releasable)

    @property
    def stats(self) -> dict[str, Any]:
        return self._ep._locked(lambda: self._room.stats())

    def abort(self, reason: str = "aborted by decode") -> None:
        self._ep._abort(self._room, reason)
