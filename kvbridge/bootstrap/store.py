"""Where the daemon's state lives: the ``RegistryStore`` interface, the index every
store answers reads from, and the etcd options (``--store etcd://...``). The daemon
picks its store in ``app.make_store`` (the etcd one imported only there).

    Registry (registry.py)        the rules, written once: lease secrets, caps, contract
         │                        checks, field diffs, the 409/503/404 answers
         ▼
    RegistryStore                 add_rank / renew / remove_rank / expire / add_refusal
     ├── MemoryStore              one process; the embedded default (store_memory.py)
     └── EtcdStore                etcd v3: leases with TTLs, a watched cache, any number of
                                  daemon replicas on one cluster (store_etcd.py)

Reads (look-ups, views, diagnostics) are answered from ``RankIndex``, an in-memory
index of instances and their ranks: the store's whole state for ``MemoryStore``, the
watched cache for ``EtcdStore``. The registry checks its rules under ``store.lock``;
an in-memory store's write follows under the same lock, a remote store's after it is
released (its round trips must not stall look-ups): that store makes the write itself
conditional (an etcd transaction), so two writers, in one replica or in two, cannot
both win one rank's coordinates.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from kvbridge.bootstrap.claims import Claim
from kvbridge.bootstrap.lapses import Lapsed
from kvbridge.bootstrap.records import InstanceRecord, RankRecord
from kvbridge.bootstrap.schemas import MismatchRecord
from kvbridge.errors import BootstrapUnavailable, ConfigError, UnknownInstance

__all__ = [
    "StoreUnavailable",
    "StoreHealth",
    "ReplicaView",
    "RankIndex",
    "RegistryStore",
    "EtcdOptions",
    "parse_store_url",
]


class StoreUnavailable(BootstrapUnavailable):
    """The daemon's store cannot take writes or answer new look-ups now (503
    ``store_unavailable``); the message names the cause (etcd quorum lost, members
    unreachable). Cached state keeps serving what it safely can."""


@dataclass(frozen=True)
class ReplicaView:
    """A daemon replica as the store sees it (every replica announces itself)."""

    name: str
    url: str
    started: float
    seen_s_ago: float


@dataclass
class StoreHealth:
    kind: Literal["memory", "etcd"]
    ok: bool = True
    cause: str = ""  # why not ok, for a person
    since: float = field(default_factory=time.time)  # wall time of the last change of ``ok``
    endpoints: tuple[str, ...] = ()
    requests: int = 0  # requests this replica made to the store since it started
    watch_restarts: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "ok": self.ok, "cause": self.cause, "since": self.since,
                "endpoints": list(self.endpoints), "requests": self.requests,
                "watch_restarts": self.watch_restarts}


class RankIndex:
    """Instances and their ranks, indexed by rank id, coordinates and claimed transport
    session (claims.py). Not locked itself: callers hold the owning store's ``lock``."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceRecord] = {}
        self.rank_instance: dict[str, str] = {}  # rank id -> instance name
        self.sessions: dict[str, dict[str, Claim]] = {}  # claim key -> rank id -> its claim
        self.claim_keys: dict[str, str] = {}  # rank id -> its claim's key (claims.claim_session)
        # claims whose lease lapsed, held for their owner's key (lapses.py): claim key -> rank id -> it
        self.lapsed: dict[str, dict[str, Lapsed]] = {}

    def session_claims(self, session: str) -> list[Claim]:
        """The live claims in one transport session (``claims.session_key``)."""
        return list(self.sessions.get(session, {}).values())

    def lapsed_claims(self, session: str) -> list[Lapsed]:
        """The lapsed claims (lapses.py) in one claim key, still within their grace or not."""
        return list(self.lapsed.get(session, {}).values())

    def add_lapsed(self, lapsed: Lapsed) -> None:
        self.lapsed.setdefault(lapsed.claim.session, {})[lapsed.claim.rank_id] = lapsed

    def drop_lapsed(self, session: str, rank_ids: list[str]) -> None:
        held = self.lapsed.get(session, {})
        for r in rank_ids:
            held.pop(r, None)
        if not held:
            self.lapsed.pop(session, None)

    def expire_lapsed(self, now: float) -> int:
        """Forget lapsed claims whose grace ended (``now``: wall clock); returns how many."""
        n = 0
        for session in list(self.lapsed):
            gone = [r for r, x in self.lapsed[session].items() if x.until <= now]
            n += len(gone)
            self.drop_lapsed(session, gone)
        return n

    def all_lapsed(self) -> list[Lapsed]:
        return [x for held in self.lapsed.values() for x in held.values()]

    def rank(self, rank_id: str) -> RankRecord | None:
        name = self.rank_instance.get(rank_id)
        return None if name is None else self.instances[name].ranks.get(rank_id)

    def put(self, inst: InstanceRecord, rec: RankRecord) -> None:
        """Add ``rec`` to ``inst`` (kept as the instance's record when the name is new);
        a rank that held the same coordinates leaves the index."""
        held = self.instances.get(inst.name)
        if held is None:
            held = self.instances[inst.name] = InstanceRecord(inst.name, inst.topology, inst.contract, inst.fingerprint)
        old = held.by_coords.get(rec.identity.coords)
        if old is not None and old != rec.rank_id:
            self.drop(old)
            held = self.instances.setdefault(inst.name, held)
        held.ranks[rec.rank_id] = rec
        held.by_coords[rec.identity.coords] = rec.rank_id
        self.rank_instance[rec.rank_id] = inst.name
        claim = rec.claim()
        self.sessions.setdefault(claim.session, {})[rec.rank_id] = claim
        self.claim_keys[rec.rank_id] = claim.session

    def drop(self, rank_id: str) -> RankRecord | None:
        name = self.rank_instance.pop(rank_id, None)
        if name is None:
            return None
        inst = self.instances[name]
        rec = inst.ranks.pop(rank_id)
        if inst.by_coords.get(rec.identity.coords) == rank_id:
            del inst.by_coords[rec.identity.coords]
        session = self.claim_keys.pop(rank_id, "")
        claims = self.sessions.get(session, {})
        claims.pop(rank_id, None)
        if not claims:
            self.sessions.pop(session, None)
        if not inst.ranks:
            del self.instances[name]
        return rec

    def clear(self) -> None:
        self.instances.clear()
        self.rank_instance.clear()
        self.sessions.clear()
        self.claim_keys.clear()
        self.lapsed.clear()

    def all_ranks(self) -> list[RankRecord]:
        return [r for inst in self.instances.values() for r in inst.ranks.values()]


