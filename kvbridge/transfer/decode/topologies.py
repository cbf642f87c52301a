"""Decode's knowledge of prefill instances: look-up answers per DP group, refusals, and
the senders each answer places for this decode rank's TP route.

One look-up answer serves every room of its (instance, DP group) for ``topology_ttl``
seconds; a group in use is looked up again, off the loop, half way to expiry, so a room
never waits for a look-up only because the last room of its group came a while ago. A
409 (contract mismatch, hard rule 7) refuses other rooms toward the instance for
``topology_ttl`` without asking again. While the daemon is unreachable the last answer,
however old, still names the ranks (liveness pings catch the dead ones).

    (instance, dp) ──▶ (when, LookupResponse) ──placed for our TP route──▶ Placement
                                                                           (senders asked, by (cp, tp, pp))

Plain state: the time is passed in; the look-ups themselves are the room state
machine's ``LookUp`` / ``Refresh`` actions, carried out by the endpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.errors import TopologyError
from kvbridge.layout import OwnerLanes, PoolSpec, TPRoute, tp_route
from kvbridge.transfer.decode.config import DecodeConfig

if TYPE_CHECKING:
    from kvbridge.bootstrap.schemas import LookupResponse

REFRESH_IDLE_S = 30.0  # a cached topology used within this long is refreshed before it expires
MAX_PLACEMENTS = 1024  # DP groups whose last look-up answer is kept placed for our TP route

Key = tuple[str, int | None]  # (prefill instance, DP group; None until the instance's dp_size is known)
SenderKey = tuple[int, int, int]  # (cp_rank, tp_rank, pp_rank) of a prefill sender


@dataclass(frozen=True, eq=False)
class Placement:
    """The senders a room of one prefill DP group asks, for this decode rank's TP route: every
    CP rank and, in it, every TP rank of the route and every pipeline stage, with the pools each
    sends. Built once per look-up answer and shared by the rooms that use it (read-only).

    Pipeline stages: a stage sends the layers it registered (``kvbridge.layout.stages``), so it
    is asked only for the pools it holds a layer of; for every pool the stages' registered
    layers must tile the pool's layers exactly (checked here: a layer no stage sends, or two
    stages send, refuses the answer). ``stages[pool]``: the stages a page of that pool comes from,
    each with its own layer range; the ledger counts a page done once every one of them sent it."""

    topology: LookupResponse
    route: TPRoute
    lanes: OwnerLanes
    senders: dict[SenderKey, Any]  # (cp_rank, tp_rank, pp_rank) -> SenderRank
    by_endpoint: dict[str, SenderKey]  # a sender's control endpoint -> (cp_rank, tp_rank, pp_rank)
    asks: tuple[tuple[SenderKey, Any, tuple[str, ...]], ...]  # (key, sender, its pools), by key
    stages: dict[str, tuple[int, ...]]  # pool -> the pipeline stages that send its layers
    aux_stage: int  # the stage that writes the aux row (the last)
    layers: dict[SenderKey, dict[str, tuple[int, ...]]]  # pp > 1: each sender's layer ids per pool (its digests)
    # every rank of the group in the TP columns our decode instance draws from, but the room's
    # decider (cp 0, tp 0, pp 0): where our tp rank 0 hands the decider's ticket on (machine.py)
    columns: tuple[str, ...] = ()

    @classmethod
    def of(cls, topo: LookupResponse, route: TPRoute, room: int, specs: Mapping[str, PoolSpec],
           columns: tuple[int, ...] = ()) -> Placement:
        """``columns``: the prefill TP ranks any decode TP rank of our instance draws from."""
        pp = topo.topology.pp_size
        senders = {(r.cp_rank, r.tp_rank, r.pp_rank): r for r in topo.ranks}
        need = {(cp, tp, s) for cp in range(topo.plan.cp_size) for tp in route.sources for s in range(pp)}
        if need - set(senders):
            cp, tp, s = min(need - set(senders))
            stage = f"/pp{s}" if pp > 1 else ""
            raise TopologyError(f"the look-up of prefill instance {topo.instance!r} lists no sender cp{cp}/tp{tp}{stage}, "
                                f"which this decode rank's TP route draws from", room=room, field="ranks")
        chosen = {key: senders[key] for key in sorted(need)}
        pools = {key: tuple(route.pools_from(key[1])) for key in chosen}
        stages: dict[str, tuple[int, ...]] = {p: (0,) for p in specs}
        layers: dict[SenderKey, dict[str, tuple[int, ...]]] = {}
        if pp > 1:
            pools, stages, layers = _stage_pools(topo, chosen, pools, specs, room)
        others = tuple(sorted({r.control_endpoint for r in topo.ranks
                               if r.tp_rank in columns and (r.cp_rank, r.tp_rank, r.pp_rank) != (0, 0, 0)}))
        return cls(topo, route, OwnerLanes(topo.plan.cp_size, topo.plan.rule), chosen,
                   {s.control_endpoint: key for key, s in chosen.items()},
                   tuple((key, s, pools[key]) for key, s in chosen.items() if pools[key]), stages, pp - 1, layers,
                   others)


def _stage_pools(topo: LookupResponse, chosen: Mapping[SenderKey, Any], pools: Mapping[SenderKey, tuple[str, ...]],
                 specs: Mapping[str, PoolSpec], room: int
                 ) -> tuple[dict[SenderKey, tuple[str, ...]], dict[str, tuple[int, ...]],
                            dict[SenderKey, dict[str, tuple[int, ...]]]]:
    """Which pools each pipeline stage sends (those it registered layers of), checked: in every
    (cp, tp) group the stages' layers of each pool tile the pool's layers, and every CP rank's
    stages hold the same pools (TopologyError naming pool, layer and stages)."""
    held: dict[SenderKey, dict[str, set[int]]] = {}
    for key, s in chosen.items():
        layers: dict[str, set[int]] = {}
        for d in s.pools:
            layers.setdefault(d.pool, set()).add(d.layer_id)
        held[key] = layers
    out = {key: tuple(p for p in pools[key] if p in held[key]) for key in chosen}
    stages: dict[str, set[int]] = {}
    groups = sorted({key[:2] for key in chosen})
    for cp, tp in groups:
        group = [key for key in chosen if key[:2] == (cp, tp)]
        for pool in pools[group[0]]:
            want = set(specs[pool].layer_ids)
            owners: dict[int, list[int]] = {}
            for key in group:
                for lid in held[key].get(pool, ()):
                    owners.setdefault(lid, []).append(key[2])
            where = f"of prefill instance {topo.instance!r} (cp{cp}/tp{tp})"
            twice = sorted(lid for lid, st in owners.items() if len(st) > 1)
            if twice:
                st = sorted(owners[twice[0]])
                raise TopologyError(f"pool {pool!r} layer {twice[0]} is registered by pipeline stages "
                                    f"{', '.join(f'pp{s}' for s in st)} {where}: a layer comes from one stage",
                                    room=room, field="ranks")
            if set(owners) != want:
                gone = sorted(want - set(owners))
                what = (f"layer {gone[0]} is registered by no pipeline stage {where}" if gone else
                        f"layer {min(set(owners) - want)} registered {where} is not a layer of this decode rank's pool")
                raise TopologyError(f"pool {pool!r} {what}", room=room, field="ranks")
            senders_of = tuple(sorted({s for st in owners.values() for s in st}))
            if stages.setdefault(pool, set(senders_of)) != set(senders_of):
                raise TopologyError(f"pool {pool!r} comes from pipeline stages {sorted(stages[pool])} on one CP rank and "
                                    f"{list(senders_of)} {where}: every CP rank splits the layers alike",
                                    room=room, field="ranks")
    layers = {key: {p: tuple(sorted(ids)) for p, ids in held[key].items()} for key in chosen}
    return out, {p: tuple(sorted(st)) for p, st in stages.items()}, layers


class Topologies:
    def __init__(self, config: DecodeConfig, specs: Mapping[str, PoolSpec]) -> None:
        self.cfg = config
        self.specs = specs
        self.cache: dict[tuple[str, int], tuple[float, LookupResponse]] = {}
        self.cache_used: dict[tuple[str, int], float] = {}  # when a room last took a cached topology
        self.dp_sizes: dict[str, int] = {}
        self.in_flight: dict[Key, float] = {}  # group -> when its one look-up (or refresh) was asked; its rooms wait
        self.refusals: dict[str, tuple[float, str, list[Any]]] = {}  # instance -> (when, reason, diff) of a 409
        self.routes: dict[int, TPRoute] = {}  # prefill tp size -> this rank's TP route
        self.instance_columns: dict[int, tuple[int, ...]] = {}  # prefill tp size -> our instance's columns
        self.placements: dict[tuple[str, int], Placement] = {}  # (instance, DP group) -> its last answer, placed

    def key(self, instance: str, dp_rank: int | None, room: int) -> Key:
        """(instance, DP group) of a room; the group is None until the instance's dp_size is known."""
        if dp_rank is None and instance in self.dp_sizes:
            dp_rank = room % self.dp_sizes[instance]
        return instance, dp_rank

    def cached(self, key: Key, now: float) -> LookupResponse | None:
        hit = self.cache.get(key) if key[1] is not None else None  # type: ignore[arg-type]
        if hit and now - hit[0] < self.cfg.topology_ttl:
            self.cache_used[key] = now  # type: ignore[index]
            return hit[1]  # shared by the group's rooms, not copied per room (its ``room``: the one that looked up)
        return None

    def stale(self, key: Key) -> LookupResponse | None:
        """The last answer for the group however old (the daemon is unreachable)."""
        hit = self.cache.get(key) if key[1] is not None else None  # type: ignore[arg-type]
        return None if hit is None else hit[1]

    def store(self, topo: LookupResponse, now: float) -> None:
        """A fresh answer from the daemon: (re)starts the cache's clock, ends a refusal."""
        self.cache[(topo.instance, topo.dp_rank)] = (now, topo)
        self.refusals.pop(topo.instance, None)
        self.dp_sizes[topo.instance] = topo.topology.dp_size

    def refresh_due(self, now: float) -> list[tuple[str, int]]:
        """Groups half way to expiry that a room used lately and no look-up is asking for."""
        due = []
        for key, (when, _) in self.cache.items():
            if now - when < self.cfg.topology_ttl / 2 or key in self.in_flight:
                continue
            if now - self.cache_used.get(key, when) <= REFRESH_IDLE_S:
                due.append(key)
        return due

    def refreshed(self, key: tuple[str, int], topo: LookupResponse | None, now: float) -> None:
        """A refresh's answer. A failed one changes nothing: the entry expires as it would have, and
        the next room looks up itself (meeting the error, or using ``stale`` while the daemon is away)."""
        self.in_flight.pop(key, None)
        if topo is not None and key in self.cache:
            self.cache[key] = (now, topo)

    def refuse(self, instance: str, reason: str, diff: list[Any], now: float) -> None:
        self.refusals[instance] = (now, reason, list(diff))

    def refusal(self, instance: str, now: float | None = None) -> tuple[float, str, list[Any]] | None:
        """The instance's last 409 (within ``topology_ttl`` of ``now`` when given)."""
        hit = self.refusals.get(instance)
        if hit is None or (now is not None and now - hit[0] >= self.cfg.topology_ttl):
            return None
        return hit

    def forget_instance(self, instance: str) -> None:
        """A rank of ``instance`` died: its answers are no longer trusted."""
        self.cache = {k: v for k, v in self.cache.items() if k[0] != instance}

    def clear(self) -> None:
        """Forget every answer: the next room of each group looks up again."""
        self.cache.clear()

    def placement(self, topo: LookupResponse, room: int) -> Placement:
        """The senders of ``topo`` for this rank's TP route, placed once per look-up answer
        (TopologyError: the answer lacks a sender the route needs, or the heads do not split;
        nothing is kept then)."""
        route = self.route(topo.topology.tp_size)
        key = (topo.instance, topo.dp_rank)  # one kept per DP group: a newer answer replaces it
        hit = self.placements.get(key)
        if hit is None or hit.topology is not topo or hit.route is not route:
            if key not in self.placements and len(self.placements) >= MAX_PLACEMENTS:
                self.placements.clear()
            hit = self.placements[key] = Placement.of(topo, route, room, self.specs,
                                                      self.columns(topo.topology.tp_size))
        return hit

    def columns(self, prefill_tp: int) -> tuple[int, ...]:
        """The prefill TP ranks any TP rank of our decode instance draws from (every rank's route)."""
        hit = self.instance_columns.get(prefill_tp)
        if hit is None:
            tp = self.cfg.tp_size
            hit = self.instance_columns[prefill_tp] = tuple(sorted(
                {t for j in range(tp) for t in tp_route(self.specs, prefill_tp, tp, j).sources}))
        return hit

    def route(self, prefill_tp: int) -> TPRoute:
        """Which prefill TP ranks send this rank what (TopologyError when the heads do not split)."""
        hit = self.routes.get(prefill_tp)
        if hit is None:
            hit = self.routes[prefill_tp] = tp_route(self.specs, prefill_tp, self.cfg.tp_size, self.cfg.tp_rank)
        return hit
