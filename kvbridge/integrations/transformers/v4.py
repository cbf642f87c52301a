"""Model mode for DeepSeek-V4 (transformers' ``DeepseekV4ForCausalLM``): its cache as kvbridge
pools of every kind, and back, so that a disaggregated decode can be compared with a
colocated one logit for logit.

    transformers cache, per layer                 pool (kvbridge.deepseek_v4_pools)   kind
    keys (= values), the last W-1 tokens          swa          token row at its page   window
    compressed_kv["compressor"]                    csa / hca    entry e at its page     compressed
    compressed_kv["indexer"]            (CSA)      csa_index                            compressed
    buffer_kv/gate["compressor"]                   csa_tail / hca_tail  row pos % R     state (tail)
    buffer_kv/gate["indexer"]           (CSA)      csa_index_tail                       state (tail)
    overlap_kv/gate[compressor, indexer] (CSA)     csa_overlap  R rows                  state
    entry_count, cumulative_length                 derived from the token count: n // R, n

``V4Pools`` holds one rank's buffers (torch, CPU) and the physical units of one request
(token pages, entry pages, a state slot). Prefill writes its cache into them after every
chunk (``write_cache``); each chunk sends what ``kvbridge.chunk_extent`` gives it; decode
rebuilds a cache from what arrived (``read_cache``). Only kvbridge's public API is used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.integrations.transformers.kinds import KindPools, send_chunk

__all__ = ["TINY_V4", "V4Pools", "greedy_decode", "prefill_chunks", "run_v4_request", "send_chunk", "tiny_v4_model", "v4_specs"]

# A tiny random DeepSeek-V4: HCA and CSA layers, indexer on, window 16, ratios 4 and 32 (small
# so that short prompts complete HCA windows); float32, built in a second from a fixed seed.
TINY_V4 = dict(
    vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, sliding_window=16, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
    index_topk=8, hc_mult=2, max_position_embeddings=4096,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})


def tiny_v4_model(seed: int = 0) -> Any:
    """``DeepseekV4ForCausalLM`` of ``TINY_V4`` with random weights (seeded), in eval mode."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(DeepseekV4Config(**TINY_V4)).eval()

def v4_specs(config: Any, page_size: int = 16) -> dict[str, kvb.PoolSpec]:
    """The pools of a transformers ``DeepseekV4Config`` (float32 reference weights: float32 rows)."""
    dtype = str(getattr(config, "dtype", None) or torch.float32).removeprefix("torch.")
    return kvb.deepseek_v4_pools(
        config.num_hidden_layers, page_size, layer_types=config.layer_types, head_dim=config.head_dim,
        index_head_dim=config.index_head_dim, sliding_window=config.sliding_window,
        csa_ratio=config.compress_rates["compressed_sparse_attention"],
        hca_ratio=config.compress_rates["heavily_compressed_attention"], draft_layers=0, kv_dtype=dtype,
        state_dtype="float32")


