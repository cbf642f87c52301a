"""SGLang's ``KVArgs`` in kvbridge's terms: pools, layer ids and aux regions.

Pure: reads attributes of a ``KVArgs``-shaped object (or anything with the same
fields) and never imports SGLang. SGLang 0.5.23 hands a backend flat lists:

    kv_data_ptrs / kv_data_lens / kv_item_lens   one entry per buffer, item = one page
        MLA (DeepSeek):  target layer 0 .. L-1, then the draft's D layers
        MHA/GQA:         target k 0 .. L-1, target v 0 .. L-1, then draft k, draft v
        (num_draft_entries = how many trailing entries are the draft's)
    state_types / state_data_* / state_item_lens  one component per state type;
        DSA = the NSA index-K cache of DeepSeek V3.2: target layers, then the
        draft's; a 0-byte item is a layer without index K (it reuses a top-k)
    aux_data_* / aux_item_lens   MetadataBuffers.get_buf_infos(): one tensor per
        field, item = one row (see METADATA_FIELDS)

and kvbridge sees:

    pool     layer ids                      from
    target   0 .. L-1                       MLA target entries
    draft    L .. L+D-1                     MLA draft entries (numbered after the target)
    k, v     0 .. L-1                       MHA target entries
    draft_k, draft_v  L .. L+D-1            MHA draft entries
    index    target ids (+ draft ids)       the DSA state component
    others   per state_kinds.STATE_KINDS    the other state components, when the room endpoints
                                            carry their kind (kvbridge.ROOM_POOL_KINDS); else
                                            refused by name, naming the kind

Buffers stay addresses (``SGLangBuffer``: pointer, bytes, bytes per item; ``raw()``
gives the ``kvbridge.RawBuffer`` an endpoint takes): SGLang never hands tensors.
``check_against_contract`` compares the geometry with a runtime contract;
``pool_specs`` gives the ``PoolSpec``s for geometries kvbridge knows (DeepSeek
V3/V3.2 MLA bf16/fp8, index K, k/v pools).

A pipeline stage (``--pp-size > 1``) lists only its own target layers, from
``KVArgs.prefill_start_layer`` (``stage_layers``); ``model_specs`` turns its specs into the
whole model's, which every stage and decode share (see ``model_specs``). A hybrid or V4 stage
lists its own layers of each pool only: the model's come from its layer pattern (``model_layers``:
the model config, V4's ``mla_compression_ratios``; ``swa_full_layers`` numbers an SWA pool's
full-attention entries).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvbridge import ConfigError, PoolSpec, RawBuffer, RuntimeContract
from kvbridge.integrations.sglang.state_kinds import (HEAD_SHARDED, HybridGeometry, component_pools, room_pool_kinds,
                                                      state_kind, state_type_names, v4_kv_pools)

TARGET, DRAFT, INDEX = "target", "draft", "index"
K, V, DRAFT_K, DRAFT_V = "k", "v", "draft_k", "draft_v"
ROOM = "room"  # kvbridge's room-echo region; SGLang's bootstrap_room
DSA_STATE = "dsa"  # StateType.DSA's value

# MetadataBuffers (sglang.srt.disaggregation.utils, 0.5.23): its fields in
# get_buf_infos() order as (name, element dtype, elements per row); None = the
# width varies (max_top_logprobs_num, max_sampling_mask_tokens, hidden_size,
# the DSA top-k width) and is read from the item length. ``optional`` fields are
# present only when SGLang enables them.
METADATA_FIELDS: tuple[tuple[str, str, int | None, str], ...] = (
    ("output_ids", "int32", 16, ""),
    ("cached_tokens", "int32", 16, ""),
    ("output_token_logprobs_val", "float32", 16, ""),
    ("output_token_logprobs_idx", "int32", 16, ""),
    ("output_top_logprobs_val", "float32", None, ""),
    ("output_top_logprobs_idx", "int32", None, ""),
    ("output_token_sampling_mask_len", "int32", 16, "sampling_mask"),
    ("output_token_sampling_mask_idx", "int32", None, "sampling_mask"),
    ("output_token_sampling_logprobs", "float32", None, "sampling_mask"),
    ("output_topk_p", "float32", 16, ""),
    ("output_topk_index", "int64", 16, ""),
    ("output_hidden_states", "", None, ""),  # dtype: the model's hidden-state dtype
    ("output_dsa_topk_indices", "int32", None, "dsa_topk"),
    ("bootstrap_room", "uint64", 8, ""),
    ("kv_checksum", "uint64", 8, "kv_checksum"),
)
ITEMSIZE = {"int32": 4, "int64": 8, "uint64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"auto": "bfloat16", "bf16": "bfloat16", "bfloat16": "bfloat16", "float16": "float16",
                  "fp16": "float16", "half": "float16", "float32": "float32", "fp8_e4m3": "fp8_e4m3",
                  "mxfp8": "fp8_e4m3",  # e4m3 values; the per-32 UE8M0 scales are the BLOCK_SCALE pools
                  "fp8_e5m2": "fp8_e5m2"}  # fmt: skip


@dataclass(frozen=True)
class SGLangBuffer:
    """One engine buffer as SGLang describes it: a device address, its size in
    bytes and the bytes of one item (a page for KV and state, a row for aux)."""

    ptr: int
    nbytes: int
    item_bytes: int

    @property
    def capacity(self) -> int:
        """Whole items in the buffer (pages or rows)."""
        return self.nbytes // self.item_bytes if self.item_bytes else 0

    def raw(self, device: str) -> RawBuffer:
        """The whole items of the buffer, as kvbridge takes them."""
        return RawBuffer(self.ptr, self.capacity * self.item_bytes, device)


@dataclass(frozen=True)
class PoolBuffers:
    """One kvbridge pool: its layer ids and one buffer per layer id, in order."""

    name: str
    layer_ids: tuple[int, ...]
    buffers: tuple[SGLangBuffer, ...]

    @property
    def bytes_per_page(self) -> int:
        return self.buffers[0].item_bytes

    @property
    def capacity_pages(self) -> int:
        """Pages every layer's buffer holds (the smallest)."""
        return min(b.capacity for b in self.buffers)


