"""Turning a decode rank's TransferRequest into a checked :class:`Target` (pure: no I/O).

Everything about the destination is checked here, before any write is posted
(hard rule 5), against what the decode rank *registered* with the bootstrap
daemon (``DecodePeer``), not what the request claims: the page mapping covers
exactly the request's pages from ``first_page`` on, every destination page lies
inside every registered buffer it will be written to, buffers pair by (pool,
layer id) with equal page sizes (hard rule 8), and the aux slot lies inside
every registered aux region. A bad request fails its target with the reason;
nothing is written.

With another TP size on the decode side, the request must ask this TP rank for
exactly the pools of the decode rank's TP route (``kvbridge.layout.tp_route``,
from the TP sizes and ranks both sides registered), and each pool is planned as
whole rows or as the route's head slice (``plan_target``).

A layer-range write (``send(..., layers=)``) plans the same parts cut to the range's layer
ids (``layer_range_specs``; ``Target.cut_parts``, kept per range). Its pages count for the
target only once writes of every layer of every pool reached it (``Target.layers_done``).

Prefill's view of the decode ranks that ask it for rooms, as state.

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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvbridge.errors import KVBridgeError, LayoutError, PageRangeError
from kvbridge.layout import (AuxSchema, BufferDesc, HeadSlice, PoolSpec, TPRoute, TransferPlan, num_drawing,
                             pair_head_buffers, plan_head_transfer, plan_transfer, tp_route, tp_spec)
from kvbridge.layout.pairing import PairedBuffers, pair_buffers
from kvbridge.transfer.channel import wire
from kvbridge.transfer.aux_rows import RegionAddr, aux_slices, packed_base

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import RankDetail

Waiter = tuple[bytes, "wire.TransferRequest"]


@dataclass(frozen=True, slots=True)
class Resolve:
    """Read registration ``rank_id`` from the daemon (off the loop); answer with
    the event ``Resolved`` (``events.py``), fed to the room machine."""

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
    engine_kind: str = "local"  # the kind of engine our writes to its session go through (choose_path's ``engine``)
    by_read: bool = False  # our engine reads its session: its memory is proven by read (prefill/admission.py)
    pairings: dict[tuple[str, ...], PairedBuffers] = field(default_factory=dict)
    routes: dict[tuple[int, int], tuple[TargetPart, ...]] = field(default_factory=dict)
    checked: dict[tuple[int, int], Any] = field(default_factory=dict)  # (tp size, tp rank) -> targets.PeerRoute

    @classmethod
    def of(cls, detail: RankDetail, engine_kind: str = "local", by_read: bool = False) -> DecodePeer:
        return cls(
            rank_id=detail.rank_id, label=detail.rank.label, session=detail.session_id, fingerprint=detail.fingerprint,
            buffers=[BufferDesc(p.pool, p.layer_id, p.base, p.capacity_pages, p.bytes_per_page) for p in detail.pools],
            aux={r.name: RegionAddr.of(r) for r in detail.aux_regions},
            tp_size=detail.rank.tp_size, tp_rank=detail.rank.tp_rank, instance=detail.rank.instance,
            scratch=None if detail.scratch is None else (detail.scratch.base, detail.scratch.nbytes),
            staging=None if detail.staging is None else (detail.staging.base, detail.staging.nbytes,
                                                         detail.staging.slot_bytes),
            proof_key=detail.proof_key, engine_kind=engine_kind, by_read=by_read,
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
            if specs[pool].kind != "paged":  # window, compressed and state pools: planned by prefill/kinds.py
                continue
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

    def wait_for(self, ident: bytes, req: wire.TransferRequest) -> Resolve | None | bool:
        """Hold ``req`` until its registration is read: a Resolve for the first request of that
        rank, None for the next ones, False when too many already wait (refuse it)."""
        if sum(len(w) for w in self.waiting.values()) >= self.max_waiting:
            return False
        first = req.decode_rank_id not in self.waiting
        self.waiting.setdefault(req.decode_rank_id, []).append((ident, req))
        return Resolve(req.decode_rank_id, req.decode_rank) if first else None

    def resolved(self, rank_id: str, detail: RankDetail | None, problem: str | None,
                 engine_kind: str = "local", by_read: bool = False) -> tuple[list[Waiter], str | None]:
        """The daemon's answer (and the kind of engine our writes to its session go through): keep
        the registration; the requests that waited for it, and the reason to refuse them (None:
        deliver them)."""
        waiters = self.waiting.pop(rank_id, [])
        if detail is not None and detail.rank.role != "decode":
            detail, problem = None, f"registration {rank_id} is a {detail.rank.role} rank ({detail.rank.label})"
        if detail is not None:
            self.entries[rank_id] = DecodePeer.of(detail, engine_kind, by_read)
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


NO_DEADLINE_S = 3600.0


@dataclass
class Target:
    """One decode rank that receives a room (checked against what it registered), and how far
    the room's writes to it got."""

    decode_rank: str
    ident: bytes  # the id of the decode rank's connection to our control server
    session: str
    first_page: int  # decode already holds logical pages [0, first_page)
    dst_pages: np.ndarray  # logical page first_page + i -> destination physical page dst_pages[i]
    pools: tuple[str, ...]
    aux_dst: dict[str, RegionAddr]  # the decode rank's registered aux regions
    aux_slot: int
    deadline: float  # monotonic
    want_digest: bool
    parts: tuple[TargetPart, ...]  # what of which pools goes to this decode rank (TP route)
    created: float  # monotonic
    num_expected: int = 0  # owned pages >= first_page: what this target receives
    aux_source: bool = True  # this TP rank writes the aux row to it (when this CP rank owns the last token)
    num_decode_targets: int = 1  # decode ranks that draw from this TP rank (each asks for the room)
    aux_row_base: int | None = None  # the decode rank's aux rows are one packed store from here (None: by region)
    posted: int = 0  # chunks posted so far
    group_at: int = 0  # pages of the chunk being posted already started (a staged chunk goes in slot-sized groups)
    inflight: dict[int, tuple[np.ndarray, bool]] = field(default_factory=dict)  # write id -> (logical pages, aux row too)
    aux_posted: bool = False
    aux_done: bool = False
    num_pages_done: int = 0
    failure: str | None = None
    abort_reason: str | None = None  # decode asked to abort
    closed: bool = False  # final report (success, failure or abort ack) sent
    # layer-range writes: per logical page, target layers written (final, ok); None: none yet
    layers_done: np.ndarray | None = None
    cut: dict[tuple[int, int], tuple[TargetPart, ...]] = field(default_factory=dict)  # layer range -> its parts
    kind_wait: bool = False  # window, compressed or state units still to write to it (prefill/kinds.py)
    decode_tp: tuple[int, int] = (1, 0)  # the decode rank's (tp_size, tp_rank): how its state slots are cut
    aux_inline: bool = False  # it takes the aux row in the report (TransferRequest.aux_inline), not as a write
    aux_ahead: bool = False  # in a report of its own, sent after the pages' write is posted (TransferRequest.aux_ahead)

    @property
    def active(self) -> bool:
        return self.failure is None and self.abort_reason is None

    def overdue(self, silent: float, peer_timeout: float, now: float) -> str | None:
        """Why this target fails now: its decode rank (which pings while it has rooms here) sent
        nothing for ``silent`` seconds, past ``peer_timeout``, or its deadline passed (None: neither)."""
        if silent > peer_timeout:
            return (f"decode rank {self.decode_rank} ({self.session}) sent nothing for {silent:.1f}s "
                    f"(peer timeout {peer_timeout:.1f}s): presumed dead")
        if now > self.deadline:
            return f"decode rank {self.decode_rank}'s deadline passed before the room was written"
        return None

    def cut_parts(self, layers: tuple[int, int], specs: Mapping[str, PoolSpec]) -> tuple[TargetPart, ...]:
        """The parts of a layer range's writes: each part's pools that have layers in ``specs``
        (the range's cut, ``layer_range_specs``), their pairs and decode widths cut alike."""
        hit = self.cut.get(layers)
        if hit is None:
            parts = []
            for part in self.parts:
                paired = part.paired.cut({n: specs[n] for n in part.pools if n in specs})
                if not paired.pools:
                    continue
                dst = None if part.dst_specs is None else {
                    n: replace(part.dst_specs[n], layer_ids=specs[n].layer_ids) for n in paired.pools}
                parts.append(replace(part, pools=paired.pools, paired=paired, dst_specs=dst))
            hit = self.cut[layers] = tuple(parts)
        return hit

    def count_layers(self, pages: np.ndarray, num_layers: int, width: int, num_pages: int) -> np.ndarray:
        """A layer-range write of ``pages`` carrying ``num_layers`` target layers is final (ok):
        the pages whose every layer (of ``width``) has now reached this target."""
        if self.layers_done is None:
            self.layers_done = np.zeros(num_pages, dtype=np.int32)
        self.layers_done[pages] += num_layers  # (a range is refused twice: no page counted twice)
        return pages[self.layers_done[pages] >= width]


