"""vLLM's other cache shapes: HND (LBHNC, the CPU backend's layout) between equal TP sizes,
DeepSeek-shaped MLA with a prefill TP wider than decode's, and the start-up refusals of a
decode whose contract differs from its prefill instance's (block size, dtype, an HND TP
layout), each naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from _vllm_world import start_ranks
from test_vllm_transfer import BS, _check, _run_pair, _world


def _pairs(pre, dec, seeds_lengths, rng):
    for seed, n in seeds_lengths:
        prompt = [int(t) for t in rng.integers(3, 500, n)]
        rid = _run_pair(pre, dec, prompt, seed)
        _check(dec, rid, prompt, seed)
        for w in dec.workers:
            w.call("reset")


def _refusals(pre, daemon, changes):
    """Decode ranks built like ``pre``'s peers but each with one of ``changes``, started side
    by side: their start-up answers."""
    url, token = daemon
    cfgs = []
    for i, change in enumerate(changes):
        cfgs.append({**pre.cfgs[0], "role": "kv_consumer", "tp_rank": 0,
                     "extra": {"bootstrap_url": url, "bootstrap_token": token, "instance": f"d-wrong-{i}",
                               "prefill_instance": pre.cfgs[0]["extra"]["instance"], "prefill_wait_s": 5},
                     **change})
    answers = start_ranks(cfgs)
    for proc, _, _ in answers:
        proc.join(30.0)
    return [a for _, _, a in answers]


@pytest.mark.timeout(900)
def test_hnd_equal_tp_and_refusals(tmp_path, daemon):
    """HND moves whole blocks per TP rank pair (p2 -> d2, 4 KV heads: 2 a rank); a decode of
    another block size, dtype or TP size under HND is refused before its first request. (With
    one KV head a rank, HND and NHD blocks are the same bytes: rows, any TP.)"""
    pre, dec = _world(tmp_path, daemon, p_tp=2, d_tp=2, layout="LBHNC", model_overrides={"num_key_value_heads": 4})
    try:
        assert {w.info["layout"] for w in dec.workers} == {"LBHNC"}
        _pairs(pre, dec, [(21, 9), (22, 48)], np.random.default_rng(3))
        cases = (({"block_size": 32}, "pools.kv.page_size"), ({"dtype": "float16"}, "pools.kv.dtype"),
                 ({"tp": 1}, "kernel.abi"))
        for (kind, name, message, field), (_, names) in zip(_refusals(pre, daemon, [c for c, _ in cases]), cases):
            assert (kind, name) == ("error", "ContractMismatch"), message
            assert names in message and field and "/diagnostics" in message, message
    finally:
        pre.stop()
        dec.stop()


@pytest.mark.timeout(600)
def test_mla_prefill_tp2_to_decode_tp1(tmp_path, daemon):
    """DeepSeek V3-shaped MLA (576-wide bf16 latent, replicated over TP): prefill TP rank 0
    sends, rank 1 sends nothing and still releases its blocks; decode gets every byte."""
    pre, dec = _world(tmp_path, daemon, p_tp=2, d_tp=1, kind="mla")
    try:
        assert [w.info["endpoint"] for w in pre.workers] == [True, False]  # rank 1 registers nothing
        assert {w.info["layout"] for w in pre.workers + dec.workers} == {"MLA"}
        free_p = pre.free_blocks()
        _pairs(pre, dec, [(31, 20), (32, 3 * BS)], np.random.default_rng(4))
        pre.run_until(lambda: pre.free_blocks() == free_p)
    finally:
        pre.stop()
        dec.stop()
