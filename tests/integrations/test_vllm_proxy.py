"""``kvbridge vllm-proxy`` (a real proxy process) against scripted upstream HTTP servers: the
request each side sees, and every failure ending as the client's error, never as a success.
The proxy in front of real vLLM servers: tests/integrations/vllm/test_serve_pd.py."""

from __future__ import annotations

import json
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

from kvbridge.cli.vllm_proxy import prefill_request, room_of

HOST = "127.0.0.1"


class Upstream:
    """One scripted server: records every body it gets; ``mode`` picks its answer."""

    def __init__(self, role: str) -> None:
        self.role, self.mode, self.bodies = role, "ok", []
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            if self.mode == "error":
                return JSONResponse({"error": {"message": f"{self.role} refused"}}, status_code=500)
            if self.role == "prefill":
                params = None if self.mode == "no-params" else {
                    "do_remote_prefill": True, "kvbridge_room": body["kv_transfer_params"]["kvbridge_room"]}
                return {"choices": [{"text": "x", "finish_reason": "length"}], "kv_transfer_params": params}
            if body.get("stream"):
                async def events() -> Iterator[bytes]:
                    for i in range(3):
                        yield f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode()
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return {"choices": [{"text": "decoded", "finish_reason": "length"}], "seen": body["kv_transfer_params"]}

        sock = socket.socket()
        sock.bind((HOST, 0))
        self.url = f"http://{HOST}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
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


def _proxy(tmp_path: Path, prefill: str, decode: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli.main", "vllm-proxy", "--prefill", prefill, "--decode",
                             decode, "--port", "0", "--port-file", str(port_file), "--timeout", "10"],
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
        u.mode, u.bodies[:] = "ok", []


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=20, trust_env=False)


def test_prefill_gets_one_token_and_the_room_then_decode_gets_the_request_with_prefills_params(upstreams, proxy):
    p, d = upstreams
    body = {"model": "m", "prompt": "w1 w2", "max_tokens": 50, "temperature": 0, "stream": False}
    r = _post(proxy, body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    [sent] = p.bodies
    room = sent["kv_transfer_params"]["kvbridge_room"]
    assert sent == {**body, "max_tokens": 1, "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "kvbridge_room": room}}  # fmt: skip
    assert 0 < room < 1 << 63
    assert d.bodies == [{**body, "kv_transfer_params": {"do_remote_prefill": True, "kvbridge_room": room}}]
    _post(proxy, body)
    assert p.bodies[1]["kv_transfer_params"]["kvbridge_room"] != room  # a fresh room per request


def test_a_clients_room_is_kept_and_a_bad_one_refused(upstreams, proxy):
    p, d = upstreams
    r = _post(proxy, {"prompt": "w1", "max_tokens": 3, "kv_transfer_params": {"kvbridge_room": 12345}})
    assert r.status_code == 200 and p.bodies[0]["kv_transfer_params"]["kvbridge_room"] == 12345
    for bad in (0, -1, 1 << 63, "7", True):
        r = _post(proxy, {"prompt": "w1", "kv_transfer_params": {"kvbridge_room": bad}})
        assert r.status_code == 400 and "kvbridge_room must be an integer" in r.json()["error"]["message"]
    assert len(p.bodies) == 1 and len(d.bodies) == 1
    with pytest.raises(ValueError):
        room_of({"kv_transfer_params": {"kvbridge_room": 1.5}})


@pytest.mark.parametrize("mode, reason", [("error", "answered 500"), ("no-params", "returned no kv_transfer_params")])
def test_a_failed_prefill_is_a_502_and_decode_is_not_asked(upstreams, proxy, mode, reason):
    p, d = upstreams
    p.mode = mode
    r = _post(proxy, {"prompt": "w1", "max_tokens": 3})
    assert r.status_code == 502 and reason in r.json()["error"]["message"] and "prefill" in r.json()["error"]["message"]
    assert d.bodies == []


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
