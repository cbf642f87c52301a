"""``kvbridge.start_bootstrap``: a bootstrap daemon process for a ``with`` block (embedding, tests)."""

from __future__ import annotations

import socket

import httpx

import kvbridge as kvb


def listening(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def test_a_daemon_for_the_with_block_with_a_fresh_token():
    with kvb.start_bootstrap(lease_ttl=5) as (url, token):
        assert len(token) == 32 and httpx.get(f"{url}/healthz", trust_env=False).json()["status"] == "ok"
        assert httpx.post(f"{url}/v1/lookup", json={}, trust_env=False).status_code == 401  # writes need the token
        with kvb.BootstrapClient(url, token=token) as client:
            assert client.instances() == []
    assert not listening(url)  # stopped when the block ended
    with kvb.start_bootstrap(with_token=False) as (url, token):
        assert token == "" and httpx.post(f"{url}/v1/lookup", json={}, trust_env=False).status_code == 422
    assert not listening(url)
