"""Decode side of one room: the engine-facing :class:`KVReceiver`, and the
room's state that the :class:`~kvbridge.transfer.decode.DecodeEndpoint` loop drives.

    Bootstrapping     waiting for the prefill topology (bootstrap lookup; 409 -> Failed with the diff)
    WaitingForInput   topology known, waiting for init(page_ids, aux_slot, num_tokens)
    Transferring      TransferRequest sent to every CP rank; the ledger fills up
    Success           every (pool, page) once + the aux row checked (+ digests, when asked)
    Failed            reason kept; pages released only once every CP rank that was
                      asked is quiet: acked the abort, reported failure, or is dead (hard rule 6)
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.layout import AuxRow, OwnerLanes, owner_of_last_token
from kvbridge.transfer.ledger import PageLedger
from kvbridge.transfer.poll import KVPoll, RoomState

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse
    from kvbridge.transfer.decode import DecodeEndpoint


class RecvRoom:
    def __init__(self, room: int, prefill_instance: str, dp_rank: int | None) -> None:
        self.room = room
        self.prefill_instance = prefill_instance
        self.dp_rank = dp_rank
        self.state = RoomState()
        self.topology: LookupResponse | None = None
        self.lanes: OwnerLanes | None = None
        self.senders: dict[int, Any] = {}  # cp_rank -> SenderRank
        self.page_ids: np.ndarray | None = None
        self.aux_slot = -1
        self.num_tokens = 0
        self.ledger: PageLedger | None = None
        self.requested: set[int] = set()  # cp ranks a TransferRequest went to
        self.quiet: set[int] = set()  # cp ranks that will write nothing more (hard rule 6)
        self.abort_sent: set[int] = set()
        self.last_abort = 0.0
        self.aux: AuxRow | None = None
        self.mismatch: list[Any] = []  # field diff when the contract was refused
        self.digests: list[tuple[np.ndarray, np.ndarray]] = []  # (logical pages, their digests) per PagesDone
        self.lookup_pending = False
        self.next_lookup = 0.0
        self.lookup_problem = ""  # the daemon's last 503 (which sender ranks are missing), for the timeout reason
        self.engine_done = False
        self.bytes_expected = 0

    @property
    def initialised(self) -> bool:
        return self.page_ids is not None

    @property
    def num_pages(self) -> int:
        return 0 if self.page_ids is None else int(self.page_ids.size)

    @property
    def age_ms(self) -> float:
        return (time.monotonic() - self.state.entered[KVPoll.Bootstrapping]) * 1000

    @property
    def pages_releasable(self) -> bool:
        """True when no write of this room can still land (hard rule 6)."""
        if self.state.state == KVPoll.Success:
            return True
        return self.state.state == KVPoll.Failed and self.requested <= self.quiet

    def set_topology(self, topo: LookupResponse) -> None:
        self.topology = topo
        self.dp_rank = topo.dp_rank
        self.lanes = OwnerLanes(topo.plan.cp_size, topo.plan.rule)
        self.senders = {r.cp_rank: r for r in topo.ranks}

    def start_ledger(self, pools: list[str], page_size: int) -> None:
        aux_owner = owner_of_last_token(self.num_tokens, page_size, self.lanes)
        self.ledger = PageLedger(self.room, pools, self.num_pages, self.lanes, aux_owner)

    def stats(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "state": self.state.state.name,
            "num_tokens": self.num_tokens,
            "bytes": self.bytes_expected if self.state.state == KVPoll.Success else 0,
            "pages_by_rank": dict(self.ledger.pages_by_rank) if self.ledger else {},
            "seconds": self.state.durations(),
            "total_s": round(time.monotonic() - self.state.entered[KVPoll.Bootstrapping], 6),
        }


class KVReceiver:
    """Engine-facing receiver of one room on one decode rank (thread-safe)."""

    def __init__(self, endpoint: DecodeEndpoint, room: int) -> None:
        self._ep = endpoint
        self.room = room
        # once the engine drops this object, a final room may be forgotten
        weakref.finalize(self, endpoint._release, room)

    def init(self, page_ids: np.ndarray, aux_slot: int, num_tokens: int) -> None:
        """Destination pages (one mapping for every pool: logical page l -> physical page
        ``page_ids[l]``), the aux row slot, and the request's valid token count."""
        self._ep._init_room(self.room, page_ids, aux_slot, num_tokens)

    def poll(self) -> KVPoll:
        return self._ep._with_room(self.room, lambda r: r.state.state, KVPoll.Failed)

    @property
    def failure_reason(self) -> str | None:
        return self._ep._with_room(self.room, lambda r: r.state.reason, "room unknown")

    @property
    def aux(self) -> AuxRow | None:
        return self._ep._with_room(self.room, lambda r: r.aux, None)

    @property
    def lanes(self) -> OwnerLanes | None:
        """The prefill instance's owner lanes, once the topology is known (WaitingForInput):
        allocate destination pages lane-major (``lanes.lane_major``) for one run per CP rank."""
        return self._ep._with_room(self.room, lambda r: r.lanes, None)

    @property
    def mismatch(self) -> list[Any]:
        """The field diff when the prefill instance's contract differed (hard rule 7)."""
        return self._ep._with_room(self.room, lambda r: list(r.mismatch), [])

    @property
    def pages_releasable(self) -> bool:
        return self._ep._with_room(self.room, lambda r: r.pages_releasable, True)

    @property
    def stats(self) -> dict[str, Any]:
        return self._ep._with_room(self.room, lambda r: r.stats(), {})

    def abort(self, reason: str = "aborted by decode") -> None:
        self._ep._abort(self.room, reason)
