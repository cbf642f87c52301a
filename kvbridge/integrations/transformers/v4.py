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

__all__ = ["V4Pools", "send_chunk", "v4_specs"]

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
