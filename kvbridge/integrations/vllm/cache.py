"""vLLM's KV cache in kvbridge's terms: one pool, one buffer per layer, and the contract.

vLLM (0.32) hands a worker one tensor per attention layer, the logical page grid
``[B, H, N, C]`` (blocks, KV head slots, tokens of a block, the cell: a head's K then
V for MHA/GQA, the latent for MLA) in a physical order its ``KVCacheLayout`` names:

    LBNHC (NHD)  block = N token rows | row = H cells, head-major   -> kvbridge "rows"
                 |t0: h0 h1 .. | t1: h0 h1 .. | ...                    head-sharded over TP
    LBHNC (HND)  block = H head runs  | run = N cells                -> whole blocks, same TP
                 |h0: t0 t1 .. | h1: t0 t1 .. | ...
    MLA          H = 1: both orders are the same rows (the latent is replicated over TP)

so kvbridge sees:

    pool   layer ids            bytes per token      heads
    kv     0 .. L-1 (MHA/GQA)   H_rank * C           NHD: [h0, h1) of the model's KV heads
    mla    0 .. L-1 (MLA)       C                    replicated

Hybrid groups (``KVBridgeHMAConnector``): each KV cache group's layers are a cache of their own
(``read_group_caches``; a sliding-window group a window pool, ``window_spec``), and the tensor
vLLM shares between one layer of each group is registered once (``SharedRegions``).

Layer ids come from the layer's name (``model.layers.7.self_attn.attn`` is 7), never
from the dict's order (hard rule 8). A block is addressed as vLLM allocates it: the
buffer of layer ``l`` is ``[data_ptr, + num_blocks * block bytes)``; kernel blocks that
subdivide a manager block (``shape[0] = num_blocks * ratio``) are contiguous in it.

An HND block holds each head's tokens apart, so the valid rows of a partial block are H
ranges and a head range is a byte range of the block: kvbridge's ``rows`` layout has
neither, so HND moves whole blocks (a block's tail beyond the prompt is never read by
vLLM's attention and is overwritten by decode's next tokens), and the TP size goes into
the contract (a prefill and a decode of different TP under HND are refused at start-up,
naming ``kernel.abi``). Layouts with the block outermost (several layers in one block)
are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvbridge import (
    AuxRegion,
    AuxSchema,
    ConfigError,
    PoolSpec,
    RawBuffer,
    RuntimeContract,
    contract_for,
    rank_heads,
    window_pool,
)

NHD, HND, MLA = "LBNHC", "LBHNC", "MLA"
KV_POOL, MLA_POOL = "kv", "mla"
AUX_SCHEMA = AuxSchema((AuxRegion("room", "uint64"),))  # vLLM recomputes the last token: the row is the echo
_ABI = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "uint8": "uint8", "int8": "uint8",
        "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}  # fmt: skip


@dataclass(frozen=True)
class LayerBuffer:
    layer_id: int
    name: str
    ptr: int
    nbytes: int
    device: str


@dataclass(frozen=True)
class VLLMCache:
    """One worker's KV cache: its layout, geometry and per-layer buffers."""

    layout: str  # NHD, HND or MLA
    dtype: str  # what the bytes mean (torch dtype name without "torch.")
    abi: str  # what they are stored as (kvbridge.PoolSpec.abi)
    block_size: int
    num_blocks: int
    num_heads: int  # KV head slots in this rank's block (1 for MLA)
    cell_bytes: int  # C: one head slot of one token
    layers: tuple[LayerBuffer, ...]
    pool_name: str = ""  # hybrid groups: the group's pool (group<i>); else kv / mla

    @property
    def pool(self) -> str:
        return self.pool_name or (MLA_POOL if self.layout == MLA else KV_POOL)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_heads * self.cell_bytes

    @property
    def whole_blocks(self) -> bool:
        """HND moves whole blocks (see the module docstring)."""
        return self.layout == HND

    def buffers(self) -> dict[tuple[str, int], RawBuffer]:
        return {(self.pool, b.layer_id): RawBuffer(b.ptr, b.nbytes, b.device) for b in self.layers}

    def layer_of(self, name: str) -> int:
        for b in self.layers:
            if b.name == name:
                return b.layer_id
        raise ConfigError(f"layer {name!r} has no KV cache registered with kvbridge", field="layer_name")


