"""``EtcdStore``: the registry's state in an etcd v3 cluster, so any number of daemon
replicas serve one cluster and a dead rank vanishes with no daemon running.

Keys (under ``prefix``, ``/kvbridge/`` by default):

    ranks/<rank_id>                           the rank's record, its instance's topology,
                                              contract and fingerprint, the SHA-256 of its
                                              lease secret                  [rank's lease]
    coords/<instance>/<dp>.<cp>.<tp>.<pp>     the rank id holding these coordinates
                                                                            [rank's lease]
    claims/<session digest>/<rank_id>         the transport session and address ranges the
                                              rank holds (claims.py)        [rank's lease]
    lapse/<session digest>/<rank_id>          the same claim with the rank's proof key: once
                                              the rank's lease is gone it is a lapsed claim,
                                              its owner's key's for the grace (lapses.py)
                                                     [grace lease: TTL + grace, kept alive with
                                                      the rank's by every heartbeat]
    refusals/<time ns>-<random>               a refusal with its field diff (bounded: the
                                              oldest are deleted past max_refusals)
    replicas/<name>                           a daemon replica, rewritten every health tick
                                                                         [replica's lease]

Every rank has its own etcd lease with the rank's TTL: a heartbeat (to any replica) is
a lease keep-alive, and etcd deletes both keys when the lease runs out. A registration is
one transaction that puts its keys only if the coordinates are free (or still held by the
rank being replaced) and no key under its session's ``claims/`` prefix changed since it read
them and found no conflict (an etcd compare over the prefix: every key's mod revision below
the read's). So two replicas cannot both win one rank's coordinates, nor two conflicting
claims on one session; claims vanish with their rank's lease, and a daemon restart reads them
back from etcd.

The cache: a snapshot of the prefix (one range read at revision R), then a watch from
R + 1 applies every put and delete to the ``RankIndex`` that look-ups read, so a look-up
costs no etcd request. Each replica rewrites its own key every health tick; when the
store answers but this watch has seen nothing for a few ticks, the watch is dead
(its member went away) and the cache is reloaded from a fresh snapshot.

Health: the tick's write doubles as the quorum probe. When it fails on every endpoint
(quorum lost, members down), the store is unavailable: registrations, heartbeats and
new look-ups answer 503 naming the cause; views answer from the cache. The next tick that
succeeds makes it available again, with no restart. (On a new leader etcd renews every
lease to its full TTL, so ranks survive a quorum loss that outlasts their TTL.)

The client is ``etcd3gw`` (etcd's v3 JSON gateway, sync, maintained by OpenStack):
it does leases, prefix watches and transactions, needs no gRPC stack, and its blocking
calls suit the registry, which the daemon runs off its event loop. It talks to one
member per client: ``_Members`` keeps one per endpoint and moves to the next when one
fails.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from kvbridge.bootstrap.claims import Claim, claim_held, find_conflict
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.lapses import DEFAULT_CLAIM_GRACE_S, Lapsed, check_lapsed
from kvbridge.bootstrap.mismatches import MismatchLog
from kvbridge.bootstrap.records import InstanceRecord, RankRecord
from kvbridge.bootstrap.schemas import MismatchRecord, RankIdentity, ScratchDescriptor, StagingDescriptor
from kvbridge.bootstrap.store import (
    EtcdOptions,
    RegistryStore,
    ReplicaView,
    StoreHealth,
    StoreUnavailable,
)
from kvbridge.bootstrap.topology import AuxDescriptor, AuxRegionDescriptor, PoolDescriptor, Topology
from kvbridge.errors import LeaseHeld

__all__ = ["EtcdStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_STALE_TICKS = 3  # a watch that saw none of our own tick writes for this many ticks is dead
CATCH_UP_INTERVAL_S = 1.0  # a miss reads its key from etcd at most this often


class StoredRank(BaseModel):
    """A rank as kept under ``ranks/<id>``: enough to rebuild its ``RankRecord`` and
    its instance's record on any replica."""

    model_config = ConfigDict(extra="forbid")

    rank_id: str
    identity: RankIdentity
    control_endpoint: str
    session_id: str
    pools: list[PoolDescriptor]
    aux: AuxDescriptor | None = None
    aux_regions: list[AuxRegionDescriptor] = []
    scratch: ScratchDescriptor | None = None
    staging: StagingDescriptor | None = None
    proof_key: str | None = None
    engine_metadata: str = ""
    lease_ttl_s: float
    lease_id: int
    grace_lease_id: int = 0
    secret_sha256: str  # hex; the secret itself is never stored
    topology: Topology
    contract: RuntimeContract
    fingerprint: str

    @classmethod
    def of(cls, inst: InstanceRecord, rec: RankRecord) -> StoredRank:
        return cls(rank_id=rec.rank_id, identity=rec.identity, control_endpoint=rec.control_endpoint,
                   session_id=rec.session_id, pools=rec.pools, aux=rec.aux, aux_regions=rec.aux_regions,
                   scratch=rec.scratch, staging=rec.staging, proof_key=rec.proof_key,
                   engine_metadata=rec.engine_metadata, lease_ttl_s=rec.lease_ttl_s, lease_id=rec.lease_id,
                   grace_lease_id=rec.grace_lease_id,
                   secret_sha256=rec.secret_digest.hex(), topology=inst.topology, contract=inst.contract,
                   fingerprint=inst.fingerprint)

    def records(self, now: float) -> tuple[InstanceRecord, RankRecord]:
        inst = InstanceRecord(self.identity.instance, self.topology, self.contract, self.fingerprint)
        rec = RankRecord(rank_id=self.rank_id, identity=self.identity, control_endpoint=self.control_endpoint,
                         session_id=self.session_id, pools=list(self.pools), aux=self.aux,
                         lease_ttl_s=self.lease_ttl_s, expires_at=now + self.lease_ttl_s,
                         secret_digest=bytes.fromhex(self.secret_sha256), scratch=self.scratch,
                         aux_regions=list(self.aux_regions), lease_id=self.lease_id, staging=self.staging,
                         proof_key=self.proof_key, engine_metadata=self.engine_metadata,
                         grace_lease_id=self.grace_lease_id)
        return inst, rec


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class _Members:
    """One ``etcd3gw`` client per endpoint; a call goes to the current one and moves on
    to the next when a member is down, slow or leaderless. All failing: StoreUnavailable."""

    def __init__(self, options: EtcdOptions, on_down: Callable[[str], None] = lambda cause: None) -> None:
        import etcd3gw  # the client is imported only by the etcd store
        from etcd3gw import exceptions as etcd_exc

        self._opts = options
        self._on_down = on_down
        self._errors: tuple[type[BaseException], ...] = (etcd_exc.Etcd3Exception,)
        self._clients = [
            etcd3gw.Etcd3Client(host=h, port=p, protocol="https" if options.tls else "http",
                                ca_cert=options.ca_cert, cert_cert=options.cert, cert_key=options.key,
                                timeout=options.timeout_s, api_path="/v3/")
            for h, p in options.endpoints
        ]
        self._current = 0
        self._lock = threading.Lock()
        self.requests = 0
        self._authed: set[int] = set()

    @property
    def where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self._opts.endpoints)

    def _authenticate(self, i: int) -> None:
        if self._opts.user is None or i in self._authed:
            return
        c = self._clients[i]
        answer = c.post(c.get_url("/auth/authenticate"), json={"name": self._opts.user, "password": self._opts.password})
        c.session.headers["Authorization"] = answer["token"]
        self._authed.add(i)

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        with self._lock:
            first = self._current
        last: BaseException | None = None
        n = len(self._clients)
        deadline = time.monotonic() + self._opts.failover_window_s
        k = 0
        refused = 0  # members of this round that refused the connection: nothing listens there
        while k < n or time.monotonic() < deadline:  # every member once, then rounds until the window closes
            if k and k % n == 0:
                if refused == n:
                    break  # no member listens at all: no election to wait for
                refused = 0
                time.sleep(0.2)  # a round failed: an election may be under way
            i = (first + k) % n
            k += 1
            try:
                self.requests += 1
                self._authenticate(i)
                out = fn(self._clients[i])
            except self._errors as exc:
                last = exc
                refused += "refused" in str(getattr(exc, "detail_text", "") or exc).lower()
                if "auth" in str(getattr(exc, "detail_text", "") or exc).lower():
                    self._authed.discard(i)  # an expired token: authenticate again next time
                log.debug("etcd %s at %s:%d failed: %s", what, *self._opts.endpoints[i], exc)
                continue
            if i != first:
                with self._lock:
                    self._current = i
            return out
        text = str(getattr(last, "detail_text", "") or last).strip()
        detail = f"{type(last).__name__}: {text}" if text else type(last).__name__
        exc = StoreUnavailable(f"etcd cluster {self.where} did not complete {what} on any member "
                               f"(quorum lost or members unreachable): {detail[:300]}")
        self._on_down(str(exc))
        raise exc

    def client(self) -> Any:
        with self._lock:
            return self._clients[self._current]


