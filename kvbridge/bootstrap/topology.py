"""Topology: the sizes that may legally differ between a prefill and a decode
instance (dp/cp/tp/pp, addresses, capacities) and so stay out of the contract.

They still have rules, checked here with their own errors (``TopologyError``):

- every rank of one instance reports the same role and the same four sizes;
- a rank's coordinates lie inside those sizes (checked by the schema);
- a rank's pool descriptors agree with its own contract: known pool, one of the
  pool's layer ids, ``bytes_per_page = page_size * bytes_per_token``, each
  ``(pool, layer_id)`` once (``BufferSpecError``, hard rules 5 and 8);
- a prefill pipeline stage (``pp_size > 1``) declares its target layers ``pp_layers``
  and describes exactly its layers of every pool (``check_stage``); the stages of an
  instance tile the target layers in stage order (``stage_layers_conflict``, by name).

Senders. Pipeline stages hold disjoint layers, so every stage sends its own;
every CP rank sends the pages it owns. Inside a CP rank's TP group the senders
depend on the asking decode rank (``kvbridge.layout.tp_routes``): MLA's latent KV
is one head replicated across attention TP, so ``tp_rank 0`` holds every byte;
a head-sharded pool (MHA/GQA k/v) comes from every prefill TP rank whose heads
overlap the decode rank's. The senders of a room are therefore ``(cp, tp, pp)``
for every cp and pp and every tp of that decode rank's route.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.diff import FieldDiff, breaks_for
from kvbridge.errors import BufferSpecError, TopologyError
from kvbridge.layout import stage_conflict, stage_layer_ids, tp_route, tp_spec

__all__ = ["Topology", "LayerRange", "OwnerLanePlan", "PoolDescriptor", "AuxDescriptor", "AuxRegionDescriptor", "topology_diff",
           "check_descriptors", "check_stage", "stage_layers_conflict", "sender_coords"]

SIZE_FIELDS = ("dp_size", "cp_size", "tp_size", "pp_size")


class Topology(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    role: Literal["prefill", "decode"]
    dp_size: int = Field(ge=1, le=4096)
    cp_size: int = Field(ge=1, le=4096)
    tp_size: int = Field(ge=1, le=4096)
    pp_size: int = Field(ge=1, le=4096)

    @property
    def num_ranks(self) -> int:
        return self.dp_size * self.cp_size * self.tp_size * self.pp_size

    @property
    def shape(self) -> str:
        return f"dp{self.dp_size} x cp{self.cp_size} x tp{self.tp_size} x pp{self.pp_size}"


class LayerRange(BaseModel):
    """The target layers ``[start, end)`` a pipeline stage holds (``kvbridge.layout.stages``:
    index-K layers follow the same split; draft layers and the aux row belong to the last stage)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    start: int = Field(ge=0)
    end: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LayerRange:
        if self.start >= self.end:
            raise ValueError(f"layer range [{self.start}, {self.end}) is empty: start must be below end")
        return self

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)


class OwnerLanePlan(BaseModel):
    """What a decode rank needs to rebuild ``OwnerLanes(cp_size, rule)``."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    cp_size: int = Field(ge=1)
    rule: Literal["interleaved", "contiguous", "replicated", "balanced"]


class PoolDescriptor(BaseModel):
    """One registered buffer: one layer of one pool (the fields of ``layout.pairing.BufferDesc``)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    pool: str = Field(min_length=1, max_length=64)
    layer_id: int = Field(ge=0)
    base: int = Field(ge=0, lt=2**64)  # device or host address of page 0
    capacity_pages: int = Field(ge=1)
    bytes_per_page: int = Field(ge=1)


