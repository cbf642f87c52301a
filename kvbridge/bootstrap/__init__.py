"""kvbridge.bootstrap: the runtime contract and its fingerprint, field diffs,
the bootstrap daemon (``create_app``, imported lazily: it pulls in FastAPI) and
the client workers use (``BootstrapClient``, ``LeaseKeeper``)."""

from __future__ import annotations

from typing import Any

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper, Registration
from kvbridge.bootstrap.contract import (
    CONTRACT_PRESETS,
    CP_RULES,
    FINGERPRINT_PREFIX,
    SPEC_ALGORITHMS,
    WIRE_VERSION,
    AuxContract,
    AuxField,
    KernelContract,
    ModelIdentity,
    PoolContract,
    RuntimeContract,
    SourceDigest,
    SpeculativeContract,
    canonical_json,
    contract_for,
    contract_from_preset,
    fingerprint,
    preset_contract,
    source_digest,
)
from kvbridge.bootstrap.diff import FieldDiff, diff_contracts
from kvbridge.bootstrap.weights import contract_weights, weights_digest
from kvbridge.bootstrap.schemas import (
    LookupResponse,
    MismatchRecord,
    RankIdentity,
    RegisterRequest,
    SenderRank,
)
from kvbridge.bootstrap.topology import AuxDescriptor, OwnerLanePlan, PoolDescriptor, Topology

__all__ = [
    "CONTRACT_PRESETS",
    "CP_RULES",
    "FINGERPRINT_PREFIX",
    "SPEC_ALGORITHMS",
    "WIRE_VERSION",
    "AuxContract",
    "AuxField",
    "KernelContract",
    "ModelIdentity",
    "PoolContract",
    "RuntimeContract",
    "SourceDigest",
    "SpeculativeContract",
    "canonical_json",
    "contract_for",
    "contract_from_preset",
    "fingerprint",
    "preset_contract",
    "source_digest",
    "contract_weights",
    "weights_digest",
    "FieldDiff",
    "diff_contracts",
    "RankIdentity",
    "RegisterRequest",
    "LookupResponse",
    "SenderRank",
    "MismatchRecord",
    "Topology",
    "OwnerLanePlan",
    "PoolDescriptor",
    "AuxDescriptor",
    "BootstrapClient",
    "Registration",
    "LeaseKeeper",
    "BootstrapSettings",
    "create_app",
]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "BootstrapSettings"):
        from kvbridge.bootstrap import app

        return getattr(app, name)
    raise AttributeError(f"module 'kvbridge.bootstrap' has no attribute {name!r}")
