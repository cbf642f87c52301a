"""Request and response bodies of the bootstrap daemon (``/v1``).

Requests are strict: ``"1"`` is not a rank and unknown keys are typos, so a bad
body is refused with 422 naming the field (``rank.dp_rank``). Responses are
the same models, which ``BootstrapClient`` parses back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.diff import FieldDiff
from kvbridge.bootstrap.topology import (
    AuxDescriptor,
    AuxRegionDescriptor,
    LayerRange,
    OwnerLanePlan,
    PoolDescriptor,
    Topology,
)

__all__ = [
    "INSTANCE_PATTERN",
    "MAX_ROOM",
    "RankIdentity",
    "ScratchDescriptor",
    "StagingDescriptor",
    "RegisterRequest",
    "RegisterResponse",
    "HeartbeatResponse",
    "LookupRequest",
    "SenderRank",
    "LookupResponse",
    "RankView",
    "RankDetail",
    "InstanceView",
    "InstanceFingerprint",
    "MismatchSide",
    "MismatchRecord",
    "ErrorBody",
]

# Instance names travel in URLs, logs and HTML: keep them plain.
INSTANCE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_ROOM = 2**63 - 1
Role = Literal["prefill", "decode"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class RankIdentity(_Strict):
    """Who a rank is: its instance, role, coordinates, and the instance's sizes."""

    instance: str = Field(pattern=INSTANCE_PATTERN)
    role: Role
    dp_size: int = Field(default=1, ge=1, le=4096)
    cp_size: int = Field(default=1, ge=1, le=4096)
    tp_size: int = Field(default=1, ge=1, le=4096)
    pp_size: int = Field(default=1, ge=1, le=4096)
    dp_rank: int = Field(default=0, ge=0)
    cp_rank: int = Field(default=0, ge=0)
    tp_rank: int = Field(default=0, ge=0)
    pp_rank: int = Field(default=0, ge=0)
    # a prefill pipeline stage's target layers (required when pp_size > 1; the daemon checks that
    # the stages of an instance tile the model's target layers, kvbridge.layout.stages)
    pp_layers: LayerRange | None = None

    @field_validator("dp_rank", "cp_rank", "tp_rank", "pp_rank")
    @classmethod
    def _inside(cls, v: int, info: ValidationInfo) -> int:
        size_name = info.field_name.replace("_rank", "_size")  # type: ignore[union-attr]
        size = info.data.get(size_name)
        if size is not None and v >= size:
            raise ValueError(f"{info.field_name} {v} is outside {size_name} {size}")
        return v

    @property
    def coords(self) -> tuple[int, int, int, int]:
        return (self.dp_rank, self.cp_rank, self.tp_rank, self.pp_rank)

    @property
    def topology(self) -> Topology:
        return Topology(role=self.role, dp_size=self.dp_size, cp_size=self.cp_size, tp_size=self.tp_size, pp_size=self.pp_size)

    @property
    def label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/cp{self.cp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"


class ScratchDescriptor(_Strict):
    """A small registered region that holds no KV: ``kvbridge doctor`` writes a probe into it
    and reads it back to check that the rank's transfer-engine session answers, both ways."""

    base: int = Field(ge=0, lt=2**64)
    nbytes: int = Field(ge=16, le=1 << 20)


class StagingDescriptor(_Strict):
    """A decode rank's staging area (staged transfers, docs/staging.md): ``nbytes`` of registered
    memory from ``base``, cut into slots of ``slot_bytes``. Prefill writes a staged chunk only
    into one whole slot of it, and checks every request's area against this (hard rule 5)."""

    base: int = Field(ge=0, lt=2**64)
    nbytes: int = Field(ge=16, le=1 << 40)
    slot_bytes: int = Field(ge=16, le=1 << 40)

    @field_validator("slot_bytes")
    @classmethod
    def _slots(cls, v: int, info: ValidationInfo) -> int:
        nbytes = info.data.get("nbytes")
        if v % 16:
            raise ValueError(f"slot_bytes {v} is not a multiple of 16")
        if nbytes is not None and (nbytes < v or nbytes % v):
            raise ValueError(f"nbytes {nbytes} is not a whole number of {v}-byte slots")
        return v

    @property
    def num_slots(self) -> int:
        return self.nbytes // self.slot_bytes


ENGINE_METADATA_MAX = 256 << 10  # base64 characters: a NIXL agent with thousands of regions fits


class RegisterRequest(_Strict):
    rank: RankIdentity
    control_endpoint: str = Field(min_length=1, max_length=512, pattern=r"^[a-z][a-z0-9+.-]*://\S+$")
    session_id: str = Field(min_length=1, max_length=256)
    pools: list[PoolDescriptor] = Field(default_factory=list, max_length=65536)
    aux: AuxDescriptor | None = None
    aux_regions: list[AuxRegionDescriptor] = Field(default_factory=list, max_length=64)
    contract: RuntimeContract
    lease_ttl_s: float | None = Field(default=None, gt=0, le=3600)
    scratch: ScratchDescriptor | None = None
    staging: StagingDescriptor | None = None  # a decode rank's staging area (None: every write direct)
    # a decode rank's Ed25519 public key (hex): the proof that a connection is this registration
    # (transfer/ownership.py); prefill refuses to write for a decode registration without one
    proof_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # that key's Ed25519 signature over this registration's instance and coordinates (hex;
    # bootstrap/lapses.py): what lets a rank take its own lapsed claim back; never read back
    proof_signature: str | None = Field(default=None, pattern=r"^[0-9a-f]{128}$")
    # what a writer must load before writing into this rank's memory, base64 (the transfer engine's
    # ``metadata``: a NIXL agent's; empty for Mooncake, whose session id is enough)
    engine_metadata: str = Field(default="", max_length=ENGINE_METADATA_MAX, pattern=r"^[A-Za-z0-9+/]*={0,2}$")


class RegisterResponse(_Strict):
    rank_id: str
    instance: str
    fingerprint: str
    lease_ttl_s: float
    replaced: str | None = None  # an earlier registration of the same coordinates
    # present it (header X-KVBridge-Lease) on heartbeats, deregistration and re-registration
    lease_secret: str = ""


class HeartbeatResponse(_Strict):
    rank_id: str
    lease_ttl_s: float


class LookupRequest(_Strict):
    prefill_instance: str = Field(pattern=INSTANCE_PATTERN)
    room: int = Field(ge=0, lt=MAX_ROOM + 1)  # exclusive 2**63: a bound a JSON (f64) schema validator holds exactly
    dp_rank: int | None = Field(default=None, ge=0)  # default: room % dp_size
    contract: RuntimeContract
    rank: RankIdentity  # the asking decode rank

    @field_validator("rank")
    @classmethod
    def _decode(cls, v: RankIdentity) -> RankIdentity:
        if v.role != "decode":
            raise ValueError(f"lookups come from decode ranks; {v.label} says role {v.role!r}")
        return v


class SenderRank(_Strict):
    rank_id: str
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int
    control_endpoint: str
    session_id: str
    pools: list[PoolDescriptor]
    aux: AuxDescriptor | None = None
    pp_layers: LayerRange | None = None  # the stage's target layers (None: pp_size 1, all of them)


class LookupResponse(_Strict):
    """The senders of one room to the asking decode rank: for every (cp_rank, pp_rank) of the
    chosen DP group, the TP ranks of its route (``kvbridge.layout.tp_route``; tp 0 when no
    pool is head-sharded). To decode tp rank 0, the routes of every TP rank of its instance:
    it hands the room's ticket on to them (transfer/prefill/tickets.py)."""

    instance: str
    room: int
    dp_rank: int
    topology: Topology
    fingerprint: str
    plan: OwnerLanePlan
    ranks: list[SenderRank]


class RankView(_Strict):
    rank_id: str
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int
    control_endpoint: str
    session_id: str
    num_pools: int
    has_aux: bool
    pp_layers: LayerRange | None = None
    scratch: ScratchDescriptor | None = None
    lease_ttl_s: float
    lease_remaining_s: float


class RankDetail(_Strict):
    """One registered rank and the memory a peer may write into (``GET /v1/ranks/{rank_id}``):
    what prefill checks a decode rank's requests against (hard rule 5)."""

    rank_id: str
    rank: RankIdentity
    fingerprint: str
    control_endpoint: str
    session_id: str
    pools: list[PoolDescriptor]
    aux: AuxDescriptor | None = None
    aux_regions: list[AuxRegionDescriptor] = Field(default_factory=list)
    lease_ttl_s: float
    lease_remaining_s: float
    scratch: ScratchDescriptor | None = None  # where prefill writes the nonce that proves the rank holds its memory
    staging: StagingDescriptor | None = None  # where staged chunks may land (prefill checks requests against it)
    proof_key: str | None = None  # the key a connection acting for this registration signs with (ownership.py)
    engine_metadata: str = ""  # base64: what a writer loads into its engine first (``RegisterRequest``)


class InstanceView(_Strict):
    name: str
    role: Role
    fingerprint: str
    topology: Topology
    num_ranks: int
    expected_ranks: int
    complete: bool  # every (dp, cp, pp) sender registered
    ranks: list[RankView]


class InstanceFingerprint(_Strict):
    instance: str
    role: Role
    fingerprint: str
    contract: RuntimeContract
    ranks: list[str]  # rank labels


class MismatchSide(_Strict):
    label: str  # "prefill" / "decode", or "registered" / "incoming" inside one instance
    instance: str
    role: Role
    rank: str
    fingerprint: str


class MismatchRecord(_Strict):
    """A refused handshake or registration. In ``diff``, ``prefill`` is the left
    side's value and ``decode`` the right side's."""

    time: float  # unix seconds
    kind: Literal["lookup", "register"]
    reason: Literal["contract", "topology"]
    message: str
    left: MismatchSide
    right: MismatchSide
    diff: list[FieldDiff]


class ErrorBody(BaseModel):
    """Every non-2xx answer: a code, a sentence, and what it is about."""

    error: str
    message: str
    field: str | None = None
    diff: list[FieldDiff] | None = None
    missing: list[str] | None = None
    fields: list[dict[str, Any]] | None = None
    holder: str | None = None  # claim_held: the live rank holding the session or range
