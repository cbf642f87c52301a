"""The runtime contract: everything a prefill and a decode instance must agree
on for the bytes of a page to mean the same thing on both sides (hard rule 7).

    RuntimeContract
    ├── wire_version       kvbridge control-message protocol
    ├── model              name, weights revision, target / draft layer counts, weights digest
    ├── pools[]            per pool: dtype, abi, bytes/token, page size, in-page layout,
    │                      value/scale split, kernel ABI, layer ids   (matched by name);
    │                      TP sharding: replicated, or heads (num_heads x head_dim, the whole row);
    │                      kind: paged | window (window, ring_stride) | compressed (ratio) |
    │                      state (shard_units x unit_bytes, the whole slot);
    │                      page_stride: a padded page's stride (left out when unpadded)
    ├── cp_rule            owner-lane rule: interleaved | contiguous | replicated | balanced
    ├── kernel             attention backend and its page-layout ABI
    ├── speculative        none | eagle | eagle3 | nextn, hidden width/dtype, top-k
    ├── aux                aux-row regions (name, dtype, shape, offset, bytes) and row bytes
    ├── source             digest over the source files that define the byte meaning
    └── transport          the transfer engine's session family (mooncake | nixl | ...): the
                           endpoints stamp their engine's, so sides on different engines (whose
                           sessions and memory keys mean nothing to each other) are refused

Sizes that may legally differ between the sides (tp/cp/dp/pp, addresses,
capacities) are topology, not contract: see ``kvbridge.bootstrap.topology``. A
head-sharded pool (``tp_sharding = "heads"``) is described by its whole row, every
head: each TP rank holds its own head range of it, whatever the TP size.

The canonical encoding is compact JSON with sorted keys over ints, strings,
lists and objects only (no floats), pools sorted by name and layer ids sorted,
so the fingerprint is equal across processes, machines and Python versions.
``transport`` is left out of it when it is ``mooncake`` (the encoding of contracts that
predate the field), so a Mooncake contract's fingerprint did not change.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvbridge._version import WIRE_VERSION
from kvbridge.bootstrap import digest
from kvbridge.bootstrap.digest import ExtraFiles
from kvbridge.errors import ContractError, LayoutError
from kvbridge.layout.aux import AuxSchema
from kvbridge.layout.lanes import LANE_RULES
from kvbridge.layout.hybrid import KIND_PRESETS, deepseek_v4_pools
from kvbridge.layout.pools import ABI_ITEMSIZE, PRESETS, PoolSpec, preset_pools

__all__ = [
    "WIRE_VERSION",
    "FINGERPRINT_PREFIX",
    "CP_RULES",
    "SPEC_ALGORITHMS",
    "CONTRACT_PRESETS",
    "ModelIdentity",
    "PoolContract",
    "KernelContract",
    "SpeculativeContract",
    "AuxField",
    "AuxContract",
    "SourceDigest",
    "RuntimeContract",
    "canonical_json",
    "fingerprint",
    "source_digest",
    "contract_for",
    "contract_from_preset",
    "preset_contract",
]

# Control-message protocol version; keep equal to kvbridge.transfer.channel.wire's.
# Version of the canonical encoding itself; bump it if canonical_json changes.
FINGERPRINT_PREFIX = "kvb1:"
CP_RULES = LANE_RULES  # interleaved, contiguous, replicated, balanced (kvbridge.layout.lanes)
SPEC_ALGORITHMS = ("none", "eagle", "eagle3", "nextn")
CONTRACT_PRESETS = PRESETS + KIND_PRESETS  # deepseek-v4: window, compressed and state pools

DEFAULT_TRANSPORT = "mooncake"  # Mooncake and the "auto" engine (its sessions are Mooncake's)
CpRule = Literal["interleaved", "contiguous", "replicated", "balanced"]
SpecAlgorithm = Literal["none", "eagle", "eagle3", "nextn"]
_NAME = Field(min_length=1, max_length=256)


class _Frozen(BaseModel):
    # strict: "1" is not an int and 1.0 is not a page size; extra keys are typos.
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class ModelIdentity(_Frozen):
    name: str = _NAME
    revision: str = Field(min_length=1, max_length=256)  # weights revision or digest
    target_layers: int = Field(ge=1)
    draft_layers: int = Field(ge=0)
    # the checkpoint's own identity (``bootstrap/weights.py``: headers, sizes, sampled bytes), so that
    # other weights under the same name are refused; "unspecified": not computed (left out of the encoding)
    weights: str = Field(default="unspecified", min_length=1, max_length=256)


class PoolContract(_Frozen):
    """One pool's geometry: the fields of ``PoolSpec`` that give bytes their meaning."""

    name: str = _NAME
    dtype: str = _NAME
    abi: str = _NAME
    bytes_per_token: int = Field(ge=1)
    page_size: int = Field(ge=1)
    layout: Literal["rows", "values_then_scales"]
    value_bytes_per_token: int = Field(ge=0)
    scale_bytes_per_token: int = Field(ge=0)
    kernel_abi: str = Field(max_length=256)
    layer_ids: list[int] = Field(min_length=1)
    # across TP: "replicated" (every rank holds the whole row: MLA latent, index K) or "heads"
    # (MHA/GQA k/v: rank r holds its heads of num_heads x head_dim; bytes_per_token is the whole row)
    tp_sharding: Literal["replicated", "heads"] = "replicated"
    num_heads: int = Field(default=0, ge=0)
    head_dim: int = Field(default=0, ge=0)
    # pool kind (kvbridge.layout.kinds); a paged pool leaves these out of the encoding
    kind: Literal["paged", "window", "compressed", "state"] = "paged"
    window: int = Field(default=0, ge=0)  # window: the last `window` tokens
    ring_stride: int = Field(default=0, ge=0)  # window: ring-addressed slots per request row (0: pages)
    ratio: int = Field(default=0, ge=0)  # compressed: tokens per entry
    shard_units: list[int] = Field(default_factory=list)  # state: TP-sharded groups, in units (whole slot)
    unit_bytes: int = Field(default=0, ge=0)  # state: bytes per unit
    page_stride: int = Field(default=0, ge=0)  # bytes from page to page when padded past the payload (0: unpadded)

    @field_validator("layer_ids")
    @classmethod
    def _sorted_distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v) or min(v) < 0:
            raise ValueError("layer ids must be distinct and non-negative")
        return sorted(v)

    @model_validator(mode="after")
    def _heads(self) -> PoolContract:
        if self.kind != "paged" or self.page_stride:
            try:
                self.to_spec()
            except LayoutError as exc:
                raise ValueError(exc.reason) from None
        if self.tp_sharding == "replicated":
            if self.num_heads or self.head_dim:
                raise ValueError(f"pool {self.name!r}: num_heads/head_dim describe head-sharded pools only")
            return self
        try:
            self.to_spec()
        except LayoutError as exc:
            raise ValueError(exc.reason) from None
        if not self.num_heads or self.bytes_per_token != self.num_heads * self.head_bytes:
            raise ValueError(f"pool {self.name!r}: {self.bytes_per_token} bytes per token is not {self.num_heads} heads "
                             f"of {self.head_dim} x {self.abi} (the whole row)")
        return self

    @property
    def head_bytes(self) -> int:
        return self.head_dim * ABI_ITEMSIZE.get(self.abi, 0)

    @classmethod
    def from_spec(cls, spec: PoolSpec) -> PoolContract:
        """The contract's form of a pool: a head-sharded rank's spec becomes its whole row."""
        heads = dict(tp_sharding="heads", num_heads=spec.num_heads, head_dim=spec.head_dim) if spec.head_sharded else {}
        if spec.kind != "paged":
            heads.update(kind=spec.kind, window=spec.window, ring_stride=spec.ring_stride, ratio=spec.ratio,
                         shard_units=list(spec.shard_units), unit_bytes=spec.unit_bytes)
        return cls(
            name=spec.name,
            dtype=spec.dtype,
            abi=spec.abi,
            bytes_per_token=spec.full_bytes_per_token,
            page_size=spec.page_size,
            layout=spec.layout,  # type: ignore[arg-type]
            value_bytes_per_token=spec.value_bytes_per_token,
            scale_bytes_per_token=spec.scale_bytes_per_token,
            kernel_abi=spec.kernel_abi,
            layer_ids=list(spec.layer_ids),
            page_stride=spec.page_stride,
            **heads,
        )

    def to_spec(self) -> PoolSpec:
        """The whole-row spec (every head of a head-sharded pool: ``kvbridge.layout.tp_spec``
        gives a TP rank's)."""
        return PoolSpec(
            name=self.name,
            dtype=self.dtype,
            abi=self.abi,
            bytes_per_token=self.bytes_per_token,
            page_size=self.page_size,
            layer_ids=tuple(self.layer_ids),
            layout=self.layout,
            value_bytes_per_token=self.value_bytes_per_token,
            scale_bytes_per_token=self.scale_bytes_per_token,
            kernel_abi=self.kernel_abi,
            num_heads=self.num_heads,
            kind=self.kind,
            window=self.window,
            ring_stride=self.ring_stride,
            ratio=self.ratio,
            shard_units=tuple(self.shard_units),
            unit_bytes=self.unit_bytes,
            page_stride=self.page_stride,
        )

    @property
    def bytes_per_page(self) -> int:
        return self.page_stride or self.bytes_per_token * self.page_size


