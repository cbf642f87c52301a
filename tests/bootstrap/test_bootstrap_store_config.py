"""The store's configuration (URL, flag > env > TOML) and the client's replica list, without etcd:
what a typo costs is a named ConfigError, and a client moves on from a dead replica at once."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from kvbridge.bootstrap.client import BootstrapClient, daemon_urls
from kvbridge.bootstrap.store import EtcdOptions, parse_store_url
from kvbridge.cli.bootstrap import STORE_SETTINGS, etcd_options, store_settings
from kvbridge.errors import BootstrapUnavailable, ConfigError


def test_store_urls() -> None:
    assert parse_store_url("memory") == ("memory", (), False)
    kind, endpoints, tls = parse_store_url("etcd://h1:2379,h2:2380,[::1]:2379")
    assert kind == "etcd" and endpoints == (("h1", 2379), ("h2", 2380), ("::1", 2379)) and not tls
    assert parse_store_url("etcds://h1:2379")[2] is True
    for bad in ("redis://h:1", "etcd://h1", "etcd://h1:0", "etcd://:2379", "etcd://h1:port"):
        with pytest.raises(ConfigError) as exc:
            parse_store_url(bad)
        assert exc.value.field == "store"
    with pytest.raises(ConfigError, match="etcd-key"):
        EtcdOptions(endpoints=(("h", 1),), cert="c.pem")
    with pytest.raises(ConfigError, match="prefix"):
        EtcdOptions(endpoints=(("h", 1),), prefix="kvbridge")


def _args(**given: object) -> argparse.Namespace:
    values = {name: None for name, _, _ in STORE_SETTINGS} | {"config": None}
    return argparse.Namespace(**(values | given))


def test_store_settings_flag_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "kvbridge.toml"
    toml.write_text('[bootstrap]\nstore = "etcd://t:1"\netcd-prefix = "/from-toml/"\nreplica_name = "t"\n')
    monkeypatch.setenv("KVBRIDGE_ETCD_PREFIX", "/from-env/")
    monkeypatch.setenv("KVBRIDGE_ETCD_PASSWORD", "pw")
    opts = store_settings(_args(config=toml, replica_name="flag"))
    assert opts["store"] == "etcd://t:1" and opts["etcd_prefix"] == "/from-env/" and opts["replica_name"] == "flag"
    assert opts["etcd_timeout"] == 2.0  # the default
    etcd = etcd_options(opts | {"etcd_user": "kv"})
    assert etcd.endpoints == (("t", 1),) and etcd.prefix == "/from-env/" and etcd.password == "pw"
    assert etcd_options(store_settings(_args())) is None  # memory by default
    toml.write_text('[bootstrap]\nstroe = "etcd://t:1"\n')
    with pytest.raises(ConfigError, match="stroe"):
        store_settings(_args(config=toml))


def test_client_takes_a_list_of_replicas_and_fails_over_at_once() -> None:
    assert daemon_urls("http://a:1, http://b:2/") == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="ftp://b"):
        daemon_urls("http://a:1,ftp://b")
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"status": "ok"}, headers={"X-KVBridge-Replica": "rb"})

    with BootstrapClient("http://a:1,http://b:2", retries=0, transport=httpx.MockTransport(handler)) as client:
        assert client.health() == {"status": "ok"} and client.last_replica == "rb" and client.failovers == 1
        client.health()
        assert seen == ["a", "b", "b"]  # it stays with the replica that answered

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": "store_unavailable", "message": "etcd quorum lost"})

    with BootstrapClient(["http://a:1", "http://b:2"], retries=1, backoff=0.01,
                         transport=httpx.MockTransport(down)) as client:
        with pytest.raises(BootstrapUnavailable, match="quorum lost"):
            client.health()


def test_client_waits_the_stores_retry_after_between_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that is down comes back at the daemon's next health tick (an etcd election): the
    client waits the 503's Retry-After between rounds of replicas, not its 0.1 s backoff, and
    the request that follows the election succeeds."""
    import kvbridge.bootstrap.client as client_mod

    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    answers = iter([503, 503, 503, 503, 200])

    def flaky(request: httpx.Request) -> httpx.Response:
        if next(answers) == 503:
            return httpx.Response(503, json={"error": "store_unavailable", "message": "election"},
                                  headers={"Retry-After": "1"})
        return httpx.Response(200, json={"status": "ok"})

    with BootstrapClient(["http://a:1", "http://b:2"], retries=3, backoff=0.01,
                         transport=httpx.MockTransport(flaky)) as client:
        assert client.health() == {"status": "ok"}
    assert slept == [1.0, 1.0]  # one wait per failed round of both replicas, each the Retry-After
