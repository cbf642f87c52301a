"""Checks at construction: an endpoint's pool specs, aux schema and lane rule must be
what its runtime contract says (the contract is what the other side agreed to).

A disagreement is a ``ConfigError`` naming the field, both values and what it
would break, raised before anything is registered: a bf16 spec under a float32
contract, or a 288-byte aux row under a 24-byte one, would otherwise move bytes
that the other side reads as something else.

A head-sharded pool's contract is the whole row; an endpoint's spec is its TP
rank's heads of it, and must be exactly the heads ``rank_heads(num_heads,
tp_size, tp_rank)`` gives (peers cut head slices by that rule).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvbridge.bootstrap.contract import AuxContract, PoolContract, RuntimeContract
from kvbridge.bootstrap.diff import breaks_for
from kvbridge.errors import ConfigError
from kvbridge.layout import AuxSchema, PoolSpec, rank_heads


def check_against_contract(
    specs: Mapping[str, PoolSpec],
    aux_schema: AuxSchema,
    contract: RuntimeContract,
    *,
    rank: str,
    lane_rule: str | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> None:
    """Raise ConfigError at the first field where the endpoint and its contract disagree."""
    if not isinstance(aux_schema, AuxSchema):
        raise ConfigError(f"aux_schema must be a kvbridge.AuxSchema, got {type(aux_schema).__name__}", rank=rank,
                          field="aux_schema")
    names, agreed = sorted(specs), sorted(p.name for p in contract.pools)
    if names != agreed:
        raise _error("pools", names, agreed, rank)
    for name in names:
        if specs[name].name != name:
            raise ConfigError(f"spec under key {name!r} is named {specs[name].name!r}", rank=rank, field="specs")
        mine, theirs = PoolContract.from_spec(specs[name]).model_dump(), contract.pool(name).model_dump()
        for key in mine:
            if mine[key] != theirs[key]:
                raise _error(f"pools.{name}.{key}", mine[key], theirs[key], rank)
        spec = specs[name]
        if spec.head_sharded:
            want = rank_heads(spec.num_heads, tp_size, tp_rank)
            if (spec.head_start, spec.head_stop) != want:
                raise ConfigError(
                    f"pools.{name}.heads: tp rank {tp_rank} of {tp_size} holds heads [{want[0]}, {want[1]}) of "
                    f"{spec.num_heads}, its spec holds [{spec.head_start}, {spec.head_stop}): "
                    f"{breaks_for(f'pools.{name}.heads')}", rank=rank, field=f"pools.{name}.heads")
    mine_aux, theirs_aux = AuxContract.from_schema(aux_schema).model_dump(), contract.aux.model_dump()
    if mine_aux != theirs_aux:
        if mine_aux["row_bytes"] != theirs_aux["row_bytes"]:
            raise _error("aux.row_bytes", mine_aux["row_bytes"], theirs_aux["row_bytes"], rank)
        raise _error("aux.regions", [_region(r) for r in mine_aux["regions"]],
                     [_region(r) for r in theirs_aux["regions"]], rank)
    if lane_rule is not None and lane_rule != contract.cp_rule:
        raise _error("cp_rule", lane_rule, contract.cp_rule, rank, mine_name="lane_rule")


def _region(r: dict) -> str:
    return f"{r['name']}:{r['dtype']}{r['shape'] or ''}"


def _error(path: str, mine: object, theirs: object, rank: str, mine_name: str = "endpoint") -> ConfigError:
    return ConfigError(
        f"{path}: the {mine_name} says {mine!r}, the contract says {theirs!r}: {breaks_for(path)}", rank=rank,
        field=path,
    )