class Sized(Protocol):
    """What a request is checked against of its room: its length and this rank's share."""

    @property
    def num_pages(self) -> int: ...
    def num_owned_from(self, first_page: int) -> int: ...


def target_from_request(
    req: wire.TransferRequest,
    ident: bytes,
    specs: Mapping[str, PoolSpec],
    src_bufs: Sequence[BufferDesc],
    aux_schema: AuxSchema,
    room: Sized,
    peer: DecodePeer,
    *,
    tp: tuple[int, int] = (1, 0),
    now: float = 0.0,
    aux_stage: bool = True,
) -> Target:
    """``tp``: this prefill rank's (tp_size, tp_rank); ``now``: the time (deadlines count from it);
    ``aux_stage``: this rank is in the pipeline stage that writes the aux row (the last). What
    holds for every request of this decode rank (its TP route, buffer pairing, aux regions) is checked once per peer
    (``PeerRoute``); the request's own fields are checked here, every time."""
    ctx = dict(room=req.room, rank=req.decode_rank)
    pools = tuple(req.pools)
    route = peer.checked.get(tp) if req.num_decode_ranks == peer.tp_size else None
    if route is None or tuple(sorted(pools)) != route.pools:  # (the route's pools: known, each once)
        route = _checked_route(req, pools, specs, src_bufs, aux_schema, peer, tp, ctx)
    num_pages = room.num_pages
    if not 0 <= req.first_page <= num_pages:
        raise LayoutError(f"first_page {req.first_page} outside a request of {num_pages} pages", field="first_page",
                          **ctx)
    dst_pages = np.frombuffer(req.page_ids, dtype="<i4").astype(np.int64)  # (decoding checked: whole int32s)
    if dst_pages.size != num_pages - req.first_page:
        raise LayoutError(f"{dst_pages.size} destination pages for pages [{req.first_page}, {num_pages}) of a request "
                          f"of {num_pages} pages", field="page_ids", **ctx)
    if req.want_digest and route.head_sliced:
        raise LayoutError("a digest check compares whole rows; this decode rank receives head slices",
                          field="want_digest", **ctx)
    lo, hi = (int(dst_pages.min()), int(dst_pages.max())) if dst_pages.size else (0, -1)
    if lo < 0 or hi >= route.min_dst_capacity:
        _raise_outside(route.parts, lo if lo < 0 else hi, ctx)
    if route.aux and not 0 <= req.aux_slot < route.aux_rows:
        r = next(r for r in route.aux if not 0 <= req.aux_slot < r.capacity_rows)
        raise PageRangeError(f"aux slot {req.aux_slot} outside the {r.capacity_rows} rows decode rank {peer.label} "
                             f"registered for aux region {r.name!r}; nothing written", field="aux_slot", **ctx)
    deadline = now + (req.deadline_ms / 1000.0 if req.deadline_ms > 0 else NO_DEADLINE_S)
    return Target(decode_rank=req.decode_rank, ident=ident, session=peer.session, first_page=req.first_page,
                  dst_pages=dst_pages, pools=pools, aux_dst=peer.aux, aux_slot=req.aux_slot, deadline=deadline,
                  want_digest=req.want_digest, parts=route.parts, aux_row_base=route.aux_row_base, created=now,
                  num_expected=room.num_owned_from(req.first_page),
                  aux_source=route.aux_source and aux_stage, num_decode_targets=route.num_drawing,
                  decode_tp=(peer.tp_size, peer.tp_rank), aux_inline=req.aux_inline,
                  aux_ahead=req.aux_inline and req.aux_ahead)


