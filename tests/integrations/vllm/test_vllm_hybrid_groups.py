"""vLLM's KV cache groups under the hybrid manager as kvbridge pool kinds
(integrations/vllm/hybrid.py), on vLLM's own spec classes: full attention -> paged, sliding
window -> window (W - 1 tokens), Mamba -> a state slot; the pools build one contract, and a
group kvbridge has no kind for is refused naming the group."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

import kvbridge as kvb
from kvbridge import ConfigError
from kvbridge.integrations.vllm.hybrid import group_specs
from kvbridge.integrations.vllm.settings import refuse_hybrid


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
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                        attention_chunk_size=32)
    with pytest.raises(ConfigError) as err:
        group_specs(_config(KVCacheGroupSpec(["model.layers.0.attn"], chunked)))
    assert err.value.field == "kv_cache_config.kv_cache_groups[0].kv_cache_spec"
    with pytest.raises(ConfigError) as err:
        refuse_hybrid(_config(KVCacheGroupSpec(["model.layers.0.attn"], chunked)))
    assert "ChunkedLocalAttentionSpec has no kvbridge pool kind" in str(err.value)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="no layer number"):
        group_specs(_config(KVCacheGroupSpec(["lm_head"], full)))


# -- refuse_hybrid: by the kind the rooms do not carry; gpt-oss and a Mamba hybrid, grouped by vLLM ---

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
GPT_OSS = {f"model.layers.{i}.self_attn.attn": SWA if i % 2 == 0 else FULL for i in range(4)}  # gpt-oss alternates
MAMBA = MambaSpec(block_size=16, shapes=((3, 96), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                  page_size_padded=FULL.page_size_bytes)
QWEN3_NEXT = {**{f"model.layers.{i}.linear_attn": MAMBA for i in (0, 1, 2)}, "model.layers.3.self_attn.attn": FULL}


@pytest.fixture
def carried(monkeypatch):
    def set_kinds(kinds):
        monkeypatch.setattr(kvb, "ROOM_POOL_KINDS", frozenset(kinds), raising=False)
    set_kinds({"paged"})
    return set_kinds


def _grouped(layers, hma=True):
    """vLLM's own grouping: the hybrid manager's groups, or (off) the promoted single group."""
    specs = dict(layers)
    if not hma:
        kv_cache_utils.unify_hybrid_kv_cache_specs(specs)
        return _config(*kv_cache_utils._get_kv_cache_groups_uniform_spec(specs))
    return _config(*kv_cache_utils._get_kv_cache_groups_uniform_page_size(specs))


def test_gpt_oss_with_the_hybrid_manager_is_refused_by_the_window_kind(carried):
    config = _grouped(GPT_OSS)
    assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == ["SlidingWindowSpec", "FullAttentionSpec"]
    specs = group_specs(config)
    assert (specs["group0"].kind, specs["group0"].window, specs["group0"].layer_ids) == ("window", 127, (0, 2))
    assert (specs["group1"].kind, specs["group1"].layer_ids) == ("paged", (1, 3))
    with pytest.raises(ConfigError, match=r"KV cache group 0 \(SlidingWindowSpec, layers \[0, 2\]\) is a kvbridge "
                                          r"'window' pool, and the room endpoints carry only \['paged'\]") as err:
        refuse_hybrid(config)
    assert err.value.field == "kv_cache_config.kv_cache_groups[0]"
    carried({"paged", "window"})  # carried by the rooms: still two groups, which this connector does not register
    with pytest.raises(ConfigError, match=r"the room endpoints carry their kinds, but kvbridge's vLLM connector "
                                          r"registers one paged pool") as err:
        refuse_hybrid(config)
    assert err.value.field == "kv_cache_config.kv_cache_groups"


def test_gpt_oss_without_the_hybrid_manager_is_one_paged_group(carried):
    """KVBridgeConnector (no SupportsHMA): vLLM turns the manager off and allocates the window in
    full, so every token's block is kept and moves; accepted as today."""
    config = _grouped(GPT_OSS, hma=False)
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, FullAttentionSpec) and group.kv_cache_spec.sliding_window == 128
    refuse_hybrid(config)
    assert group_specs(config)["group0"].kind == "paged"


def test_a_mamba_hybrid_is_refused_by_the_state_kind(carried):
    config = _grouped(QWEN3_NEXT)
    specs = group_specs(config)
    assert [s.kind for s in specs.values()] == ["state", "state", "state", "paged"]
    assert specs["group0"].bytes_per_token == MAMBA.page_size_bytes and specs["group0"].layer_ids == (0,)
    with pytest.raises(ConfigError, match=r"KV cache group 0 \(MambaSpec, layers \[0\]\) is a kvbridge 'state' "
                                          r"pool"):
        refuse_hybrid(config)
    carried({"paged", "state"})
    with pytest.raises(ConfigError, match="per-group pools are not built yet"):
        refuse_hybrid(config)


def test_the_hma_connector_supports_hma_and_finishes_all_groups():
    """vLLM's factory sees SupportsHMA on KVBridgeHMAConnector only (so vLLM keeps its hybrid
    manager on for it and calls request_finished_all_groups), and one group's blocks reach
    the scheduler side's request_finished."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvbridge.integrations.vllm.connector import KVBridgeHMAConnector

    def cfg(name):
        return KVTransferConfig(kv_connector=name, kv_connector_module_path="kvbridge.integrations.vllm",
                                kv_role="kv_producer")
    assert KVConnectorFactory.supports_hma_config(cfg("KVBridgeHMAConnector"))
    assert not KVConnectorFactory.supports_hma_config(cfg("KVBridgeConnector"))
    calls = []
    conn = object.__new__(KVBridgeHMAConnector)  # the scheduler side only: a recording stand-in
    conn.scheduler_side = SimpleNamespace(request_finished=lambda r, b: calls.append((r.request_id, b)) or (True, None))
    req = SimpleNamespace(request_id="r1")
    assert conn.request_finished_all_groups(req, ([3, 4],)) == (True, None)
    assert calls == [("r1", [3, 4])]
    with pytest.raises(ConfigError, match="blocks of 2 KV cache groups"):
        conn.request_finished_all_groups(req, ([3], [4]))
