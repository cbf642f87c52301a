"""Model mode end to end in one process: a tiny Qwen2 (GQA) and a tiny
DeepSeek-V3 (MLA + NextN draft) prefill into CP-sharded paged pools at random
pages, kvbridge's own plans move the owned pages into a poisoned decode pool,
decode rebuilds the model's caches from those pages and generates. Against the
colocated run (same prompts, the model's own cache, no transfer): bytes equal,
poison intact, logits bit-equal (target and draft), greedy tokens equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _inproc import run_inproc

from kvbridge.integrations.transformers import (
    DST_POISON,
    SRC_STALE,
    decode,
    prefill,
    untouched_bytes,
)

MODELS = ("tiny-qwen2", "tiny-deepseek-v3")
PAGE_SIZE = 4


def prompts(bs: int, seed: int = 0) -> list[list[int]]:
    """bs 1: 13 tokens (not a multiple of the page size); bs 3 adds 4 (exactly
    one page) and 1 (a lone partial page)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 4, 1)[:bs]]


def assert_all_ok(run) -> None:
    bad = [c for c in run.checks if not c.ok]
    assert not bad, "; ".join(f"request {c.index}: {c.detail}" for c in bad)


@pytest.mark.parametrize("chunk_size", [None, 3, 5], ids=["one-shot", "chunk3", "chunk5"])
@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_pages_rebuild_the_cache_bit_exactly(tiny, name, cp, bs, chunk_size):
    run = run_inproc(tiny(name), prompts(bs, seed=cp * 7 + bs), page_size=PAGE_SIZE, cp=cp, chunk_size=chunk_size)
    assert_all_ok(run)
    assert [c.num_tokens for c in run.checks] == [13, 4, 1][:bs]


@pytest.mark.parametrize(
    "name,pool", [("tiny-qwen2", "v"), ("tiny-deepseek-v3", "target"), ("tiny-deepseek-v3", "draft")]
)
def test_negative_control_one_flipped_byte_is_caught(tiny, name, pool):
    run = run_inproc(tiny(name), prompts(3), page_size=PAGE_SIZE, cp=2, chunk_size=5, corrupt=pool)
    bad = [c for c in run.checks if not c.ok]
    assert [c.index for c in bad] == [2], [c.detail for c in run.checks]
    (c,) = bad
    assert not c.bytes_equal and f"pool {pool!r}" in c.detail and "logical page 0, row 0" in c.detail
    assert c.poison_intact
    # the flipped byte reached the model: its logits (the draft's, for a draft page) moved
    assert not c.logits_equal
    assert ("(target)" in c.detail) == (pool != "draft")


@pytest.mark.parametrize("name", MODELS)
def test_a_written_tail_is_caught_by_the_poison_check(tiny, name):
    run = run_inproc(tiny(name), prompts(1), page_size=PAGE_SIZE, cp=2)
    lens = [13]
    assert untouched_bytes(run.dst[0], run.dst_tables, lens, DST_POISON) is None
    pool = next(iter(run.dst[0].specs))
    tail_slot = int(run.dst_tables[0][3]) * PAGE_SIZE + 1  # token 13: past the last valid row (12)
    run.dst[0].byte_view(pool)[0, tail_slot, 0] = SRC_STALE
    msg = untouched_bytes(run.dst[0], run.dst_tables, lens, DST_POISON)
    assert msg and f"page {run.dst_tables[0][3]} row 1" in msg


