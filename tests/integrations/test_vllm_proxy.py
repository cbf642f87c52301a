"""``kvbridge vllm-proxy`` (a real proxy process) against scripted upstream HTTP servers: the
request each side sees, and every failure ending as the client's error, never as a success.
The proxy in front of real vLLM servers: tests/integrations/vllm/test_serve_pd.py."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvbridge.integrations.vllm.proxy import client_params, merge_batch, prefill_request, split_batch

HOST = "127.0.0.1"


class Upstream:
    """One scripted server: records every body and headers it gets; ``mode`` picks its answer."""

    def __init__(self, role: str) -> None:
        self.role, self.mode, self.bodies, self.headers, self.cancelled = role, "ok", [], [], 0
        app = FastAPI()

        @app.get("/health")
        async def health() -> Any:
            return {}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if self.mode == "error":
                return JSONResponse({"error": {"message": f"{self.role} refused"}}, status_code=500)
            if self.mode == "400":
                return JSONResponse({"error": {"message": "bad min_p", "param": "min_p"}}, status_code=400)
            if self.mode == "slow":  # a long decode: stops when the client (the proxy) leaves
                for _ in range(400):
                    if await request.is_disconnected():
                        self.cancelled += 1
                        return {}
                    await asyncio.sleep(0.05)
                return {"choices": []}
            if self.role == "prefill":
                room = body["kv_transfer_params"].get("kvbridge_room") or random.randrange(1, 1 << 63)
                params = None if self.mode == "no-params" else {"do_remote_prefill": True, "kvbridge_room": room}
                if self.mode == "fallback":  # the room was refused: no room, decode computes the prompt
                    params = {"do_remote_prefill": False, "do_remote_decode": False, "kvbridge_fallback": "room_in_use"}
                return {"choices": [{"text": "x", "finish_reason": "length"}], "kv_transfer_params": params}
            if body.get("stream"):
                async def events() -> Iterator[bytes]:
                    for i in range(3):
                        yield f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode()
                        await asyncio.sleep(0.01)
                    if self.mode == "break":  # dies mid-stream: the connection breaks, no [DONE]
                        raise RuntimeError("decode died")
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return {"choices": [{"index": 0, "text": f"decoded {body['prompt']}", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 2, "completion_tokens": 3}, "seen": body["kv_transfer_params"]}

        sock = socket.socket()
        sock.bind((HOST, 0))
        self.url = f"http://{HOST}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    p, d = Upstream("prefill"), Upstream("decode")
    yield p, d
    p.stop()
    d.stop()


def _proxy(tmp_path: Path, prefill: str, decode: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli.main", "vllm-proxy", "--prefill", prefill, "--decode",
                             decode, "--port", "0", "--port-file", str(port_file), "--timeout", "10", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
        time.sleep(0.05)
    return proc, f"http://{HOST}:{int(port_file.read_text())}"


@pytest.fixture(scope="module")
def proxy(upstreams, tmp_path_factory) -> Iterator[str]:
    p, d = upstreams
    proc, url = _proxy(tmp_path_factory.mktemp("proxy"), p.url, d.url)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(autouse=True)
def _reset(upstreams) -> None:
    for u in upstreams:
        u.mode, u.bodies[:], u.headers[:], u.cancelled = "ok", [], [], 0


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=20, trust_env=False)


def test_prefill_gets_one_token_and_draws_the_room_then_decode_gets_the_request_with_prefills_params(upstreams,
                                                                                                       proxy):
    p, d = upstreams
    body = {"model": "m", "prompt": "w1 w2", "max_tokens": 50, "min_tokens": 4, "temperature": 0, "stream": False}
    r = _post(proxy, body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded w1 w2"
    [sent] = p.bodies
    prefill_body = {k: v for k, v in body.items() if k != "min_tokens"}  # a minimum above 1 token: vLLM refuses it
    assert sent == {**prefill_body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    room = d.bodies[0]["kv_transfer_params"]["kvbridge_room"]  # prefill's, passed on
    assert d.bodies == [{**body, "kv_transfer_params": {"do_remote_prefill": True, "kvbridge_room": room}}]


def test_a_clients_room_is_refused_unless_allowed(upstreams, proxy, tmp_path):
    p, d = upstreams
    r = _post(proxy, {"prompt": "w1", "max_tokens": 3, "kv_transfer_params": {"kvbridge_room": 12345}})
    assert r.status_code == 400 and "--allow-client-rooms" in r.json()["error"]["message"]
    assert p.bodies == [] and d.bodies == []
    proc, url = _proxy(tmp_path, p.url, d.url, "--allow-client-rooms")
    try:
        signed = {"kvbridge_room": 12345, "kvbridge_room_sig": "ab" * 32, "kvbridge_room_expires": 2_000_000_000}
        r = _post(url, {"prompt": "w1", "max_tokens": 3, "kv_transfer_params": signed})
        assert r.status_code == 200 and p.bodies[0]["kv_transfer_params"] == {**signed, "do_remote_decode": True}
        for bad in (0, -1, 1 << 63, "7", True):
            r = _post(url, {"prompt": "w1", "kv_transfer_params": {"kvbridge_room": bad}})
            assert r.status_code == 400 and "kvbridge_room must be an integer" in r.json()["error"]["message"]
        assert len(p.bodies) == 1 and len(d.bodies) == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_prefills_client_errors_pass_through_unchanged(upstreams, proxy):
    p, d = upstreams
    p.mode = "400"
    r = _post(proxy, {"prompt": "w1", "max_tokens": 3, "min_p": 7})
    assert r.status_code == 400 and r.json() == {"error": {"message": "bad min_p", "param": "min_p"}}
    assert d.bodies == []


def test_a_batch_gets_one_room_per_prompt_and_one_answer(upstreams, proxy):
    p, d = upstreams
    r = _post(proxy, {"prompt": ["a b", "c d", [5, 6]], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["decoded a b", "decoded c d", "decoded [5, 6]"]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert r.json()["usage"] == {"prompt_tokens": 6, "completion_tokens": 9}
    assert sorted(str(b["prompt"]) for b in p.bodies) == ["[5, 6]", "a b", "c d"]
    assert len({b["kv_transfer_params"]["kvbridge_room"] for b in d.bodies}) == 3  # one room each
    r = _post(proxy, {"prompt": ["a", "b"], "max_tokens": 3, "stream": True})
    assert r.status_code == 400 and "one request per prompt" in r.json()["error"]["message"]
    assert split_batch({"prompt": [1, 2, 3]}) is None and split_batch({"prompt": ["one"]}) is None


def test_headers_reach_both_legs(upstreams, proxy):
    p, d = upstreams
    r = httpx.post(f"{proxy}/v1/completions", json={"prompt": "w1", "max_tokens": 3}, trust_env=False, timeout=20,
                   headers={"Authorization": "Bearer sk-1", "X-Request-Id": "abc"})  # fmt: skip
    assert r.status_code == 200
    for u in (p, d):
        assert u.headers[0]["authorization"] == "Bearer sk-1" and u.headers[0]["x-request-id"] == "abc"


def test_decode_dying_mid_stream_ends_in_an_error_event(upstreams, proxy):
    upstreams[1].mode = "break"
    with httpx.stream("POST", f"{proxy}/v1/completions", json={"prompt": "w1", "max_tokens": 3, "stream": True},
                      timeout=20, trust_env=False) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    assert "data: [DONE]" not in lines and len(lines) == 4, lines
    assert "stream broke" in json.loads(lines[-1][6:])["error"]["message"]
    assert 'kvbridge_proxy_upstream_failures_total{side="decode",reason="stream_broken"}' in \
        httpx.get(f"{proxy}/metrics", trust_env=False).text


def test_a_client_that_leaves_cancels_decode(upstreams, proxy):
    upstreams[1].mode = "slow"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy}/v1/completions", json={"prompt": "w1", "max_tokens": 600}, timeout=1.5,
                   trust_env=False)  # fmt: skip
    deadline = time.monotonic() + 15
    while upstreams[1].cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert upstreams[1].cancelled == 1


def test_an_unreachable_decode_fails_over_and_health_stays_up(upstreams, tmp_path):
    p, d = upstreams
    with socket.socket() as s:
        s.bind((HOST, 0))
        dead = f"http://{HOST}:{s.getsockname()[1]}"  # bound, not listening: refused
        port_file = tmp_path / "port"
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli.main", "vllm-proxy", "--prefill", p.url,
                                 "--decode", dead, "--decode", d.url, "--port", "0", "--port-file", str(port_file)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            url = f"http://{HOST}:{int(port_file.read_text())}"
            for _ in range(3):
                assert _post(url, {"prompt": "w1", "max_tokens": 3}).status_code == 200
            assert len(d.bodies) == 3
            metrics = httpx.get(f"{url}/metrics", trust_env=False).text
            assert 'kvbridge_proxy_upstream_failures_total{side="decode",reason="unreachable"} 1' in metrics, metrics
            assert 'kvbridge_proxy_requests_total{outcome="ok"} 3' in metrics
            health = httpx.get(f"{url}/health", timeout=20, trust_env=False)
            assert health.status_code == 200 and health.json()["down"] == [dead]
        finally:
            proc.terminate()
            proc.wait(10)


@pytest.mark.parametrize("mode, reason", [("error", "answered 500"), ("no-params", "returned no kv_transfer_params")])
def test_a_failed_prefill_is_a_502_and_decode_is_not_asked(upstreams, proxy, mode, reason):
    p, d = upstreams
    p.mode = mode
    r = _post(proxy, {"prompt": "w1", "max_tokens": 3})
    assert r.status_code == 502 and reason in r.json()["error"]["message"] and "prefill" in r.json()["error"]["message"]
    assert d.bodies == []


def test_a_prefill_fallback_goes_to_decode_without_a_room_and_is_counted(upstreams, proxy):
    p, d = upstreams
    p.mode = "fallback"
    r = _post(proxy, {"prompt": "w1", "max_tokens": 3})
    assert r.status_code == 200 and d.bodies[0]["kv_transfer_params"]["do_remote_prefill"] is False
    assert "kvbridge_room" not in d.bodies[0]["kv_transfer_params"]
    metrics = httpx.get(f"{proxy}/metrics", trust_env=False).text
    assert 'kvbridge_proxy_fallbacks_total{reason="room_in_use"} 1' in metrics, metrics


def test_decodes_error_passes_through(upstreams, proxy):
    upstreams[1].mode = "error"
    r = _post(proxy, {"prompt": "w1", "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["message"] == "decode refused"


def test_a_stream_is_relayed(upstreams, proxy):
    with httpx.stream("POST", f"{proxy}/v1/completions", json={"prompt": "w1", "max_tokens": 3, "stream": True},
                      timeout=20, trust_env=False) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4
    assert upstreams[0].bodies[0]["stream"] is False and "stream_options" not in upstreams[0].bodies[0]


def test_unreachable_servers_are_502s_naming_the_side(tmp_path, upstreams):
    with socket.socket() as s:
        s.bind((HOST, 0))
        dead = f"http://{HOST}:{s.getsockname()[1]}"  # bound, not listening: refused
        for prefill, decode, side in ((dead, upstreams[1].url, "prefill"), (upstreams[0].url, dead, "decode")):
            proc, url = _proxy(tmp_path, prefill, decode)
            try:
                r = _post(url, {"prompt": "w1", "max_tokens": 3})
                assert r.status_code == 502 and f"{side} {dead} failed: ConnectError" in r.json()["error"]["message"]
                assert httpx.get(f"{url}/health", timeout=20, trust_env=False).status_code == 503
            finally:
                proc.terminate()
                proc.wait(10)
            (tmp_path / "port").unlink()


def test_prefill_request_for_chat_caps_both_token_fields():
    body = {"messages": [], "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    assert prefill_request(body, 5) == {"messages": [], "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                                        "kv_transfer_params": {"do_remote_decode": True, "kvbridge_room": 5}}  # fmt: skip
    assert prefill_request(body)["kv_transfer_params"] == {"do_remote_decode": True}


def test_client_params_and_batch_merging_are_pure():
    client_params({}, allow=False)
    with pytest.raises(ValueError, match="--allow-client-rooms"):
        client_params({"kv_transfer_params": {}}, allow=False)
    with pytest.raises(ValueError, match="kvbridge_room"):
        client_params({"kv_transfer_params": {"kvbridge_room": 1.5}}, allow=True)
    merged = merge_batch([{"id": "a", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": None},
                          {"id": "b", "choices": [{"index": 0, "text": "y"}]}])  # fmt: skip
    assert merged == {"id": "a", "choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}]}
