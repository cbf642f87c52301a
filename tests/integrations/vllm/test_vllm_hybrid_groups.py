"""vLLM's KV cache groups under the hybrid manager as kvbridge pool kinds
(integrations/vllm/hybrid.py), on vLLM's own spec classes: full attention -> paged, sliding
window -> window (W tokens: decode recomputes the last prompt token), Mamba -> state slots; the
pools build one contract, a group kvbridge has no kind for is refused naming the group, and the
window's pages are checked against vLLM's own decode allocation."""

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
    g0, g1, g2 = specs["group0"], specs["group1"], specs["group2_state0"]
    assert (g0.kind, g0.layer_ids, g0.bytes_per_token, g0.page_size) == ("paged", (0, 4), 2 * 2 * 64 * 2, 16)
    assert (g1.kind, g1.window, g1.bytes_per_token) == ("window", 128, 2 * 2 * 64 * 2)
    assert (g2.kind, g2.layer_ids, g2.bytes_per_token) == ("state", (2, 3), 3 * 96 * 2)  # conv: bf16 (3, 96)
    assert specs["group2_state1"].bytes_per_token == 4 * 16 * 16 * 4  # ssm: fp32 (4, 16, 16), after conv
    contract = kvb.contract_for(specs, model="vllm/hybrid", aux=kvb.AuxSchema.standard(0, "bfloat16", 0))
    assert contract.pool("group1").window == 128
    assert kvb.needed_bytes(g1, 300) == 128 * g1.bytes_per_token
    assert kvb.needed_bytes(g2, 300) == 2 * 3 * 96 * 2  # one slot per layer, whatever the prompt's length


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


def test_gpt_oss_with_the_hybrid_manager_is_a_paged_and_a_window_group(carried):
    config = _grouped(GPT_OSS)
    assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == ["SlidingWindowSpec", "FullAttentionSpec"]
    specs = group_specs(config)
    assert (specs["group0"].kind, specs["group0"].window, specs["group0"].layer_ids) == ("window", 128, (0, 2))
    assert (specs["group1"].kind, specs["group1"].layer_ids) == ("paged", (1, 3))
    with pytest.raises(ConfigError, match=r"KV cache group 0 \(SlidingWindowSpec, layers \[0, 2\]\) is a kvbridge "
                                          r"'window' pool, and the room endpoints carry only \['paged'\]") as err:
        refuse_hybrid(config)
    assert err.value.field == "kv_cache_config.kv_cache_groups[0]"
    carried({"paged", "window"})  # carried by the rooms: the full group is the room's pages, the window its units
    layout = refuse_hybrid(config)
    assert (layout.paged, layout.windows, layout.block_size) == (1, ((0, "group0", 128),), 16)
    two_full = _config(*config.kv_cache_groups, KVCacheGroupSpec(["model.layers.5.self_attn.attn"], FULL))
    with pytest.raises(ConfigError, match="2 full-attention groups; a room has one page mapping"):
        refuse_hybrid(two_full)
    with pytest.raises(ConfigError, match="moves a sliding-window group only beside one full-attention group"):
        refuse_hybrid(_config(config.kv_cache_groups[0]))


def test_gpt_oss_without_the_hybrid_manager_is_one_paged_group(carried):
    """KVBridgeConnector (no SupportsHMA): vLLM turns the manager off and allocates the window in
    full, so every token's block is kept and moves; accepted as today."""
    config = _grouped(GPT_OSS, hma=False)
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, FullAttentionSpec) and group.kv_cache_spec.sliding_window == 128
    refuse_hybrid(config)
    assert group_specs(config)["group0"].kind == "paged"


def test_a_mamba_hybrid_needs_the_state_kind(carried):
    config = _grouped(QWEN3_NEXT)
    specs = group_specs(config)
    assert [s.kind for s in specs.values()] == ["state"] * 6 + ["paged"]  # (vLLM: a group per Mamba layer here)
    assert specs["group0_state0"].layer_ids == (0,) and specs["group0_state0"].page_stride == FULL.page_size_bytes
    with pytest.raises(ConfigError, match=r"KV cache group 0 \(MambaSpec, layers \[0\]\) is a kvbridge 'state' "
                                          r"pool, and the room endpoints carry only"):
        refuse_hybrid(config)
    carried({"paged", "state"})  # carried by the rooms: each Mamba group's states beside the paged group
    layout = refuse_hybrid(config)
    assert (layout.paged, layout.backoff, [g for g, _ in layout.states]) == (3, 1, [0, 1, 2])