class AuxDescriptor(BaseModel):
    """The registered aux-row buffer: ``capacity_rows`` rows of ``row_bytes``."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    base: int = Field(ge=0, lt=2**64)
    capacity_rows: int = Field(ge=1)
    row_bytes: int = Field(ge=1)


class AuxRegionDescriptor(BaseModel):
    """One registered aux region (``kvbridge.layout.AuxRegion``): the region of row ``i`` starts
    at ``base + i * row_bytes``. A packed aux buffer gives one per region (``base`` offset by the
    region's place in the row, ``row_bytes`` the packed row); a tensor per region gives its own."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    base: int = Field(ge=0, lt=2**64)
    capacity_rows: int = Field(ge=1)
    row_bytes: int = Field(ge=1)


def topology_diff(registered: Topology, incoming: Topology) -> list[FieldDiff]:
    """Role and sizes that differ between two ranks of one instance."""
    out = []
    for name in ("role", *SIZE_FIELDS):
        a, b = getattr(registered, name), getattr(incoming, name)
        if a != b:
            path = f"topology.{name}"
            out.append(FieldDiff(path=path, prefill=a, decode=b, breaks=breaks_for(path)))
    return out


def check_descriptors(
    contract: RuntimeContract,
    descriptors: Sequence[PoolDescriptor],
    aux: AuxDescriptor | None,
    *,
    rank: str,
    aux_regions: Sequence[AuxRegionDescriptor] = (),
    tp: tuple[int, int] = (1, 0),
) -> None:
    """Each descriptor (``pool, layer_id, bytes_per_page, capacity_pages``) must
    fit its own contract (a head-sharded pool: the rank's heads of the row, for its
    ``tp = (tp_size, tp_rank)``); raises ``BufferSpecError`` naming the field."""
    pools = {p.name: p for p in contract.pools}
    page_bytes = {p.name: tp_spec(p.to_spec(), *tp).bytes_per_page for p in contract.pools}
    seen: set[tuple[str, int]] = set()
    for i, d in enumerate(descriptors):
        pool_name, layer_id = d.pool, d.layer_id
        where = f"pools[{i}]"
        pool = pools.get(pool_name)
        if pool is None:
            raise BufferSpecError(
                f"descriptor for pool {pool_name!r} but the contract's pools are {sorted(pools)}", rank=rank, field=f"{where}.pool"
            )
        if layer_id not in pool.layer_ids:
            raise BufferSpecError(
                f"pool {pool_name!r} has no layer {layer_id} in the contract (layers {pool.layer_ids[0]}..{pool.layer_ids[-1]})",
                rank=rank,
                field=f"{where}.layer_id",
            )
        if d.bytes_per_page != page_bytes[pool_name]:
            heads = f"; tp rank {tp[1]} of {tp[0]} holds its heads of the row" if pool.tp_sharding == "heads" else ""
            raise BufferSpecError(
                f"pool {pool_name!r} layer {layer_id}: {d.bytes_per_page} bytes per page, the contract says "
                f"{page_bytes[pool_name]} ({pool.page_size} tokens x {pool.bytes_per_token} B{heads})",
                rank=rank,
                field=f"{where}.bytes_per_page",
            )
        if (pool_name, layer_id) in seen:
            raise BufferSpecError(
                f"pool {pool_name!r} layer {layer_id} described twice (buffers pair by name and layer id)",
                rank=rank,
                field=f"{where}.layer_id",
            )
        seen.add((pool_name, layer_id))
    if aux is not None and aux.row_bytes < contract.aux.row_bytes:
        raise BufferSpecError(
            f"aux rows of {aux.row_bytes} bytes cannot hold the contract's {contract.aux.row_bytes}-byte aux row",
            rank=rank,
            field="aux.row_bytes",
        )
    sizes = {r.name: r.nbytes for r in contract.aux.regions}
    seen_regions: set[str] = set()
    for i, r in enumerate(aux_regions):
        if r.name not in sizes or r.name in seen_regions or r.row_bytes < sizes[r.name]:
            raise BufferSpecError(
                f"aux region {r.name!r}: unknown, described twice, or rows of {r.row_bytes} B too small; the "
                f"contract's regions are {sizes} (name: bytes)", rank=rank, field=f"aux_regions[{i}]",
            )
        seen_regions.add(r.name)


def check_stage(contract: RuntimeContract, role: str, pp_size: int, pp_rank: int, layers: LayerRange | None,
                descriptors: Sequence[PoolDescriptor], *, rank: str) -> None:
    """A rank's own pipeline-stage declaration, alone (``kvbridge.layout.stages``): a prefill rank of
    ``pp_size > 1`` declares its target layers ``pp_layers``, inside the contract's target layers, and
    registers exactly the layers of every pool its stage holds; with ``pp_size`` 1 a declaration, if
    any, is every target layer. TopologyError / BufferSpecError (409) naming the field."""
    n = contract.model.target_layers
    if layers is None:
        if pp_size > 1 and role == "prefill":
            raise TopologyError(f"{rank} is pipeline stage pp{pp_rank} of {pp_size} but declares no layer range "
                                "(rank.pp_layers: the target layers [start, end) this stage holds and sends)",
                                rank=rank, field="rank.pp_layers")
        return
    if role != "prefill":
        raise TopologyError(f"{rank} is a {role} rank: only prefill pipeline stages declare layers (rank.pp_layers); "
                            "a decode rank holds every layer", rank=rank, field="rank.pp_layers")
    if layers.end > n or (pp_size == 1 and layers.span != (0, n)):
        raise TopologyError(f"{rank} declares layers [{layers.start}, {layers.end}); "
                            + (f"the contract's model has {n} target layers" if layers.end > n else
                               f"with pp_size 1 the one stage holds every target layer [0, {n})"),
                            rank=rank, field="rank.pp_layers")
    have: dict[str, set[int]] = {}
    for i, d in enumerate(descriptors):
        have.setdefault(d.pool, set()).add(d.layer_id)
    for pool in contract.pools:
        want = set(stage_layer_ids(pool.to_spec(), layers.span, n))
        got = have.get(pool.name, set())
        if got - want:
            raise BufferSpecError(f"pool {pool.name!r} layer {min(got - want)} lies outside pipeline stage pp{pp_rank}'s "
                                  f"layers [{layers.start}, {layers.end}) (a stage registers and sends its own layers "
                                  "only)", rank=rank, field="pools")
        if want - got:
            raise BufferSpecError(f"pipeline stage pp{pp_rank} holds pool {pool.name!r} layer {min(want - got)} "
                                  f"(layers [{layers.start}, {layers.end})) but registers no buffer for it",
                                  rank=rank, field="pools")


def stage_layers_conflict(registered: Sequence[tuple[str, int, LayerRange | None]], pp_rank: int,
                          layers: LayerRange | None, pp_size: int, num_target_layers: int) -> str | None:
    """The incoming stage against the stages of its instance registered so far (``(label, pp_rank,
    layers)`` of each rank): the same stage declares the same layers on every rank, and the
    stages tile ``[0, num_target_layers)`` in stage order (``stage_conflict``). A sentence naming the
    stages, or None."""
    if layers is None:
        return None
    stages: dict[int, tuple[int, int]] = {}
    for label, s, other in registered:
        if other is None:
            continue
        if s == pp_rank and other.span != layers.span:
            return (f"stage pp{pp_rank} declares layers [{layers.start}, {layers.end}) here but "
                    f"[{other.start}, {other.end}) on {label}: every rank of a stage holds the same layers")
        stages[s] = other.span
    stages[pp_rank] = layers.span
    return stage_conflict(stages, pp_size, num_target_layers)


def sender_coords(topology: Topology, dp_rank: int, contract: RuntimeContract | None = None,
                  decode_tp: tuple[int, int] | None = None) -> list[tuple[int, int, int, int]]:
    """``(dp, cp, tp, pp)`` of the ranks that send a room of DP group ``dp_rank`` to the
    decode rank ``decode_tp = (tp_size, tp_rank)`` (TopologyError when the TP sizes do not
    fit the contract's heads). Without one: every rank that may send to some decode rank
    (all TP ranks when a pool is head-sharded, else tp 0)."""
    if contract is not None and decode_tp is not None:
        tps = tp_route([p.to_spec() for p in contract.pools], topology.tp_size, *decode_tp).sources
    elif contract is not None and any(p.tp_sharding == "heads" for p in contract.pools):
        tps = tuple(range(topology.tp_size))
    else:
        tps = (0,)
    return [(dp_rank, cp, tp, pp) for cp in range(topology.cp_size) for tp in tps for pp in range(topology.pp_size)]