@dataclass(frozen=True)
class AuxBuffer:
    """One aux region (one ``MetadataBuffers`` field): ``shape`` elements of
    ``dtype`` per row, ``buffer.capacity`` rows."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: SGLangBuffer


@dataclass(frozen=True)
class SGLangCache:
    """What one SGLang rank registers, in kvbridge's terms."""

    page_size: int
    kv_cache_dtype: str
    is_mla: bool
    pools: Mapping[str, PoolBuffers]
    aux: tuple[AuxBuffer, ...]
    # pools built from state components (state_kinds.py), with their specs: window, state, scale pools
    kind_specs: Mapping[str, PoolSpec] = field(default_factory=dict)
    # pool -> the SGLang state type (its value) it was built from, for the pools of kind_specs
    state_of: Mapping[str, str] = field(default_factory=dict)

    @property
    def aux_rows(self) -> int:
        return min(a.buffer.capacity for a in self.aux) if self.aux else 0

    def pool(self, name: str) -> PoolBuffers:
        if name not in self.pools:
            raise ConfigError(f"SGLang registered no pool {name!r}; pools are {list(self.pools)}", field="pools")
        return self.pools[name]


def read_kv_args(
    kv_args: Any,
    *,
    is_mla: bool,
    kv_checksum: bool = False,
    hidden_dtype: str = "bfloat16",
    num_hidden_layers: int | None = None,
    geometry: HybridGeometry | None = None,
) -> SGLangCache:
    """Translate one rank's ``KVArgs``. ``is_mla``: the manager's ``is_mla_backend``;
    ``kv_checksum``: SGLang's ``--disaggregation-enable-kv-checksum`` (adds an aux
    region SGLang's lists cannot tell apart from the DSA top-k one);
    ``hidden_dtype``: the dtype of ``output_hidden_states``; ``num_hidden_layers``:
    where draft layer ids start (default: after the target's); ``geometry``: what KVArgs does
    not say about a hybrid model's state (``state_kinds.HybridGeometry``). Every state
    component maps to a kvbridge pool kind (``state_kinds.STATE_KINDS``); one whose kind the
    room endpoints do not carry (``kvbridge.ROOM_POOL_KINDS``) is refused by name. Raises
    ``ConfigError`` naming the field when SGLang's lists do not fit together."""
    page_size = _positive_int(getattr(kv_args, "page_size", None), "page_size")
    if getattr(kv_args, "mla_compression_ratios", None) is not None:
        return _v4_cache(kv_args, page_size, kv_checksum=kv_checksum, hidden_dtype=hidden_dtype,
                         geometry=geometry or HybridGeometry())
    ptrs = _ints(kv_args, "kv_data_ptrs")
    lens = _ints(kv_args, "kv_data_lens")
    items = _ints(kv_args, "kv_item_lens")
    if not (len(ptrs) == len(lens) == len(items)) or not ptrs:
        raise ConfigError(
            f"KVArgs lists kv_data_ptrs/kv_data_lens/kv_item_lens have lengths {len(ptrs)}/{len(lens)}/{len(items)}; "
            "they must be equal and non-empty",
            field="kv_data_ptrs",
        )
    buffers = [SGLangBuffer(p, n, i) for p, n, i in zip(ptrs, lens, items)]
    num_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    if not 0 <= num_draft < len(buffers):
        raise ConfigError(f"num_draft_entries {num_draft} of {len(buffers)} KV entries", field="num_draft_entries")
    target, draft = buffers[: len(buffers) - num_draft], buffers[len(buffers) - num_draft :]
    explicit_ids = _ints(kv_args, "kv_layer_ids", default=[])
    per_layer = 1 if is_mla else 2
    for name, part in (("target", target), ("draft", draft)):
        if len(part) % per_layer:
            raise ConfigError(f"{len(part)} {name} KV entries for an MHA pool (k entries then v entries, one per "
                              "layer, so an even count)", field="kv_data_ptrs")  # fmt: skip
    num_target_layers = len(target) // per_layer
    start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    target_ids = tuple(range(start, start + num_target_layers))
    draft_base = num_hidden_layers if num_hidden_layers is not None else start + num_target_layers
    draft_ids = tuple(range(draft_base, draft_base + len(draft) // per_layer))
    if explicit_ids:  # hybrid pools report ids; SGLang remaps the draft's above the target's
        if len(explicit_ids) != len(buffers):
            raise ConfigError(f"{len(explicit_ids)} kv_layer_ids for {len(buffers)} KV entries", field="kv_layer_ids")
        target_ids = tuple(explicit_ids[: num_target_layers])
        draft_ids = tuple(explicit_ids[len(target) : len(target) + len(draft) // per_layer])

    pools: dict[str, PoolBuffers] = {}
    if is_mla:
        pools[TARGET] = _pool(TARGET, target_ids, target, page_size)
        if draft:
            pools[DRAFT] = _pool(DRAFT, draft_ids, draft, page_size)
    else:
        pools[K] = _pool(K, target_ids, target[:num_target_layers], page_size)
        pools[V] = _pool(V, target_ids, target[num_target_layers:], page_size)
        if draft:
            half = len(draft) // 2
            pools[DRAFT_K] = _pool(DRAFT_K, draft_ids, draft[:half], page_size)
            pools[DRAFT_V] = _pool(DRAFT_V, draft_ids, draft[half:], page_size)
    state_of: dict[str, str] = {}
    kind_specs = _state_pools(kv_args, pools, geometry or HybridGeometry(), page_size=page_size, state_of=state_of,
                              kv_dtype=_DTYPE_ALIASES.get(str(getattr(kv_args, "kv_cache_dtype_str", "auto")).lower(),
                                                          "bfloat16"), target_ids=target_ids, draft_ids=draft_ids)
    aux = read_metadata_buffers(
        _ints(kv_args, "aux_data_ptrs"), _ints(kv_args, "aux_data_lens"), _ints(kv_args, "aux_item_lens"),
        kv_checksum=kv_checksum, hidden_dtype=hidden_dtype,
    )  # fmt: skip
    dtype = str(getattr(kv_args, "kv_cache_dtype_str", "auto") or "auto")
    return SGLangCache(page_size=page_size, kv_cache_dtype=dtype, is_mla=is_mla, pools=pools, aux=aux,
                       kind_specs=kind_specs, state_of=state_of)


def _v4_cache(kv_args: Any, page_size: int, *, kv_checksum: bool, hidden_dtype: str,
              geometry: HybridGeometry) -> SGLangCache:
    """DeepSeek-V4 (``KVArgs.mla_compression_ratios`` set): its KV lists are compressed pools by
    ratio (``state_kinds.v4_kv_pools``: their units are the KV's pages), its state components
    window and state pools; refused by name while the rooms do not carry them."""
    carried = room_pool_kinds()
    if "compressed" not in carried:
        raise ConfigError(
            "SGLang's DeepSeek-V4 KV (KVArgs.mla_compression_ratios set) is kvbridge 'compressed' pools (C4, C4 "
            "indexer and C128 entries; integrations/sglang/state_kinds.py), and the room endpoints carry only "
            f"{sorted(carried)} pools (kvbridge.ROOM_POOL_KINDS) in this kvbridge; serve this model with "
            "--disaggregation-transfer-backend mooncake until they carry it", field="mla_compression_ratios")  # fmt: skip
    _refuse_uncarried(state_type_names(kv_args))
    pools: dict[str, PoolBuffers] = {}
    specs: dict[str, PoolSpec] = {}
    for made in v4_kv_pools(kv_args, page_size):
        name = made.spec.name
        bufs = [SGLangBuffer(p, n, i) for p, n, i in zip(made.ptrs, made.lens, made.items)]
        pools[name], specs[name] = _pool(name, made.spec.layer_ids, bufs, made.spec.page_size), made.spec
    target_ids = tuple(range(len(kv_args.mla_compression_ratios)))
    state_of: dict[str, str] = {}
    specs.update(_state_pools(kv_args, pools, geometry, page_size=page_size, kv_dtype="bfloat16",
                              target_ids=target_ids, draft_ids=(), state_of=state_of))
    aux = read_metadata_buffers(_ints(kv_args, "aux_data_ptrs"), _ints(kv_args, "aux_data_lens"),
                                _ints(kv_args, "aux_item_lens"), kv_checksum=kv_checksum, hidden_dtype=hidden_dtype)
    return SGLangCache(page_size=page_size, kv_cache_dtype=str(getattr(kv_args, "kv_cache_dtype_str", "auto")),
                       is_mla=True, pools=pools, aux=aux, kind_specs=specs, state_of=state_of)


def read_metadata_buffers(
    ptrs: Sequence[int],
    lens: Sequence[int],
    items: Sequence[int],
    *,
    kv_checksum: bool = False,
    hidden_dtype: str = "bfloat16",
) -> tuple[AuxBuffer, ...]:
    """Name the regions of ``MetadataBuffers.get_buf_infos()``. Which optional
    fields are present follows from the count once ``kv_checksum`` is known:
    count = 10 + 3 (sampling mask) + 1 (DSA top-k) + 1 (checksum)."""
    if not (len(ptrs) == len(lens) == len(items)):
        raise ConfigError(f"aux lists have lengths {len(ptrs)}/{len(lens)}/{len(items)}", field="aux_data_ptrs")
    if hidden_dtype not in ITEMSIZE:
        raise ConfigError(f"hidden dtype {hidden_dtype!r} is not one of {tuple(ITEMSIZE)}", field="hidden_dtype")
    optional = len(ptrs) - 10 - int(kv_checksum)
    sampling_mask, dsa_topk = divmod(optional, 3)
    if optional < 0 or sampling_mask > 1:
        raise ConfigError(
            f"{len(ptrs)} aux buffers do not match SGLang 0.5.23's MetadataBuffers (10 fields, + 3 with the "
            f"sampling mask, + 1 with DSA top-k indices, + 1 with the KV checksum; kv_checksum={kv_checksum})",
            field="aux_data_ptrs",
        )
    present = {"": True, "sampling_mask": bool(sampling_mask), "dsa_topk": bool(dsa_topk), "kv_checksum": kv_checksum}
    fields = [f for f in METADATA_FIELDS if present[f[3]]]
    out = []
    rows = None
    for (name, dtype, width, _), ptr, nbytes, item in zip(fields, ptrs, lens, items):
        dtype = dtype or hidden_dtype
        size = ITEMSIZE[dtype]
        if item <= 0 or item % size or (width is not None and item != width * size):
            expected = f"{width} x {dtype}" if width is not None else f"a multiple of {size} ({dtype})"
            raise ConfigError(f"aux region {name}: {item} bytes per row, expected {expected}",
                              field=f"aux.{name}")  # fmt: skip
        buf = SGLangBuffer(ptr, nbytes, item)
        if rows is not None and buf.capacity != rows:
            raise ConfigError(f"aux region {name}: {buf.capacity} rows, the regions before it {rows}",
                              field=f"aux.{name}")  # fmt: skip
        rows = buf.capacity
        out.append(AuxBuffer(ROOM if name == "bootstrap_room" else name, dtype, (item // size,), buf))
    pairs = {a.name: a.shape for a in out}
    for val, idx in (("output_top_logprobs_val", "output_top_logprobs_idx"),
                     ("output_token_sampling_mask_idx", "output_token_sampling_logprobs")):  # fmt: skip
        if val in pairs and pairs[val] != pairs[idx]:
            raise ConfigError(f"aux regions {val} {pairs[val]} and {idx} {pairs[idx]} differ in width",
                              field=f"aux.{idx}")  # fmt: skip
    return tuple(out)


def check_against_contract(cache: SGLangCache, contract: RuntimeContract) -> dict[str, PoolSpec]:
    """The contract's ``PoolSpec``s, after checking that SGLang registered exactly
    those pools with the same layer ids, page size and bytes per page."""
    specs = {p.name: p.to_spec() for p in contract.pools}
    if set(specs) != set(cache.pools):
        raise ConfigError(
            f"SGLang registers pools {sorted(cache.pools)}, the contract has {sorted(specs)}: a pool on one side "
            "only would never be sent or never be filled",
            field="pools",
        )
    for name, spec in specs.items():
        pool = cache.pools[name]
        own_page = cache.kind_specs[name].page_size if name in cache.kind_specs else cache.page_size
        if spec.page_size != own_page:
            raise ConfigError(f"pool {name!r}: SGLang's page size {own_page}, the contract's "
                              f"{spec.page_size}: pages would be cut differently",
                              field=f"pools.{name}.page_size")  # fmt: skip
        if sorted(spec.layer_ids) != sorted(pool.layer_ids):
            raise ConfigError(f"pool {name!r}: SGLang registers layers {_span(pool.layer_ids)}, the contract has "
                              f"{_span(spec.layer_ids)}: layers would be paired wrongly or not at all",
                              field=f"pools.{name}.layer_ids")  # fmt: skip
        if spec.bytes_per_page != pool.bytes_per_page:
            raise ConfigError(f"pool {name!r}: SGLang's pages are {pool.bytes_per_page} bytes, the contract's "
                              f"{spec.bytes_per_page} ({spec.page_size} tokens x {spec.bytes_per_token} B): "
                              "rows would land at the wrong offsets", field=f"pools.{name}.bytes_per_page")  # fmt: skip
    return specs


def stage_layers(cache: SGLangCache, kv_args: Any, pattern: ModelLayers | None = None) -> tuple[int, int]:
    """A pipeline stage's target layers ``[start, end)``. A dense model: SGLang lists the stage's
    own layers from ``KVArgs.prefill_start_layer`` on, and sets ``prefill_end_layer`` (the pool's
    end layer) where the pool has one; the two must agree. With the model's layer ``pattern``
    (hybrid and V4 models: ``prefill_start_layer`` counts full-attention layers there, and a
    hybrid pool has no end layer) the range is read off the layers the stage's pools hold: from
    just after the model's previous layer that holds anything (0 for the first stage) to its last
    own layer (to the model's end for the last stage), so that the stages tile the model."""
    if pattern is None:
        if TARGET not in cache.pools and K not in cache.pools:
            raise ConfigError(f"a pipeline stage registering pools {sorted(cache.pools)} and no target or k pool: "
                              "its layers follow from the model's layer pattern, which this manager was not given "
                              "(the scheduler's model_config)", field="model_config")  # fmt: skip
        ids = cache.pools[TARGET if cache.is_mla else K].layer_ids
        start, end = ids[0], ids[-1] + 1
        given = getattr(kv_args, "prefill_end_layer", None)
        if given is not None and int(given) != end:
            raise ConfigError(f"KVArgs.prefill_end_layer {given}, but the stage lists {len(ids)} target layers from "
                              f"prefill_start_layer {start} (to {end})", field="prefill_end_layer")  # fmt: skip
        return start, end
    own = sorted({i for p in cache.pools.values() for i in p.layer_ids if i < pattern.num_layers})
    if not own:
        raise ConfigError(f"the pipeline stage's pools {sorted(cache.pools)} hold none of the model's "
                          f"{pattern.num_layers} target layers", field="prefill_start_layer")
    cached = np.asarray(pattern.cached, dtype=np.int64)
    before, after = cached[cached < own[0]], cached[cached > own[-1]]
    return int(before[-1]) + 1 if before.size else 0, own[-1] + 1 if after.size else pattern.num_layers


def model_specs(own: Mapping[str, PoolSpec], layers: tuple[int, int], num_target_layers: int,
                model: Mapping[str, PoolSpec] | None = None,
                pattern: ModelLayers | None = None) -> dict[str, PoolSpec]:
    """The whole model's specs from a pipeline stage's own (``pool_specs`` of its ``KVArgs``, target
    layers ``layers``); every stage and decode must build the same contract from them.

    A dense model (``pattern`` None): the last stage (``layers`` ends at ``num_target_layers``, the
    end of its own range) knows the model: a pool's ids in its range become
    ``[0, num_target_layers)``, ids past it (draft layers, numbered after the target's) stay.
    A hybrid or V4 model (``pattern``: the model's layer pattern, ``model_layers``): each pool's
    ids are the model's layers of it (``ModelLayers.layers_of``), checked against the stage's own
    within its range (ConfigError naming the pool where SGLang lists others), so any stage knows
    them. Another stage does not know, on every SGLang set-up, the draft layers (with
    ``SGLANG_ENABLE_PP_SPEC`` only the last stage lists a draft pool) nor, for a dense model, the
    model's layer count: ``model`` is the last stage's (its registered contract's specs), and each
    pool takes its layer ids from there, its geometry from this stage's own spec where the stage
    holds the pool's layers (ConfigError naming the pool where the two differ), else (the draft
    pools, sent by the last stage only) the last stage's spec."""
    start, end = layers
    if pattern is None:
        unpaged = sorted(f"{n} ({s.kind})" for n, s in own.items() if s.kind != "paged")
        if unpaged:
            mine = ", ".join(f"{n} {list(s.layer_ids)}" for n, s in sorted(own.items()))
            raise ConfigError(f"pipeline stage layers [{start}, {end}) with window, compressed or state pools "
                              f"{unpaged}: SGLang's KVArgs list this stage's own layers of each pool only ({mine}); "
                              "the model's layers of each come from SGLang's model config (the scheduler's "
                              "model_config: full_attention_layer_ids, linear_layer_ids or mamba_layer_ids), which "
                              "this manager was not given", field="model_config")  # fmt: skip
        for name, spec in own.items():  # a dense stage's pools hold every layer of its range, or none
            held = [i for i in spec.layer_ids if start <= i < end]
            if held and held != list(range(start, end)):
                raise ConfigError(f"pool {name!r} of pipeline stage layers [{start}, {end}) holds layers "
                                  f"{_span(held)} only: a dense model's pools hold every layer of a stage; give the "
                                  "manager the model's layer pattern (the scheduler's model_config)",
                                  field=f"pools.{name}.layer_ids")  # fmt: skip
    else:
        num_target_layers = pattern.num_layers
        own = {name: _model_pool(name, spec, layers, pattern) for name, spec in own.items()}
    if model is None:
        if end != num_target_layers:
            raise ConfigError(f"pipeline stage layers [{start}, {end}) do not end the model's {num_target_layers} "
                              "target layers: only the last stage knows them alone", field="prefill_end_layer")
        if pattern is not None:
            return own
        every = tuple(range(num_target_layers))
        return {name: spec if not any(start <= i < end for i in spec.layer_ids) else
                replace(spec, layer_ids=every + tuple(i for i in spec.layer_ids if i >= end))
                for name, spec in own.items()}  # fmt: skip
    extra = sorted(set(own) - set(model))
    if extra:
        raise ConfigError(f"this pipeline stage registers pools {extra} that the last stage's contract does not "
                          f"have ({sorted(model)}): the stages of one prefill serve one model", field="pools")
    # this rank's heads of a head-sharded cache (MHA/GQA over attention TP): the last stage's specs are
    # whole rows (the contract's), this rank's share of them is what it registers
    sharded = next(((m.head_start, m.head_stop) for m in own.values() if m.num_heads), None)
    out = {}
    for name, theirs in model.items():
        if theirs.num_heads and sharded is not None:
            theirs = theirs.with_heads(*sharded)
        mine = own.get(name)
        if mine is None or not any(start <= i < end for i in mine.layer_ids):
            out[name] = theirs
            continue
        held = [i for i in mine.layer_ids if start <= i < end]
        missing = sorted(set(held) - set(theirs.layer_ids))
        if missing or replace(mine, layer_ids=theirs.layer_ids) != theirs or \
                held != [i for i in theirs.layer_ids if start <= i < end]:
            why = (f"layers {_span(missing)} are not in its layers {_span(theirs.layer_ids)}" if missing else
                   f"{mine} here, {theirs} there")
            raise ConfigError(f"pool {name!r} of pipeline stage layers [{start}, {end}) differs from the last "
                              f"stage's contract: {why}", field=f"pools.{name}")  # fmt: skip
        out[name] = theirs
    return out


def _model_pool(name: str, spec: PoolSpec, layers: tuple[int, int], pattern: ModelLayers) -> PoolSpec:
    """``spec`` (a stage's own) over the model's layers of it, after checking the stage's own ids
    are the model's in the stage's range; a draft-numbered pool keeps its ids (past the target's)."""
    start, end = layers
    n = pattern.num_layers
    want = pattern.layers_of(name)
    if want is None:
        if any(i < n for i in spec.layer_ids):
            raise ConfigError(f"pool {name!r}: layers {_span(spec.layer_ids)} are numbered as the draft's, after the "
                              f"model's {n} target layers, but some are not", field=f"pools.{name}.layer_ids")
        return spec
    held = [i for i in spec.layer_ids if i < n]
    if held != [i for i in want if start <= i < end]:
        raise ConfigError(f"pool {name!r} of pipeline stage layers [{start}, {end}): SGLang registers its layers "
                          f"{list(held)}, the model's layer pattern (the model config) has "
                          f"{[i for i in want if start <= i < end]} of it there: the stages' layers would not pair "
                          "with decode's", field=f"pools.{name}.layer_ids")  # fmt: skip
    return replace(spec, layer_ids=tuple(want) + tuple(i for i in spec.layer_ids if i >= n))


def head_range(num_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """KV heads ``[h0, h1)`` of attention TP rank ``tp_rank``, as SGLang shards an MHA/GQA cache:
    ``num_heads / tp_size`` consecutive heads each when TP divides the heads; one head each when
    TP exceeds them (rank r holds head ``r * num_heads // tp_size``: replicated)."""
    if num_heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"KV heads {num_heads} over attention TP rank {tp_rank} of {tp_size}", field="kv_head_num")
    if tp_size <= num_heads:
        if num_heads % tp_size:
            raise ConfigError(f"{num_heads} KV heads do not split evenly over attention TP {tp_size}",
                              field="total_kv_head_num")  # fmt: skip
        per = num_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % num_heads:
        raise ConfigError(f"attention TP {tp_size} is not a multiple of the {num_heads} KV heads it replicates",
                          field="total_kv_head_num")  # fmt: skip
    head = tp_rank * num_heads // tp_size
    return head, head + 1


def pool_specs(cache: SGLangCache, heads: tuple[int, int, int] | None = None) -> dict[str, PoolSpec]:
    """``PoolSpec``s for the geometries kvbridge knows: DeepSeek MLA in bf16
    (1152 B/token), fp8 with scales (656 B/token: V3.2's DSA pool) or plain fp8
    (576 B/token: SGLang's MLA pool for V3, one scale per tensor), the NSA index K
    (128 fp8 values then 4 scale bytes per token) and plain k/v pools in
    bf16/fp16/fp32/fp8. ``heads`` = (KV heads of the whole row, first, stop): the k/v pools
    are head-sharded over attention TP and this rank's rows hold heads ``[first, stop)``.
    Anything else raises ``ConfigError``: describe it with ``PoolSpec`` yourself."""
    dtype = _DTYPE_ALIASES.get(cache.kv_cache_dtype.lower())
    sharding = {} if heads is None else dict(zip(("num_heads", "head_start", "head_stop"), heads))
    out = {}
    for name, pool in cache.pools.items():
        if name in cache.kind_specs:  # built from a state component, with its geometry (state_kinds.py)
            kind_spec = cache.kind_specs[name]
            if heads is not None and name in HEAD_SHARDED:  # KV heads per row, like the k/v pools
                kind_spec = replace(kind_spec, **sharding)
            out[name] = kind_spec
            continue
        per_token, rem = divmod(pool.bytes_per_page, cache.page_size)
        geometry = dict(name=name, page_size=cache.page_size, layer_ids=pool.layer_ids, bytes_per_token=per_token)
        if rem:
            raise ConfigError(f"pool {name!r}: {pool.bytes_per_page} bytes per page is not a whole number of "
                              f"{cache.page_size}-token rows", field=f"pools.{name}.bytes_per_page")  # fmt: skip
        if name == INDEX and per_token == 132:
            out[name] = PoolSpec(dtype="fp8_e4m3", abi="uint8", layout="values_then_scales",
                                 value_bytes_per_token=128, scale_bytes_per_token=4,
                                 kernel_abi="nsa-index-k-fp8-uint8", **geometry)  # fmt: skip
        elif cache.is_mla and dtype == "bfloat16" and per_token == 1152:
            out[name] = PoolSpec(dtype="bfloat16", abi="bfloat16", kernel_abi="mla-bf16", **geometry)
        elif cache.is_mla and dtype == "fp8_e4m3" and per_token == 656:  # DSA (V3.2): FlashMLA's fp8 with scales
            out[name] = PoolSpec(dtype="fp8_e4m3_with_scale", abi="uint8", kernel_abi="mla-fp8-656", **geometry)
        elif cache.is_mla and dtype in ("fp8_e4m3", "fp8_e5m2") and per_token == 576:  # V3: one fp8 per value
            out[name] = PoolSpec(dtype=dtype, abi="uint8", kernel_abi=f"mla-{dtype}-576", **geometry)
        elif not cache.is_mla and dtype in ("bfloat16", "float16", "float32") and name != INDEX:
            out[name] = PoolSpec(dtype=dtype, abi=dtype, **geometry, **sharding)
        elif not cache.is_mla and dtype in ("fp8_e4m3", "fp8_e5m2") and name != INDEX:
            out[name] = PoolSpec(dtype=dtype, abi="uint8", **geometry, **sharding)
        else:
            raise ConfigError(
                f"pool {name!r}: no known kvbridge geometry for {'MLA' if cache.is_mla else 'MHA'} "
                f"kv_cache_dtype {cache.kv_cache_dtype!r} with {per_token} bytes per token; build its PoolSpec "
                "by hand", field=f"pools.{name}",
            )  # fmt: skip
    return out


# -- the model's layer pattern (pipeline stages of hybrid and V4 models) ------------------------------

# which of the model's layers each pool spans, by the layer set ``ModelLayers`` names; pools not
# listed here and not numbered as the draft's have no rule, and a stage holding one is refused
_FULL_POOLS = frozenset({K, V, TARGET, INDEX, "k_scale", "v_scale", "index_tail_k", "index_tail_score"})
_SWA_POOLS = frozenset({"swa_k", "swa_v", "swa_k_scale", "swa_v_scale"})
_V4_POOLS = {"swa": 0, "swa_ring": 0, "swa_ring_rope": 0, "c4": 4, "c4_index": 4, "c4_state": 4,
             "c4_index_state": 4, "c128": 128, "c128_state": 128}  # pool -> its layers' ratio (0: every layer)
_DRAFT_NUMBERED = frozenset({"draft", "draft_k", "draft_v", "request_row"})  # ids past the target layers


@dataclass(frozen=True)
class ModelLayers:
    """The model's layer pattern, which a pipeline stage's ``KVArgs`` do not give (they list the
    stage's own layers of each pool): ``num_layers`` target layers, of which ``full`` have KV pages
    (k/v or MLA, index K), ``mamba`` Mamba / linear-attention state and ``swa`` an SWA pool's
    pages; DeepSeek-V4's ``ratios`` (``KVArgs.mla_compression_ratios``, the whole model's) say
    its pools' layers instead. From ``model_layers``."""

    num_layers: int
    full: tuple[int, ...] = ()
    mamba: tuple[int, ...] = ()
    swa: tuple[int, ...] = ()
    ratios: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("full", "mamba", "swa"):
            ids = getattr(self, name)
            if any(not 0 <= i < self.num_layers for i in ids) or list(ids) != sorted(set(ids)):
                raise ConfigError(f"the model config's {name} layer ids {list(ids)} are not distinct ids of its "
                                  f"{self.num_layers} layers", field=f"model_config.{name}_layer_ids")

    def layers_of(self, pool: str) -> tuple[int, ...] | None:
        """The model's layers of ``pool``; None for a pool numbered as the draft's (after the target
        layers: the last stage's); ConfigError naming the pool where no rule says."""
        if self.ratios and pool in _V4_POOLS:
            r = _V4_POOLS[pool]
            return tuple(i for i, got in enumerate(self.ratios) if not r or got == r)
        if not self.ratios and pool in _FULL_POOLS:
            return self.full
        if not self.ratios and pool in _SWA_POOLS:
            return self.swa
        if not self.ratios and pool.startswith("mamba_"):
            return self.mamba
        if pool in _DRAFT_NUMBERED or pool.startswith("draft_"):
            return None
        raise ConfigError(f"pool {pool!r}: kvbridge's SGLang backend has no rule for which of the model's layers it "
                          "spans, so a pipeline stage cannot build the model's contract for it; serve this model "
                          "with --pp-size 1", field=f"pools.{pool}")

    @property
    def cached(self) -> tuple[int, ...]:
        """The layers that hold anything a room moves."""
        if self.ratios:
            return tuple(range(self.num_layers))
        return tuple(sorted(set(self.full) | set(self.mamba) | set(self.swa)))


def swa_full_layers(cache: SGLangCache, queue: Any, pattern: ModelLayers | None) -> SGLangCache:
    """A sliding-window hybrid's full-attention pools (k/v and their MXFP8 scales) numbered by the
    model's layers. SGLang's ``SWAKVPool`` lists its full-attention KV entries without layer ids
    (``kv_layer_ids`` empty) from ``start_layer`` 0 on every pipeline stage, so ``read_kv_args``
    numbers them 0, 1, ..; the pool's ``layers_mapping`` (the queue's ``token_to_kv_pool``) names
    the model layer of each. Unchanged without an SWA ``pattern`` or that mapping."""
    mapping = getattr(getattr(queue, "token_to_kv_pool", None), "layers_mapping", None)
    if pattern is None or not pattern.swa or pattern.ratios or not isinstance(mapping, dict):
        return cache
    full = tuple(sorted(int(layer) for layer, (_, is_swa) in mapping.items() if not is_swa))
    pools, specs = dict(cache.pools), dict(cache.kind_specs)
    for name in (K, V, TARGET, "k_scale", "v_scale"):
        pool = pools.get(name)
        if pool is None:
            continue
        if len(pool.layer_ids) != len(full):
            raise ConfigError(f"pool {name!r}: {len(pool.layer_ids)} full-attention KV entries, and the SWA pool's "
                              f"layers_mapping names {len(full)} full-attention layers {list(full)}",
                              field=f"pools.{name}.layer_ids")  # fmt: skip
        pools[name] = replace(pool, layer_ids=full)
        if name in specs:
            specs[name] = replace(specs[name], layer_ids=full)
    return replace(cache, pools=pools, kind_specs=specs)


def model_layers(kv_args: Any, queue: Any = None) -> ModelLayers | None:
    """The model's layer pattern where it is not its dense KV pool's: DeepSeek-V4 from
    ``KVArgs.mla_compression_ratios``; a hybrid from the model config of the SGLang queue building
    the manager (``queue.scheduler.model_config``: ``num_hidden_layers``, the hybrid SWA models'
    ``full_attention_layer_ids`` / ``swa_attention_layer_ids``, else its ``hf_text_config``'s
    ``full_attention_layer_ids`` and ``linear_layer_ids`` / ``mamba_layer_ids``). None for a
    dense model (every layer one KV pool) or without a model config."""
    ratios = getattr(kv_args, "mla_compression_ratios", None)
    if ratios is not None:
        return ModelLayers(len(ratios), ratios=tuple(int(r) for r in ratios))
    config = getattr(getattr(queue, "scheduler", None), "model_config", None)
    num = getattr(config, "num_hidden_layers", None)
    if config is None or not num:
        return None
    text = getattr(config, "hf_text_config", None)

    def ids(*names: str) -> tuple[int, ...] | None:
        for owner in (config, text):
            for name in names:
                got = getattr(owner, name, None)
                if got is not None:
                    return tuple(int(i) for i in got)
        return None

    full = ids("full_attention_layer_ids")
    swa = ids("swa_attention_layer_ids") or ()
    mamba = ids("linear_layer_ids", "mamba_layer_ids") or ()
    if not swa and not mamba:
        return None  # dense: its KV pools hold every layer of a stage
    return ModelLayers(int(num), full=tuple(range(int(num))) if full is None else full, mamba=mamba, swa=swa)


# -- helpers ---------------------------------------------------------------------------


def _pool(name: str, layer_ids: tuple[int, ...], buffers: Sequence[SGLangBuffer], page_size: int) -> PoolBuffers:
    sizes = {b.item_bytes for b in buffers}
    if len(sizes) != 1:
        raise ConfigError(f"pool {name!r}: its layers have different page sizes in bytes {sorted(sizes)}",
                          field=f"pools.{name}.bytes_per_page")  # fmt: skip
    (size,) = sizes
    if size <= 0 or size % page_size:
        raise ConfigError(f"pool {name!r}: {size} bytes per page is not {page_size} whole token rows",
                          field=f"pools.{name}.bytes_per_page")  # fmt: skip
    for layer, b in zip(layer_ids, buffers):
        if b.capacity < 1 or b.ptr <= 0:
            raise ConfigError(f"pool {name!r} layer {layer}: buffer at {b.ptr:#x} of {b.nbytes} bytes holds no "
                              f"page of {size} bytes", field=f"pools.{name}.buffers")  # fmt: skip
    return PoolBuffers(name, tuple(layer_ids), tuple(buffers))


def _refuse_uncarried(types: Sequence[str]) -> None:
    """The first state component (in SGLang's order) whose kind the rooms do not carry, or that
    has no kind, refused by name."""
    carried = room_pool_kinds()
    for st in types:
        kind = state_kind(st)
        if kind not in carried:
            raise ConfigError(
                f"SGLang state {st!r} maps to kvbridge {kind!r} pools (integrations/sglang/state_kinds.py), and the "
                f"room endpoints carry only {sorted(carried)} pools (kvbridge.ROOM_POOL_KINDS) in this kvbridge; "
                "serve this model with --disaggregation-transfer-backend mooncake until they carry it",
                field="state_types")  # fmt: skip


def _state_pools(kv_args: Any, pools: dict[str, PoolBuffers], geometry: HybridGeometry, *, page_size: int,
                 kv_dtype: str, target_ids: tuple[int, ...], draft_ids: tuple[int, ...],
                 state_of: dict[str, str] | None = None) -> dict[str, PoolSpec]:
    """Every state component of ``kv_args`` as kvbridge pools, added to ``pools``; returns the
    specs of those that are not the DSA index (whose geometry ``pool_specs`` knows). A component
    whose kind the room endpoints do not carry is refused by name (the first one, in SGLang's
    order), as is one kvbridge has no kind for."""
    types = state_type_names(kv_args)
    _refuse_uncarried(types)
    specs: dict[str, PoolSpec] = {}
    seen: set[str] = set()
    for at, st in enumerate(types):
        if st == DSA_STATE:
            if st in seen:
                raise ConfigError(f"{types.count(DSA_STATE)} DSA state components, expected one", field="state_types")
            index = _index_pool(kv_args, at, target_ids, draft_ids, page_size)
            if index is not None:
                pools[INDEX] = index
        else:
            for made in component_pools(kv_args, at, geometry, page_size=page_size, kv_dtype=kv_dtype,
                                        target_ids=target_ids, draft_ids=draft_ids, draft_component=st in seen):
                name = made.spec.name
                if name in pools:
                    raise ConfigError(f"SGLang state {st!r}: pool {name!r} twice", field=f"pools.{name}")
                bufs = [SGLangBuffer(p, n, i) for p, n, i in zip(made.ptrs, made.lens, made.items)]
                pools[name] = _pool(name, made.spec.layer_ids, bufs, made.spec.page_size)
                specs[name] = made.spec
                if state_of is not None:
                    state_of[name] = st
        seen.add(st)
    return specs


def _index_pool(
    kv_args: Any, at: int, target_ids: tuple[int, ...], draft_ids: tuple[int, ...], page_size: int
) -> PoolBuffers | None:
    """The DSA component (V3.2's index K): target layers, then the draft's; a 0-byte item is a
    layer without index K (it reuses a top-k)."""
    ptrs = list(kv_args.state_data_ptrs[at])
    lens = list(kv_args.state_data_lens[at])
    items = list(kv_args.state_item_lens[at])
    ids = target_ids + draft_ids
    if not (len(ptrs) == len(lens) == len(items)) or len(ptrs) not in (len(target_ids), len(ids)):
        raise ConfigError(
            f"DSA state has {len(ptrs)}/{len(lens)}/{len(items)} ptrs/lens/items for {len(target_ids)} target and "
            f"{len(draft_ids)} draft layers",
            field="state_data_ptrs",
        )
    kept = [(lid, SGLangBuffer(p, n, i)) for lid, p, n, i in zip(ids, ptrs, lens, items) if i > 0]
    if not kept:
        return None
    return _pool(INDEX, tuple(lid for lid, _ in kept), [b for _, b in kept], page_size)


def _ints(obj: Any, name: str, default: list[int] | None = None) -> list[int]:
    value = getattr(obj, name, None)
    if value is None:
        if default is not None:
            return list(default)
        raise ConfigError(f"KVArgs has no {name}", field=name)
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"KVArgs.{name} is not a list of integers: {value!r}", field=name) from None


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"KVArgs.{name} must be a positive integer, got {value!r}", field=name)
    return value


def _span(ids: Sequence[int]) -> str:
    ids = sorted(ids)
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return str(ids)