def test_the_hma_connector_supports_hma_and_finishes_all_groups():
    """vLLM's factory sees SupportsHMA on KVBridgeHMAConnector only (so vLLM keeps its hybrid
    manager on for it and calls request_finished_all_groups), and the paged group's blocks reach
    the scheduler side's request_finished."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvbridge.integrations.vllm.connector import KVBridgeHMAConnector
    from kvbridge.integrations.vllm.hybrid import GroupLayout

    def cfg(name):
        return KVTransferConfig(kv_connector=name, kv_connector_module_path="kvbridge.integrations.vllm",
                                kv_role="kv_producer")
    assert KVConnectorFactory.supports_hma_config(cfg("KVBridgeHMAConnector"))
    assert not KVConnectorFactory.supports_hma_config(cfg("KVBridgeConnector"))
    calls = []
    conn = object.__new__(KVBridgeHMAConnector)  # the scheduler side only: a recording stand-in
    side = SimpleNamespace(groups=None, request_finished=lambda r, b: calls.append((r.request_id, b)) or (True, None))
    conn.scheduler_side = side
    req = SimpleNamespace(request_id="r1")
    assert conn.request_finished_all_groups(req, ([3, 4],)) == (True, None)
    with pytest.raises(ConfigError, match="blocks of 2 KV cache groups, the connector was built for 1"):
        conn.request_finished_all_groups(req, ([3], [4]))
    side.groups = GroupLayout(paged=1, windows=((0, "group0", 128),), block_size=16, names=("group0", "group1"))
    assert conn.request_finished_all_groups(req, ([0, 5], [6, 7])) == (True, None)
    assert calls == [("r1", [3, 4]), ("r1", [6, 7])]


# -- the window's blocks: tokens [n - W, n), and vLLM's decode allocation -------------------------------

def test_window_pages_cover_the_token_the_recomputed_last_token_attends():
    """vLLM recomputes the prompt's last token n - 1 on decode, which attends n - W .. n - 1: the
    window pool (W, not W - 1) moves the block of token n - W too."""
    from kvbridge.integrations.vllm.hybrid import window_gap, window_pages

    assert window_pages(70, 32, 16) == (2, 5)  # token 38 is row 6 of page 2
    assert kvb.needed_extent(kvb.window_pool("w", [0], 8, window=32, page_size=16), 70).first_row == 6
    assert window_pages(48, 32, 16) == (1, 3)  # token 16 opens page 1
    assert window_pages(10, 32, 16) == (0, 1)
    assert [n for n in range(32, 100) if window_gap(n, 32, 16)] == [47, 63, 79, 95]  # n - W + 1 = 16, 32, 48, 64


def test_window_gap_is_where_vllms_decode_allocation_holds_no_block(monkeypatch):
    """On vLLM's own hybrid KVCacheManager, a decode request that loads its n prompt tokens
    (get_num_new_matched_tokens -> n, allocated as vLLM's scheduler does) holds vLLM's null
    block for the page of token n - W exactly where ``window_gap`` says."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvbridge.integrations.vllm.hybrid import window_gap, window_pages

    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=32)
    layers = {f"model.layers.{i}.self_attn.attn": swa if i % 2 == 0 else FULL for i in range(4)}
    groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(dict(layers))
    config = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=groups)
    w = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)][0]
    seen = {}
    for n in range(33, 100):
        mgr = _manager(KVCacheManager, config)
        blocks = _allocate_external(mgr, n)
        first, _ = window_pages(n, 32, 16)
        page_block = blocks.blocks[w][first] if first < len(blocks.blocks[w]) else None
        seen[n] = page_block is None or page_block.is_null
    assert [n for n, gap in seen.items() if gap] == [n for n in seen if window_gap(n, 32, 16)]


def _manager(cls, config):
    return cls(config, max_model_len=512, scheduler_block_size=16, hash_block_size=16, enable_caching=False)


def _allocate_external(mgr, n):
    """What vLLM's scheduler allocates for a decode request whose connector loads all n prompt
    tokens asynchronously (no local hit, no new token this step)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id=f"r{n}", prompt_token_ids=list(range(n)), sampling_params=SamplingParams(max_tokens=3),
                  pooling_params=None)
    assert mgr.allocate_slots(req, 0, num_external_computed_tokens=n, delay_cache_blocks=True) is not None
    return mgr.get_blocks(req.request_id)
