"""Bearer token on writes (401 before the body is read) and the body-size limit
(413 from Content-Length, from a chunked body, and from a Content-Length that
promises more than it sends)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.errors import Unauthorized

TOKEN = "s3cret-token"
LIMIT = 64 * 1024  # the smallest realistic register body is ~3 KiB


@pytest.fixture(scope="module")
def guarded(module_daemons: Callable[..., Any]) -> Any:
    # The token comes from the environment, as an operator's unit file would give it.
    return module_daemons("--max-body-bytes", str(LIMIT), env={"KVBRIDGE_BOOTSTRAP_TOKEN": TOKEN})


def _post(url: str, body: Any = None, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers or {}, timeout=5.0, trust_env=False, **kw)


def test_writes_need_the_token(guarded: Any, kvb: Any, small_contract: RuntimeContract,
                               instance_name: Callable[[str], str]) -> None:
    body = kvb.body(kvb.register_request(small_contract, instance_name("p")))
    url = f"{guarded.url}/v1/ranks"
    missing = _post(url, body)
    assert missing.status_code == 401 and missing.json()["error"] == "missing_token"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    wrong = _post(url, body, {"Authorization": "Bearer not-it"})
    assert wrong.status_code == 401 and wrong.json()["error"] == "wrong_token"
    assert _post(url, body, {"Authorization": f"Basic {TOKEN}"}).status_code == 401
    ok = _post(url, body, {"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 201
    rank_id, secret = ok.json()["rank_id"], ok.json()["lease_secret"]
    assert _post(f"{guarded.url}/v1/ranks/{rank_id}/heartbeat").status_code == 401
    assert httpx.delete(f"{guarded.url}/v1/ranks/{rank_id}", trust_env=False).status_code == 401
    # A malformed body without a token is still a 401: the token is checked before parsing.
    assert httpx.post(url, content=b"{", trust_env=False).status_code == 401
    # Reads name sessions, endpoints and addresses: with a write token set, they need a token too
    # (issue 20, finding 6); the write token reads, and the open endpoints stay open.
    for path in ("/v1/instances", f"/v1/ranks/{rank_id}", "/v1/diagnostics/fingerprints", "/diagnostics"):
        anon = httpx.get(f"{guarded.url}{path}", trust_env=False)
        assert anon.status_code == 401 and anon.json()["error"] == "missing_token", (path, anon.text)
        assert "session_id" not in anon.text and '"base"' not in anon.text
        assert httpx.get(f"{guarded.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"},
                         trust_env=False).status_code == 200, path
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert httpx.get(f"{guarded.url}{path}", trust_env=False).status_code == 200, path
    # The write token alone does not reach another rank's registration: its lease secret does.
    assert httpx.delete(f"{guarded.url}/v1/ranks/{rank_id}", headers={"Authorization": f"Bearer {TOKEN}"},
                        trust_env=False).status_code == 403
    assert httpx.delete(f"{guarded.url}/v1/ranks/{rank_id}", headers={"Authorization": f"Bearer {TOKEN}",
                        "X-KVBridge-Lease": secret}, trust_env=False).status_code == 204


def test_client_maps_401(guarded: Any, kvb: Any, small_contract: RuntimeContract, instance_name: Callable[[str], str]) -> None:
    req = kvb.register_request(small_contract, instance_name("p"))
    with BootstrapClient(guarded.url, token="wrong", retries=0) as client, pytest.raises(Unauthorized, match="401"):
        client.register(req)
    with BootstrapClient(guarded.url, token=TOKEN) as client:
        reg = client.register(req)
        client.deregister(reg)


def test_oversized_body_with_content_length_is_413(guarded: Any) -> None:
    r = httpx.post(f"{guarded.url}/v1/lookup", content=b"x" * (LIMIT + 1),
                   headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}, trust_env=False)
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"


def test_oversized_chunked_body_is_413(guarded: Any) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(LIMIT // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(f"{guarded.url}/v1/lookup", content=chunks(),
                   headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}, trust_env=False)
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 413


def test_content_length_that_promises_too_much_is_refused_at_once(guarded: Any) -> None:
    """Content-Length says 10 MiB, 2 bytes follow: 413 without waiting for the rest."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {10 << 20}\r\n\r\n".encode() + b"{}"
        )
        t0 = time.monotonic()
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 2.0


def test_refusals_are_counted(guarded: Any) -> None:
    text = httpx.get(f"{guarded.url}/metrics", trust_env=False).text
    assert 'kvbridge_bootstrap_rejected_requests_total{reason="unauthorized"}' in text
    assert 'kvbridge_bootstrap_rejected_requests_total{reason="too_large"}' in text
