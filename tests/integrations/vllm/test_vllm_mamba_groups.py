"""vLLM Mamba KV cache groups as kvbridge state pools (integrations/vllm/hybrid.py,
``mamba_state_specs``; cache.py, ``mamba_state_buffers``), on vLLM's own objects: its
``get_kv_cache_configs`` grouping of a full-attention + Mamba2 hybrid, its ``allocate_kv_cache``
(one backing allocation, a Mamba layer's raw view sharing an attention layer's tensor) and its
``MambaBase.bind_kv_cache`` (how a Mamba layer cuts a block into conv then SSM state). A slot
moved by kvbridge's own plan lands exactly the slot's conv and SSM bytes, no padding; every other
byte of the allocation keeps its poison. vLLM's CPU platform does not serve Mamba hybrids (the
hybrid manager is off there), so no model runs: these are vLLM's classes with the manager on."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)

import kvbridge as kvb
from kvbridge import ConfigError
from kvbridge.integrations.vllm.cache import mamba_state_buffers
from kvbridge.integrations.vllm.hybrid import group_layout, group_specs, mamba_state_specs, state_slot

BS, POISON = 16, 0xEE
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
CONV, SSM = (96, 3), (4, 8, 16)  # Mamba2, DS conv layout: (x+B+C channels, kernel - 1); (heads, head_dim, state)


def _mamba(**kw):
    return MambaSpec(block_size=512, shapes=(CONV, SSM), dtypes=(torch.bfloat16, torch.float32),
                     page_size_padded=FULL.page_size_bytes, **kw)


def _allocated(tmp_path, num_blocks=40):
    """vLLM's grouping and allocation of layers 0, 2 (Mamba) and 1, 3 (full attention)."""
    import _vllm_config as C
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vc = C.vllm_config(C.model_dir(tmp_path, "gqa", num_hidden_layers=4), "kv_producer", {}, window=32)
    specs = {"model.layers.0.mixer": _mamba(), "model.layers.1.self_attn.attn": FULL,
             "model.layers.2.mixer": _mamba(), "model.layers.3.self_attn.attn": FULL}
    (cfg,) = get_kv_cache_configs(vc, [specs], [FULL.page_size_bytes * 2 * num_blocks])
    return cfg, allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout["LBNHC"])