class V4Pools(KindPools):
    """A rank's DeepSeek-V4 pools: ``write_cache`` after each prefill chunk, ``read_cache`` on decode."""

    # --- the cache ------------------------------------------------------------------------------------------

    def write_cache(self, cache: Any, num_tokens: int, last: bool) -> None:
        """Write what a prefill cache holds after ``num_tokens`` tokens: the window rows it keeps,
        every compressed entry, and (``last``) the compressor state. Writing a row twice writes
        the same bytes (a token's row does not change)."""
        for lid, layer in enumerate(cache.layers):
            keys = layer.keys[0, 0]  # [rows, D]: the last min(n, W-1) tokens
            self.put("swa", lid, num_tokens - len(keys), keys)
            csa = hasattr(layer, "overlap_kv")
            kv_pool = "csa" if csa else "hca"
            for name, pool in (("compressor", kv_pool), ("indexer", "csa_index")):
                if name not in layer.compressed_kv or layer.compressed_kv[name] is None:
                    continue
                self.put(pool, lid, 0, layer.compressed_kv[name][0])
            if not last:
                continue
            self._write_state(layer, lid, csa)

    def _write_state(self, layer: Any, lid: int, csa: bool) -> None:
        tails = (("compressor", "csa_tail"), ("indexer", "csa_index_tail")) if csa else (("compressor", "hca_tail"),)
        for name, pool in tails:
            kv, gate = layer.buffer_kv[name], layer.buffer_gate[name]
            slot = self.slot(pool, lid).view(torch.float32).view(self.specs[pool].ratio, -1)
            if kv is not None and kv.shape[1]:
                width = kv.shape[-1]
                slot[: kv.shape[1], :width] = kv[0]
                slot[: kv.shape[1], width:] = gate[0]
        if csa and layer.overlap_kv["compressor"] is not None:
            slot = self.slot("csa_overlap", lid).view(torch.float32).view(layer.compress_rate, -1)
            parts = [layer.overlap_kv["compressor"][0], layer.overlap_gate["compressor"][0],
                     layer.overlap_kv["indexer"][0], layer.overlap_gate["indexer"][0]]
            slot[:] = torch.cat(parts, dim=-1)

    def read_cache(self, config: Any, num_tokens: int) -> Any:
        """A decode cache rebuilt from the pools after a request of ``num_tokens`` tokens arrived."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=config)
        window = self.specs["swa"].window
        d, di = config.head_dim, config.index_head_dim
        f32 = torch.float32
        for lid, layer in enumerate(cache.layers):
            start = max(0, num_tokens - window)
            keys = self.get("swa", lid, start, num_tokens - start, f32).view(1, 1, -1, d)
            layer.lazy_initialization(keys, keys)
            layer.keys = keys
            layer.values = keys
            layer.cumulative_length = num_tokens
            csa = hasattr(layer, "overlap_kv")
            ratio = layer.compress_rate
            entries = num_tokens // ratio
            tail = num_tokens % ratio
            named = (("compressor", "csa" if csa else "hca", d, "csa_tail" if csa else "hca_tail",
                      2 * d if csa else d),)
            if csa:
                named += (("indexer", "csa_index", di, "csa_index_tail", 2 * di),)
            for name, pool, width, tail_pool, tail_width in named:
                layer.compressed_kv[name] = self.get(pool, lid, 0, entries, f32).view(1, entries, width)
                layer.entry_count[name] = entries
                slot = self.slot(tail_pool, lid).view(f32).view(ratio, -1)
                layer.buffer_kv[name] = slot[:tail, :tail_width].clone().unsqueeze(0)
                layer.buffer_gate[name] = slot[:tail, tail_width:].clone().unsqueeze(0)
            if csa and entries:
                rows = self.slot("csa_overlap", lid).view(f32).view(ratio, -1)
                cuts = np.cumsum([0, d, d, di, di])
                kv_c, gate_c, kv_i, gate_i = (rows[:, a:b].clone().unsqueeze(0) for a, b in zip(cuts, cuts[1:]))
                layer.overlap_kv.update(compressor=kv_c, indexer=kv_i)
                layer.overlap_gate.update(compressor=gate_c, indexer=gate_i)
        return cache


def prefill_chunks(model: Any, ids: torch.Tensor, cuts: list[int]) -> Any:
    """Prefill ``ids`` in chunks ending at ``cuts`` (and the end): per chunk, the cache, the
    chunk's bounds, whether it is the last, and the last position's logits."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    bounds = [0, *cuts, ids.shape[1]]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        with torch.no_grad():
            out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
        yield cache, a, b, i == len(bounds) - 2, out.logits[:, -1]


def greedy_decode(model: Any, cache: Any, first: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """``steps`` greedy steps from ``cache`` after token ``first``: their logits and the tokens."""
    logits, tokens, tok = [], [int(first)], first
    for _ in range(steps):
        with torch.no_grad():
            out = model(tok.view(1, 1), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        tok = out.logits[0, -1].argmax()
        tokens.append(int(tok))
    return torch.stack(logits) if logits else torch.zeros(0), tokens


def run_v4_request(model: Any, ids: torch.Tensor, cuts: list[int], engines: tuple[Any, Any], steps: int = 4,
                   page_size: int = 4, capacity: int = 128, reports: list | None = None) -> dict[str, Any]:
    """One request colocated and disaggregated: chunked prefill, each chunk's share of every pool
    written through ``engines`` (prefill's, decode's) into poisoned decode pools at reversed
    units, the decode cache rebuilt from them, ``steps`` greedy steps on both. Returns the
    bytes moved and needed, whether logits are bit-equal and tokens equal, and the tokens;
    ``reports`` gets what each chunk reported (``send_chunk``)."""
    n = ids.shape[1]
    for cache, *_, logits in prefill_chunks(model, ids, cuts):
        pass
    want, want_tokens = greedy_decode(model, cache, logits[0].argmax(), steps)
    specs = v4_specs(model.config, page_size=page_size)
    src_pools, dst_pools = V4Pools(specs, capacity), V4Pools(specs, capacity, fill=0xEE)
    src_pools.allocate(n, needed=False, base=1)
    dst_pools.allocate(n, needed=True, order="reversed", base=2)
    src, dst = engines
    for ptr, size in src_pools.regions():
        src.register(ptr, size)
    for ptr, size in dst_pools.regions():
        dst.register(ptr, size)
    try:
        moved = 0
        for cache, done, end, last, logits in prefill_chunks(model, ids, cuts):
            src_pools.write_cache(cache, end, last)
            moved += send_chunk(src_pools, dst_pools, src, dst.session_id, n, done, end, last, reports=reports)
    finally:
        for ptr, _ in src_pools.regions():
            src.unregister(ptr)
        for ptr, _ in dst_pools.regions():
            dst.unregister(ptr)
    got, got_tokens = greedy_decode(model, dst_pools.read_cache(model.config, n), logits[0].argmax(), steps)
    return {"tokens": n, "bytes_moved": moved, "bytes_needed": sum(kvb.needed_bytes(s, n) for s in specs.values()),
            "logits_equal": bool(torch.equal(got, want)), "tokens_equal": got_tokens == want_tokens,
            "generated": got_tokens}
