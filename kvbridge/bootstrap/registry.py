"""The registry's rules, written once above its store: instances, their ranks and
leases, and the recent refusals kept for diagnostics. One ``Registry`` per app
(``app.state``); its state lives in a ``RegistryStore`` (store.py: in memory, or etcd).

    instance "prefill-a" (role, sizes, contract + fingerprint fixed by its first rank)
      └── ranks by id, and by coordinates (dp, cp, tp, pp): a re-registration of the
          same coordinates replaces the old record (a restarted worker) when it
          presents the old record's lease secret (see ``leases.py``)

Limits: an instance's topology may not exceed ``max_ranks_per_instance`` ranks, and
at most ``max_instances`` instances live at once (429, named).

Leases: every rank holds one for ``lease_ttl_s``; a heartbeat renews it. The store
drops expired ranks (in memory: lazily on every access and by the app's periodic
sweep; etcd: by itself, with no daemon running); an instance with no rank left is
forgotten, so it may come back with a new contract.

Store down (etcd quorum lost): registrations, heartbeats and new look-ups answer 503
``store_unavailable`` naming the cause; views keep answering from the cache.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Literal

from kvbridge.bootstrap.claims import claim_held, find_conflict
from kvbridge.bootstrap.contract import fingerprint
from kvbridge.bootstrap.diff import FieldDiff, breaks_for, diff_contracts
from kvbridge.bootstrap.lapses import DEFAULT_CLAIM_GRACE_S, check_lapsed, signature_ok
from kvbridge.bootstrap.leases import (
    check_secret,
    new_secret,
    refuse_replacement,
    secret_digest,
)
from kvbridge.bootstrap.metrics import Metrics
from kvbridge.bootstrap.records import InstanceRecord, RankRecord
from kvbridge.bootstrap.schemas import (
    HeartbeatResponse,
    InstanceFingerprint,
    InstanceView,
    LookupRequest,
    LookupResponse,
    MismatchRecord,
    MismatchSide,
    RankDetail,
    RankIdentity,
    RegisterRequest,
    RegisterResponse,
)
from kvbridge.bootstrap.store import RegistryStore
from kvbridge.bootstrap.store_memory import MemoryStore
from kvbridge.bootstrap.topology import (
    OwnerLanePlan,
    check_descriptors,
    check_stage,
    sender_coords,
    stage_layers_conflict,
    topology_diff,
)
from kvbridge.errors import (
    BootstrapUnavailable,
    ContractMismatch,
    InstanceIncomplete,
    KVBridgeError,
    LimitExceeded,
    TopologyError,
    UnknownInstance,
)

__all__ = ["Registry", "RankRecord", "InstanceRecord"]  # the records live in records.py

log = logging.getLogger(__name__)


def _topology_error(message: str, diff: list[FieldDiff], **ctx: object) -> TopologyError:
    exc = TopologyError(message, **ctx)  # type: ignore[arg-type]
    exc.diff = diff  # type: ignore[attr-defined]  # same shape as ContractMismatch.diff
    return exc


class Registry:
    def __init__(
        self,
        *,
        metrics: Metrics,
        default_ttl_s: float = 10.0,
        max_ttl_s: float = 300.0,
        max_mismatches: int = 100,
        max_ranks_per_instance: int = 1024,
        max_instances: int = 1024,
        pause_grace_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        store: RegistryStore | None = None,
        claim_grace_s: float = DEFAULT_CLAIM_GRACE_S,
        max_ranks: int = 8192,
        max_metadata_chars: int = 64 << 20,
    ) -> None:
        self.metrics = metrics
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.max_ranks_per_instance = max_ranks_per_instance
        self.max_instances = max_instances
        self.claim_grace_s = claim_grace_s  # how long a lapsed claim stays its owner's (lapses.py)
        self.max_ranks = max_ranks
        self.max_metadata_chars = max_metadata_chars
        self._clock = clock
        self._wall = wall_clock
        self.store = store if store is not None else MemoryStore(max_refusals=max_mismatches, pause_grace_s=pause_grace_s,
                                                                 clock=clock)
        self._lock = self.store.lock
        self._index = self.store.index

    @property
    def pauses(self) -> int:
        """Pauses of the daemon forgiven by lengthening leases (in-memory store only)."""
        return getattr(self.store, "pauses", 0)

    # -- leases -----------------------------------------------------------------

    def expire(self) -> int:
        """Drop every rank whose lease has passed; returns how many."""
        with self._lock:
            n = self._expire_locked()
            self._index.expire_lapsed(self._wall())
            return n

    def _expire_locked(self) -> int:
        dropped = self.store.expire(self._clock())
        for rec in dropped:
            log.info("lease of %s (%s) expired; its claim stays its owner's for %.0f s", rec.identity.label,
                     rec.rank_id, self.claim_grace_s)
        if dropped:
            # the grace counts from when each lease ran out, not from when the daemon noticed
            wall, now = self._wall(), self._clock()
            self.store.lapse([(r, wall - max(0.0, now - r.expires_at) + self.claim_grace_s) for r in dropped])
            self.metrics.inc("kvbridge_bootstrap_leases_expired_total", len(dropped))
        return len(dropped)

    def _ttl(self, asked: float | None) -> float:
        return min(asked if asked is not None else self.default_ttl_s, self.max_ttl_s)

    # -- writes -----------------------------------------------------------------

    def register(self, req: RegisterRequest, *, lease_secret: str | None = None, admin: bool = False) -> RegisterResponse:
        ident = req.rank
        fp = fingerprint(req.contract)
        check_descriptors(req.contract, req.pools, req.aux, rank=ident.label, aux_regions=req.aux_regions,
                          tp=(ident.tp_size, ident.tp_rank))  # BufferSpecError -> 409
        check_stage(req.contract, ident.role, ident.pp_size, ident.pp_rank, ident.pp_layers, req.pools,
                    rank=ident.label)  # TopologyError / BufferSpecError -> 409
        secret = new_secret()
        with self._lock:
            self._expire_locked()
            self.store.check_available(f"registration of {ident.label}", rank=ident.label)
            inst = self._index.instances.get(ident.instance)
            replaced = inst.by_coords.get(ident.coords) if inst is not None else None
            if inst is not None and replaced is not None:
                old = inst.ranks[replaced]
                refuse_replacement(old.secret_digest, lease_secret, admin=admin, label=ident.label, rank_id=replaced,
                                   remaining_s=old.expires_at - self._clock())
            if inst is not None and replaced is not None and len(inst.ranks) == 1:
                # The instance's only rank restarts: it may come back with a new contract.
                inst = None
            if inst is not None:
                self._check_same_instance(inst, req, fp)
            else:
                self._check_limits(ident, replacing=replaced is not None)
                inst = InstanceRecord(ident.instance, ident.topology, req.contract, fp)
            self._check_stages(inst, ident, fp, replaced)
            self._check_totals(req, replaced)
            if replaced is not None:
                log.info("%s registers again; replacing %s", ident.label, replaced)
            ttl = self._ttl(req.lease_ttl_s)
            rec = RankRecord(
                rank_id=secrets.token_hex(8),
                identity=ident,
                control_endpoint=req.control_endpoint,
                session_id=req.session_id,
                pools=list(req.pools),
                aux=req.aux,
                lease_ttl_s=ttl,
                expires_at=self._clock() + ttl,
                aux_regions=list(req.aux_regions),
                secret_digest=secret_digest(secret),
                scratch=req.scratch,
                staging=req.staging,
                proof_key=req.proof_key,
                engine_metadata=req.engine_metadata,
            )
            proven = signature_ok(req.proof_key, req.proof_signature, ident.instance, ident.coords)
            retaken = self._check_claims(rec, replaced, proven)
            if not self.store.remote:
                self.store.add_rank(inst, rec, replaced, retaken=retaken, proven=proven)
        if self.store.remote:
            # A shared store settles conflicting writers itself (one transaction: LeaseHeld when
            # another replica took the coordinates meanwhile, ClaimHeld when it took the session
            # or an address range); its round trips must not hold the
            # lock that look-ups, answered from the cache, take.
            self.store.add_rank(inst, rec, replaced, retaken=retaken, proven=proven)
        self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="ok")
        log.info("registered %s as %s (%s)", ident.label, rec.rank_id, fp[:17])
        return RegisterResponse(rank_id=rec.rank_id, instance=inst.name, fingerprint=fp, lease_ttl_s=ttl, replaced=replaced,
                                lease_secret=secret)

    def _check_claims(self, rec: RankRecord, replaced: str | None, proven: bool) -> tuple[str, ...]:
        """A rank's transport session and address ranges are its own (claims.py): 409
        ``claim_held`` naming the live rank that holds them, or the rank whose lapsed claim holds
        them for its owner's key (lapses.py). The rank it replaces holds nothing against it.
        Returns the lapsed claims it takes back (its own key's)."""
        claim = rec.claim()
        conflict = find_conflict(self._index.session_claims(claim.session), claim, exclude=(replaced, rec.rank_id))
        retaken: list[str] = []
        if conflict is None:
            conflict, retaken = check_lapsed(self._index.lapsed_claims(claim.session), claim, proof_key=rec.proof_key,
                                             proven=proven, now=self._wall())
        if conflict is not None:
            self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="claim_held")
            raise claim_held(rec.identity.label, *conflict)
        if retaken:
            log.info("%s takes its lapsed claim back (%s)", rec.identity.label, ", ".join(retaken))
        return tuple(retaken)

    def _check_totals(self, req: RegisterRequest, replaced: str | None) -> None:
        """Every instance together: at most ``max_ranks`` ranks and ``max_metadata_chars`` of
        engine_metadata held (429, named): one write-token holder registering new instances with
        the largest metadata meets these, not the daemon's memory."""
        ranks = self._index.all_ranks()
        old = self._index.rank(replaced) if replaced is not None else None
        n = len(ranks) - (old is not None)
        if n >= self.max_ranks:
            self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="too_many_ranks")
            exc = LimitExceeded(f"{n} ranks are registered, this daemon's limit (--max-ranks); {req.rank.label} "
                                "refused", rank=req.rank.label, field="rank")
            exc.code = "too_many_ranks"  # type: ignore[attr-defined]
            raise exc
        held = sum(len(r.engine_metadata) for r in ranks) - (len(old.engine_metadata) if old is not None else 0)
        if held + len(req.engine_metadata) > self.max_metadata_chars:
            self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="too_much_metadata")
            exc = LimitExceeded(f"{req.rank.label}'s engine_metadata ({len(req.engine_metadata)} characters) would "
                                f"take the daemon's total over {self.max_metadata_chars} (--max-metadata-chars; "
                                f"{held} held)", rank=req.rank.label, field="engine_metadata")
            exc.code = "too_much_metadata"  # type: ignore[attr-defined]
            raise exc

    def _check_limits(self, ident: RankIdentity, *, replacing: bool = False) -> None:
        """A new instance: its size and the number of instances stay under the daemon's limits."""
        n = ident.topology.num_ranks
        if n > self.max_ranks_per_instance:
            self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="too_many_ranks")
            exc = LimitExceeded(f"instance {ident.instance!r} is {ident.topology.shape} = {n} ranks, over this daemon's "
                                f"limit of {self.max_ranks_per_instance} ranks per instance (--max-ranks-per-instance)",
                                rank=ident.label, field="rank")
            exc.code = "too_many_ranks"  # type: ignore[attr-defined]
            raise exc
        live = len(self._index.instances) - (1 if replacing else 0)  # an instance restarting its only rank
        if live >= self.max_instances:
            self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="too_many_instances")
            exc = LimitExceeded(f"{live} instances are registered, this daemon's limit "
                                f"(--max-instances); {ident.instance!r} refused", rank=ident.label, field="rank.instance")
            exc.code = "too_many_instances"  # type: ignore[attr-defined]
            raise exc

    def _check_same_instance(self, inst: InstanceRecord, req: RegisterRequest, fp: str) -> None:
        ident = req.rank
        tdiff = topology_diff(inst.topology, ident.topology)
        if tdiff:
            msg = f"{ident.label} reports {ident.topology.role} {ident.topology.shape}; instance is {inst.topology.role} {inst.topology.shape}"
            self._refuse("register", "topology", msg, self._registered_side(inst), self._incoming_side(ident, fp), tdiff)
            self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="topology")
            raise _topology_error(msg, tdiff, rank=ident.label, field=tdiff[0].path)
        if fp != inst.fingerprint:
            diff = diff_contracts(inst.contract, req.contract)
            msg = f"{ident.label} has contract {fp}, instance {inst.name!r} has {inst.fingerprint}: {len(diff)} field(s) differ"
            self._refuse("register", "contract", msg, self._registered_side(inst), self._incoming_side(ident, fp), diff)
            self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="mismatch")
            raise ContractMismatch(msg, diff=diff, rank=ident.label, field=diff[0].path if diff else None)

    def _check_stages(self, inst: InstanceRecord, ident: RankIdentity, fp: str, replaced: str | None) -> None:
        """Pipeline stages (``kvbridge.layout.stages``): the incoming stage's layers agree with the
        stages registered so far; refused (409, kept for diagnostics) naming both stages."""
        others = [(r.identity.label, r.identity.pp_rank, r.identity.pp_layers) for k, r in inst.ranks.items()
                  if k != replaced]
        problem = stage_layers_conflict(others, ident.pp_rank, ident.pp_layers, ident.pp_size,
                                        inst.contract.model.target_layers)
        if problem is None:
            return
        msg = f"{ident.label}: pipeline stages of instance {inst.name!r} do not tile its target layers: {problem}"
        registered = {f"pp{r.identity.pp_rank}": [r.identity.pp_layers.start, r.identity.pp_layers.end]
                      for _, r in sorted(inst.ranks.items()) if r.identity.pp_layers is not None}
        incoming = [ident.pp_layers.start, ident.pp_layers.end] if ident.pp_layers is not None else None
        diff = [FieldDiff(path="rank.pp_layers", prefill=registered, decode={f"pp{ident.pp_rank}": incoming},
                          breaks=breaks_for("rank.pp_layers"))]
        self._refuse("register", "topology", msg, self._registered_side(inst), self._incoming_side(ident, fp), diff)
        self.metrics.inc("kvbridge_bootstrap_registrations_total", outcome="topology")
        raise _topology_error(msg, diff, rank=ident.label, field="rank.pp_layers")

    def _rank(self, rank_id: str, what: str) -> RankRecord:
        rec = self._index.rank(rank_id)
        if rec is None and self.store.catch_up(rank_id=rank_id):  # registered through another replica a moment ago
            rec = self._index.rank(rank_id)
        if rec is None:
            raise self.store.unknown(rank_id, what)
        return rec

    def heartbeat(self, rank_id: str, *, lease_secret: str | None = None, admin: bool = False) -> HeartbeatResponse:
        with self._lock:
            self._expire_locked()
            try:
                rec = self._rank(rank_id, ": register again")
                check_secret(rec.secret_digest, lease_secret, admin=admin, action="heartbeat", label=rec.identity.label,
                             rank_id=rank_id)
            except UnknownInstance:
                self.metrics.inc("kvbridge_bootstrap_heartbeats_total", outcome="unknown")
                raise
            except KVBridgeError:
                self.metrics.inc("kvbridge_bootstrap_heartbeats_total", outcome="refused")
                raise
        try:
            self.store.renew(rec)  # outside the lock: a remote store's round trip must not hold up look-ups
        except UnknownInstance:
            self.metrics.inc("kvbridge_bootstrap_heartbeats_total", outcome="unknown")
            raise
        except KVBridgeError:
            self.metrics.inc("kvbridge_bootstrap_heartbeats_total", outcome="unavailable")
            raise
        self.metrics.inc("kvbridge_bootstrap_heartbeats_total", outcome="ok")
        return HeartbeatResponse(rank_id=rank_id, lease_ttl_s=rec.lease_ttl_s)

    def deregister(self, rank_id: str, *, lease_secret: str | None = None, admin: bool = False) -> None:
        with self._lock:
            self._expire_locked()
            rec = self._rank(rank_id, "")
            check_secret(rec.secret_digest, lease_secret, admin=admin, action="deregistration", label=rec.identity.label,
                         rank_id=rank_id)
            if not self.store.remote:
                self.store.remove_rank(rank_id)
        if self.store.remote:
            self.store.remove_rank(rank_id)
        self.metrics.inc("kvbridge_bootstrap_deregistrations_total")
        log.info("deregistered %s (%s)%s", rec.identity.label, rank_id, " by an admin" if admin and not lease_secret else "")

    # -- the handshake ----------------------------------------------------------

    def lookup(self, req: LookupRequest) -> LookupResponse:
        try:
            try:
                return self._lookup(req)
            except (UnknownInstance, InstanceIncomplete):
                # A shared store's cache may lag a registration made through another replica:
                # catch up (rate-limited by the store) and answer once more.
                if not self.store.catch_up(instance=req.prefill_instance):
                    raise
                return self._lookup(req)
        except ContractMismatch:
            self.metrics.inc("kvbridge_bootstrap_lookups_total", outcome="mismatch")
            raise
        except InstanceIncomplete:
            self.metrics.inc("kvbridge_bootstrap_lookups_total", outcome="incomplete")
            raise
        except UnknownInstance:
            self.metrics.inc("kvbridge_bootstrap_lookups_total", outcome="unknown")
            raise
        except TopologyError:
            self.metrics.inc("kvbridge_bootstrap_lookups_total", outcome="topology")
            raise
        except BootstrapUnavailable:
            self.metrics.inc("kvbridge_bootstrap_lookups_total", outcome="unavailable")
            raise

    def _lookup(self, req: LookupRequest) -> LookupResponse:
        who = req.rank.label
        fp = fingerprint(req.contract)
        # A store that lost its quorum may have missed changes: new look-ups wait for it
        # (decode ranks keep using the topology they cached).
        self.store.check_available(f"look-up of room {req.room} on {req.prefill_instance!r}", room=req.room, rank=who)
        with self._lock:
            self._expire_locked()
            inst = self._index.instances.get(req.prefill_instance)
            if inst is None:
                raise UnknownInstance(f"no prefill instance {req.prefill_instance!r} is registered", rank=who, field="prefill_instance")
            if inst.topology.role != "prefill":
                raise UnknownInstance(f"instance {inst.name!r} is a {inst.topology.role} instance, not prefill", rank=who, field="prefill_instance")
            topo = inst.topology
            dp = req.dp_rank if req.dp_rank is not None else req.room % topo.dp_size
            if fp != inst.fingerprint:
                diff = diff_contracts(inst.contract, req.contract)
                msg = (f"decode {who} (contract {fp}) and prefill {inst.name!r} (contract {inst.fingerprint}) "
                       f"disagree on {len(diff)} field(s): {', '.join(d.path for d in diff[:5])}")
                left = MismatchSide(label="prefill", instance=inst.name, role="prefill", rank=f"{inst.name}/dp{dp}", fingerprint=inst.fingerprint)
                right = MismatchSide(label="decode", instance=req.rank.instance, role=req.rank.role, rank=who, fingerprint=fp)
                self._refuse("lookup", "contract", msg, left, right, diff)
                raise ContractMismatch(msg, diff=diff, room=req.room, rank=who, field=diff[0].path if diff else None)
            if dp >= topo.dp_size:
                raise TopologyError(f"dp_rank {dp} is outside prefill {inst.name!r}'s dp_size {topo.dp_size}", room=req.room, rank=who, field="dp_rank")
            # the senders this decode rank needs: its TP route through the prefill TP group; decode
            # tp rank 0 also every rank its instance's other TP ranks draw from, where it hands the
            # room's ticket on (one decision per room, transfer/prefill/tickets.py)
            tps = range(req.rank.tp_size) if req.rank.tp_rank == 0 else (req.rank.tp_rank,)
            coords = sorted({c for j in tps for c in sender_coords(topo, dp, inst.contract, (req.rank.tp_size, j))})
            missing = inst.missing(dp, coords)
            if missing:
                raise InstanceIncomplete(
                    f"prefill {inst.name!r} DP group {dp} lacks {len(missing)} sender rank(s): {', '.join(missing[:8])}"
                    + (" ..." if len(missing) > 8 else ""),
                    missing=missing,
                    room=req.room,
                    rank=who,
                )
            senders = [inst.ranks[inst.by_coords[c]] for c in coords]
        self.metrics.inc("kvbridge_bootstrap_lookups_total", outcome="ok")
        return LookupResponse(
            instance=inst.name,
            room=req.room,
            dp_rank=dp,
            topology=topo,
            fingerprint=inst.fingerprint,
            plan=OwnerLanePlan(cp_size=topo.cp_size, rule=inst.contract.cp_rule),
            ranks=[r.sender() for r in senders],
        )

    # -- diagnostics ------------------------------------------------------------

    def _registered_side(self, inst: InstanceRecord) -> MismatchSide:
        first = next(iter(inst.ranks.values()), None)
        rank = first.identity.label if first else inst.name
        return MismatchSide(label="registered", instance=inst.name, role=inst.topology.role, rank=rank, fingerprint=inst.fingerprint)

    @staticmethod
    def _incoming_side(ident: RankIdentity, fp: str) -> MismatchSide:
        return MismatchSide(label="incoming", instance=ident.instance, role=ident.role, rank=ident.label, fingerprint=fp)

    def _refuse(self, kind: Literal["lookup", "register"], reason: Literal["contract", "topology"], message: str,
                left: MismatchSide, right: MismatchSide, diff: list[FieldDiff]) -> None:
        rec = MismatchRecord(time=self._wall(), kind=kind, reason=reason, message=message, left=left, right=right, diff=diff)
        self.metrics.inc("kvbridge_bootstrap_mismatches_total", kind=kind, reason=reason)
        for field in sorted({".".join(d.path.split(".")[:2]) for d in diff[:32]}):  # bounded label values
            self.metrics.inc("kvbridge_bootstrap_contract_refusals_total", kind=kind, field=field)
        log.warning("refused (%s, %s): %s", kind, reason, message)
        try:
            self.store.add_refusal(rec)
        except BootstrapUnavailable as exc:  # the refusal itself still answers 409; only its record is lost
            log.warning("refusal not kept in the store: %s", exc)

    def mismatches(self, limit: int | None = None) -> list[MismatchRecord]:
        """Recent refusals, newest first."""
        return self.store.refusals(limit)

    def rank(self, rank_id: str) -> RankDetail:
        """One registered rank with its buffers; UnknownInstance (404) once its lease is gone."""
        with self._lock:
            self._expire_locked()
            name = self._index.rank_instance.get(rank_id)
            if name is None:
                raise UnknownInstance(f"no rank {rank_id!r} is registered (never, or its lease expired)", field="rank_id")
            inst = self._index.instances[name]
            r = inst.ranks[rank_id]
            return RankDetail(rank_id=rank_id, rank=r.identity, fingerprint=inst.fingerprint,
                              control_endpoint=r.control_endpoint, session_id=r.session_id, pools=r.pools, aux=r.aux,
                              aux_regions=r.aux_regions, lease_ttl_s=r.lease_ttl_s,
                              lease_remaining_s=round(max(0.0, r.expires_at - self._clock()), 3), scratch=r.scratch,
                              staging=r.staging, proof_key=r.proof_key,
                              engine_metadata=r.engine_metadata)

    def instances(self) -> list[InstanceView]:
        now = self._clock()
        with self._lock:
            self._expire_locked()
            return [inst.view(now) for _, inst in sorted(self._index.instances.items())]

    def instance(self, name: str) -> InstanceView:
        now = self._clock()
        with self._lock:
            self._expire_locked()
            inst = self._index.instances.get(name)
            if inst is None:
                raise UnknownInstance(f"no instance {name!r} is registered", field="instance")
            return inst.view(now)

    def fingerprints(self) -> list[InstanceFingerprint]:
        with self._lock:
            self._expire_locked()
            return [inst.fingerprint_view() for _, inst in sorted(self._index.instances.items())]

    def gauges(self, replica: str = "") -> dict[str, list[tuple[dict[str, str], float]]]:
        """Live numbers for /metrics."""
        h = self.store.health()
        who = {"kind": h.kind, "replica": replica}
        store = {
            "kvbridge_bootstrap_store_up": [(who, 1.0 if h.ok else 0.0)],
            "kvbridge_bootstrap_store_requests": [(who, float(h.requests))],
            "kvbridge_bootstrap_store_watch_restarts": [(who, float(h.watch_restarts))],
            "kvbridge_bootstrap_replicas": [({"replica": replica}, float(max(1, len(self.store.replicas()))))],
        }
        with self._lock:
            self._expire_locked()
            ranks = {"prefill": 0, "decode": 0}
            insts: dict[tuple[str, str], int] = {}
            for inst in self._index.instances.values():
                ranks[inst.topology.role] += len(inst.ranks)
                key = (inst.topology.role, "true" if inst.complete else "false")
                insts[key] = insts.get(key, 0) + 1
        return {
            "kvbridge_bootstrap_registered_ranks": [({"role": r}, n) for r, n in sorted(ranks.items())],
            "kvbridge_bootstrap_instances": [({"role": r, "complete": c}, n) for (r, c), n in sorted(insts.items())],
            **store,
        }

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index.instances), len(self._index.rank_instance)