class EtcdStore(RegistryStore):
    kind = "etcd"
    remote = True

    def __init__(self, options: EtcdOptions, *, max_refusals: int = 100, replica: str = "", url: str = "",
                 clock: Callable[[], float] = time.monotonic, claim_grace_s: float = DEFAULT_CLAIM_GRACE_S) -> None:
        super().__init__()
        self.claim_grace_s = claim_grace_s
        self.options = options
        self.prefix = options.prefix
        self.clock = clock
        self.replica = replica or f"replica-{secrets.token_hex(3)}"
        self.url = url
        self.started = time.time()
        # A failed request marks the store down at once; only the health tick marks it up again
        # (after reloading the cache, which may have missed changes meanwhile).
        self._members = _Members(options, on_down=lambda cause: self._set_health(False, cause))
        self._refusals = MismatchLog(max_refusals)
        self._refusal_keys: list[str] = []  # oldest first, for trimming
        self._replicas: dict[str, tuple[dict[str, Any], float]] = {}  # name -> (value, seen at, monotonic)
        self._health = StoreHealth(kind="etcd", ok=True, endpoints=options.urls)
        self._stop = threading.Event()
        self._replica_lease: Any = None
        self._watch_cancel: Callable[[], None] | None = None
        self._watch_thread: threading.Thread | None = None
        self._tick_thread: threading.Thread | None = None
        self._last_event = clock()
        self._caught_up: dict[str, float] = {}  # catch-up key -> when (bounded)
        self._generation = 0  # bumped on every reload: events of an older watch are ignored

    # -- keys --------------------------------------------------------------------

    def _rank_key(self, rank_id: str) -> str:
        return f"{self.prefix}ranks/{rank_id}"

    def _claims_prefix(self, claim: Claim) -> str:
        return f"{self.prefix}claims/{claim.digest}/"

    def _lapse_prefix(self, claim: Claim) -> str:
        return f"{self.prefix}lapse/{claim.digest}/"

    def _coords_key(self, ident: RankIdentity) -> str:
        return f"{self.prefix}coords/{ident.instance}/{ident.dp_rank}.{ident.cp_rank}.{ident.tp_rank}.{ident.pp_rank}"

    # -- life --------------------------------------------------------------------

    def start(self) -> None:
        """Load the cache and start the watch and the health tick; StoreUnavailable
        (naming the endpoints) when no member answers."""
        self._tick_once()
        if not self._health.ok:
            raise StoreUnavailable(f"cannot start on etcd: {self._health.cause}")
        self._reload()
        self._tick_thread = threading.Thread(target=self._tick_loop, name="etcd-health", daemon=True)
        self._tick_thread.start()

    def close(self) -> None:
        self._stop.set()
        self._cancel_watch()
        for t in (self._tick_thread, self._watch_thread):
            if t is not None and t.is_alive():
                t.join(5.0)
        if self._replica_lease is not None:
            try:
                self._members.call("revoke of the replica lease", lambda c: c.post(
                    c.get_url("/kv/lease/revoke"), json={"ID": self._replica_lease}))
            except StoreUnavailable as exc:
                log.info("replica key left to its lease: %s", exc)

    # -- writes ------------------------------------------------------------------

    def _grant(self, ttl_s: float) -> int:
        ttl = max(1, math.ceil(ttl_s))
        return int(self._members.call("lease grant", lambda c: c.lease(ttl)).id)

    def _revoke(self, lease_id: int) -> None:
        try:
            self._members.call("lease revoke", lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease_id}))
        except StoreUnavailable as exc:
            log.info("lease %x left to expire: %s", lease_id, exc)

    def _read_claims(self, claim: Claim, label: str) -> tuple[int, list[Claim], list[Lapsed]]:
        """The live and the lapsed claims (lapses.py) in ``claim``'s session, as etcd has them now,
        and the revision read (one transaction: one revision)."""
        cp, lp = self._claims_prefix(claim), self._lapse_prefix(claim)
        txn = {"compare": [], "success": [{"request_range": {"key": _b64(cp), "range_end": _b64(_prefix_end(cp))}},
                                          {"request_range": {"key": _b64(lp), "range_end": _b64(_prefix_end(lp))}}],
               "failure": []}
        answer = self._members.call(f"claims read of {label}", lambda c: c.transaction(txn))
        responses = answer.get("responses", [{}, {}])
        held: list[Claim] = []
        lapsed: list[Lapsed] = []
        for i, out in enumerate(responses[:2]):
            for kv in out.get("response_range", {}).get("kvs", []):
                try:
                    value = _unb64(kv.get("value", ""))
                    if i == 0:
                        held.append(Claim.from_json(value))
                    else:
                        lapsed.append(Lapsed.from_json(value))
                except (ValueError, KeyError) as exc:
                    log.warning("etcd key %s holds no valid claim: %s", _unb64(kv["key"]).decode(errors="replace"), exc)
        live = {c.rank_id for c in held}
        # a lapse key outlives its rank's lease by the grace: while the rank is live it is no lapse;
        # etcd deletes it when the grace ends, so what is left is within it
        until = time.time() + self.claim_grace_s
        lapsed = [Lapsed(x.claim, x.proof_key, until) for x in lapsed if x.claim.rank_id not in live]
        return int(answer["header"]["revision"]), held, lapsed

    def _revoke_both(self, rec: RankRecord) -> None:
        self._revoke(rec.lease_id)
        if rec.grace_lease_id:
            self._revoke(rec.grace_lease_id)

    def add_rank(self, inst: InstanceRecord, rec: RankRecord, replaces: str | None, *, retaken: tuple[str, ...] = (),
                 proven: bool = False) -> None:
        label = rec.identity.label
        claim = rec.claim()
        cp, lp = self._claims_prefix(claim), self._lapse_prefix(claim)
        rec.lease_id = self._grant(rec.lease_ttl_s)
        rec.grace_lease_id = self._grant(rec.lease_ttl_s + self.claim_grace_s)
        ck, rk = self._coords_key(rec.identity), self._rank_key(rec.rank_id)
        value = StoredRank.of(inst, rec).model_dump_json()
        lapse = Lapsed(claim, rec.proof_key, 0.0).to_json()
        puts = [{"request_put": {"key": _b64(rk), "value": _b64(value), "lease": rec.lease_id}},
                {"request_put": {"key": _b64(ck), "value": _b64(rec.rank_id), "lease": rec.lease_id}},
                {"request_put": {"key": _b64(cp + rec.rank_id), "value": _b64(claim.to_json()), "lease": rec.lease_id}},
                {"request_put": {"key": _b64(lp + rec.rank_id), "value": _b64(lapse), "lease": rec.grace_lease_id}}]
        expect = replaces
        with self.lock:
            replaced = self.index.rank(replaces) if replaces is not None else None
        old_claim_key = f"{self._claims_prefix(replaced.claim())}{replaces}" if replaced is not None else None
        old_lapse_key = f"{self._lapse_prefix(replaced.claim())}{replaces}" if replaced is not None else None
        for _ in range(8):  # each retry follows a concurrent change of this session's claims
            revision, held, lapsed = self._read_claims(claim, label)
            conflict = find_conflict(held, claim, exclude=(replaces, rec.rank_id))
            back: list[str] = []
            if conflict is None:
                lapsed = [x for x in lapsed if x.claim.rank_id not in (replaces, rec.rank_id)]
                conflict, back = check_lapsed(lapsed, claim, proof_key=rec.proof_key, proven=proven, now=time.time())
            if conflict is not None:
                self._revoke_both(rec)
                raise claim_held(label, *conflict)
            take_back = [{"request_delete_range": {"key": _b64(lp + r)}} for r in back]  # its owner's own
            # nothing under the session's claims prefix changed since the read (a new key's
            # mod revision would be above it; a deleted one frees, never conflicts)
            claims_unchanged = {"key": _b64(cp), "range_end": _b64(_prefix_end(cp)), "result": "LESS", "target": "MOD",
                                "mod_revision": revision + 1}
            if expect is None:
                compare = [{"key": _b64(ck), "result": "EQUAL", "target": "CREATE", "create_revision": 0}]
                ops = [*puts, *take_back]
            else:
                compare = [{"key": _b64(ck), "result": "EQUAL", "target": "VALUE", "value": _b64(expect)}]
                ops = [*puts, *take_back, {"request_delete_range": {"key": _b64(self._rank_key(expect))}}]
                if old_claim_key is not None and old_claim_key != cp + rec.rank_id:
                    ops.append({"request_delete_range": {"key": _b64(old_claim_key)}})  # its session is free at once
                if old_lapse_key is not None and old_lapse_key != lp + rec.rank_id:
                    # and no lapsed claim is left on it: the owner moved, it did not lapse
                    ops.append({"request_delete_range": {"key": _b64(old_lapse_key)}})
            txn = {"compare": [*compare, claims_unchanged], "success": ops,
                   "failure": [{"request_range": {"key": _b64(ck)}}]}
            answer = self._members.call(f"registration of {label}", lambda c: c.transaction(txn))
            if answer.get("succeeded"):
                break
            kvs = answer.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
            holder = _unb64(kvs[0]["value"]).decode() if kvs and kvs[0].get("value") else None
            if holder is None and expect is not None:
                expect = None  # the rank being replaced expired meanwhile: the coordinates are free
                continue
            if holder == expect:
                continue  # the coordinates are as expected: the session's claims changed; read them again
            self._revoke_both(rec)
            with self.lock:
                held_rank = self.index.rank(holder) if holder else None
            remaining = max(0.0, held_rank.expires_at - self.clock()) if held_rank else rec.lease_ttl_s
            raise LeaseHeld(f"{label} is held by live rank {holder} (registered through another "
                            f"replica): register with its lease secret, wait for its lease to run out, or use the "
                            f"admin token", retry_after=remaining, rank=label, field="rank")
        else:
            self._revoke_both(rec)
            raise StoreUnavailable(f"registration of {label}: etcd transaction did not settle (the session's "
                                   f"claims kept changing)")
        if replaces is not None:
            with self.lock:  # the record read before the transaction: the watch may have dropped it since
                old = self.index.rank(replaces) or replaced
            if old is not None and old.lease_id:
                self._revoke_both(old)  # its keys are gone or moved to the new lease: nothing else on them
        rec.expires_at = self.clock() + rec.lease_ttl_s
        with self.lock:
            if replaces is not None:
                self.index.drop(replaces)
            self.index.put(inst, rec)

    def renew(self, rec: RankRecord) -> None:
        ttl = self._members.call(f"lease keep-alive of {rec.identity.label}", lambda c: int(
            c.post(c.get_url("/lease/keepalive"), json={"ID": rec.lease_id}).get("result", {}).get("TTL", -1)))
        if ttl <= 0:
            with self.lock:
                self.index.drop(rec.rank_id)
            raise self.unknown(rec.rank_id, ": its etcd lease ran out; register again")
        if rec.grace_lease_id:  # its lapsed claim outlives the rank's lease by the grace, counted from now
            grace = rec.grace_lease_id
            self._members.call(f"claim keep-alive of {rec.identity.label}", lambda c: c.post(
                c.get_url("/lease/keepalive"), json={"ID": grace}))
        rec.expires_at = self.clock() + rec.lease_ttl_s

    def remove_rank(self, rank_id: str) -> None:
        with self.lock:
            rec = self.index.rank(rank_id)
        if rec is None:
            return
        self._members.call(f"deregistration of {rec.identity.label}", lambda c: c.post(
            c.get_url("/kv/lease/revoke"), json={"ID": rec.lease_id}))
        if rec.grace_lease_id:  # the owner lets go: no lapsed claim is left
            self._members.call(f"deregistration of {rec.identity.label}", lambda c: c.post(
                c.get_url("/kv/lease/revoke"), json={"ID": rec.grace_lease_id}))
        with self.lock:
            self.index.drop(rank_id)

    def expire(self, now: float) -> list[RankRecord]:
        return []  # etcd deletes a rank's keys when its lease runs out; the watch drops it here

    def add_refusal(self, rec: MismatchRecord) -> None:
        key = f"{self.prefix}refusals/{time.time_ns():020d}-{secrets.token_hex(3)}"
        self._members.call("refusal record", lambda c: c.put(key, rec.model_dump_json()))
        with self.lock:
            self._apply_refusal(key, rec)
            extra = self._refusal_keys[: max(0, len(self._refusal_keys) - self._refusals.maxlen)]
        for old in extra:  # bounded in etcd too; another replica may already have deleted it
            self._members.call("refusal trim", lambda c, k=old: c.delete(k))

    def _apply_refusal(self, key: str, rec: MismatchRecord) -> None:
        if key in self._refusal_keys:
            return
        self._refusal_keys.append(key)
        self._refusal_keys.sort()
        self._refusals.append(rec)

    def refusals(self, limit: int | None = None) -> list[MismatchRecord]:
        return self._refusals.recent(limit)

    # -- health ------------------------------------------------------------------

    def health(self) -> StoreHealth:
        self._health.requests = self._members.requests
        return self._health

    def replicas(self) -> list[ReplicaView]:
        now = self.clock()
        with self.lock:
            items = sorted(self._replicas.items())
        return [ReplicaView(name=n, url=str(v.get("url", "")), started=float(v.get("started", 0.0)),
                            seen_s_ago=round(now - seen, 3)) for n, (v, seen) in items]

    def _set_health(self, ok: bool, cause: str = "") -> None:
        h = self._health
        if ok != h.ok:
            h.since = time.time()
            (log.info if ok else log.error)("etcd store %s%s", "available again" if ok else "unavailable: ", cause)
        h.ok, h.cause = ok, cause

    def _tick_once(self) -> None:
        """Keep this replica's key (the quorum probe: a write) and its lease."""
        me = json.dumps({"name": self.replica, "url": self.url, "started": self.started, "time": time.time()})
        key = f"{self.prefix}replicas/{self.replica}"
        try:
            if self._replica_lease is None:
                ttl = 3 * self.options.health_interval_s + self.options.timeout_s
                self._replica_lease = self._grant(ttl)
            else:
                lease = self._replica_lease
                left = self._members.call("replica keep-alive", lambda c: int(
                    c.post(c.get_url("/lease/keepalive"), json={"ID": lease}).get("result", {}).get("TTL", -1)))
                if left <= 0:
                    self._replica_lease = self._grant(3 * self.options.health_interval_s + self.options.timeout_s)
            lease = self._replica_lease
            self._members.call("health probe", lambda c: c.post(
                c.get_url("/kv/put"), json={"key": _b64(key), "value": _b64(me), "lease": lease}))
        except StoreUnavailable as exc:
            self._set_health(False, str(exc))
            return
        self._set_health(True)

    def _tick_loop(self) -> None:
        interval = self.options.health_interval_s
        while not self._stop.wait(interval):
            was_ok = self._health.ok
            self._tick_once()
            if not self._health.ok:
                continue
            stale = self.clock() - self._last_event > _STALE_TICKS * interval + self.options.timeout_s
            if not was_ok or stale:
                log.info("etcd watch %s: reloading the cache", "stale" if stale else "after an outage")
                try:
                    self._reload()
                except StoreUnavailable as exc:
                    self._set_health(False, str(exc))

    # -- the cache -----------------------------------------------------------------

    def catch_up(self, *, rank_id: str | None = None, instance: str | None = None) -> bool:
        """A miss (an unknown rank, an unknown or incomplete instance) may be a registration the
        watch has not delivered yet, or a watch that died with its member: read just that rank, or
        that instance's coordinates and the ranks behind them, from etcd. At most once per key per
        ``CATCH_UP_INTERVAL_S`` (bounded table), so a flood of misses for a name nobody registered
        costs etcd one small read per interval."""
        key = f"r:{rank_id}" if rank_id is not None else f"i:{instance}"
        now = self.clock()
        with self.lock:
            if not self._health.ok or now - self._caught_up.get(key, -CATCH_UP_INTERVAL_S) < CATCH_UP_INTERVAL_S:
                return False
            self._caught_up[key] = now
            while len(self._caught_up) > 4096:
                self._caught_up.pop(next(iter(self._caught_up)))
        try:
            if rank_id is not None:
                ids = [rank_id]
            else:
                coords = self._members.call("catch-up read", lambda c: c.get_prefix(f"{self.prefix}coords/{instance}/"))
                ids = [value.decode() for value, _meta in coords]  # get_prefix answers (value, metadata)
            with self.lock:
                ids = [i for i in ids if self.index.rank(i) is None]
            found = False
            for i in ids:
                values = self._members.call("catch-up read", lambda c, k=self._rank_key(i): c.get(k))
                if values:
                    with self.lock:
                        self._apply(self._rank_key(i), values[0], deleted=False)
                    found = True
            return found
        except StoreUnavailable:
            return False

    def _reload(self) -> None:
        """Snapshot the prefix at one revision, replace the cache, watch from the next."""
        end = _prefix_end(self.prefix)
        txn = {"compare": [], "success": [{"request_range": {"key": _b64(self.prefix), "range_end": _b64(end)}}],
               "failure": []}
        answer = self._members.call("cache snapshot", lambda c: c.transaction(txn))
        revision = int(answer["header"]["revision"])
        kvs = answer.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        self._cancel_watch()
        with self.lock:
            self._generation += 1
            self.index.clear()
            self._refusal_keys.clear()
            self._refusals.replace([])
            self._replicas.clear()
            for kv in kvs:
                self._apply(_unb64(kv["key"]).decode(), _unb64(kv.get("value", "")), deleted=False)
            self._last_event = self.clock()
            generation = self._generation
        if generation > 1:
            self._health.watch_restarts += 1
        self._start_watch(revision + 1, generation)

    def _start_watch(self, revision: int, generation: int) -> None:
        client = self._members.client()
        events, cancel = client.watch_prefix(self.prefix, start_revision=revision)
        self._watch_cancel = cancel
        self._watch_thread = threading.Thread(target=self._watch_loop, args=(events, generation), name="etcd-watch",
                                              daemon=True)
        self._watch_thread.start()

    def _cancel_watch(self) -> None:
        cancel, self._watch_cancel = self._watch_cancel, None
        if cancel is not None:
            try:
                cancel()
            except OSError as exc:  # the stream's socket is already gone
                log.debug("watch cancel: %s", exc)

    def _watch_loop(self, events: Iterator[dict[str, Any]], generation: int) -> None:
        for ev in events:
            kv = ev.get("kv", {})
            key = kv.get("key", b"")
            with self.lock:
                if generation != self._generation:
                    return
                self._last_event = self.clock()
                self._apply(key.decode() if isinstance(key, bytes) else str(key), kv.get("value", b"") or b"",
                            deleted=ev.get("type") == "DELETE")

    def _apply(self, key: str, value: bytes, *, deleted: bool) -> None:
        """One key's state into the cache (the caller holds ``lock``)."""
        rel = key[len(self.prefix):]
        kind, _, name = rel.partition("/")
        try:
            if kind == "ranks":
                if deleted:
                    self.index.drop(name)
                    return
                known = self.index.rank(name)
                if known is None:
                    inst, rec = StoredRank.model_validate_json(value).records(self.clock())
                    self.index.put(inst, rec)
            elif kind == "refusals":
                if deleted:
                    if key in self._refusal_keys:
                        self._refusal_keys.remove(key)
                    return
                self._apply_refusal(key, MismatchRecord.model_validate_json(value))
            elif kind == "replicas":
                if deleted:
                    self._replicas.pop(name, None)
                else:
                    self._replicas[name] = (json.loads(value), self.clock())
        except ValueError as exc:  # a value another program wrote under our prefix: skip it, say so
            log.warning("etcd key %s holds no valid kvbridge record: %s", key, exc)
