"""Hybrid models in model mode: a tiny random Qwen3-Next (Gated DeltaNet conv + recurrent
state beside full attention) and a tiny gpt-oss (sliding window beside full attention)
prefill, their caches travel as paged, window and state pools (each chunk's share from
``chunk_extent``, planned by ``plan_kind``, written by a transfer engine), and decode from
the rebuilt cache is bit-equal to colocated; the bytes moved equal ``needed_bytes``."""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvbridge as kvb  # noqa: E402
from kvbridge.integrations.transformers.hybrid import HybridPools, hybrid_specs, send_chunk  # noqa: E402
from kvbridge.integrations.transformers.v4 import greedy_decode, prefill_chunks  # noqa: E402
from kvbridge.transfer.engine import LocalFabric, create_engine  # noqa: E402

NEW_TOKENS = 3


@pytest.fixture(scope="module")
def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                          linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                          linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, decoder_sparse_step=1, full_attention_interval=2)
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).eval(), (32, 32, 64)  # conv channel groups: q, k, v


@pytest.fixture(scope="module")
def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                       sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return GptOssForCausalLM(cfg).eval(), None


def _run(model, groups, n, cuts, cp=1):
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    for cache, *_, logits in prefill_chunks(model, ids, cuts):
        pass
    template = cache
    specs = hybrid_specs(template, page_size=4, conv_groups=groups)
    want = greedy_decode(model, cache, logits[0].argmax(), NEW_TOKENS)[0]

    # CP is simulated as model mode does: every CP rank runs the whole prompt, and sends only what it owns
    ranks = [HybridPools(specs, 16) for _ in range(cp)]
    decode_pools = HybridPools(specs, 16, fill=0xEE)
    for r, pools in enumerate(ranks):
        pools.allocate(n, needed=False, base=2 + r)
    decode_pools.allocate(n, needed=True, order="reversed", base=1)
    lanes = kvb.OwnerLanes(cp) if cp > 1 else None
    fabric = LocalFabric()
    src, dst = create_engine("local", fabric=fabric), create_engine("local", fabric=fabric)
    try:
        for pools in ranks:
            for ptr, size in pools.regions():
                src.register(ptr, size)
        for ptr, size in decode_pools.regions():
            dst.register(ptr, size)
        moved = 0
        for cache, done, end, last, logits in prefill_chunks(model, ids, cuts):
            for r, pools in enumerate(ranks):
                pools.write_cache(cache, end, last)
                moved += send_chunk(pools, decode_pools, src, dst.session_id, n, done, end, last, lanes=lanes,
                                    cp_rank=r, token_page_size=4)
    finally:
        src.close()
        dst.close()
    assert moved == sum(kvb.needed_bytes(s, n) for s in specs.values())
    got = greedy_decode(model, decode_pools.read_cache(model.config, n, template), logits[0].argmax(), NEW_TOKENS)[0]
    assert torch.equal(got, want), (got - want).abs().max()
    return specs


@pytest.mark.parametrize("n, cuts", [(5, ()), (21, ()), (30, (9, 17))])
def test_qwen3_next_disaggregated_equals_colocated(qwen3_next, n, cuts):
    specs = _run(*qwen3_next, n, cuts)
    assert {s.kind for s in specs.values()} == {"paged", "state"}
    assert specs["conv"].shard_units == (32, 32, 64)


@pytest.mark.parametrize("n, cuts", [(5, ()), (13, ()), (30, (9, 17))])
def test_gpt_oss_disaggregated_equals_colocated(gpt_oss, n, cuts):
    specs = _run(*gpt_oss, n, cuts)
    assert specs["swa"].kind == "window" and specs["swa"].window == 7


@pytest.mark.parametrize("n, cuts", [(13, ()), (30, (9, 17))])
def test_cp2_lanes_send_each_owned_unit_once(qwen3_next, gpt_oss, n, cuts):
    """CP 2, interleaved lanes: each rank sends the token pages (paged and window) it owns and
    the owner of the last token the state; together exactly what decode needs."""
    _run(*qwen3_next, n, cuts, cp=2)
    _run(*gpt_oss, n, cuts, cp=2)