@pytest.mark.parametrize("name", MODELS)
def test_each_cp_rank_stores_only_the_pages_it_owns(tiny, name):
    run = run_inproc(tiny(name), prompts(3), page_size=PAGE_SIZE, cp=2, chunk_size=3)
    lens = [13, 4, 1]
    for (r, _), paged in run.src.items():
        owned_rows = sum(min(PAGE_SIZE, n - l * PAGE_SIZE) for n in lens for l in range(r, -(-n // PAGE_SIZE), 2))
        for pool in paged.specs:
            view = paged.byte_view(pool)
            written = (view != SRC_STALE).any(dim=-1).any(dim=0)  # slots with any byte written, any layer
            assert int(written.sum()) == owned_rows, (r, pool)


@pytest.mark.parametrize(
    "src_tp,dst_tp,cp", [(1, 2, 1), (2, 1, 2), (2, 4, 1), (1, 4, 2)], ids=["p1-d2", "p2-d1-cp2", "p2-d4", "p1-d4-cp2"]
)
def test_decode_tp_other_than_prefill_tp_reassembles_heads(tiny, src_tp, dst_tp, cp):
    """Qwen2 has 2 KV heads: d=4 replicates them (rank j holds head j*2//4)."""
    lm = tiny("tiny-qwen2")
    run = run_inproc(lm, prompts(3), page_size=PAGE_SIZE, cp=cp, chunk_size=5, src_tp=src_tp, dst_tp=dst_tp)
    assert_all_ok(run)
    widths = {paged.specs["k"].bytes_per_token for paged in run.dst}
    assert widths == {2 * 16 * 4 // min(dst_tp, 2)}


def test_bfloat16_models_round_trip_bit_exactly(tiny):
    for name in MODELS:
        run = run_inproc(tiny(name, "bfloat16"), prompts(3), page_size=PAGE_SIZE, cp=2, chunk_size=5)
        assert_all_ok(run)
        assert all(s.abi == "bfloat16" for s in run.dst[0].specs.values())


@pytest.mark.parametrize("name", MODELS)
def test_the_colocated_reference_is_the_model_own_greedy_generation(tiny, name):
    """The reference itself is honest: one-shot prefill + decode give the logits
    of ``model.generate`` (greedy) bit for bit, and its tokens; chunking the
    prefill keeps the tokens on these prompts."""
    from kvbridge.integrations.transformers import bits_equal

    lm = tiny(name)
    prompt = prompts(1)[0]
    gen = lm.model.generate(
        torch.tensor([prompt]), max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    expect = gen.sequences[0, len(prompt) :].tolist()
    (p,) = prefill(lm, [prompt])
    out = decode(lm, p.cache, p.draft_cache, p.first_token, p.num_tokens, 3)
    assert out.tokens == expect
    assert bits_equal(p.logits, gen.logits[0][0])
    assert all(bits_equal(out.logits[i], gen.logits[i + 1][0]) for i in range(3))
    (p,) = prefill(lm, [prompt], chunk_size=5)
    assert decode(lm, p.cache, p.draft_cache, p.first_token, p.num_tokens, 3).tokens == expect


def test_rows_are_what_the_model_cached(tiny):
    """MLA: the row is | kv_a_layernorm(latent) | rope key after RoPE |,
    recomputed here from the layer's own weights."""
    lm = tiny("tiny-deepseek-v3")
    prompt = torch.tensor(prompts(1)[0])
    (p,) = prefill(lm, [prompt.tolist()])
    attn = lm.model.model.layers[0].self_attn
    with torch.inference_mode():
        h = lm.model.model.layers[0].input_layernorm(lm.model.model.embed_tokens(prompt[None]))
        latent, _ = torch.split(attn.kv_a_proj_with_mqa(h), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        normed = attn.kv_a_layernorm(latent)
    assert torch.equal(p.cache.layers[0].keys[0, 0], normed[0])
    assert p.cache.layers[0].values.shape[-1] == attn.qk_rope_head_dim
    np.testing.assert_array_equal(p.cache.layers[0].keys.shape, (1, 1, 13, 32))


def test_non_finite_logits_never_pass_as_equal(tiny):
    from kvbridge.integrations.transformers import Decoded, check_request

    lm = tiny("tiny-qwen2")
    (p,) = prefill(lm, [prompts(1)[0]])
    nan = Decoded(tokens=[1, 2], logits=torch.full((1, 4), float("nan")), draft_logits=None)
    c = check_request(p, nan, nan, pages_diff=None, poison_diff=None)
    assert not c.logits_equal and "not finite" in c.detail


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_writes_the_rows_of_a_page_as_they_appear(tiny, name, model_cache):
    """Chunks of 3 over pages of 4: after each step exactly the owned rows
    computed so far are in the pool; the page a chunk ends inside is partial."""
    import kvbridge as kvb
    from kvbridge.integrations.transformers import PagedKV, RankWriter, cache_geometry, model_pools

    lm = tiny(name)
    lanes, seen = kvb.OwnerLanes(2), []
    paged = PagedKV(model_pools(lm.model, PAGE_SIZE), 8, fill=SRC_STALE)

    class Recording(RankWriter):
        def write(self, step):
            n = super().write(step)
            pool = next(iter(self.paged.specs))
            written = (self.paged.byte_view(pool) != SRC_STALE).any(dim=-1).any(dim=0)
            seen.append((n, torch.nonzero(written).flatten().tolist()))
            return n

    writer = Recording(cache_geometry(lm.model), paged, lanes, cp_rank=1)
    writer.add_request(0, 13, np.array([5, 2]))  # cp rank 1 owns logical pages 1 and 3 (tokens 4..7, 12)
    logical, physical = writer.owned_pages(0)
    assert logical.tolist() == [1, 3] and physical.tolist() == [5, 2]
    prefill(lm, [prompts(1)[0]], chunk_size=3, writers=[writer])
    slot = lambda page, rows: [page * PAGE_SIZE + r for r in rows]  # noqa: E731
    assert seen == [
        (0, []),  # tokens 0..2: page 0 belongs to cp rank 0
        (2, slot(5, [0, 1])),  # tokens 3..5: 4, 5 land in page 5 (logical 1), rows 2, 3 not yet computed
        (2, slot(5, [0, 1, 2, 3])),  # tokens 6..8
        (0, slot(5, [0, 1, 2, 3])),  # tokens 9..11: logical page 2 is cp rank 0's
        (1, sorted(slot(2, [0]) + slot(5, [0, 1, 2, 3]))),  # token 12: the last, partial page
    ]
