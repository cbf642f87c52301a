"""Per-rank credentials (lease secrets), the admin and read tokens, and the daemon's
limits, against real daemon processes (issue 10, security)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.metrics import Metrics
from kvbridge.bootstrap.registry import Registry
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.schemas import RankIdentity
from kvbridge.errors import LeaseHeld, LimitExceeded, Unauthorized

WRITE, READ, ADMIN = "write-token-1", "read-token-2", "admin-token-3"
DECODE = RankIdentity(instance="decode-s", role="decode")


def bearer(token: str, lease: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    return headers | ({"X-KVBridge-Lease": lease} if lease else {})


@pytest.fixture(scope="module")
def secured(module_daemons: Callable[..., Any]) -> Any:
    return module_daemons("--max-ranks-per-instance", "8", "--max-lookups-per-s", "5", "--lease-ttl", "30",
                          env={"KVBRIDGE_BOOTSTRAP_TOKEN": WRITE, "KVBRIDGE_READ_TOKEN": READ,
                               "KVBRIDGE_ADMIN_TOKEN": ADMIN})


@pytest.fixture(scope="module")
def http(secured: Any) -> Any:
    with httpx.Client(base_url=secured.url, timeout=5.0, trust_env=False) as c:
        yield c


def register(http: httpx.Client, kvb: Any, contract: RuntimeContract, name: str, **kw: Any) -> dict[str, Any]:
    r = http.post("/v1/ranks", json=kvb.body(kvb.register_request(contract, name, **kw)), headers=bearer(WRITE))
    assert r.status_code == 201, r.text
    return r.json()


def test_another_instance_with_the_write_token_cannot_touch_a_rank(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                                   instance_name: Callable[[str], str]) -> None:
    name = instance_name("p")
    mine = register(http, kvb, small_contract, name)
    rank_id = mine["rank_id"]
    # heartbeat, deregistration: 403 without the secret, or with a wrong one
    r = http.post(f"/v1/ranks/{rank_id}/heartbeat", headers=bearer(WRITE))
    assert r.status_code == 403 and r.json()["error"] == "lease_secret_required" and name in r.json()["message"]
    r = http.delete(f"/v1/ranks/{rank_id}", headers=bearer(WRITE, "guessed"))
    assert r.status_code == 403 and r.json()["error"] == "wrong_lease_secret"
    # the probe that redirected a rank's control endpoint: re-register its coordinates elsewhere
    hijack = kvb.body(kvb.register_request(small_contract, name))
    hijack["control_endpoint"] = "tcp://127.0.0.1:1"  # (a local-mode daemon refuses other hosts first: 400)
    r = http.post("/v1/ranks", json=hijack, headers=bearer(WRITE))
    assert r.status_code == 409 and r.json()["error"] == "lease_held" and int(r.headers["retry-after"]) >= 1
    r = http.post("/v1/ranks", json=hijack, headers=bearer(WRITE, "guessed"))
    assert r.status_code == 409 and "not this rank's" in r.json()["message"]
    view = http.get(f"/v1/instances/{name}", headers=bearer(READ)).json()
    assert [x["rank_id"] for x in view["ranks"]] == [rank_id]
    assert view["ranks"][0]["control_endpoint"] == "tcp://127.0.0.1:20000"
    # the rank itself, with its secret
    assert http.post(f"/v1/ranks/{rank_id}/heartbeat", headers=bearer(WRITE, mine["lease_secret"])).status_code == 200
    metrics = http.get("/metrics").text
    assert 'kvbridge_bootstrap_heartbeats_total{outcome="refused"}' in metrics


def test_the_admin_token_replaces_and_drops_any_rank(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                      instance_name: Callable[[str], str]) -> None:
    name = instance_name("p")
    first = register(http, kvb, small_contract, name)
    body = kvb.body(kvb.register_request(small_contract, name))
    r = http.post("/v1/ranks", json=body, headers=bearer(ADMIN))
    assert r.status_code == 201 and r.json()["replaced"] == first["rank_id"]
    second = r.json()
    assert http.post(f"/v1/ranks/{second['rank_id']}/heartbeat", headers=bearer(ADMIN)).status_code == 200
    assert http.delete(f"/v1/ranks/{second['rank_id']}", headers=bearer(ADMIN)).status_code == 204
    assert http.get(f"/v1/instances/{name}", headers=bearer(ADMIN)).status_code == 404


def test_reads_need_a_token_when_a_read_token_is_set(http: httpx.Client, secured: Any) -> None:
    for path in ("/v1/instances", "/v1/instances/x", "/v1/diagnostics/fingerprints", "/v1/diagnostics/mismatches",
                 "/diagnostics", "/v1/ranks/0123456789abcdef"):  # a prefix rule: routes added under /v1 are covered
        r = http.get(path)
        assert r.status_code == 401 and r.json()["error"] == "missing_token", path
        assert http.get(path, headers=bearer("nope")).json()["error"] == "wrong_token", path
        for token in (READ, WRITE, ADMIN):
            assert http.get(path, headers=bearer(token)).status_code != 401, (path, token)
    for path in ("/healthz", "/metrics", "/openapi.json", "/docs"):
        assert http.get(path).status_code == 200, path
    # the read token writes nothing
    assert http.post("/v1/lookup", json={}, headers=bearer(READ)).status_code == 401
    with BootstrapClient(secured.url, token=READ) as reader:
        assert isinstance(reader.instances(), list)
    with BootstrapClient(secured.url) as anonymous, pytest.raises(Unauthorized, match="401"):
        anonymous.instances()


def test_openapi_declares_the_tokens_this_daemon_needs(http: httpx.Client, start_daemon: Callable[..., Any]) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    assert paths["/v1/ranks"]["post"].get("security") and paths["/v1/instances"]["get"].get("security")
    assert "X-KVBridge-Lease" in {p["name"] for p in paths["/v1/ranks/{rank_id}/heartbeat"]["post"]["parameters"]}
    open_daemon = start_daemon()
    open_paths = httpx.get(f"{open_daemon.url}/openapi.json", trust_env=False).json()["paths"]
    assert not open_paths["/v1/ranks"]["post"].get("security")  # no token: the schema must not ask for one
    assert not open_paths["/v1/instances"]["get"].get("security")


def test_instance_size_is_capped(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                 instance_name: Callable[[str], str]) -> None:
    name = instance_name("big")
    body = kvb.body(kvb.register_request(small_contract, name, sizes=(2, 2, 2, 2)))  # 16 ranks > 8
    r = http.post("/v1/ranks", json=body, headers=bearer(WRITE))
    assert r.status_code == 429 and r.json()["error"] == "too_many_ranks"
    assert "16 ranks" in r.json()["message"] and "--max-ranks-per-instance" in r.json()["message"]
    assert "retry-after" not in r.headers  # waiting does not help
    with BootstrapClient(str(http.base_url), token=WRITE, retries=1) as client, pytest.raises(LimitExceeded, match="429"):
        client.register(kvb.register_request(small_contract, name, sizes=(2, 2, 2, 2)))


def test_instance_count_is_capped(start_daemon: Callable[..., Any], kvb: Any, small_contract: RuntimeContract) -> None:
    d = start_daemon("--max-instances", "2")
    with BootstrapClient(d.url, retries=0) as client:
        client.register(kvb.register_request(small_contract, "one"))
        client.register(kvb.register_request(small_contract, "two"))
        with pytest.raises(LimitExceeded) as exc:
            client.register(kvb.register_request(small_contract, "three"))
        assert exc.value.code == "too_many_instances" and "'three'" in str(exc.value)  # type: ignore[attr-defined]


def test_lookups_per_decode_instance_are_rate_limited(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                      instance_name: Callable[[str], str], secured: Any) -> None:
    name = instance_name("p")
    register(http, kvb, small_contract, name)
    body = kvb.lookup_body(small_contract, name, room=1, decode="flooder")
    # a burst of 10 at 5/s, then refused: asked until the first refusal (bounded), so a loaded host whose
    # look-ups come slower than the refill still reaches it, and the refusal read is that one
    codes: list[int] = []
    for _ in range(200):
        r = http.post("/v1/lookup", json=body, headers=bearer(WRITE))
        codes.append(r.status_code)
        if r.status_code == 429:
            break
    assert codes.count(200) >= 5 and codes[-1] == 429, codes
    assert r.json()["error"] == "too_many_lookups" and "'flooder'" in r.json()["message"] and int(r.headers["retry-after"]) >= 1
    # another decode instance keeps its share
    other = kvb.lookup_body(small_contract, name, room=1, decode="polite")
    assert http.post("/v1/lookup", json=other, headers=bearer(WRITE)).status_code == 200
    # the client waits out a Retry-After within its retries
    with BootstrapClient(secured.url, token=WRITE, retries=3) as client:
        assert client.lookup(name, room=1, contract=small_contract, rank=RankIdentity(instance="flooder", role="decode")).ranks


def test_a_restarted_worker_takes_its_coordinates_back_with_its_lease_file(start_daemon: Callable[..., Any], kvb: Any,
                                                                           small_contract: RuntimeContract, tmp_path: Any) -> None:
    d = start_daemon()
    lease_file = tmp_path / "rank.lease"
    req = kvb.register_request(small_contract, "restarting", lease_ttl_s=30.0)
    with BootstrapClient(d.url, lease_file=lease_file) as before:
        old = before.register(req)
    assert lease_file.stat().st_mode & 0o777 == 0o600 and old.lease_secret in lease_file.read_text()
    with BootstrapClient(d.url, lease_file=lease_file, lease_wait_s=0) as after:  # the "restarted process"
        new = after.register(req)  # at once: its saved secret proves the coordinates are its own
        assert new.rank_id != old.rank_id and new.lease_secret in lease_file.read_text()
        view = after.instance("restarting")
        assert [r.rank_id for r in view.ranks] == [new.rank_id]
        after.deregister(new)
    assert not lease_file.exists()


def test_a_restarted_worker_without_its_secret_waits_for_the_old_lease(start_daemon: Callable[..., Any], kvb: Any,
                                                                       small_contract: RuntimeContract) -> None:
    d = start_daemon()
    req = kvb.register_request(small_contract, "crashed", lease_ttl_s=0.8)
    with BootstrapClient(d.url) as client:
        old = client.register(req)  # then the process dies: nobody heartbeats
        with BootstrapClient(d.url, lease_wait_s=10) as restarted:
            new = restarted.register(req)  # waits until the dead rank's lease ran out
        assert new.rank_id != old.rank_id
        # a rank that is in fact alive keeps its coordinates: the newcomer gives up after lease_wait_s
        keeper = LeaseKeeper(client, new, interval_s=0.2).start()
        try:
            with BootstrapClient(d.url, lease_wait_s=1.0) as impostor, pytest.raises(LeaseHeld, match="held by live rank"):
                impostor.register(req)
            assert client.instance("crashed").ranks[0].rank_id == new.rank_id
        finally:
            keeper.stop()


def test_lease_keeper_survives_a_daemon_restart_with_secrets(start_daemon: Callable[..., Any], kvb: Any,
                                                             small_contract: RuntimeContract) -> None:
    d = start_daemon("--token", WRITE)
    client = BootstrapClient(d.url, token=WRITE, retries=2, backoff=0.05, timeout=1.0)
    reg = client.register(kvb.register_request(small_contract, "survivor", lease_ttl_s=0.9))
    first_secret = reg.lease_secret
    keeper = LeaseKeeper(client, reg, interval_s=0.2).start()
    try:
        d.restart()
        deadline = time.monotonic() + 10
        while reg.reregistrations < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reg.reregistrations >= 1 and reg.lease_secret != first_secret
        beats = keeper.beats
        deadline = time.monotonic() + 5
        while keeper.beats < beats + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keeper.beats >= beats + 2 and keeper.last_error is None  # heartbeats with the new secret
    finally:
        keeper.stop(deregister=True)
        client.close()


def test_tokens_must_differ(tmp_path: Any) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvbridge.cli.main", "bootstrap", "--port", "0", "--token", "same",
                          "--admin-token", "same"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must differ" in out.stderr and "Traceback" not in out.stderr


def test_concurrent_registrations_of_one_rank_keep_exactly_one(start_daemon: Callable[..., Any], kvb: Any,
                                                               small_contract: RuntimeContract) -> None:
    d = start_daemon()
    req = kvb.register_request(small_contract, "racing")
    results: list[Any] = []

    def attempt() -> None:
        with BootstrapClient(d.url, lease_wait_s=0, retries=0) as c:
            try:
                results.append(c.register(req))
            except LeaseHeld as exc:
                results.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [r for r in results if not isinstance(r, Exception)]
    assert len(winners) == 1 and len(results) == 6
    with BootstrapClient(d.url) as c:
        assert [r.rank_id for r in c.instance("racing").ranks] == [winners[0].rank_id]


def test_a_daemon_that_did_not_run_lengthens_leases_instead_of_expiring_them_all(kvb: Any,
                                                                                 small_contract: RuntimeContract) -> None:
    """SIGSTOP of the daemon past every lease: on resume its ranks are still there (they could
    not heartbeat a stopped daemon); a rank that really stopped heartbeating still expires."""
    now = [100.0]
    reg = Registry(metrics=Metrics(), pause_grace_s=3.0, clock=lambda: now[0])
    kept = reg.register(kvb.register_request(small_contract, "paused", lease_ttl_s=1.0))
    now[0] += 10.0  # the daemon did not run for 10 s
    assert [i.name for i in reg.instances()] == ["paused"] and reg.pauses == 1
    for _ in range(5):  # then it runs again, sweeping every 0.5 s, and nobody heartbeats
        now[0] += 0.5
        reg.expire()
    assert reg.instances() == [] and reg.pauses == 1
    assert kept.lease_secret


def test_lookups_and_reads_per_client_address_are_rate_limited(start_daemon: Callable[..., Any], kvb: Any,
                                                                small_contract: RuntimeContract) -> None:
    """Issue 20, finding 6: a client that names a new decode instance on every look-up gets a fresh
    per-instance bucket each time; the per-address cap (on by default, 2,000/s) still stops it, and
    it counts the /v1 reads too. Writes (registration, heartbeats) do not count."""
    # one request per 5 s (a bucket of 1): the second request is refused unless 5 s passed between the two,
    # whatever the host's load (at 5/s with 30 requests, a loaded host's look-ups refilled the bucket as
    # fast as they spent it, and the last one was not refused)
    d = start_daemon("--token", WRITE, "--max-requests-per-s-per-address", "0.2")
    with httpx.Client(base_url=d.url, headers=bearer(WRITE), timeout=5.0, trust_env=False) as h:
        assert h.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, "p"))).status_code == 201
        codes = [h.post("/v1/lookup", json=kvb.lookup_body(small_contract, "p", room=1, decode=f"name-{i}")).status_code
                 for i in range(3)]
        assert codes == [200, 429, 429], codes  # each a new decode name: a fresh per-instance bucket each time
        r = h.get("/v1/instances")
        assert r.status_code == 429 and r.json()["error"] == "too_many_requests" and int(r.headers["retry-after"]) >= 1
        assert "127.0.0.1" in r.json()["message"]
        assert h.post("/v1/ranks", json=kvb.body(kvb.register_request(small_contract, "q"))).status_code == 201
