"""The test a user trusts: real ``vllm serve`` processes with kvbridge's connector.

A real bootstrap daemon (``kvbridge bootstrap``), a prefill server (``kv_producer``) and a
decode server (``kv_consumer``) started with ``--kv-transfer-config`` exactly as docs/vllm.md
has a user type it and ``kvbridge vllm-proxy`` in front, on a tiny random-weight Llama-shaped
GQA model built here (no downloads). The reference is prefill-0 serving plain requests (no
kv_transfer_params): the producer connector leaves them untouched (checked: no params in the
answer, every prompt token computed locally), so prefill-0 is a colocated server of its own and
no third server is started for it.

- greedy tokens through the proxy equal the colocated computation's, for a batch of prompts of
  several lengths sent at once, including prefix-cache hits on decode; decode's own counters show
  that it computed no prompt token itself (every one came over kvbridge or from its prefix cache);
- a decode whose block size differs from prefill's is refused at start-up, naming the field, and
  never becomes healthy (a dtype mismatch is refused the same way, naming ``pools.kv.dtype``:
  test_vllm_layouts.py, with vLLM's real classes);
- prefill killed with a room pending, and decode killed mid-generation, both end in errors within
  a bound; nothing is served as a success;
- issue 31's attacks on rooms (another request's room, a longer prompt, a reused room, a room
  claimed before its owner) end in errors on the same servers, and the owner is still served.
- a ``prompt_logprobs`` request (decode computes its prompt) releases its room: prefill counts it
  at once, not after ``target_timeout``.

vLLM start-up dominates the wall time (about 50 s for one server alone on 2 cores, 2-3 min for
several at once): four servers in all, each started once for the module, two at a time.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs vLLM: make test-vllm")

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from _vllm_model import LLAMA_GQA, build_model  # noqa: E402
from _vllm_serve import (BLOCK_SIZE, Proxy, VllmServer, complete, prompt, sources, start_all, tokens_of,  # noqa: E402
                         transfer_config)

from kvbridge.integrations.vllm.proxy import prefill_request  # noqa: E402

pytestmark = pytest.mark.timeout(900)

ERROR_BOUND_S = 90.0  # a failed room must end the request within this


# Lengths in tokens before BOS: under a block, a block's worth around the boundary, several blocks.
LENGTHS = (4, BLOCK_SIZE - 2, BLOCK_SIZE - 1, BLOCK_SIZE, 2 * BLOCK_SIZE + 5, 200)
SHARED = prompt(3 * BLOCK_SIZE, salt=99)  # the prefix of the prefix-hit prompts (3 whole blocks)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "tiny-llama", LLAMA_GQA)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def bootstrap(module_daemons):
    return module_daemons("--lease-ttl", "10")


def _producer(name: str, model: Path, workdir: Path, url: str) -> VllmServer:
    return VllmServer(name, workdir, model, "--kv-transfer-config",
                      transfer_config("kv_producer", {"bootstrap_url": url, "instance": name}))  # fmt: skip


def _consumer(name: str, model: Path, workdir: Path, url: str, *args: str) -> VllmServer:
    return VllmServer(name, workdir, model, *args, "--kv-transfer-config",
                      transfer_config("kv_consumer", {"bootstrap_url": url, "instance": name,
                                                      "prefill_instance": "prefill-0"}))  # fmt: skip


@pytest.fixture(scope="module")
def cluster(model: Path, workdir: Path, bootstrap):
    """prefill-0, decode-0 and the proxy in front of the pair."""
    servers = {"prefill-0": _producer("prefill-0", model, workdir, bootstrap.url),
               "decode-0": _consumer("decode-0", model, workdir, bootstrap.url)}  # fmt: skip
    started = time.monotonic()
    start_all(list(servers.values()))
    print(f"two vllm servers healthy {time.monotonic() - started:.0f}s after start")
    proxy = Proxy(workdir, [servers["prefill-0"].url], [servers["decode-0"].url]).start().wait_ready()
    yield servers, proxy
    proxy.stop()
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def late_servers(cluster, model: Path, workdir: Path, bootstrap):
    """Started after the first test, together: a decode server whose block size differs from
    prefill-0's and prefill-1, the one the prefill-death test kills."""
    refused = {"block_size": _consumer("decode-bs64", model, workdir, bootstrap.url, "--block-size", "64")}
    prefill_1 = _producer("prefill-1", model, workdir, bootstrap.url)
    for s in (*refused.values(), prefill_1):
        s.start()
    try:
        prefill_1.wait_ready()
        yield refused, prefill_1
    finally:
        for s in (*refused.values(), prefill_1):
            s.stop()