def _states(view):
    """The layer's states as vLLM's Mamba layer binds them (MambaBase.bind_kv_cache)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    layer = types.SimpleNamespace(get_state_shape=lambda: (CONV, SSM),
                                  get_state_dtype=lambda: (torch.bfloat16, torch.float32))
    MambaBase.bind_kv_cache(layer, view)
    return layer.kv_cache


def _backing(caches):
    """Every byte of the one allocation the layers view, as uint8."""
    storage = next(iter(caches.values())).untyped_storage()
    return np.ctypeslib.as_array((ctypes.c_uint8 * storage.nbytes()).from_address(storage.data_ptr()))


def test_a_mamba_slot_moves_its_conv_and_ssm_bytes_and_nothing_else(tmp_path):
    cfg, src = _allocated(tmp_path)
    _, dst = _allocated(tmp_path)
    g = next(i for i, grp in enumerate(cfg.kv_cache_groups) if isinstance(grp.kv_cache_spec, MambaSpec))
    group = cfg.kv_cache_groups[g]
    assert group.layer_names == ["model.layers.0.mixer", "model.layers.2.mixer"]  # vLLM's grouping
    specs = {n: s for n, s in group_specs(cfg).items() if n.startswith(f"group{g}_")}
    conv_bytes, ssm_bytes = 96 * 3 * 2, 4 * 8 * 16 * 4
    assert [(s.bytes_per_token, s.page_stride, s.kind) for s in specs.values()] == [
        (conv_bytes, FULL.page_size_bytes, "state"), (ssm_bytes, FULL.page_size_bytes, "state")]
    _backing(src)[:] = 0
    _backing(dst)[:] = POISON
    gen = torch.Generator().manual_seed(3)
    for name in group.layer_names:  # prefill's states: random values in every block
        for state in _states(src[name]):
            state.copy_(torch.rand(state.shape, generator=gen).to(state.dtype) + 1)
    bufs = {side: mamba_state_buffers(c, group, g, cfg.num_blocks, specs) for side, c in (("p", src), ("d", dst))}
    src_slot, dst_slot, moved = 5, cfg.num_blocks - 1, 0  # decode's slot: the last block (the buffer's end)
    for pool, spec in specs.items():
        descs = {side: [kvb.describe_buffer(spec, lid, b) for (p, lid), b in bufs[side].items() if p == pool]
                 for side in bufs}
        assert {d.capacity_pages for d in descs["d"]} == {cfg.num_blocks}
        plan = kvb.plan_kind(spec, descs["p"], descs["d"], kvb.needed_extent(spec, 77), [src_slot], [dst_slot])
        for s, d, n in zip(plan.src, plan.dst, plan.length):
            ctypes.memmove(int(d), int(s), int(n))
        moved += int(plan.length.sum())
    assert moved == 2 * (conv_bytes + ssm_bytes)  # two layers, no padding
    touched = np.zeros(_backing(dst).size, dtype=bool)
    base = next(iter(dst.values())).untyped_storage().data_ptr()
    for name in group.layer_names:
        for a, b in zip(_states(src[name]), _states(dst[name])):
            assert torch.equal(a[src_slot], b[dst_slot])
            start = b[dst_slot].data_ptr() - base
            touched[start:start + b[dst_slot].numel() * b.element_size()] = True
    assert int(touched.sum()) == moved
    assert not np.count_nonzero(_backing(dst)[~touched] != POISON)  # attention pages, other slots, padding


def test_what_one_slot_per_request_does_not_carry_is_refused_by_field():
    for spec, field in ((_mamba(mamba_cache_mode="align"), "mamba_cache_mode"),
                        (_mamba(num_speculative_blocks=1), "num_speculative_blocks"),
                        (_mamba(tokens_per_state=16), "tokens_per_state")):
        with pytest.raises(ConfigError) as err:
            mamba_state_specs(spec, 1, (0,))
        assert err.value.field == f"kv_cache_config.kv_cache_groups[1].kv_cache_spec.{field}"


def test_decode_of_another_tp_size_differs_in_the_state_pools_fields():
    """vLLM shards a rank's state (half the conv channels and SSM heads at TP 2): kvbridge does not
    cut it across TP sizes, the contract names the field instead."""
    tp1 = mamba_state_specs(_mamba(), 0, (0, 2), tp_size=1)
    half = MambaSpec(block_size=512, shapes=((48, 3), (2, 8, 16)), dtypes=(torch.bfloat16, torch.float32),
                     page_size_padded=FULL.page_size_bytes)
    tp2 = mamba_state_specs(half, 0, (0, 2), tp_size=2)
    aux = kvb.AuxSchema.standard(0, "bfloat16", 0)
    diff = kvb.diff_contracts(kvb.contract_for(tp1, model="m", aux=aux), kvb.contract_for(tp2, model="m", aux=aux))
    paths = {d.path for d in diff}
    assert {"pools.group0_state0.kernel_abi", "pools.group0_state1.bytes_per_token"} <= paths
    same = mamba_state_specs(_mamba(), 0, (0, 2), tp_size=1)
    assert not kvb.diff_contracts(kvb.contract_for(tp1, model="m", aux=aux), kvb.contract_for(same, model="m", aux=aux))


def test_the_slot_is_the_requests_one_state_block_and_mamba_goes_beside_full_attention_only(tmp_path):
    assert state_slot(([3, 4, 5], [0, 0, 9]), 1, 0) == (9, "")  # vLLM's null block 0 is not a slot
    slot, why = state_slot(([3], [7, 9]), 1, 0)
    assert slot is None and "holds 2 state blocks" in why
    cfg, _ = _allocated(tmp_path)
    layout = group_layout(cfg)
    g = next(i for i, grp in enumerate(cfg.kv_cache_groups) if isinstance(grp.kv_cache_spec, MambaSpec))
    assert layout.states == ((g, (f"group{g}_state0", f"group{g}_state1")),) and layout.backoff == 1
    assert layout.state_blocks(([4, 5], [6]) if g == 1 else ([6], [4, 5]), 0) == (
        ((f"group{g}_state0", (6,)), (f"group{g}_state1", (6,))), "")
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=32)
    groups = [KVCacheGroupSpec(["model.layers.0.mixer"], _mamba()), KVCacheGroupSpec(["model.layers.1.attn"], FULL),
              KVCacheGroupSpec(["model.layers.2.attn"], swa)]
    with pytest.raises(ConfigError, match="Mamba state beside sliding-window groups") as err:
        group_layout(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups))
    assert err.value.field == "kv_cache_config.kv_cache_groups"
    with pytest.raises(ConfigError) as err:
        group_layout(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.mixer"], _mamba(mamba_cache_mode="all")), groups[1]]))
    assert err.value.field.endswith("mamba_cache_mode")


def test_regions_inside_a_registered_one_are_counted_not_registered_again():
    """A Mamba layer's conv and SSM regions lie inside its view (registered whole first), which an
    attention layer of another group may share: one engine registration, dropped with the last."""
    from kvbridge.integrations.vllm.cache import SharedRegions

    calls = []
    engine = types.SimpleNamespace(register=lambda p, n: calls.append(("reg", p, n)),
                                   unregister=lambda p: calls.append(("unreg", p)))
    shared = SharedRegions(engine, "tcp")
    shared.register(1000, 800)  # the Mamba layer's view
    shared.register(1000, 800)  # the attention layer sharing it
    shared.register(1000, 120)  # conv state region
    shared.register(1120, 680)  # SSM state region
    shared.register(5000, 100)  # elsewhere
    assert calls == [("reg", 1000, 800), ("reg", 5000, 100)]
    for ptr in (1120, 1000, 1000, 5000):
        shared.unregister(ptr)
    assert calls[2:] == [("unreg", 5000)]
    shared.unregister(1000)
    assert calls[3:] == [("unreg", 1000)]


def test_a_failed_hybrid_load_is_reported_by_request_not_block_ids(tmp_path):
    """vLLM raises on invalid_block_ids with several KV cache groups (block ids are per group): a
    hybrid decode's failed room goes to failed_recving (and finished_recving), no block ids."""
    import _vllm_config as C
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge.integrations.vllm import KVBridgeHMAConnector
    from kvbridge.integrations.vllm.meta import Receive

    vc = C.vllm_config(C.model_dir(tmp_path, "gqa", num_hidden_layers=4), "kv_consumer",
                       {"bootstrap_url": "http://127.0.0.1:9"}, mamba=True)
    worker = KVBridgeHMAConnector(vc, KVConnectorRole.WORKER, C.kv_cache_config(vc, 48)).worker_side
    assert worker.groups is not None and worker.groups.states
    worker._receive(Receive("r", 7, "p", (3, 4), 0, error="refused by the scheduler side", num_tokens=20))
    assert worker.get_transfer_results(set()) == (set(), {"r"}, {"r"})
    assert worker.get_block_ids_with_load_errors() == set() and worker.stats.data["load_failed"] == 1