def layer_id(name: str) -> int:
    """The layer index in a vLLM attention layer's name (the one integer in it)."""
    ints = [int(part) for part in name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise ConfigError(f"layer name {name!r} does not name one layer index (kvbridge pairs buffers by layer id)",
                          field="kv_caches")
    return ints[0]


def read_kv_caches(kv_caches: dict[str, Any], num_blocks: int, block_size: int, is_mla: bool) -> VLLMCache:
    """The worker's cache from vLLM's per-layer tensors (``register_kv_caches``)."""
    if not kv_caches:
        raise ConfigError("vLLM registered no KV cache layers", field="kv_caches")
    geoms, layers = set(), []
    for name, t in kv_caches.items():
        if t.dim() != 4:
            raise ConfigError(f"layer {name!r}: KV cache of shape {tuple(t.shape)}; kvbridge reads vLLM's 4-D "
                              "[blocks, heads, tokens, cell] layer views", field="kv_caches")
        kernel_blocks, heads, tokens, cell = (int(d) for d in t.shape)
        if kernel_blocks % num_blocks or tokens * kernel_blocks // num_blocks != block_size:
            raise ConfigError(f"layer {name!r}: {kernel_blocks} kernel blocks of {tokens} tokens are not vLLM's "
                              f"{num_blocks} blocks of {block_size}", field="kv_caches")
        item = t.element_size()
        sb, sh, sn, sc = (int(s) for s in t.stride())
        if sc != 1:
            raise ConfigError(f"layer {name!r}: a cell is not contiguous (strides {t.stride()})", field="kv_caches")
        if heads == 1 or (sn == heads * cell and sh == cell):
            layout = MLA if is_mla else NHD
        elif sh == tokens * cell and sn == cell:
            layout = HND
        else:
            raise ConfigError(f"layer {name!r}: strides {tuple(t.stride())} of shape {tuple(t.shape)} are neither "
                              "LBNHC (NHD) nor LBHNC (HND) blocks", field="kv_cache_layout")
        if sb != heads * tokens * cell:
            raise ConfigError(f"layer {name!r}: blocks {sb * item} B apart but {heads * tokens * cell * item} B "
                              "long: a layout with the block outermost (several layers per block) or padded pages "
                              "is not supported by kvbridge's vLLM connector; serve with VLLM_KV_CACHE_LAYOUT "
                              "LBNHC or LBHNC", field="kv_cache_layout")
        dtype = str(t.dtype).removeprefix("torch.")
        abi = _ABI.get(dtype)
        if abi is None:
            raise ConfigError(f"layer {name!r}: KV cache dtype {dtype} is not one kvbridge moves", field="kv_cache_dtype")
        device = "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index or 0}"
        geoms.add((layout, dtype, abi, heads, cell * item))
        layers.append(LayerBuffer(layer_id(name), name, int(t.data_ptr()), kernel_blocks * sb * item, device))
    if len(geoms) != 1:
        raise ConfigError(f"the layers' caches differ in geometry {sorted(geoms)}: kvbridge moves one pool",
                          field="kv_caches")
    ids = [b.layer_id for b in layers]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"two layers share a layer index in {sorted(kv_caches)}", field="kv_caches")
    spans = sorted((b.ptr, b.ptr + b.nbytes, b.name) for b in layers)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ConfigError(f"layers {a!r} and {b!r} overlap in memory (a cross-layer KV layout); kvbridge "
                              "registers one region per layer: serve with VLLM_KV_CACHE_LAYOUT LBNHC or LBHNC",
                              field="kv_cache_layout")
    ((layout, dtype, abi, heads, cell_bytes),) = geoms
    return VLLMCache(layout, dtype, abi, block_size, num_blocks, heads, cell_bytes,
                     tuple(sorted(layers, key=lambda b: b.layer_id)))


