"""vLLM's KV cache groups under the hybrid manager as kvbridge pool kinds
(integrations/vllm/hybrid.py), on vLLM's own spec classes: full attention -> paged, sliding
window -> window (W - 1 tokens), Mamba -> a state slot; the pools build one contract, and a
group kvbridge has no kind for is refused naming the group."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

import kvbridge as kvb
from kvbridge import ConfigError
from kvbridge.integrations.vllm.hybrid import group_specs


def _config(*groups):
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))


def test_full_sliding_and_mamba_groups_become_kinds():
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    mamba = MambaSpec(block_size=16, shapes=((3, 96), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32))
    specs = group_specs(_config(
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.4.self_attn.attn"], full),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], swa),
        KVCacheGroupSpec(["model.layers.2.mixer", "model.layers.3.mixer"], mamba)))
    g0, g1, g2 = specs["group0"], specs["group1"], specs["group2"]
    assert (g0.kind, g0.layer_ids, g0.bytes_per_token, g0.page_size) == ("paged", (0, 4), 2 * 2 * 64 * 2, 16)
    assert (g1.kind, g1.window, g1.bytes_per_token) == ("window", 127, 2 * 2 * 64 * 2)
    assert (g2.kind, g2.layer_ids, g2.bytes_per_token) == ("state", (2, 3), mamba.page_size_bytes)
    contract = kvb.contract_for(specs, model="vllm/hybrid", aux=kvb.AuxSchema.standard(0, "bfloat16", 0))
    assert contract.pool("group1").window == 127
    assert kvb.needed_bytes(g1, 300) == 127 * g1.bytes_per_token
    assert kvb.needed_bytes(g2, 300) == 2 * mamba.page_size_bytes


def test_a_group_without_a_kind_is_refused_by_name():
    chunked = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=32)
    with pytest.raises(ConfigError) as err:
        group_specs(_config(KVCacheGroupSpec(["model.layers.0.attn"], chunked)))
    assert err.value.field == "kv_cache_config.kv_cache_groups[0].kv_cache_spec"
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="no layer number"):
        group_specs(_config(KVCacheGroupSpec(["lm_head"], full)))