class KernelContract(_Frozen):
    """The attention backend whose page layout the bytes follow, and its ABI tag."""

    attention_backend: str = _NAME
    abi: str = Field(max_length=256)


class SpeculativeContract(_Frozen):
    algorithm: SpecAlgorithm
    hidden_size: int = Field(ge=0)  # width of the carried hidden state; 0 without one
    hidden_dtype: str = Field(max_length=64)
    topk: int = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeContract:
        if self.algorithm != "none" and (self.hidden_size <= 0 or self.topk <= 0 or not self.hidden_dtype):
            raise ValueError(f"speculative algorithm {self.algorithm!r} needs hidden_size > 0, topk > 0 and a hidden_dtype")
        return self


class AuxField(_Frozen):
    """One region of the aux row (``kvbridge.layout.AuxRegion``) with its place in a packed row."""

    name: str = _NAME
    dtype: str = _NAME
    shape: list[int] = Field(default_factory=list)
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError("aux region dimensions must be non-negative")
        return v


class AuxContract(_Frozen):
    """The contract's form of ``kvbridge.layout.AuxSchema`` (its ``to_dict()``): the regions
    in order and the packed row size. Internal: engines describe aux rows with ``AuxSchema``."""

    regions: list[AuxField]
    row_bytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _is_a_schema(self) -> AuxContract:
        try:
            AuxSchema.from_dict(self.model_dump())
        except LayoutError as exc:
            raise ValueError(exc.reason) from None
        return self

    @classmethod
    def from_schema(cls, schema: AuxSchema) -> AuxContract:
        return cls.model_validate(schema.to_dict())

    def to_schema(self) -> AuxSchema:
        return AuxSchema.from_dict(self.model_dump())