def test_prefill_stops_one_token_short_once_and_refuses_a_prompt_it_cannot_shorten(tmp_path):
    """vLLM's real Scheduler (hybrid manager on) calls the connector's on_new_request as a request
    arrives: the prompt loses its last token once (not again, say after a preemption), the room
    stays bound to the whole prompt; a one-token prompt cannot lose one and is answered without a
    room (decode computes it)."""
    import _vllm_config as C
    from _vllm_world import Instance

    from kvbridge.integrations.vllm.scheduler import prompt_binding

    inst = Instance("kv_producer", C.model_dir(tmp_path, "gqa", num_hidden_layers=4),
                    {"bootstrap_url": "http://127.0.0.1:9", "instance": "p"}, tp=1, layout="LBNHC", block_size=BS,
                    num_blocks=48, mamba=True)
    side = inst.scheduler.connector.scheduler_side
    prompt = list(range(3, 73))
    whole = inst.add("whole", list(prompt), None)  # (no kv_transfer_params: not a P/D request, untouched)
    req = inst.add("pd", list(prompt), {"do_remote_decode": True})
    assert (whole.num_prompt_tokens, req.num_prompt_tokens, req.max_tokens) == (70, 69, 1)
    assert req.prompt_token_ids == prompt[:-1] and side._whole["pd"] == (prompt_binding(whole), 70)
    side.on_new_request(req)
    assert req.num_prompt_tokens == 69
    one = inst.add("one", [5], {"do_remote_decode": True})
    side.update_state_after_alloc(one, None, 0)
    assert one.num_prompt_tokens == 1 and side._fallback["one"] == "room_refused"
    side.update_state_after_alloc(req, None, 0)
    assert side._sends["pd"].binding == prompt_binding(whole) and side._sends["pd"].claim == 70