def test_disaggregated_tokens_equal_colocated(cluster):
    servers, proxy = cluster
    decode = servers["decode-0"].url
    prompts = [prompt(n, salt=i) for i, n in enumerate(LENGTHS)]
    hits = [SHARED + " " + prompt(n, salt=50 + n) for n in (3, BLOCK_SIZE + 7)]  # share 3 blocks with SHARED
    colocated = servers["prefill-0"].url  # plain requests: the connector leaves them alone
    before_p = sources(colocated)
    plain = complete(colocated, prompts[-1], 16)
    assert plain.json().get("kv_transfer_params") is None, plain.json()  # no room opened for it
    want = {p: tokens_of(complete(colocated, p, 16)) for p in [*prompts, SHARED, *hits]}
    assert want[prompts[-1]] == tokens_of(plain)
    assert len({tuple(t) for t in want.values()}) == len(want)  # the model's output depends on the context
    after_p = sources(colocated)
    assert after_p.get("external_kv_transfer", 0.0) == before_p.get("external_kv_transfer", 0.0)  # computed there
    assert after_p["local_compute"] > before_p.get("local_compute", 0.0)

    before = sources(decode)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:  # one batch, as decode schedules it
        got = dict(zip(prompts, pool.map(lambda p: tokens_of(complete(proxy.url, p, 16)), prompts)))
    got[SHARED] = tokens_of(complete(proxy.url, SHARED, 16))  # decode caches its 3 blocks
    for p in hits:
        got[p] = tokens_of(complete(proxy.url, p, 16))
    got["again"] = tokens_of(complete(proxy.url, hits[-1], 16))  # the same prompt twice: a hit on both sides
    assert got.pop("again") == want[hits[-1]]
    assert got == want

    after = sources(decode)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    num_prompt_tokens = sum(len(p.split()) + 1 for p in [*prompts, SHARED, *hits, hits[-1]])  # + BOS each
    assert delta["local_compute"] == 0, delta  # decode computed no prompt token itself
    assert delta["local_cache_hit"] >= 3 * BLOCK_SIZE * (len(hits) + 1), delta  # the shared blocks stayed home
    assert delta["local_cache_hit"] + delta["external_kv_transfer"] == num_prompt_tokens, delta


def _decode(url: str, body: dict, params: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=ERROR_BOUND_S,
                      trust_env=False)  # fmt: skip


