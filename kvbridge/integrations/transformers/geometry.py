"""What a transformers model caches, as kvbridge pools, and the translation
between its cache tensors and pool rows (one row per token per layer).

transformers 5.17 caches per layer a ``(keys, values)`` pair, ``[batch, heads, seq, dim]``:

    Qwen2 / Llama (GQA)   keys   = K after RoPE     [b, H_kv, s, D]  -> pool "k": row = H_kv*D, head-major
                          values = V                [b, H_kv, s, D]  -> pool "v": row = H_kv*D, head-major
    DeepSeek-V3 (MLA)     keys   = kv_a_layernorm(compressed latent)   [b, 1, s, kv_lora_rank]
                          values = rope key after RoPE                 [b, 1, s, qk_rope_head_dim]
                          -> pool "target": row = | latent (normed) | rope key |   (512 + 64 in V3)

The MLA row is what SGLang and vLLM store (latent after ``kv_a_layernorm``,
rope key after RoPE); K and V are rebuilt from it by the layer's own
``kv_b_proj`` on every forward (``DeepseekV3Attention.expand_kv``), so a cache
rebuilt from rows is consumed exactly like the stock one. One difference in the
bytes: with ``rope_interleave`` (V3's default) transformers rotates the
interleaved pairs and stores the rope key *de-interleaved* (rotated even dims,
then odd dims), where SGLang keeps the interleaved order. The pools' kernel ABI
says so, and a contract between a transformers side and an SGLang side differs there.

The NextN/MTP draft layer (transformers' ``MtpModel``) has an MLA cache of the
same geometry; it is pool ``draft`` with layer ids after the target's
(``num_layers + i``) on the same page mapping. Its row ``i`` is the MTP layer's
latent for (embedding of token ``i+1``, last hidden state of token ``i``), so
the last row of a prompt needs the first generated token.

Pools keep the model's dtype: the bytes are what the model wrote, copied, never
converted; a rebuilt cache is bit-identical to the colocated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kvbridge as kvb

MLA = "mla"
GQA = "gqa"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CacheGeometry:
    """A model's KV cache per token per layer. ``tp_size``/``tp_rank`` select the
    heads a rank holds (GQA; MLA rows are replicated across TP)."""

    kind: str
    num_layers: int
    draft_layers: int
    dtype: str
    latent_dim: int = 0
    rope_dim: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rope_interleaved: bool = False
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def heads(self) -> kvb.HeadGeometry:
        if self.kind != GQA:
            raise kvb.LayoutError(f"a {self.kind} cache has no KV heads to slice", field="kind")
        return kvb.HeadGeometry(self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def head_range(self) -> tuple[int, int]:
        """KV heads ``[h0, h1)`` this rank holds (GQA)."""
        return kvb.rank_heads(self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def row_elems(self) -> int:
        if self.kind == MLA:
            return self.latent_dim + self.rope_dim
        h0, h1 = self.head_range
        return (h1 - h0) * self.head_dim

    def pools_of_layer(self, layer_id: int) -> tuple[str, ...]:
        """Pool names a layer's cache goes to (draft layers after the target's)."""
        if self.kind == GQA:
            return ("k", "v")
        return ("target",) if layer_id < self.num_layers else ("draft",)

    @property
    def kernel_abi(self) -> str:
        if self.kind == GQA:
            return "transformers/kv-head-major/k-after-rope"
        rope = "rope-deinterleaved" if self.rope_interleaved else "rope"
        return f"transformers/mla-normed-latent+{rope}"


def cache_geometry(
    model_or_config: Any, *, dtype: str | None = None, tp_size: int = 1, tp_rank: int = 0
) -> CacheGeometry:
    """The cache geometry of a transformers model or config (``dtype`` defaults
    to the model's). Refuses what model mode does not page: sliding windows,
    linear attention, MLA with several KV heads."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if dtype is None:
        dtype = str(getattr(model_or_config, "dtype", None) or config.dtype or "float32").removeprefix("torch.")
    if dtype not in TORCH_DTYPES:
        raise kvb.ConfigError(f"cache dtype {dtype!r} is not one of {tuple(TORCH_DTYPES)}", field="dtype")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise kvb.ConfigError(
            f"model mode pages full-attention caches only; this config has layer types {sorted(layer_types)}",
            field="layer_types",
        )
    num_layers = int(config.num_hidden_layers)
    if getattr(config, "kv_lora_rank", None):
        kvb.rank_heads(1, tp_size, tp_rank)  # validates the rank; MLA rows are replicated across TP
        return CacheGeometry(
            kind=MLA,
            num_layers=num_layers,
            draft_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0),
            dtype=dtype,
            latent_dim=int(config.kv_lora_rank),
            rope_dim=int(config.qk_rope_head_dim),
            rope_interleaved=bool(getattr(config, "rope_interleave", False)),
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    geom = CacheGeometry(
        kind=GQA,
        num_layers=num_layers,
        draft_layers=0,
        dtype=dtype,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    geom.head_range  # noqa: B018  validates tp against the KV heads
    return geom


def model_pools(
    model_or_config: Any,
    page_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    *,
    dtype: str | None = None,
    draft: bool = True,
) -> dict[str, kvb.PoolSpec]:
    """The pools of one rank: GQA ``k`` and ``v`` (this TP rank's heads,
    head-major), MLA ``target`` (+ ``draft`` for a NextN layer, with
    ``draft=True`` and a config that has one)."""
    geom = cache_geometry(model_or_config, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
    return pools_of(geom, page_size, draft=draft)


def pools_of(geom: CacheGeometry, page_size: int, *, draft: bool = True) -> dict[str, kvb.PoolSpec]:
    target_ids = tuple(range(geom.num_layers))
    if geom.kind == GQA:
        return {
            name: geom.heads.spec(name, page_size, target_ids, geom.tp_size, geom.tp_rank, kernel_abi=geom.kernel_abi)
            for name in ("k", "v")
        }
    itemsize = torch.empty(0, dtype=geom.torch_dtype).element_size()
    mla = dict(dtype=geom.dtype, abi=geom.dtype, bytes_per_token=geom.row_elems * itemsize, page_size=page_size)
    pools = {"target": kvb.PoolSpec(name="target", layer_ids=target_ids, kernel_abi=geom.kernel_abi, **mla)}
    if draft and geom.draft_layers:
        draft_ids = tuple(range(geom.num_layers, geom.num_layers + geom.draft_layers))
        pools["draft"] = kvb.PoolSpec(name="draft", layer_ids=draft_ids, kernel_abi=geom.kernel_abi, **mla)
    return pools


def layer_rows(geom: CacheGeometry, layer_id: int, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``[seq, row_elems]`` per pool of one layer's cache tensors (batch 1):
    ``{"k": .., "v": ..}`` with this rank's heads, or ``{"target" | "draft": ..}`` (MLA)."""
    if geom.kind == MLA:
        return {geom.pools_of_layer(layer_id)[0]: torch.cat([keys[0, 0], values[0, 0]], dim=-1)}
    h0, h1 = geom.head_range
    return {name: t[0, h0:h1].transpose(0, 1).reshape(t.shape[2], -1) for name, t in (("k", keys), ("v", values))}


def layer_tensors(
    geom: CacheGeometry, layer_id: int, rows: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``layer_rows`` for a rank that holds every head: the
    ``(keys, values)`` of one layer, batch 1, contiguous."""
    if geom.kind == MLA:
        latent = rows[geom.pools_of_layer(layer_id)[0]]
        keys, values = latent[:, : geom.latent_dim], latent[:, geom.latent_dim :]
        return keys.contiguous()[None, None], values.contiguous()[None, None]
    if geom.head_range != (0, geom.num_kv_heads):
        raise kvb.LayoutError(
            f"tp rank {geom.tp_rank} of {geom.tp_size} holds heads {geom.head_range} of {geom.num_kv_heads}: "
            "merge the head slices of every rank first (merge_head_rows)",
            field="tp_rank",
        )
    k, v = (
        rows[n].reshape(rows[n].shape[0], geom.num_kv_heads, geom.head_dim).transpose(0, 1).contiguous()[None]
        for n in ("k", "v")
    )
    return k, v


def merge_head_rows(geoms: Sequence[CacheGeometry], rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whole rows ``[..., H*D]`` from the head slices of every TP rank of one
    side (``rows[j]`` from ``geoms[j]``; a replicated head is taken from the
    first rank that holds it)."""
    full = geoms[0]
    out = rows[0].new_empty(*rows[0].shape[:-1], full.num_kv_heads * full.head_dim)
    covered = torch.zeros(full.num_kv_heads, dtype=torch.bool)
    for g, r in zip(geoms, rows):
        h0, h1 = g.head_range
        if not covered[h0:h1].all():
            out[..., h0 * g.head_dim : h1 * g.head_dim] = r
            covered[h0:h1] = True
    if not covered.all():
        missing = torch.nonzero(~covered).flatten().tolist()
        raise kvb.LayoutError(f"heads {missing} are on none of the {len(geoms)} ranks given", field="tp_rank")
    return out
