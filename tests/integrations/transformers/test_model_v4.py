"""DeepSeek-V4 in model mode: a tiny random ``DeepseekV4ForCausalLM`` (HCA and CSA layers,
indexer on) prefills, its cache is written into kvbridge's window, compressed and state
pools, each chunk sends what ``chunk_extent`` gives it (planned by ``plan_kind``, written by
a transfer engine), and decode rebuilds its cache from what arrived: logits and tokens
bit-equal with the colocated run, and the bytes moved equal to what decode needs
(``needed_bytes``). The model has no NextN layer in transformers, so no draft pool here."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.deepseek_v4")

import kvbridge as kvb  # noqa: E402
from kvbridge.integrations.transformers.v4 import V4Pools, send_chunk, v4_specs  # noqa: E402
from kvbridge.transfer.engine import LocalFabric, create_engine, mooncake_available  # noqa: E402

WINDOW = 16
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def v4_model():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, sliding_window=WINDOW, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
        index_topk=8, hc_mult=2, max_position_embeddings=4096,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(cfg).eval()


def _prefill(model, ids, cuts):
    """Chunked prefill; yields (cache, done, end, last) after each chunk and returns the last logits."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    bounds = [0, *cuts, ids.shape[1]]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        with torch.no_grad():
            out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
        yield cache, a, b, i == len(bounds) - 2, out.logits[:, -1]


def _decode(model, cache, first):
    logits, tok = [], first
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            out = model(tok.view(1, 1), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        tok = out.logits[0, -1].argmax()
    return torch.stack(logits)


def _engines(kind):
    if kind == "local":
        fabric = LocalFabric()
        return create_engine("local", fabric=fabric), create_engine("local", fabric=fabric)
    return create_engine("mooncake"), create_engine("mooncake")


@pytest.mark.parametrize("n, cuts", [
    (9, ()),  # shorter than the window, no complete HCA window, two complete CSA windows
    (45, ()),  # longer than the window, not a multiple of 4 or 32
    (131, (40, 96)),  # chunked, chunks not on page or window boundaries; 4 HCA entries and a tail of 3
    (64, (32,)),  # on every boundary: empty tails
])
def test_v4_disaggregated_equals_colocated(v4_model, n, cuts, engine_kind="local"):
    _run(v4_model, n, cuts, engine_kind)


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_v4_over_mooncake(v4_model):
    _run(v4_model, 77, (50,), "mooncake")


def _run(model, n, cuts, engine_kind):
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    # colocated: prefill, then decode from the same cache
    for cache, *_, logits in _prefill(model, ids, cuts):
        pass
    first = logits[0].argmax()
    want = _decode(model, cache, first)

    specs = v4_specs(model.config, page_size=4)
    prefill_pools, decode_pools = V4Pools(specs, 64), V4Pools(specs, 64, fill=0xEE)
    prefill_pools.allocate(n, needed=False, base=3)
    decode_pools.allocate(n, needed=True, order="reversed", base=1)
    src, dst = _engines(engine_kind)
    try:
        for ptr, size in prefill_pools.regions():
            src.register(ptr, size)
        for ptr, size in decode_pools.regions():
            dst.register(ptr, size)
        moved = 0
        for cache, done, end, last, logits in _prefill(model, ids, cuts):
            prefill_pools.write_cache(cache, end, last)
            moved += send_chunk(prefill_pools, decode_pools, src, dst.session_id, n, done, end, last)
    finally:
        src.close()
        dst.close()
    assert moved == sum(kvb.needed_bytes(s, n) for s in specs.values())
    got = _decode(model, decode_pools.read_cache(model.config, n), logits[0].argmax())
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_v4_decode_needs_a_fraction_of_v32_bytes():
    """The bytes decode needs per request, from the layout: V4 against V3.2 (bf16, same tokens)."""
    v4 = kvb.deepseek_v4_pools()
    v32 = kvb.preset_pools("deepseek-v3.2")
    ratios = [sum(kvb.needed_bytes(s, n) for s in v4.values()) / sum(kvb.needed_bytes(s, n) for s in v32.values())
              for n in (1024, 8192, 32768, 131072)]
    assert all(0 < r < 0.2 for r in ratios) and np.all(np.diff(ratios) < 0)