def test_attacks_on_rooms_end_in_errors_and_the_owner_is_served(cluster):
    """Issue 31's attacks, straight at the servers (no proxy): another request's room, a longer
    prompt that ends in the same block, a room used twice and a room claimed before its owner
    opened it each end in an error, never in tokens; the owner of the room a foreign claim tried
    is still served its own tokens (the refused claim touched nothing)."""
    servers, _ = cluster
    prefill, decode = servers["prefill-0"].url, servers["decode-0"].url
    n = 2 * BLOCK_SIZE + 3  # + BOS: 68 tokens, the last block partial
    body = {"model": "tiny", "prompt": prompt(n, salt=21), "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    want = tokens_of(complete(prefill, body["prompt"], 8))  # colocated
    params = httpx.post(f"{prefill}/v1/completions", json=prefill_request(body), timeout=60.0,
                        trust_env=False).json()["kv_transfer_params"]  # fmt: skip
    room = params["kvbridge_room"]

    foreign = _decode(decode, {**body, "prompt": prompt(n, salt=22)}, params)  # same length, other tokens
    assert foreign.status_code >= 400, foreign.text[:2000]
    longer = _decode(decode, {**body, "prompt": body["prompt"] + " w9"}, params)  # same last block
    assert longer.status_code >= 400, longer.text[:2000]
    assert tokens_of(_decode(decode, body, params)) == want  # the owner, after both
    reused = _decode(decode, body, params)
    assert reused.status_code >= 400, reused.text[:2000]
    log = servers["decode-0"].log_tail(10**7)
    assert f"room {room} on prefill rank prefill-0" in log and "is bound to another request" in log, log[-4000:]
    assert f"room {room} carries {n + 1} tokens (kvbridge_num_tokens) but decode's prompt has {n + 2}" in log

    # pre-claimed: a claim of a room id before its owner's prefill opens it (client-chosen room ids)
    victim, chosen = {**body, "prompt": prompt(n, salt=23)}, (1 << 62) + 31
    forged = {**params, "kvbridge_room": chosen}
    with cf.ThreadPoolExecutor(1) as pool:
        attacker = pool.submit(_decode, decode, {**body, "prompt": prompt(n, salt=24)}, forged)
        time.sleep(2.0)  # the attacker's claim reaches prefill first
        r = httpx.post(f"{prefill}/v1/completions", json=prefill_request(victim, room=chosen), timeout=60.0,
                       trust_env=False)  # fmt: skip
        victim_d = _decode(decode, victim, r.json().get("kv_transfer_params") or forged)
        assert attacker.result(timeout=ERROR_BOUND_S).status_code >= 400
    # prefill's scheduler learns its worker refused the pre-claimed room before it answers: fallback
    # params, and decode computes the victim's prompt itself; an error is right too, never other KV
    fell_back = not (r.json().get("kv_transfer_params") or {}).get("do_remote_prefill", True)
    if victim_d.status_code < 400:
        assert fell_back and tokens_of(victim_d) == tokens_of(complete(prefill, victim["prompt"], 8)), \
            victim_d.text[:2000]
    assert "claimed with binding" in servers["prefill-0"].log_tail(10**7)


def test_prompt_logprobs_release_the_room_at_once(cluster):
    """vLLM computes a ``prompt_logprobs`` request's prompt on decode (it reads no prefix), so decode
    needs nothing of the room prefill opened: it releases it, and prefill ends the room and frees
    its blocks at once (``target_timeout`` is 60 s); both servers count it in vLLM's connector
    stats ("KV Transfer metrics", logged every 10 s)."""
    servers, proxy = cluster
    resp = complete(proxy.url, prompt(2 * BLOCK_SIZE + 3, salt=31), 2, prompt_logprobs=1)
    assert resp.status_code == 200, resp.text[:2000]
    assert resp.json()["choices"][0].get("prompt_logprobs"), resp.json()
    deadline = time.monotonic() + 40.0  # two logging periods, well under target_timeout
    while time.monotonic() < deadline and not all("rooms_released=" in servers[n].log_tail(200_000)
                                                  for n in ("prefill-0", "decode-0")):
        time.sleep(1.0)
    assert "rooms_released=" in servers["prefill-0"].log_tail(200_000), servers["prefill-0"].log_tail()
    assert "local_compute_prompt_logprobs=" in servers["decode-0"].log_tail(200_000)


def test_a_mismatched_decode_is_refused_at_start_up_naming_the_field(late_servers, bootstrap):
    refused, _ = late_servers
    server, diff = refused["block_size"], "pools.kv.page_size: prefill 32 != decode 64"
    deadline = time.monotonic() + 420.0
    while time.monotonic() < deadline and server.alive() and "ContractMismatch" not in server.log_tail(10**6):
        try:  # never healthy: the refusal comes before the engine serves
            assert httpx.get(f"{server.url}/health", timeout=1.0, trust_env=False).status_code != 200
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    log = server.log_tail(10**6)
    assert "kvbridge.errors.ContractMismatch: decode " in log, log[-4000:]
    assert "does not match prefill instance 'prefill-0': " in log and diff in log, log[-4000:]
    assert f"{bootstrap.url}/diagnostics" in log  # where the field-by-field page is
    server.stop()
    assert server.proc.returncode != 0


def test_prefill_killed_with_a_room_pending_fails_the_decode_request(cluster, late_servers):
    """The proxy's first step (its own prefill_request) against prefill-1, which is then killed
    before decode asks for the room: decode's request ends in an error, not in tokens."""
    servers, _ = cluster
    _, prefill_1 = late_servers
    body = {"model": "tiny", "prompt": prompt(2 * BLOCK_SIZE + 3, salt=7), "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{prefill_1.url}/v1/completions", json=prefill_request(body, room=(1 << 62) + 17), timeout=60.0,
                   trust_env=False)  # fmt: skip
    params = r.json()["kv_transfer_params"]
    assert params["kvbridge_instance"] == "prefill-1" and params["kvbridge_room"] == (1 << 62) + 17, params
    prefill_1.kill()
    started = time.monotonic()
    d = httpx.post(f"{servers['decode-0'].url}/v1/completions", json={**body, "kv_transfer_params": params},
                   timeout=ERROR_BOUND_S, trust_env=False)  # fmt: skip
    assert time.monotonic() - started < ERROR_BOUND_S
    # vLLM's kv_load_failure_policy "fail" (its default): the request ends as an internal error
    assert d.status_code == 500, d.text[:2000]
    log = servers["decode-0"].log_tail(10**7)
    assert f"(room {(1 << 62) + 17}): KV load failed: prefill rank prefill-1/cp0" in log, log[-4000:]
    # decode lives on and serves the next room from prefill-0
    again = prompt(BLOCK_SIZE + 1, salt=8)
    assert len(tokens_of(complete(cluster[1].url, again, 8))) == 8


def test_decode_killed_mid_request_ends_in_errors(cluster):
    """Decode dies (SIGKILL) while both a streamed and a plain request are on it: the stream ends
    cut short with an error event naming decode (or a broken connection), never a [DONE] after a
    partial answer; the plain request gets 502 naming decode. Decode is killed as soon as the
    stream's headers arrive: a CPU decode of this tiny model can finish 460 tokens in well under
    a second (CI saw it finish between the first event and the kill); a request that did finish
    before the kill landed must then be whole: every token counted by id (with ``ignore_eos`` the
    tiny model may emit its special tokens, which the text leaves out: CI saw 454 words of 460)."""
    servers, proxy = cluster
    body = {"model": "tiny", "prompt": prompt(40, salt=11), "max_tokens": 460, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    with cf.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(httpx.post, f"{proxy.url}/v1/completions", json=body, timeout=ERROR_BOUND_S,
                            trust_env=False)  # fmt: skip
        events: list[str] = []
        with httpx.stream("POST", f"{proxy.url}/v1/completions", json={**body, "stream": True},
                          timeout=ERROR_BOUND_S, trust_env=False) as stream:  # fmt: skip
            assert stream.status_code == 200
            servers["decode-0"].kill()  # decoding: the crash under test
            try:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
            except httpx.HTTPError:
                pass  # the connection may break instead of ending: an error either way
        bodies = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
        finished = [b["choices"][0].get("finish_reason") for b in bodies if "choices" in b]
        errors = [b["error"]["message"] for b in bodies if "error" in b]
        ids = [t for b in bodies if "choices" in b for t in b["choices"][0].get("token_ids") or []]
        if "data: [DONE]" in events:  # it finished before the kill landed: then it is whole
            assert len(ids) == body["max_tokens"] and finished[-1] == "length" and not errors, events[-3:]
        else:  # cut short, never a complete answer; the proxy says so (unless the connection broke first)
            assert "length" not in finished and "stop" not in finished
            assert all("decode" in m and "stream broke" in m for m in errors), errors
        resp = plain.result(timeout=ERROR_BOUND_S)
    if resp.status_code == 200:  # the same: finished before the kill, whole
        assert resp.json()["usage"]["completion_tokens"] == body["max_tokens"], resp.text[:2000]
    else:
        assert resp.status_code == 502 and "decode" in resp.json()["error"]["message"], resp.text[:2000]
    assert proxy.alive()
    assert servers["prefill-0"].alive()
    assert httpx.get(f"{servers['prefill-0'].url}/health", timeout=5.0, trust_env=False).status_code == 200