# -- end to end: vLLM's Scheduler (hybrid manager on) and KVBridgeHMAConnector from KVConnectorFactory,
# workers in processes of their own with vLLM's shared tensors, real Mooncake TCP (_vllm_world.py) ---


@pytest.mark.timeout(600)
def test_mamba_hybrid_moves_the_state_after_n_minus_1_tokens(tmp_path, daemon):
    """Prefill stops one token short (its request loses the prompt's last token as it arrives),
    sends the full-attention rows of n - 1 tokens and each Mamba layer's conv and SSM state after
    them, with the last chunk; decode asks for n - 1 tokens (it computes token n - 1 on that state).
    Every moved byte is checked, every other byte of decode's allocation keeps its poison, the
    bytes counted are exactly the rows and the states (no page padding)."""

    import _vllm_config as C
    from _vllm_world import instance_pair, start_ranks

    model = C.model_dir(tmp_path, "gqa", num_hidden_layers=4)
    pre, dec = instance_pair(model, daemon, peer_timeout=10.0, tp=1, layout="LBNHC", block_size=BS, num_blocks=48,
                             mamba=True)
    try:
        kinds = [type(g.kv_cache_spec).__name__ for g in pre.kvcc.kv_cache_groups]
        assert sorted(kinds) == ["FullAttentionSpec", "MambaSpec"]  # vLLM's grouping, manager on
        assert type(pre.scheduler.connector).__name__ == "KVBridgeHMAConnector"  # from KVConnectorFactory
        paged = kinds.index("FullAttentionSpec")
        pre.attach(start_ranks(pre.cfgs))
        dec.attach(start_ranks(dec.cfgs))
        free = (pre.free_blocks(), dec.free_blocks())

        n, rid = 70, "mamba"  # prefill: 69 tokens in two steps of 64 and 5 (the state travels with the second)
        prompt = [(i * 7) % 500 + 3 for i in range(n)]
        pre.add(rid, prompt, {"do_remote_decode": True})
        assert pre.scheduler.requests[rid].num_prompt_tokens == n - 1
        pre.run_until(lambda: _finished(pre, rid), {rid: 11})
        params = pre.outputs[rid].kv_transfer_params
        assert params["do_remote_prefill"] is True and params["kvbridge_num_tokens"] == n  # the whole prompt's
        dec.add(rid, prompt, params, max_tokens=3)
        seen = {}

        def loaded():
            ids = dec.group_block_ids(rid) if rid in dec.scheduler.requests else ()
            if rid not in seen and ids and len(ids[paged]) * BS >= n - 1:
                seen[rid] = ids  # at allocation: what the connector was handed
            return _finished(dec, rid)

        dec.run_until(loaded)
        (w,) = dec.workers
        row = 2 * 64 * 2 * 2  # K and V of 2 heads of 64, bf16
        conv, ssm = 96 * 3 * 2, 4 * 8 * 16 * 4
        assert w.call("stats", rid)["bytes"] == 2 * (n - 1) * row + 2 * (conv + ssm)
        pre.run_until(lambda: pre.free_blocks() == free[0])  # prefill frees the room once decode has it
        dec.run_until(lambda: True)
        assert dec.free_blocks() == free[1]
        assert dec.worker_stats.get("rooms_received") == 1 and not dec.worker_stats.get("load_failed")
        # (the state after n tokens, what prefill holds without the backoff, would be wrong everywhere)
        assert w.call("check_mamba", seen[rid], n - 1, 11) == {"wrong": 0, "stray": 0, "mamba_layers": 2}
    finally:
        pre.stop()
        dec.stop()


def _finished(inst, rid):
    return rid in inst.outputs and inst.outputs[rid].finish_reason is not None