def pool_spec(cache: VLLMCache, total_kv_heads: int, tp_size: int, tp_rank: int) -> PoolSpec:
    """This rank's pool. NHD k/v are head-sharded: the rank's heads of the model's
    ``total_kv_heads`` (vLLM's TP split, which is kvbridge's ``rank_heads``)."""
    ids = tuple(b.layer_id for b in cache.layers)
    geometry = dict(name=cache.pool, dtype=cache.dtype, abi=cache.abi, page_size=cache.block_size, layer_ids=ids,
                    bytes_per_token=cache.num_heads * cache.cell_bytes)
    if cache.layout != NHD:
        return PoolSpec(**geometry)
    h0, h1 = rank_heads(total_kv_heads, tp_size, tp_rank)
    if h1 - h0 != cache.num_heads:
        raise ConfigError(f"TP rank {tp_rank} of {tp_size} holds {cache.num_heads} KV heads, but the model's "
                          f"{total_kv_heads} split over TP {tp_size} gives it heads [{h0}, {h1})", field="num_kv_heads")
    return PoolSpec(**geometry, num_heads=total_kv_heads, head_start=h0, head_stop=h1)


def rank_contract(cache: VLLMCache, spec: PoolSpec, *, model_name: str, revision: str, tp_size: int,
                  vllm_version: str, weights: str = "unspecified",
                  windows: Mapping[str, PoolSpec] | None = None) -> RuntimeContract:
    """The contract both sides must agree on: the model, the pool (dtype, block size, the
    whole row's heads), vLLM's version and layout; HND adds the TP size (whole blocks). Hybrid
    groups: ``windows``, the sliding-window groups' pools (their ``window`` is in the contract)."""
    abi = f"layout={cache.layout}" + (f",tp={tp_size}" if cache.layout == HND else "")
    pools = {spec.name: spec.full(), **{name: w.full() for name, w in (windows or {}).items()}}
    layers = sum(p.num_layers for p in pools.values())
    return contract_for(pools, model={"name": model_name, "revision": revision, "target_layers": layers,
                                      "draft_layers": 0, "weights": weights},
                        aux=AUX_SCHEMA, lane_rule="interleaved",
                        kernel={"attention_backend": f"vllm-{vllm_version}", "abi": abi})


def read_group_caches(kv_caches: dict[str, Any], groups: Any, names: Sequence[str], num_blocks: int,
                      block_size: int) -> dict[str, VLLMCache]:
    """Hybrid manager: each KV cache group's layers read as a cache of their own (pool name ->
    cache, ``names[i]`` for group ``i``). vLLM backs one layer of each group with the same tensor
    (``KVCacheTensor.shared_by``; a block id belongs to one group at a time), so layers of
    different groups share memory: ``SharedRegions`` registers it once."""
    out = {}
    for i, (group, name) in enumerate(zip(groups, names)):
        missing = [n for n in group.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"KV cache group {i}: layers {missing[:3]} have no KV cache registered",
                              field="kv_caches")
        cache = read_kv_caches({n: kv_caches[n] for n in group.layer_names}, num_blocks, block_size, False)
        if cache.layout != NHD:
            raise ConfigError(f"KV cache group {i}: layout {cache.layout}; kvbridge moves hybrid groups in the "
                              "LBNHC (NHD) layout, whose rows a window's first block is cut at: serve with "
                              "VLLM_KV_CACHE_LAYOUT LBNHC", field="kv_cache_layout")
        out[name] = replace(cache, pool_name=name)
    return out