def request_target(req: wire.TransferRequest, ident: bytes, room: Any, peer: DecodePeer, specs: Mapping[str, PoolSpec],
                   src_bufs: Sequence[BufferDesc], aux_schema: AuxSchema, *, fingerprint: str, digests_readable: bool,
                   tp: tuple[int, int], now: float, aux_stage: bool, rank: str) -> Target:
    """A request whose decode registration is known, checked into a Target of ``room`` (a
    PrefillRoom: its length set from the request, its prefix checked). Raises KVBridgeError
    naming why when it cannot be served: nothing was posted for it, so it is safe to refuse."""
    if peer.fingerprint != fingerprint:
        raise KVBridgeError(f"decode rank {peer.label} registered contract {peer.fingerprint}, prefill rank {rank} "
                            f"has {fingerprint}; nothing transferred (hard rule 7)")
    if req.want_digest and not digests_readable:
        raise KVBridgeError(f"decode rank {req.decode_rank} wants page digests, but prefill rank {rank}'s buffers are "
                            "not readable by kvbridge (device memory or padded pages given as addresses, "
                            "RawBuffer): turn verify_digest off on decode")
    # num_tokens 0: the decode rank knows only its pages (first_page + page ids)
    room.set_length(f"decode rank {req.decode_rank}", num_tokens=req.num_tokens or None,
                    num_pages=None if req.num_tokens else req.first_page + len(req.page_ids) // 4)
    target = target_from_request(req, ident, specs, src_bufs, aux_schema, room, peer, tp=tp, now=now,
                                 aux_stage=aux_stage)
    room.check_prefix(target)  # the engine may already skip pages below its first page
    return target


def _checked_route(req: wire.TransferRequest, pools: tuple[str, ...], specs: Mapping[str, PoolSpec],
                   src_bufs: Sequence[BufferDesc], aux_schema: AuxSchema, peer: DecodePeer, tp: tuple[int, int],
                   ctx: dict) -> PeerRoute:
    """The route of a request that is not (yet) the one checked for its peer: it must name known
    pools once each, count the decode ranks the peer registered, and ask exactly what the
    peer's TP route takes from this rank."""
    unknown = [p for p in pools if p not in specs]
    if unknown or not pools or len(set(pools)) != len(pools):
        raise LayoutError(f"decode asked for pools {list(pools)}; this rank has {sorted(specs)}", field="pools", **ctx)
    if req.num_decode_ranks != peer.tp_size:
        raise LayoutError(f"the request counts {req.num_decode_ranks} decode ranks, decode rank {peer.label} registered "
                          f"tp_size {peer.tp_size}", field="num_decode_ranks", **ctx)
    route = peer_route(peer, specs, src_bufs, aux_schema, tp, req.room)
    if tuple(sorted(pools)) != route.pools:
        raise LayoutError(f"decode rank {peer.label} (tp {peer.tp_rank} of {peer.tp_size}) asked prefill tp rank "
                          f"{tp[1]} of {tp[0]} for pools {sorted(pools)}; its TP route takes {list(route.pools)} "
                          "from it", field="pools", **ctx)
    return route


@dataclass(frozen=True)
class PeerRoute:
    """What this prefill TP rank sends one decode rank, checked once per (peer, TP sizes):
    the pools its TP route takes from us (sorted), their parts paired with its registered
    buffers, its smallest registered capacities, its aux regions (present, wide enough)."""

    pools: tuple[str, ...]
    parts: tuple[TargetPart, ...]
    head_sliced: bool
    min_dst_capacity: int
    aux: tuple[RegionAddr, ...]
    aux_rows: int  # rows every aux region holds
    aux_row_base: int | None  # its aux rows are one packed store starting here (None: by region)
    aux_source: bool
    num_drawing: int


def peer_route(peer: DecodePeer, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc],
               aux_schema: AuxSchema, tp: tuple[int, int], room: int) -> PeerRoute:
    """The decode rank's route from this prefill rank, built and checked on its first request
    (a failure is raised again on every request: nothing is cached then)."""
    hit = peer.checked.get(tp)
    if hit is not None:
        return hit
    ctx = dict(room=room, rank=peer.label)
    try:
        route = tp_route(specs, tp[0], peer.tp_size, peer.tp_rank)
    except KVBridgeError as exc:
        raise LayoutError(f"no TP route from prefill tp {tp[0]} to decode {peer.label}: {exc.reason}",
                          field="tp_size", **ctx) from None
    parts = peer.parts(specs, src_bufs, route, tp[1], room)  # PairingError: missing layer, page sizes
    missing = [r.name for r in aux_schema.regions if r.name not in peer.aux]
    if missing:
        raise LayoutError(f"decode rank {peer.label} registered no aux region {missing[0]!r}: the room's aux row "
                          "has nowhere to go", field="aux_regions", **ctx)
    aux = tuple(peer.aux[r.name] for r in aux_schema.regions)
    for r, addr in zip(aux_schema.regions, aux):
        if addr.stride < r.nbytes:
            raise LayoutError(f"decode rank {peer.label}'s aux region {r.name!r} has {addr.stride}-byte rows, the "
                              f"schema's region is {r.nbytes} B", field="aux_regions", **ctx)
    checked = peer.checked[tp] = PeerRoute(
        pools=tuple(sorted(route.pools_from(tp[1]))), parts=parts,
        head_sliced=any(p.head_slice is not None for p in parts),
        min_dst_capacity=min((p.paired.min_dst_capacity for p in parts), default=0),
        aux=aux, aux_rows=min((a.capacity_rows for a in aux), default=2**31),
        aux_row_base=packed_base(aux_schema, peer.aux),
        aux_source=route.first_source == tp[1], num_drawing=num_drawing(specs, tp[0], peer.tp_size, tp[1]),
    )  # fmt: skip
    return checked