@pytest.mark.parametrize("n", [13, 30])
def test_qwen3_next_state_from_two_tp_ranks_into_one(qwen3_next, n):
    """Heterogeneous TP of the state slots on a real model's layout: two prefill TP ranks each
    hold their half of every conv channel group (q, k, v) and of the SSM heads
    (``kvb.state_tp_spec``); each sends its part (``state_slices`` through ``plan_kind``) into
    the decode TP 1 rank's whole slot, and decode is bit-equal. (TP is simulated as model mode
    does: both ranks ran the whole prompt; the pages come whole from rank 0.)"""
    model, groups = qwen3_next
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    for cache, *_, logits in prefill_chunks(model, ids, ()):
        pass
    template = cache
    full = hybrid_specs(template, page_size=4, conv_groups=groups)
    want = greedy_decode(model, cache, logits[0].argmax(), NEW_TOKENS)[0]
    for cache, *_ in prefill_chunks(model, ids, ()):
        pass
    decode_pools = HybridPools(full, 16, fill=0xEE)
    decode_pools.allocate(n, needed=True, order="reversed", base=1)
    fabric = LocalFabric()
    src, dst = create_engine("local", fabric=fabric), create_engine("local", fabric=fabric)
    try:
        for ptr, size in decode_pools.regions():
            dst.register(ptr, size)
        moved = 0
        for r in range(2):
            specs = {name: kvb.state_tp_spec(s, 2) if s.kind == "state" else s for name, s in full.items()}
            pools = HybridPools(specs, 16)
            pools.allocate(n, needed=False, base=2)
            for ptr, size in pools.regions():
                src.register(ptr, size)
            pools.write_cache(cache, n, last=False)  # the pages
            for lid, layer in enumerate(cache.layers):
                if not hasattr(layer, "conv_states"):
                    continue
                conv, ssm = layer.conv_states[0][0], layer.recurrent_states[0][0]  # [channels, K], [heads, k, v]
                parts, at = [], 0
                for g in groups:
                    parts.append(conv[at + r * g // 2 : at + (r + 1) * g // 2])
                    at += g
                pools.slot("conv", lid).view(torch.float32)[:] = torch.cat(parts).reshape(-1)
                heads = ssm.shape[0]
                pools.slot("ssm", lid).view(torch.float32)[:] = ssm[r * heads // 2 : (r + 1) * heads // 2].reshape(-1)
            for name, spec in specs.items():
                ext = kvb.needed_extent(spec, n)
                if spec.kind == "state":
                    plan = kvb.plan_kind(spec, pools.descs(), decode_pools.descs(), ext, pools.units[name],
                                         decode_pools.units[name], dst_spec=full[name], tp=(2, r, 1, 0))
                elif r == 0:
                    units = np.arange(ext.first, ext.stop)
                    plan = kvb.plan_kind(spec, pools.descs(), decode_pools.descs(), ext, pools.units[name][units],
                                         decode_pools.units[name][units - ext.first])
                else:
                    continue
                src.write(dst.session_id, plan.src, plan.dst, plan.length)
                moved += plan.num_bytes
    finally:
        src.close()
        dst.close()
    assert moved == sum(kvb.needed_bytes(s, n) for s in full.values())
    got = greedy_decode(model, decode_pools.read_cache(model.config, n, template), logits[0].argmax(), NEW_TOKENS)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("which, cp", [("qwen3_next", 1), ("gpt_oss", 1), ("qwen3_next", 2), ("gpt_oss", 2)])
def test_hybrids_through_the_rooms_equal_colocated(request, daemon, which, cp):
    """The same models through prefill endpoints (one per CP rank) and a decode endpoint (a room per
    request, a bootstrap daemon, local engines; ``HybridRooms``): paged pools beside window or state
    pools in one room, both token-paged pools on the room's page mapping, the state slots as
    kind_units. CP 2 (interleaved lanes, CP attention simulated): each rank sends the token pages it
    owns, the owner of the last token the state and the aux row. Prompts shorter and longer than
    gpt-oss's window, not a multiple of the page, chunked: logits bit-equal, tokens equal, the bytes
    the ranks posted (less the aux row) equal to what decode needs."""
    from kvbridge.integrations.transformers.hybrid import HybridRooms

    model, groups = request.getfixturevalue(which)
    for template, *_ in prefill_chunks(model, torch.zeros((1, 5), dtype=torch.long), ()):
        pass
    rooms = HybridRooms(model, template, daemon.url, conv_groups=groups, engine="local", cp_size=cp, capacity=16,
                        instance=f"tiny-{which}-cp{cp}")
    try:
        for n, cuts in ((5, ()), (13, ()), (30, (9, 17))):
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            r = rooms.run(ids, list(cuts), steps=NEW_TOKENS)
            assert r["bytes_moved"] == r["bytes_needed"], r
            assert r["logits_equal"] and r["tokens_equal"], r
            if cp == 2:  # both ranks own token pages of every prompt here (2, 4 and 8 pages)
                assert all(r["bytes_per_rank"]), r
    finally:
        rooms.close()