class SourceDigest(_Frozen):
    algorithm: Literal["sha256"] = "sha256"
    files: dict[str, str]  # stable name -> sha256 hex or "missing"
    digest: str

    @model_validator(mode="after")
    def _matches_files(self) -> SourceDigest:
        if digest.combine(self.files) != self.digest:
            raise ValueError("source digest does not match its files")
        return self


class RuntimeContract(_Frozen):
    wire_version: int = Field(ge=1)
    model: ModelIdentity
    pools: list[PoolContract] = Field(min_length=1)
    cp_rule: CpRule
    kernel: KernelContract
    speculative: SpeculativeContract
    aux: AuxContract
    source: SourceDigest
    transport: str = Field(default=DEFAULT_TRANSPORT, min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_-]*$")

    @field_validator("pools")
    @classmethod
    def _by_name(cls, v: list[PoolContract]) -> list[PoolContract]:
        names = [p.name for p in v]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be distinct: {names}")
        # Target, index and draft share one page mapping (hard rule 3): one page size. Token-paged
        # kinds (paged, paged window) share it; compressed pools page entries, state pools slots.
        # A paged window pages like them, or finer (a divisor of their page size) when its window fits
        # in one of its pages: a ring per token page, on units the engine hands of its own
        # (DeepSeek-V4's C4 compressor rings, one per SWA page).
        paged = [p for p in v if p.kind == "paged"]
        windows = [p for p in v if p.kind == "window" and not p.ring_stride]
        token = paged[0].page_size if paged else max((p.page_size for p in windows), default=0)
        odd = [p for p in paged if p.page_size != token] + [
            p for p in windows if p.page_size != token and (token % p.page_size or p.window > p.page_size)]
        if odd:
            raise ValueError("all token-paged pools share one logical-to-physical page mapping, so one page size "
                             "(a paged window whose window fits in one of its pages may page finer, by a divisor of "
                             "it): " + ", ".join(f"{p.name}={p.page_size}" for p in paged + windows))
        return sorted(v, key=lambda p: p.name)

    def pool(self, name: str) -> PoolContract:
        for p in self.pools:
            if p.name == name:
                return p
        raise ContractError(f"contract has no pool {name!r}; pools are {[p.name for p in self.pools]}", field="pools")

    @property
    def page_size(self) -> int:
        """The page size of the token-paged pools (``kvbridge.layout.kinds.token_page_size``)."""
        for p in self.pools:
            if p.kind == "paged":
                return p.page_size
        windows = [p.page_size for p in self.pools if p.kind == "window" and not p.ring_stride]
        return max(windows) if windows else self.pools[0].page_size

    def canonical(self) -> bytes:
        return canonical_json(self)

    def fingerprint(self) -> str:
        return fingerprint(self)

    def with_transport(self, transport: str) -> RuntimeContract:
        """This contract as a rank on an engine of ``transport`` (``TransferEngine.transport``) holds it."""
        if transport == self.transport:
            return self
        return RuntimeContract.model_validate({**self.model_dump(), "transport": transport})


