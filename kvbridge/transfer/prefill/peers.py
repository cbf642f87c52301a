"""Prefill's view of the decode ranks that ask it for rooms, as state.

**Registrations.** A TransferRequest names the decode rank's registration id
(``decode_rank_id``), not its buffers: the prefill rank reads the registration
from the bootstrap daemon once (``GET /v1/ranks/{id}``), on a pool thread, and
keeps it (bounded, least recently used out). Every request is then checked
against what that decode rank *registered* (hard rule 5), never against what a
request claims. Requests that arrive while their registration is being read
wait for it; a registration that cannot be read refuses them, naming the rank.

    request(rank id R) --cached--> checked -> Target
         |  not yet
         +--> waiting[R], a Resolve action ... the endpoint asks the daemon off the loop ...
              ``resolved(R, detail, problem)``: cache, then the waiting requests are delivered or refused

**Liveness.** A decode rank pings each prefill rank it has rooms with; any
message counts. A connection silent for ``peer_timeout`` fails the targets on
it, naming the decode rank (writes to a dead rank fail too).

No socket, thread or clock here: the room state machine (``prefill/machine.py``) feeds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.layout import BufferDesc, HeadSlice, PoolSpec, TPRoute, pair_head_buffers, tp_spec
from kvbridge.layout.pairing import PairedBuffers, pair_buffers
from kvbridge.transfer.aux_rows import RegionAddr

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import RankDetail
    from kvbridge.transfer.channel.wire import TransferRequest

Waiter = tuple[bytes, "TransferRequest"]


@dataclass(frozen=True, slots=True)
class Resolve:
    """Read registration ``rank_id`` from the daemon (off the loop); answer with
    ``PrefillRooms.resolved(rank_id, detail, problem, now)``."""

    rank_id: str
    label: str


@dataclass(frozen=True)
class TargetPart:
    """Pools sent to one decode rank the same way: whole rows (``head_slice`` None, planned
    like any page) or one head slice (``dst_specs``: the decode rank's row widths). Buffers
    paired with the decode rank's registered ones and checked once."""

    pools: tuple[str, ...]
    paired: PairedBuffers
    head_slice: HeadSlice | None = None
    dst_specs: Mapping[str, PoolSpec] | None = None


@dataclass
class DecodePeer:
    """One decode rank's registration, as the daemon holds it."""

    rank_id: str
    label: str
    session: str
    fingerprint: str
    buffers: list[BufferDesc]
    aux: dict[str, RegionAddr]
    tp_size: int = 1
    tp_rank: int = 0
    instance: str = ""  # the decode instance (a room belongs to the first instance that claims it)
    scratch: tuple[int, int] | None = None  # (base, nbytes) of its scratch region: where its ownership is proven
    # (base, nbytes, slot_bytes) of its staging area: the only memory staged chunks may land in (None: none)
    staging: tuple[int, int, int] | None = None
    proof_key: str | None = None  # its ownership-proof public key (hex): who may act for it (transfer/ownership.py)
    by_read: bool = False  # our engine reads its session: its memory is proven by read (prefill/admission.py)
    pairings: dict[tuple[str, ...], PairedBuffers] = field(default_factory=dict)
    routes: dict[tuple[int, int], tuple[TargetPart, ...]] = field(default_factory=dict)
    checked: dict[tuple[int, int], Any] = field(default_factory=dict)  # (tp size, tp rank) -> targets.PeerRoute

    @classmethod
    def of(cls, detail: RankDetail, by_read: bool = False) -> DecodePeer:
        return cls(
            rank_id=detail.rank_id, label=detail.rank.label, session=detail.session_id, fingerprint=detail.fingerprint,
            buffers=[BufferDesc(p.pool, p.layer_id, p.base, p.capacity_pages, p.bytes_per_page) for p in detail.pools],
            aux={r.name: RegionAddr.of(r) for r in detail.aux_regions},
            tp_size=detail.rank.tp_size, tp_rank=detail.rank.tp_rank, instance=detail.rank.instance,
            scratch=None if detail.scratch is None else (detail.scratch.base, detail.scratch.nbytes),
            staging=None if detail.staging is None else (detail.staging.base, detail.staging.nbytes,
                                                         detail.staging.slot_bytes),
            proof_key=detail.proof_key, by_read=by_read,
        )  # fmt: skip

    def pairing(self, specs: Mapping[str, PoolSpec], src: Sequence[BufferDesc], pools: tuple[str, ...],
                room: int) -> PairedBuffers:
        """Our buffers paired with this rank's registered ones by (pool, layer id), once per pool set."""
        hit = self.pairings.get(pools)
        if hit is None:
            hit = self.pairings[pools] = pair_buffers(specs, src, self.buffers, pools, room=room, rank=self.label)
        return hit

    def parts(self, specs: Mapping[str, PoolSpec], src: Sequence[BufferDesc], route: TPRoute, src_rank: int,
              room: int) -> tuple[TargetPart, ...]:
        """What prefill TP rank ``src_rank`` sends this decode rank along its TP ``route``: whole-row
        pools in one part, head-sliced pools grouped by slice; paired once per (tp size, rank)."""
        key = (route.src_tp, src_rank)
        hit = self.routes.get(key)
        if hit is not None:
            return hit
        whole: list[str] = []
        sliced: dict[HeadSlice, list[str]] = {}
        for pool in route.pools_from(src_rank):
            hs = route.slice_from(pool, src_rank)
            if hs is None:
                whole.append(pool)
            else:
                sliced.setdefault(hs, []).append(pool)
        parts = [TargetPart(tuple(whole), self.pairing(specs, src, tuple(whole), room))] if whole else []
        for hs, pools in sliced.items():
            dst_specs = {p: tp_spec(specs[p], self.tp_size, self.tp_rank) for p in pools}
            paired = pair_head_buffers(specs, dst_specs, hs, src, self.buffers, pools, room=room, rank=self.label)
            parts.append(TargetPart(tuple(pools), paired, hs, dst_specs))
        self.routes[key] = tuple(parts)
        return self.routes[key]


class DecodePeers:
    """Registrations by id (read off the loop by the endpoint), the requests waiting for one,
    and the last time each connection spoke."""

    def __init__(self, *, max_entries: int = 256, max_waiting: int = 10_000) -> None:
        self.max_entries, self.max_waiting = max_entries, max_waiting
        self.entries: OrderedDict[str, DecodePeer] = OrderedDict()
        self.waiting: dict[str, list[Waiter]] = {}
        self.heard: dict[bytes, float] = {}  # connection -> time of its last message

    def get(self, rank_id: str) -> DecodePeer | None:
        peer = self.entries.get(rank_id)
        if peer is not None:
            self.entries.move_to_end(rank_id)
        return peer

    def wait_for(self, ident: bytes, req: TransferRequest) -> Resolve | None | bool:
        """Hold ``req`` until its registration is read: a Resolve for the first request of that
        rank, None for the next ones, False when too many already wait (refuse it)."""
        if sum(len(w) for w in self.waiting.values()) >= self.max_waiting:
            return False
        first = req.decode_rank_id not in self.waiting
        self.waiting.setdefault(req.decode_rank_id, []).append((ident, req))
        return Resolve(req.decode_rank_id, req.decode_rank) if first else None

    def resolved(self, rank_id: str, detail: RankDetail | None, problem: str | None,
                 by_read: bool = False) -> tuple[list[Waiter], str | None]:
        """The daemon's answer: keep the registration; the requests that waited for it, and the
        reason to refuse them (None: deliver them)."""
        waiters = self.waiting.pop(rank_id, [])
        if detail is not None and detail.rank.role != "decode":
            detail, problem = None, f"registration {rank_id} is a {detail.rank.role} rank ({detail.rank.label})"
        if detail is not None:
            self.entries[rank_id] = DecodePeer.of(detail, by_read)
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        return waiters, problem

    def heard_from(self, ident: bytes, now: float) -> None:
        self.heard[ident] = now

    def silent_for(self, ident: bytes, now: float, since: float) -> float:
        """Seconds since ``ident`` last spoke (or since ``since``, whichever is later)."""
        return now - max(self.heard.get(ident, since), since)

    def prune(self, now: float, keep: set[bytes], horizon: float) -> None:
        """Forget connections no target uses that have been quiet for ``horizon`` seconds."""
        for ident in [i for i, t in self.heard.items() if i not in keep and now - t > horizon]:
            del self.heard[ident]