def mamba_state_buffers(kv_caches: dict[str, Any], group: Any, index: int, num_blocks: int,
                        specs: Mapping[str, PoolSpec]) -> dict[tuple[str, int], RawBuffer]:
    """A Mamba group's state buffers (``hybrid.mamba_state_specs``): per layer and state, the
    region of vLLM's raw ``[blocks, 1, 1, C]`` int8 view from the state's offset in block 0 to
    its end in the last block (pages ``block_stride`` apart, the padding never travels). The
    specs' order is the states' order in a block. ConfigError naming the layer for a view that
    is not one."""
    out: dict[tuple[str, int], RawBuffer] = {}
    content = sum(s.bytes_per_token for s in specs.values())  # a block's states, back to back
    for name in group.layer_names:
        t = kv_caches.get(name)
        if t is None:
            raise ConfigError(f"KV cache group {index}: Mamba layer {name!r} has no KV cache registered",
                              field="kv_caches")
        shape = tuple(int(d) for d in t.shape)
        if t.element_size() != 1 or len(shape) != 4 or shape[0] != num_blocks or shape[1:3] != (1, 1) \
                or shape[3] != content or int(t.stride(3)) != 1:
            raise ConfigError(f"Mamba layer {name!r}: a view of shape {shape} ({t.dtype}); kvbridge reads vLLM's raw "
                              f"int8 [{num_blocks}, 1, 1, {content}] state pages", field="kv_caches")
        stride = int(t.stride(0))
        device = "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index or 0}"
        offset, lid = 0, layer_id(name)
        for pool, spec in specs.items():
            if spec.bytes_per_page != stride:
                raise ConfigError(f"Mamba layer {name!r}: blocks {stride} B apart, pool {pool} pages "
                                  f"{spec.bytes_per_page} B", field="kv_caches")
            out[(pool, lid)] = RawBuffer(int(t.data_ptr()) + offset, (num_blocks - 1) * stride + spec.bytes_per_token,
                                         device)
            offset += spec.bytes_per_token
    return out


def window_spec(cache: VLLMCache, name: str, window: int) -> PoolSpec:
    """A sliding-window group's pool: rows of ``window`` tokens (``hybrid.py``), this rank's heads."""
    return window_pool(name, tuple(b.layer_id for b in cache.layers), cache.num_heads * cache.cell_bytes,
                       window=window, page_size=cache.block_size, dtype=cache.dtype,
                       kernel_abi=f"vllm-sliding-window,layout={cache.layout}")


class SharedRegions:
    """A transfer engine through which a region inside one already registered (the same tensor
    vLLM shares between layers of different KV cache groups; a Mamba layer's conv or SSM state
    region inside its view) is not registered again but counted, and the registered region is
    unregistered when its last registration is withdrawn; everything else goes to ``engine`` as it
    is (a partial overlap is the engine's to refuse). ``route`` names the engine ``name`` (what
    ``create_engine`` built) for the endpoint's staging thresholds, as kvbridge's own engine
    wrappers do."""

    def __init__(self, engine: Any, name: str) -> None:
        self._engine = engine
        self._name = name
        self._regions: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, registrations)
        self._inside: dict[int, list[int]] = {}  # ptr of a region registered inside another -> the outer ptrs

    def route(self, session: str) -> str:
        inner = getattr(self._engine, "route", None)
        return inner(session) if inner is not None else self._name

    def register(self, ptr: int, nbytes: int) -> None:
        ptr, nbytes = int(ptr), int(nbytes)
        for base, (size, count) in self._regions.items():
            if base <= ptr and ptr + nbytes <= base + size:
                self._regions[base] = (size, count + 1)
                self._inside.setdefault(ptr, []).append(base)
                return
        self._engine.register(ptr, nbytes)
        self._regions[ptr] = (nbytes, 1)
        self._inside.setdefault(ptr, []).append(ptr)

    def unregister(self, ptr: int) -> None:
        outer = self._inside.get(int(ptr))
        base = outer.pop() if outer else int(ptr)
        if outer is not None and not outer:
            del self._inside[int(ptr)]
        held = self._regions.get(base)
        if held is not None and held[1] > 1:
            self._regions[base] = (held[0], held[1] - 1)
            return
        self._regions.pop(base, None)
        self._engine.unregister(base)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
