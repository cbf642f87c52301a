"""Model mode through the real worker path: a bootstrap daemon, prefill and decode
workers as processes running the tiny model (``kvbridge prefill-worker/decode-worker
--model``), KV over Mooncake TCP on loopback into poisoned decode pools at random page
ids; every request also run colocated in this process. Per request: bytes equal to
the colocated cache (per decode rank: its heads), poison intact, logits bit-equal
(target and draft), greedy tokens equal, aux row equal.

A representative subset runs here (the in-process tests of test_model_roundtrip.py
cover every combination of model, CP, batch and chunking):

    tiny-deepseek-v3  CP 2, bs 3, chunks of 5 over pages of 4 (13, 4, 1 tokens), via the CLI --json
    tiny-qwen2        decode TP 2 (each decode rank its head; rank 0 gathers), one shot, bs 1
    tiny-qwen2        prefill TP 2 -> decode TP 1, bfloat16, bs 3, chunks of 3
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvbridge.transfer.engine import mooncake_available

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]


@pytest.fixture
def model_env(tmp_path_factory, monkeypatch):
    """Tiny models cached in a private directory, for this process and the workers it starts."""
    root = tmp_path_factory.getbasetemp() / "kvbridge-cache"
    monkeypatch.setenv("KVBRIDGE_CACHE", str(root))
    return root


def assert_every_request_equal(summary: dict, n: int) -> None:
    bad = [r for r in summary["per_request"] if not r["ok"]]
    assert not bad, "; ".join(f"request {r['index']}: {r['detail']}" for r in bad)
    assert summary["requests"] == summary["requests_ok"] == summary["tokens_equal"] == summary["logits_equal"] == n
    assert summary["bytes_equal"] == summary["poison_intact"] == summary["aux_equal"] == n
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]


def test_deepseek_cp2_batch_chunked_through_the_cli(model_env):
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli.main", "demo", "--model", "tiny-deepseek-v3", "--cp", "2", "--tokens",
         "13,4,1", "--requests", "3", "--batch-size", "3", "--chunk-tokens", "5", "--max-new-tokens", "3", "--json",
         "--no-progress"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert_every_request_equal(summary, 3)
    assert [r["num_tokens"] for r in summary["per_request"]] == [13, 4, 1]
    assert all(len(r["tokens"]) == 4 for r in summary["per_request"])


@pytest.mark.parametrize(
    "prefill_tp, decode_ranks, tokens, batch, chunk, dtype",
    [(1, 2, (13,), 1, 0, "float32"), (2, 1, (13, 4, 1), 3, 3, "bfloat16")],
    ids=["qwen-p1-d2-one-shot", "qwen-p2-d1-bf16-chunked"],
)
def test_qwen_with_decode_tp_other_than_prefill_tp(model_env, prefill_tp, decode_ranks, tokens, batch, chunk, dtype):
    from kvbridge.demo_model import ModelDemoSpec, run_model_demo

    spec = ModelDemoSpec(model="tiny-qwen2", prefill_tp=prefill_tp, decode_ranks=decode_ranks, tokens=tokens,
                         batch_size=batch, chunk_tokens=chunk, max_new_tokens=3, dtype=dtype, room_timeout=60)
    summary = run_model_demo(spec, show_progress=False)
    assert_every_request_equal(summary, len(tokens))


def test_the_demo_comparison_catches_one_flipped_byte(tiny, tmp_path):
    """The verdict is not vacuous: rows read back with one byte flipped fail bytes_equal (and only
    that), an out file with other tokens fails tokens_equal."""
    from kvbridge.demo_model import ModelDemoSpec, compare, run_colocated
    from kvbridge.integrations.transformers import cache_geometry, colocated_rows
    from kvbridge.worker import ops
    from kvbridge.worker.model_decode import out_path, rows_path, save_atomic

    lm = tiny("tiny-qwen2")
    spec = ModelDemoSpec(tokens=(9,), batch_size=1, chunk_tokens=0, max_new_tokens=2)
    pre, dec = run_colocated(lm, spec, [list(range(9))])[0]
    rows = colocated_rows(cache_geometry(lm.model), pre, ["k", "v"])
    rows["v"] = rows["v"].clone()
    rows["v"].view(torch.uint8)[1, 5, 3] ^= 0x10
    save_atomic({"rows": rows, "problems": [], "tp_rank": 0}, rows_path(tmp_path, 7, 0))
    aux = {"first_token": pre.first_token, "num_cached_tokens": 9, "hidden": pre.hidden.numpy()}
    save_atomic({"tokens": dec.tokens, "logits": dec.logits, "draft_logits": None, "aux": aux}, out_path(tmp_path, 7))
    ok_reply = [ops.RoomResult(7, True, rank="d")]
    v = compare(lm, spec, 0, 7, (pre, dec), ok_reply, tmp_path)
    assert not v["bytes_equal"] and not v["ok"] and "pool 'v' layer index 1 token 5" in v["detail"]
    assert v["logits_equal"] and v["tokens_equal"] and v["poison_intact"] and v["aux_equal"]
    save_atomic({"tokens": [dec.tokens[0], dec.tokens[1] + 1, dec.tokens[2]], "logits": dec.logits,
                 "draft_logits": None, "aux": aux}, out_path(tmp_path, 7))
    assert not compare(lm, spec, 0, 7, (pre, dec), ok_reply, tmp_path)["tokens_equal"]


def test_a_model_prefill_op_without_its_prompt_is_refused_naming_the_field(model_env):
    from kvbridge.errors import ConfigError
    from kvbridge.worker import ops
    from kvbridge.worker.config import load_config
    from kvbridge.worker.model_prefill import ModelPrefillWorker

    cfg = load_config("prefill", {"model": "tiny-qwen2", "page_size": 4, "pages": 8}, environ={})
    worker = ModelPrefillWorker(cfg)  # not started: no endpoint, nothing registered
    assert worker.specs["k"].num_heads == 2 and worker.contract.pool("k").tp_sharding == "heads"
    with pytest.raises(ConfigError, match="needs the prompt's 3 token ids") as err:
        worker.begin(b"peer", 1, ops.Prefill(5, 3))
    assert err.value.field == "prompt" and err.value.room == 5
    with pytest.raises(ConfigError, match=r"token ids must be integers in \[0, 256\)"):
        worker.begin(b"peer", 1, ops.Prefill(5, 2, prompt=[1, 256]))