class RegistryStore(ABC):
    """The state under the registry's rules. Reads come from ``index`` (under ``lock``);
    writes go through the methods below, which may raise ``StoreUnavailable``."""

    kind: Literal["memory", "etcd"]
    remote: bool  # writes do network I/O: the daemon runs them off its event loop

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.index = RankIndex()

    # -- writes (the caller holds ``lock`` and has checked the rules) ------------

    @abstractmethod
    def add_rank(self, inst: InstanceRecord, rec: RankRecord, replaces: str | None, *, retaken: tuple[str, ...] = (),
                 proven: bool = False) -> None:
        """Store ``rec`` (of instance ``inst``), replacing rank ``replaces`` at the same
        coordinates and taking back the lapsed claims ``retaken`` (its owner's own, lapses.py;
        ``proven``: its registration carried its proof key's claim signature). ``LeaseHeld`` when
        another writer took the coordinates meanwhile, ``ClaimHeld`` when a live or lapsed claim
        it may not take holds its session or ranges (a shared store checks again itself)."""

    @abstractmethod
    def renew(self, rec: RankRecord) -> None:
        """Extend ``rec``'s lease by its TTL; ``UnknownInstance`` when the lease is gone."""

    @abstractmethod
    def remove_rank(self, rank_id: str) -> None:
        """Drop a rank now (deregistration)."""

    @abstractmethod
    def expire(self, now: float) -> list[RankRecord]:
        """Drop the ranks whose lease has passed (stores with their own lease clock drop
        nothing here: theirs vanish by themselves) and return them."""

    def lapse(self, lapsed: list[tuple[RankRecord, float]]) -> None:
        """Keep the claims of ranks whose leases lapsed for their owners, each until its time
        (wall clock; lapses.py). Stores that keep lapsed claims themselves (etcd) do nothing."""

    @abstractmethod
    def add_refusal(self, rec: MismatchRecord) -> None:
        """Keep a refusal for diagnostics (bounded)."""

    @abstractmethod
    def refusals(self, limit: int | None = None) -> list[MismatchRecord]:
        """Recent refusals, newest first."""

    # -- health ------------------------------------------------------------------

    @abstractmethod
    def health(self) -> StoreHealth: ...

    def replicas(self) -> list[ReplicaView]:
        """The daemon replicas serving from this store (one for an in-memory store)."""
        return []

    def check_available(self, action: str, **ctx: object) -> None:
        """Raise ``StoreUnavailable`` naming the cause when the store cannot serve ``action``."""
        h = self.health()
        if not h.ok:
            raise StoreUnavailable(f"{action} refused: the {h.kind} store is unavailable ({h.cause}); retry later",
                                   **ctx)  # type: ignore[arg-type]

    def catch_up(self, *, rank_id: str | None = None, instance: str | None = None) -> bool:
        """Read one rank (or one instance's ranks) from the store into the index now, where the
        index may lag the store (a watched cache); True when it found something new (the caller
        looks again). Stores rate-limit this per key."""
        return False

    def start(self) -> None:
        """Connect and fill the index; raise ``StoreUnavailable`` when that is impossible."""

    def close(self) -> None:
        """Stop background work; the store's state stays where it lives."""

    def unknown(self, rank_id: str, what: str) -> UnknownInstance:
        return UnknownInstance(f"no rank {rank_id!r} (lease expired or daemon restarted){what}", field="rank_id")


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach an etcd v3 cluster (``--store etcd://h1:2379,h2:2379`` and the
    ``--etcd-*`` options)."""

    endpoints: tuple[tuple[str, int], ...]
    tls: bool = False  # etcds://: https to every member
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    prefix: str = "/kvbridge/"
    timeout_s: float = 2.0  # one request to one member
    # how long a request keeps trying the members before the store is declared down: longer
    # than an election (etcd's default election timeout is 1 s), so a member lost with quorum
    # kept costs a short wait, never a 503
    failover_window_s: float = 3.0
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("the etcd store needs at least one endpoint (etcd://host:port,...)", field="store")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("give both --etcd-cert and --etcd-key, or neither", field="etcd_cert")
        if (self.user is None) != (self.password is None):
            raise ConfigError("give both --etcd-user and --etcd-password, or neither", field="etcd_user")
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise ConfigError(f"etcd prefix {self.prefix!r} must start and end with '/'", field="etcd_prefix")
        if self.timeout_s <= 0 or self.health_interval_s <= 0 or self.failover_window_s < 0:
            raise ConfigError("etcd timeout and health interval must be positive", field="etcd_timeout")

    @property
    def urls(self) -> tuple[str, ...]:
        scheme = "https" if self.tls else "http"
        return tuple(f"{scheme}://{h}:{p}" for h, p in self.endpoints)


def parse_store_url(url: str) -> tuple[Literal["memory", "etcd"], tuple[tuple[str, int], ...], bool]:
    """``memory`` (or ``memory://``) or ``etcd://h1:2379,h2:2379`` (``etcds://`` for TLS)."""
    if url in ("memory", "memory://"):
        return "memory", (), False
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds"):
        raise ConfigError(f"store {url!r}: expected 'memory' or etcd://host:port[,host:port...] (etcds:// for TLS)",
                          field="store")
    endpoints = []
    for item in parts.netloc.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"store {url!r}: endpoint {item!r} is not host:port", field="store")
        endpoints.append((host, int(port)))
    return "etcd", tuple(endpoints), parts.scheme == "etcds"
