"""What the registry keeps per rank and per instance, and the views it answers with."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.bootstrap.claims import Claim, claim_of
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.schemas import (
    InstanceFingerprint,
    InstanceView,
    RankIdentity,
    RankView,
    ScratchDescriptor,
    SenderRank,
    StagingDescriptor,
)
from kvbridge.bootstrap.topology import (
    AuxDescriptor,
    AuxRegionDescriptor,
    PoolDescriptor,
    Topology,
    sender_coords,
)

__all__ = ["Coords", "RankRecord", "InstanceRecord"]

Coords = tuple[int, int, int, int]


@dataclass
class RankRecord:
    rank_id: str
    identity: RankIdentity
    control_endpoint: str
    session_id: str
    pools: list[PoolDescriptor]
    aux: AuxDescriptor | None
    lease_ttl_s: float
    expires_at: float  # on the registry's monotonic clock
    secret_digest: bytes = b""  # SHA-256 of the lease secret handed out at registration
    scratch: ScratchDescriptor | None = None
    aux_regions: list[AuxRegionDescriptor] = field(default_factory=list)  # per-region aux rows (prefill's checks)
    lease_id: int = 0  # the store's lease (etcd), 0 where the store keeps leases itself
    grace_lease_id: int = 0  # etcd: the lease of its lapsed claim (TTL + grace, lapses.py)
    staging: StagingDescriptor | None = None  # a decode rank's staging area
    proof_key: str | None = None  # its ownership-proof public key (hex)
    engine_metadata: str = ""  # base64, what a writer's engine loads first (NIXL); "" for Mooncake

    def claim(self) -> Claim:
        """The transport session and address ranges this rank holds (claims.py)."""
        i = self.identity
        return claim_of(self.rank_id, i.label, i.instance, self.session_id, self.pools, self.aux, self.aux_regions,
                        self.scratch, self.staging, self.engine_metadata)

    def sender(self) -> SenderRank:
        """What a decode rank needs to reach this rank (a look-up answer's entry)."""
        i = self.identity
        return SenderRank(rank_id=self.rank_id, dp_rank=i.dp_rank, cp_rank=i.cp_rank, tp_rank=i.tp_rank, pp_rank=i.pp_rank,
                          control_endpoint=self.control_endpoint, session_id=self.session_id, pools=self.pools, aux=self.aux,
                          pp_layers=i.pp_layers)

    def view(self, now: float) -> RankView:
        i = self.identity
        return RankView(rank_id=self.rank_id, dp_rank=i.dp_rank, cp_rank=i.cp_rank, tp_rank=i.tp_rank, pp_rank=i.pp_rank,
                        control_endpoint=self.control_endpoint, session_id=self.session_id, num_pools=len(self.pools),
                        has_aux=self.aux is not None, pp_layers=i.pp_layers, lease_ttl_s=self.lease_ttl_s,
                        lease_remaining_s=round(max(0.0, self.expires_at - now), 3), scratch=self.scratch)


@dataclass
class InstanceRecord:
    name: str
    topology: Topology
    contract: RuntimeContract
    fingerprint: str
    ranks: dict[str, RankRecord] = field(default_factory=dict)
    by_coords: dict[Coords, str] = field(default_factory=dict)

    def missing(self, dp_rank: int, coords: list[Coords] | None = None) -> list[str]:
        """Sender ranks of DP group ``dp_rank`` not registered (``coords``: those one decode rank needs)."""
        return [
            f"{self.name}/dp{d}/cp{c}/tp{t}/pp{p}"
            for d, c, t, p in (coords if coords is not None else sender_coords(self.topology, dp_rank, self.contract))
            if (d, c, t, p) not in self.by_coords
        ]

    @property
    def complete(self) -> bool:
        return all(not self.missing(d) for d in range(self.topology.dp_size))

    def view(self, now: float) -> InstanceView:
        ranks = sorted(self.ranks.values(), key=lambda r: r.identity.coords)
        return InstanceView(name=self.name, role=self.topology.role, fingerprint=self.fingerprint, topology=self.topology,
                            num_ranks=len(ranks), expected_ranks=self.topology.num_ranks, complete=self.complete,
                            ranks=[r.view(now) for r in ranks])

    def fingerprint_view(self) -> InstanceFingerprint:
        return InstanceFingerprint(instance=self.name, role=self.topology.role, fingerprint=self.fingerprint,
                                   contract=self.contract, ranks=sorted(r.identity.label for r in self.ranks.values()))
