"""Pools of hybrid models: one constructor per pool kind, Mamba conv/SSM state, and the
DeepSeek-V4 family (``deepseek_v4_pools``).

Where each DeepSeek-V4 pool's bytes come from (per layer; ``W`` sliding window, ``D`` head
dim, ``I`` indexer head dim, fp32 compressor state):

    every layer            swa          K=V rows of the last W-1 tokens          window
    CSA layer (ratio 4)    csa          one entry per 4 complete tokens (D)     compressed
                           csa_index    indexer key per 4 complete tokens (I)   compressed
                           csa_tail     the n % 4 tokens' kv+gate (2 x 2D)      state (tail rows)
                           csa_overlap  the last window's Ca kv+gate (4 x 2(D+I)) state
                           csa_index_tail  the n % 4 tokens' indexer kv+gate    state (tail rows)
    HCA layer (ratio 128)  hca          one entry per 128 complete tokens (D)   compressed
                           hca_tail     the n % 128 tokens' kv+gate (2 x D)     state (tail rows)
    draft (NextN) layers   draft        K=V rows of the last W-1 tokens          window

``kv_dtype="fp8"``: the KV pools in SGLang's FlashMLA DeepSeek-V4 layout (what SGLang 0.5.23 serves
V4 with on CUDA): a row of ``D - R`` fp8 nope values and ``R`` bf16 rope values, then one UE8M0
scale per 64 nope values and one pad byte (``values_then_scales``: 448 + 128 | 7 + 1 = 584 B at
D 512, R 64), each page padded to whole 576-byte rows (``page_stride``; the padding never
travels, ``needed_bytes`` counts rows only); the indexer keys fp8 with one fp32 scale per 128
values (128 | 4 = 132 B). The compressor state stays ``state_dtype``.

    fp8 page (swa, csa, hca, draft)  | rows x 576 (nope fp8, rope bf16) | rows x 8 (scales) | pad to 576 |
    fp8 page (csa_index)             | entries x 128 (fp8)             | entries x 4 (fp32 scale)     |

A query attends itself and the ``W - 1`` tokens before it, so a window pool's ``window`` is
``W - 1`` tokens: what the cache keeps after prefill. The layer pattern is the reference's
(transformers' ``DeepseekV4Config``): two HCA layers, then CSA and HCA alternating.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.errors import LayoutError
from kvbridge.layout.pools import ABI_ITEMSIZE, COMPRESSED, STATE, WINDOW, PoolSpec

__all__ = ["FP8_KV_DTYPES", "KIND_PRESETS", "V4_PAGE_ALIGN", "v4_fp8_row", "v4_fp8_kv_pool", "V4_LAYER_TYPES",
           "compressed_pool", "deepseek_v4_layer_types", "deepseek_v4_pools", "mamba_pools", "state_pool",
           "window_pool"]

KIND_PRESETS = ("deepseek-v4", "deepseek-v4-fp8")  # presets with window, compressed, state pools (contract_from_preset)
V4_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")  # kv_dtype values for SGLang's FlashMLA V4 layout
V4_FP8_DTYPE, V4_FP8_KERNEL_ABI = "v4_fp8_nope_bf16_rope", "flashmla-v4"  # as the SGLang mapping names them
V4_FP8_INDEX_KERNEL_ABI = "v4-indexer-k-fp8"
V4_PAGE_ALIGN = 576  # FlashMLA pads a V4 page to whole 576-byte rows
V4_FP8_TILE, V4_FP8_INDEX_BLOCK = 64, 128  # nope values per UE8M0 scale; index values per fp32 scale
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "float32": "float32", "fp32": "float32"}


def _abi(dtype: str) -> str:
    if dtype not in _DTYPES:
        raise LayoutError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}", field="dtype")
    return _DTYPES[dtype]


def window_pool(name: str, layer_ids: Sequence[int], row_bytes: int, *, window: int, page_size: int,
                dtype: str = "bfloat16", ring_stride: int = 0, kernel_abi: str = "") -> PoolSpec:
    """A sliding-window pool: decode needs the rows of the last ``window`` tokens; paged, or
    ring-addressed (``ring_stride`` slots per request row)."""
    abi = _abi(dtype)
    return PoolSpec(name=name, dtype=abi, abi=abi, bytes_per_token=row_bytes, page_size=page_size,
                    layer_ids=tuple(layer_ids), kind=WINDOW, window=window, ring_stride=ring_stride,
                    kernel_abi=kernel_abi)


def compressed_pool(name: str, layer_ids: Sequence[int], entry_bytes: int, *, ratio: int, page_size: int,
                    dtype: str = "bfloat16", kernel_abi: str = "") -> PoolSpec:
    """A compressed pool: one entry of ``entry_bytes`` per ``ratio`` complete tokens, pages of
    ``page_size`` entries."""
    abi = _abi(dtype)
    return PoolSpec(name=name, dtype=abi, abi=abi, bytes_per_token=entry_bytes, page_size=page_size,
                    layer_ids=tuple(layer_ids), kind=COMPRESSED, ratio=ratio, kernel_abi=kernel_abi)


def state_pool(name: str, layer_ids: Sequence[int], slot_bytes: int = 0, *, dtype: str = "float32",
               shard_units: Sequence[int] = (), unit_bytes: int = 0, tp_size: int = 1, tail_ratio: int = 0,
               kernel_abi: str = "") -> PoolSpec:
    """A per-request state pool: one slot per request row. Replicated (``slot_bytes``), or
    sharded across TP by groups (``shard_units`` x ``unit_bytes``; this rank's part for
    ``tp_size``). ``tail_ratio`` R: the slot is R rows of per-token state of which decode needs
    the first ``n % R`` (a compressor's incomplete window)."""
    abi = _abi(dtype)
    if shard_units:
        slot_bytes = sum(shard_units) // max(tp_size, 1) * unit_bytes
    return PoolSpec(name=name, dtype=abi, abi=abi, bytes_per_token=slot_bytes, page_size=1,
                    layer_ids=tuple(layer_ids), kind=STATE, shard_units=tuple(shard_units), unit_bytes=unit_bytes,
                    tp_size=tp_size, ratio=tail_ratio, kernel_abi=kernel_abi)


def mamba_pools(layer_ids: Sequence[int], *, conv_groups: Sequence[int], conv_kernel: int, num_heads: int,
                head_dim: int, state_size: int, conv_dtype: str = "bfloat16", ssm_dtype: str = "float32",
                tp_size: int = 1, prefix: str = "mamba") -> dict[str, PoolSpec]:
    """Mamba2/GDN state of the linear-attention layers: ``conv`` (channels x (kernel - 1), the
    channel groups sharded across TP one by one: SGLang's ``state_conv_shard_groups``) and
    ``ssm`` (heads x head_dim x state_size, sharded by heads)."""
    conv_unit = (conv_kernel - 1) * ABI_ITEMSIZE[_abi(conv_dtype)]
    ssm_unit = head_dim * state_size * ABI_ITEMSIZE[_abi(ssm_dtype)]
    return {
        f"{prefix}_conv": state_pool(f"{prefix}_conv", layer_ids, dtype=conv_dtype, shard_units=tuple(conv_groups),
                                     unit_bytes=conv_unit, tp_size=tp_size, kernel_abi="mamba-conv-channels"),
        f"{prefix}_ssm": state_pool(f"{prefix}_ssm", layer_ids, dtype=ssm_dtype, shard_units=(num_heads,),
                                    unit_bytes=ssm_unit, tp_size=tp_size, kernel_abi="mamba-ssm-heads"),
    }


def v4_fp8_row(head_dim: int = 512, rope_head_dim: int = 64) -> tuple[int, int]:
    """(value bytes, scale bytes) of one row of the FlashMLA V4 fp8 layout: ``head_dim -
    rope_head_dim`` fp8 nope values and ``rope_head_dim`` bf16 rope values, then one UE8M0 scale
    per 64 nope values and one pad byte (SGLang's ``get_bytes_per_token``: 576 | 8 at 512 / 64)."""
    nope = head_dim - rope_head_dim
    if rope_head_dim <= 0 or nope <= 0 or nope % V4_FP8_TILE:
        raise LayoutError(f"the FlashMLA V4 fp8 layout needs a positive rope part and nope values in whole tiles of "
                          f"{V4_FP8_TILE} (head_dim {head_dim}, rope_head_dim {rope_head_dim})", field="rope_head_dim")
    return nope + 2 * rope_head_dim, nope // V4_FP8_TILE + 1


def v4_fp8_kv_pool(name: str, layer_ids: Sequence[int], *, page_size: int, head_dim: int = 512,
                   rope_head_dim: int = 64, window: int = 0, ratio: int = 0) -> PoolSpec:
    """A window (``window``) or compressed (``ratio``) pool in SGLang's FlashMLA V4 fp8 layout:
    ``page_size`` rows of values then scales, the page padded to whole 576-byte rows."""
    value, scale = v4_fp8_row(head_dim, rope_head_dim)
    payload = page_size * (value + scale)
    stride = -(-payload // V4_PAGE_ALIGN) * V4_PAGE_ALIGN
    kind = {"kind": WINDOW, "window": window} if window else {"kind": COMPRESSED, "ratio": ratio}
    return PoolSpec(name=name, dtype=V4_FP8_DTYPE, abi="uint8", bytes_per_token=value + scale, page_size=page_size,
                    layer_ids=tuple(layer_ids), layout="values_then_scales", value_bytes_per_token=value,
                    scale_bytes_per_token=scale, kernel_abi=V4_FP8_KERNEL_ABI, page_stride=stride, **kind)


def deepseek_v4_layer_types(num_layers: int) -> tuple[str, ...]:
    """The reference layer pattern: two HCA layers, then CSA and HCA alternating."""
    rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(num_layers - 2)]
    return tuple((["heavily_compressed_attention"] * min(num_layers, 2) + rest)[:num_layers])


def deepseek_v4_pools(
    num_layers: int = 43,
    page_size: int = 64,
    *,
    layer_types: Sequence[str] | None = None,
    head_dim: int = 512,
    index_head_dim: int = 128,
    sliding_window: int = 128,
    csa_ratio: int = 4,
    hca_ratio: int = 128,
    draft_layers: int = 1,
    kv_dtype: str = "bfloat16",
    state_dtype: str = "float32",
    entries_per_page: int | None = None,
    rope_head_dim: int = 64,
) -> dict[str, PoolSpec]:
    """DeepSeek-V4 pools (module docstring) for any number of layers: the sliding window on
    every layer, CSA (ratio ``csa_ratio``, with its indexer) and HCA (``hca_ratio``)
    compressed entries, and the compressors' fp32 state. Draft layers are window layers
    numbered after the target's. ``entries_per_page``: compressed pages (default
    ``page_size``). ``kv_dtype`` ``"fp8"``: the KV pools in SGLang's FlashMLA V4 fp8 layout
    (module docstring; ``rope_head_dim`` of the ``head_dim`` values are bf16 rope)."""
    if num_layers <= 0 or draft_layers < 0:
        raise LayoutError("num_layers must be positive and draft_layers non-negative", field="num_layers")
    types = tuple(layer_types) if layer_types is not None else deepseek_v4_layer_types(num_layers)
    if len(types) != num_layers or any(t not in V4_LAYER_TYPES for t in types):
        raise LayoutError(f"layer_types must be {num_layers} of {V4_LAYER_TYPES}", field="layer_types")
    fp8 = kv_dtype in FP8_KV_DTYPES
    if not fp8 and kv_dtype not in _DTYPES:
        raise LayoutError(f"kv_dtype {kv_dtype!r} is not one of {sorted(_DTYPES)}, or {list(FP8_KV_DTYPES)} for "
                          "SGLang's FlashMLA V4 fp8 layout", field="kv_dtype")
    kv, st = 0 if fp8 else ABI_ITEMSIZE[_abi(kv_dtype)], ABI_ITEMSIZE[_abi(state_dtype)]
    epp = entries_per_page or page_size
    csa = [i for i, t in enumerate(types) if t == "compressed_sparse_attention"]
    hca = [i for i, t in enumerate(types) if t == "heavily_compressed_attention"]
    window = sliding_window - 1

    def win(name: str, ids: Sequence[int]) -> PoolSpec:
        if fp8:
            return v4_fp8_kv_pool(name, ids, page_size=page_size, head_dim=head_dim, rope_head_dim=rope_head_dim,
                                  window=window)
        return window_pool(name, ids, head_dim * kv, window=window, page_size=page_size, dtype=kv_dtype,
                           kernel_abi="v4-swa-kv")

    def entries(name: str, ids: Sequence[int], ratio: int) -> PoolSpec:
        if fp8:
            return v4_fp8_kv_pool(name, ids, page_size=epp, head_dim=head_dim, rope_head_dim=rope_head_dim,
                                  ratio=ratio)
        return compressed_pool(name, ids, head_dim * kv, ratio=ratio, page_size=epp, dtype=kv_dtype,
                               kernel_abi=f"v4-{name}-kv")

    pools = {"swa": win("swa", range(num_layers))}
    if csa:
        pools["csa"] = entries("csa", csa, csa_ratio)
        if fp8:  # SGLang's indexer K: fp8 values then one fp32 scale per 128 (get_dsv4_indexer_bytes_per_token)
            if index_head_dim % V4_FP8_INDEX_BLOCK:
                raise LayoutError(f"fp8 indexer keys need index_head_dim in whole blocks of {V4_FP8_INDEX_BLOCK}",
                                  field="index_head_dim")
            iscale = index_head_dim // V4_FP8_INDEX_BLOCK * 4
            pools["csa_index"] = PoolSpec(
                name="csa_index", dtype="fp8_e4m3_with_scale", abi="uint8", bytes_per_token=index_head_dim + iscale,
                page_size=epp, layer_ids=tuple(csa), layout="values_then_scales", value_bytes_per_token=index_head_dim,
                scale_bytes_per_token=iscale, kernel_abi=V4_FP8_INDEX_KERNEL_ABI, kind=COMPRESSED, ratio=csa_ratio)
        else:
            pools["csa_index"] = compressed_pool("csa_index", csa, index_head_dim * kv, ratio=csa_ratio,
                                                 page_size=epp, dtype=kv_dtype, kernel_abi="v4-csa-indexer-k")
        # buffer kv + gate of the incomplete window: 2D wide each (the Ca and Cb series)
        pools["csa_tail"] = state_pool("csa_tail", csa, csa_ratio * 2 * 2 * head_dim * st, dtype=state_dtype,
                                       tail_ratio=csa_ratio, kernel_abi="v4-compressor-buffer")
        pools["csa_index_tail"] = state_pool("csa_index_tail", csa, csa_ratio * 2 * 2 * index_head_dim * st,
                                             dtype=state_dtype, tail_ratio=csa_ratio,
                                             kernel_abi="v4-compressor-buffer")
        # the last complete window's Ca slice, kv and gate, of the compressor and the indexer
        pools["csa_overlap"] = state_pool("csa_overlap", csa, csa_ratio * 2 * (head_dim + index_head_dim) * st,
                                          dtype=state_dtype, kernel_abi="v4-compressor-overlap")
    if hca:
        pools["hca"] = entries("hca", hca, hca_ratio)
        pools["hca_tail"] = state_pool("hca_tail", hca, hca_ratio * 2 * head_dim * st, dtype=state_dtype,
                                       tail_ratio=hca_ratio, kernel_abi="v4-compressor-buffer")
    if draft_layers:
        pools["draft"] = win("draft", range(num_layers, num_layers + draft_layers))
    return pools
