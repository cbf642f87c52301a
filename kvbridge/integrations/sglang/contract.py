"""The runtime contract of an SGLang rank, from what it registers.

Built with ``kvbridge.contract_for`` from the pools and aux regions ``kvargs``
reads out of ``KVArgs``, so prefill and decode servers started with the same
model and KV settings build the same contract without sharing a file:

    model        --served-model-name (else --model-path), --revision, the weights' identity
                 (settings.model_weights: KVBRIDGE_WEIGHTS), target / draft layers
    pools        kvargs.pool_specs: MLA target (+ draft), NSA index K, or k/v pools
    cp_rule      prefill: its CP mode (cp_modes.lane_rule); decode: the prefill instance's
    kernel       "sglang-<version>" with SGLang's KV byte layout tag (KVArgs.kv_layout)
    speculative  --speculative-algorithm, the hidden state's width and dtype, --speculative-eagle-topk
    aux          every MetadataBuffers field, in SGLang's order, bootstrap_room as "room"

``KVBRIDGE_CONTRACT`` names a contract file to use instead; it is checked against
the pools SGLang registered (``kvargs.check_against_contract``) and the aux regions.

A pipeline stage (``--pp-size > 1``) registers its own layers but the whole model's contract
(docs/pipeline.md): the last stage builds it from its own pools (``kvargs.model_specs``); any
other stage takes the model's layers from the last stage's contract (or the contract file) and
checks its own pools against it. A hybrid or V4 model's stage lists only its own layers of each
pool: the model's come from its layer pattern (``kvargs.model_layers``: the model config, V4's
``mla_compression_ratios``), which also sets the contract's target layer count on every rank.
"""

from __future__ import annotations

from pathlib import Path

from kvbridge import AuxRegion, AuxSchema, ConfigError, PoolSpec, RuntimeContract, contract_for
from kvbridge.integrations.sglang.kvargs import (ModelLayers, SGLangCache, check_against_contract, model_specs,
                                                pool_specs)
from kvbridge.integrations.sglang.settings import Settings


def aux_schema(cache: SGLangCache) -> AuxSchema:
    """The aux row: one region per MetadataBuffers field, in SGLang's order."""
    return AuxSchema(tuple(AuxRegion(a.name, a.dtype, a.shape) for a in cache.aux))


def rank_contract(cache: SGLangCache, settings: Settings, *, lane_rule: str, kv_layout: str | None,
                  sglang_version: str, heads: tuple[int, int, int] | None = None,
                  stage: tuple[int, int] | None = None, model: RuntimeContract | None = None,
                  weights: str = "unspecified",
                  pattern: ModelLayers | None = None) -> tuple[dict[str, PoolSpec], AuxSchema, RuntimeContract]:
    """``(specs, aux schema, contract)`` of one rank; ConfigError naming the field when SGLang's
    pools do not fit the contract file. ``heads``: (KV heads of the row, first, stop) of this
    rank's head-sharded k/v pools (MHA/GQA over attention TP > 1); the contract holds whole rows.
    ``stage``: a pipeline stage's target layers ``[start, end)``; ``model``: for a stage but the
    last, the last stage's contract (the specs returned are the whole model's either way).
    ``pattern``: the model's layer pattern (``kvargs.model_layers``: hybrid and V4 models), which
    gives a stage its pools' model layers and the contract its target layer count."""
    schema = aux_schema(cache)
    if settings.contract_path and stage is not None:
        model = _contract_file(settings.contract_path)
    if model is not None:  # a stage that does not know the model alone: the model's contract, checked
        theirs = {p.name: p.to_spec() for p in model.pools}
        specs = model_specs(pool_specs(cache, heads), stage, model.model.target_layers, theirs, pattern)
        source = f"KVBRIDGE_CONTRACT={settings.contract_path}" if settings.contract_path else \
            "the last stage's contract"
        _check_aux(model, schema, source)
        return specs, schema, model
    if settings.contract_path:
        contract = _contract_file(settings.contract_path)
        if heads is not None:
            raise ConfigError(f"KVBRIDGE_CONTRACT={settings.contract_path} with a head-sharded MHA/GQA cache: "
                              "build the contract from SGLang's pools instead (unset KVBRIDGE_CONTRACT)",
                              field="KVBRIDGE_CONTRACT")
        specs = check_against_contract(cache, contract)
        _check_aux(contract, schema, f"KVBRIDGE_CONTRACT={settings.contract_path}")
        return specs, schema, contract
    specs = pool_specs(cache, heads)
    if stage is not None:  # the last stage: its layers end the model's
        specs = model_specs(specs, stage, stage[1], pattern=pattern)
    target = specs.get("target") or specs.get("k")
    draft = specs.get("draft") or specs.get("draft_k")
    # a hybrid or V4 model: its layer pattern's count (pools hold some layers each; ids past it are
    # the draft's); DeepSeek-V4 without it has no per-layer KV pool: the layers its pools are numbered over
    layers = pattern.num_layers if pattern is not None else target.num_layers if target else \
        1 + max(i for s in specs.values() for i in s.layer_ids)
    model = {"name": settings.model_name, "revision": settings.revision, "weights": weights,
             "target_layers": layers, "draft_layers": draft.num_layers if draft else 0}
    hidden = schema.region("output_hidden_states")
    speculative = None
    if settings.spec_algorithm != "none":
        speculative = {"algorithm": settings.spec_algorithm, "hidden_size": hidden.count, "hidden_dtype": hidden.dtype,
                       "topk": settings.spec_topk}
    kernel = {"attention_backend": f"sglang-{sglang_version}", "abi": f"kv_layout={kv_layout or 'default'}"}
    contract = contract_for(specs, model=model, aux=schema, lane_rule=lane_rule, kernel=kernel, speculative=speculative)
    return specs, schema, contract


def _contract_file(path: str) -> RuntimeContract:
    try:
        return RuntimeContract.model_validate_json(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"KVBRIDGE_CONTRACT={path}: not a runtime contract ({exc})",
                          field="KVBRIDGE_CONTRACT") from None


def _check_aux(contract: RuntimeContract, schema: AuxSchema, source: str) -> None:
    if contract.aux.to_schema() != schema:
        raise ConfigError(f"{source}: its aux regions {list(contract.aux.to_schema().names)} are not SGLang's "
                          f"metadata buffers {list(schema.names)}: the first token and the draft state would land in "
                          "the wrong bytes", field="aux.regions")