def _check_plain(value: Any, path: str) -> None:
    """Only ints, strings, lists and string-keyed objects may enter the encoding."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        raise ContractError(f"contract value {value!r} is not an int or a string", field=path)
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]")
    elif not isinstance(value, (int, str)):
        raise ContractError(f"contract value of type {type(value).__name__} is not encodable", field=path)


_HEAD_FIELDS = ("tp_sharding", "num_heads", "head_dim")
_KIND_FIELDS = ("kind", "window", "ring_stride", "ratio", "shard_units", "unit_bytes")



def canonical_json(contract: RuntimeContract | dict[str, Any]) -> bytes:
    """Sorted-key, compact, ASCII JSON of the contract's plain form. A replicated pool
    leaves its TP-sharding fields out, a paged pool its kind fields, an unpadded pool its
    page_stride, a Mooncake contract its
    transport, and a model without a weights digest its ``weights`` (the encoding of contracts
    that predate them)."""
    if isinstance(contract, dict):
        contract = RuntimeContract.model_validate(contract)
    plain = contract.model_dump(mode="json")
    if plain["transport"] == DEFAULT_TRANSPORT:
        del plain["transport"]
    if plain["model"]["weights"] == "unspecified":
        del plain["model"]["weights"]
    for pool in plain["pools"]:
        if pool["tp_sharding"] == "replicated":
            for key in _HEAD_FIELDS:
                del pool[key]
        if pool["kind"] == "paged":
            for key in _KIND_FIELDS:
                del pool[key]
        if not pool["page_stride"]:
            del pool["page_stride"]
    _check_plain(plain, "")
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def fingerprint(contract: RuntimeContract | dict[str, Any]) -> str:
    """``kvb1:`` + SHA-256 hex of the canonical encoding."""
    return FINGERPRINT_PREFIX + hashlib.sha256(canonical_json(contract)).hexdigest()


def source_digest(extra: ExtraFiles | None = None) -> SourceDigest:
    files = digest.source_files(extra)
    return SourceDigest(files=files, digest=digest.combine(files))


def contract_for(
    pools: Sequence[PoolSpec] | Mapping[str, PoolSpec],
    *,
    model: str | Mapping[str, Any] | ModelIdentity,
    aux: AuxSchema,
    lane_rule: str = "interleaved",
    kernel: Mapping[str, Any] | KernelContract | None = None,
    speculative: Mapping[str, Any] | SpeculativeContract | None = None,
    extra_sources: ExtraFiles | None = None,
) -> RuntimeContract:
    """The runtime contract of any model's KV cache, from its pools (``PoolSpec``: several
    per layer allowed, e.g. ``k`` and ``v``; dtypes bf16, fp16, fp32, fp8 stored as uint8).

    ``model``: a name, or a mapping / ``ModelIdentity`` with ``name``, ``revision``,
    ``target_layers``, ``draft_layers`` (omitted ones: revision "unspecified", the
    distinct layer ids of the pools, 0 draft layers). ``aux``: the aux row schema.
    ``lane_rule``: how CP ranks own logical pages (interleaved, contiguous, replicated, balanced).
    ``kernel``: attention backend and page-layout ABI (default "unspecified").
    ``speculative``: algorithm, hidden_size/dtype, topk (default none). ``extra_sources``:
    engine files that define the byte meaning, hashed into the source digest.
    Raises ``ContractError`` naming the field."""
    specs = list(pools.values()) if isinstance(pools, Mapping) else list(pools)
    if not specs or not all(isinstance(s, PoolSpec) for s in specs):
        raise ContractError("pools must be a non-empty sequence (or name -> spec mapping) of PoolSpec", field="pools")
    if not isinstance(aux, AuxSchema):
        raise ContractError(f"aux must be a kvbridge.layout.AuxSchema, got {type(aux).__name__}", field="aux")
    if lane_rule not in CP_RULES:
        raise ContractError(f"lane rule {lane_rule!r} is not one of {CP_RULES}", field="cp_rule")
    layer_ids = {lid for s in specs for lid in s.layer_ids}
    identity = {"revision": "unspecified", "target_layers": len(layer_ids), "draft_layers": 0}
    identity.update({"name": model} if isinstance(model, str) else _plain(model))
    fields: dict[str, Any] = {
        "wire_version": WIRE_VERSION,
        "model": identity,
        "pools": [PoolContract.from_spec(s).model_dump() for s in specs],
        "cp_rule": lane_rule,
        "kernel": _plain(kernel) if kernel is not None else {"attention_backend": "unspecified", "abi": ""},
        "speculative": _plain(speculative) if speculative is not None
        else {"algorithm": "none", "hidden_size": 0, "hidden_dtype": "", "topk": 0},
        "aux": aux.to_dict(),
        "source": source_digest(extra_sources).model_dump(),
    }
    try:
        return RuntimeContract.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "contract"
        raise ContractError(f"cannot build the contract: {where}: {err['msg']}", field=where) from None


def _plain(value: Mapping[str, Any] | BaseModel) -> dict[str, Any]:
    return value.model_dump() if isinstance(value, BaseModel) else dict(value)


_MODEL_NAMES = {"deepseek-v3": "deepseek-ai/DeepSeek-V3", "deepseek-v3.2": "deepseek-ai/DeepSeek-V3.2",
                "deepseek-v4": "deepseek-ai/DeepSeek-V4-Flash"}
_V4_HIDDEN = 4096  # DeepSeek-V4-Flash (transformers' DeepseekV4Config default)


def contract_from_preset(
    preset: str,
    num_layers: int | None = None,
    page_size: int = 64,
    draft_layers: int = 1,
    *,
    speculative: SpeculativeContract | None = None,
    model_name: str | None = None,
    revision: str = "unspecified",
    cp_rule: str = "interleaved",
    kernel: KernelContract | None = None,
    aux: AuxSchema | None = None,
    source_files: ExtraFiles | None = None,
    wire_version: int = WIRE_VERSION,
) -> RuntimeContract:
    """The contract of a DeepSeek V3 / V3.2 / V4 preset: ``contract_for`` over ``preset_pools``
    (``deepseek_v4_pools`` for V4; ``deepseek-v4-fp8``: its KV pools in SGLang's FlashMLA fp8
    layout, ``kv_dtype="fp8"``). Defaults: 61 layers (V4: 43), NextN with a 7168-wide
    (V4: 4096) bf16 hidden state and top-1 when there are draft layers, no speculation
    otherwise; the standard aux row for that state; FlashMLA (sparse for V3.2 and V4)."""
    if preset in KIND_PRESETS:
        family = "deepseek-v4"
        num_layers = 43 if num_layers is None else num_layers
        pools = deepseek_v4_pools(num_layers, page_size, draft_layers=draft_layers,
                                  kv_dtype="fp8" if preset.endswith("-fp8") else "bfloat16")
    else:
        family = "deepseek-v3.2" if preset.startswith("deepseek-v3.2") else "deepseek-v3"
        num_layers = 61 if num_layers is None else num_layers
        pools = preset_pools(preset, num_layers=num_layers, page_size=page_size, draft_layers=draft_layers)
    hidden = _V4_HIDDEN if family == "deepseek-v4" else 7168
    if speculative is None:
        speculative = (
            SpeculativeContract(algorithm="nextn", hidden_size=hidden, hidden_dtype="bfloat16", topk=1)
            if draft_layers
            else SpeculativeContract(algorithm="none", hidden_size=0, hidden_dtype="bfloat16", topk=0)
        )
    if kernel is None and family == "deepseek-v4":
        kernel = KernelContract(attention_backend="flashmla-sparse-swa",
                                abi="v4-swa+compressed-fp8-v1" if preset.endswith("-fp8") else "v4-swa+compressed-v1")
    if kernel is None:
        sparse = family == "deepseek-v3.2"
        kernel = KernelContract(
            attention_backend="flashmla-sparse" if sparse else "flashmla",
            abi="mla-paged-v1+nsa-index-k-uint8" if sparse else "mla-paged-v1",
        )
    if aux is None:
        aux = AuxSchema.standard(speculative.hidden_size, speculative.hidden_dtype or "bfloat16", speculative.topk)
    model = ModelIdentity(name=model_name or _MODEL_NAMES[family], revision=revision, target_layers=num_layers,
                          draft_layers=draft_layers)
    contract = contract_for(pools, model=model, aux=aux, lane_rule=cp_rule, kernel=kernel, speculative=speculative,
                            extra_sources=source_files)
    return contract if wire_version == WIRE_VERSION else contract.model_copy(update={"wire_version": wire_version})


def preset_contract(name: str, **overrides: Any) -> RuntimeContract:
    """A named contract preset (one per ``PRESETS``); ``overrides`` go to
    ``contract_from_preset``."""
    if name not in CONTRACT_PRESETS:
        raise ContractError(f"unknown contract preset {name!r}; presets are {', '.join(CONTRACT_PRESETS)}", field="preset")
    return contract_from_preset(name, **overrides)