def _raise_outside(parts: Sequence[TargetPart], bad: int, ctx: dict) -> None:
    """Name the first registered buffer destination page ``bad`` falls outside of (hard rule 5)."""
    for part in parts:
        for spec, _, _, _, dst_cap in part.paired.pairs:
            for layer, cap in zip(spec.layer_ids, dst_cap.tolist()):
                if bad < 0 or bad >= cap:
                    raise PageRangeError(f"destination page {bad} outside pool {spec.name!r} layer {layer}'s "
                                         f"{cap} registered pages; nothing written", field="page_ids", **ctx)


def plan_target(specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc], t: Target, logical: np.ndarray,
                local: np.ndarray, num_tokens: int, *, room: int, rank: str,
                extra: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                layers: tuple[int, int] | None = None) -> TransferPlan:
    """The writes of ``logical`` pages (at our ``local`` pages) to target ``t``: whole rows and
    head slices as its parts say, every page checked (hard rule 5); ``extra`` slices (the aux
    row) after them. ``layers``: only that range's layers, ``specs`` then being its cut
    (``layer_range_specs``)."""
    dst = t.dst_pages[logical - t.first_page if t.first_page else logical]
    parts = t.parts if layers is None else t.cut_parts(layers, specs)
    if not parts:  # (this target takes no pool with layers in the range)
        return TransferPlan.empty() if extra is None else TransferPlan(*extra)
    if len(parts) == 1 and parts[0].head_slice is None:  # (every MLA model: whole rows)
        part = parts[0]
        return plan_transfer(specs, src_bufs, [], logical, local, dst, num_tokens, pools=part.pools, room=room,
                             rank=rank, paired=part.paired, extra=extra)
    plans = []
    for part in parts:
        if part.head_slice is None:
            plans.append(plan_transfer(specs, src_bufs, [], logical, local, dst, num_tokens, pools=part.pools,
                                       room=room, rank=rank, paired=part.paired))
        else:
            plans.append(plan_head_transfer(specs, part.dst_specs, part.head_slice, src_bufs, [], logical, local, dst,
                                            num_tokens, pools=part.pools, room=room, rank=rank, paired=part.paired))
    if extra is not None:
        plans.append(TransferPlan(*extra))
    return plans[0] if len(plans) == 1 else TransferPlan.concat(plans)


def plan_chunk(specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc], aux_schema: AuxSchema, t: Target,
               logical: np.ndarray, local: np.ndarray, num_tokens: int, aux_from: Any, *, room: int, rank: str,
               layers: tuple[int, int] | None = None) -> TransferPlan:
    """One write of a chunk's ``logical`` pages to ``t`` and, with ``aux_from`` (where the aux row
    is written from: its regions, slot and packed row base), the aux row after the pages' slices
    (one write, one completion)."""
    aux = None if aux_from is None else aux_slices(aux_schema, aux_from.regions, aux_from.slot, t.aux_dst, t.aux_slot,
                                                   src_base=aux_from.row_base, dst_base=t.aux_row_base)
    if not logical.size:
        return TransferPlan(*aux)
    return plan_target(specs, src_bufs, t, logical, local, num_tokens, room=room, rank=rank, extra=aux, layers=layers)
