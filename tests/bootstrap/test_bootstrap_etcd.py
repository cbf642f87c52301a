"""The daemon on a real three-member etcd cluster (``--store etcd://...``): registration and
look-ups through one and three replicas, a replica killed (clients fail over, no look-up
lost), an etcd member killed with quorum kept (no effect), quorum lost (503 naming the
cause) and regained (resumes with no restart), a dead rank's keys vanishing within its
TTL with no daemon running, and an unreachable etcd at start-up (exit non-zero).

The tests that break the cluster run last in this module and leave it whole."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap import BootstrapClient
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.errors import BootstrapUnavailable, ContractMismatch, InstanceIncomplete, TopologyError

TTL = 3.0  # etcd's shortest leases are about 2 s


def replicas(start_daemon: Callable[..., Any], cluster: Any, prefix: str, n: int, *extra: str) -> list[Any]:
    return [start_daemon("--store", cluster.store_url, "--etcd-prefix", prefix, "--replica-name", f"r{i}",
                         "--lease-ttl", str(TTL), *extra) for i in range(n)]


def eventually(fn: Callable[[], Any], timeout: float = 10.0, every: float = 0.1) -> Any:
    """``fn()``'s value once it stops raising the bootstrap's "not yet" errors (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (InstanceIncomplete, BootstrapUnavailable, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(every)


def register_prefill(client: BootstrapClient, kvb: Any, contract: RuntimeContract, name: str, cp: int = 2,
                     ttl: float = TTL) -> list[Any]:
    return [client.register(kvb.register_request(contract, name, sizes=(1, cp, 1, 1), coords=(0, c, 0, 0),
                                                 lease_ttl_s=ttl)) for c in range(cp)]


def lookup(client: BootstrapClient, kvb: Any, contract: RuntimeContract, name: str, room: int) -> Any:
    ident = kvb.register_request(contract, "decode-a", "decode").rank
    return client.lookup(name, room, contract, ident)


def test_one_replica_serves_the_whole_api(etcd_cluster: Any, etcd_prefix: str, start_daemon: Callable[..., Any],
                                          kvb: Any, small_contract: RuntimeContract, all_mutations: list[Any],
                                          instance_name: Callable[[str], str]) -> None:
    (d,) = replicas(start_daemon, etcd_cluster, etcd_prefix, 1)
    name = instance_name("p")
    with BootstrapClient(d.url) as client:
        regs = register_prefill(client, kvb, small_contract, name)
        answer = lookup(client, kvb, small_contract, name, room=7)
        assert [r.rank_id for r in answer.ranks] == [r.rank_id for r in regs] and client.last_replica == "r0"
        with pytest.raises(ContractMismatch) as refused:
            lookup(client, kvb, all_mutations[1].apply(small_contract), name, room=8)
        assert refused.value.diff and refused.value.diff[0].path == "model.name"
        client.heartbeat(regs[0])
        assert regs[0].reregistrations == 0
        health = client.health()
        assert health["store"]["kind"] == "etcd" and health["store"]["ok"] and health["replica"] == "r0"
        assert [m.diff[0].path for m in client.mismatches()] == ["model.name"]
        client.deregister(regs[1])
        with pytest.raises(InstanceIncomplete):
            lookup(client, kvb, small_contract, name, room=9)


def test_three_replicas_share_one_state(etcd_cluster: Any, etcd_prefix: str, start_daemon: Callable[..., Any],
                                        kvb: Any, small_contract: RuntimeContract, all_mutations: list[Any],
                                        instance_name: Callable[[str], str]) -> None:
    ds = replicas(start_daemon, etcd_cluster, etcd_prefix, 3)
    name = instance_name("p")
    a, b, c = (BootstrapClient(d.url) for d in ds)
    with a, b, c:
        regs = register_prefill(a, kvb, small_contract, name)  # through r0
        for client, replica in ((b, "r1"), (c, "r2")):  # looked up through the others, from their watched caches
            answer = eventually(lambda cl=client: lookup(cl, kvb, small_contract, name, room=3))
            assert len(answer.ranks) == 2 and client.last_replica == replica
        c.heartbeat(regs[0])  # a heartbeat may go to any replica: the lease lives in etcd
        assert regs[0].reregistrations == 0
        with pytest.raises(ContractMismatch):
            lookup(b, kvb, all_mutations[2].apply(small_contract), name, room=4)
        # the refusal recorded by r1 and the replicas are shown by every replica
        seen = eventually(lambda: [m.kind for m in c.mismatches()] if c.mismatches() else (_ for _ in ()).throw(
            AssertionError("not yet")))
        assert seen == ["lookup"]
        store = eventually(lambda: _all_replicas(a.health()))
        assert sorted(r["name"] for r in store["replicas"]) == ["r0", "r1", "r2"]
        page = httpx.get(f"{ds[2].url}/diagnostics", trust_env=False).text
        assert 'id="store" data-ok="true"' in page and "answered by <b>r2</b>" in page
        # the same coordinates through another replica need the lease secret (one transaction decides)
        again = kvb.register_request(small_contract, name, sizes=(1, 2, 1, 1), coords=(0, 0, 0, 0), lease_ttl_s=TTL)
        fresh = c.register(again, lease_secret=regs[0].lease_secret)
        assert fresh.rank_id != regs[0].rank_id


def _all_replicas(health: dict[str, Any]) -> dict[str, Any]:
    assert len(health["store"]["replicas"]) == 3
    return health["store"]  # type: ignore[no-any-return]


def test_a_replica_killed_clients_fail_over(etcd_cluster: Any, etcd_prefix: str, start_daemon: Callable[..., Any],
                                            kvb: Any, small_contract: RuntimeContract,
                                            instance_name: Callable[[str], str]) -> None:
    ds = replicas(start_daemon, etcd_cluster, etcd_prefix, 3)
    name = instance_name("p")
    with BootstrapClient([d.url for d in ds], retries=2, backoff=0.05) as client:
        regs = register_prefill(client, kvb, small_contract, name)
        assert client.last_replica == "r0"
        ds[0].proc.kill()  # a crash, not a graceful stop
        ds[0].proc.wait(10)
        answers = [lookup(client, kvb, small_contract, name, room=room) for room in range(20)]
        assert len(answers) == 20 and all(len(a.ranks) == 2 for a in answers)  # no look-up lost
        assert client.last_replica in ("r1", "r2") and client.failovers >= 1
        for reg in regs:
            client.heartbeat(reg)
            assert reg.reregistrations == 0  # the leases live in etcd: the other replicas know them
    ds[0].proc = None


def test_a_dead_rank_vanishes_within_its_ttl_with_no_daemon(etcd_cluster: Any, etcd_prefix: str,
                                                            start_daemon: Callable[..., Any], kvb: Any,
                                                            small_contract: RuntimeContract,
                                                            instance_name: Callable[[str], str]) -> None:
    import etcd3gw

    (d,) = replicas(start_daemon, etcd_cluster, etcd_prefix, 1)
    with BootstrapClient(d.url) as client:
        register_prefill(client, kvb, small_contract, instance_name("p"), cp=1)
    d.stop()  # no daemon runs from here on
    etcd = etcd3gw.Etcd3Client(host="127.0.0.1", port=etcd_cluster.client_ports[0], api_path="/v3/")
    assert len(etcd.get_prefix(f"{etcd_prefix}ranks/")) == 1 and len(etcd.get_prefix(f"{etcd_prefix}coords/")) == 1
    deadline = time.monotonic() + 2 * TTL + 2
    while etcd.get_prefix(f"{etcd_prefix}ranks/") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert etcd.get_prefix(f"{etcd_prefix}ranks/") == [] and etcd.get_prefix(f"{etcd_prefix}coords/") == []


def test_an_unreachable_etcd_at_start_up_exits_non_zero(etcd_prefix: str) -> None:
    from kvbridge.chaos.ports import private_ports

    port = private_ports(1)[0]  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "kvbridge.cli.main", "bootstrap", "--port", "0", "--store",
                           f"etcd://127.0.0.1:{port}", "--etcd-timeout", "0.5"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "etcd" in proc.stderr and f"127.0.0.1:{port}" in proc.stderr


def test_an_etcd_member_killed_with_quorum_kept_changes_nothing(etcd_cluster: Any, etcd_prefix: str,
                                                                start_daemon: Callable[..., Any], kvb: Any,
                                                                small_contract: RuntimeContract,
                                                                instance_name: Callable[[str], str]) -> None:
    ds = replicas(start_daemon, etcd_cluster, etcd_prefix, 2)
    name = instance_name("p")
    # a request may wait out an election (the store's failover window): a timeout above it, and
    # retries that wait out the daemons' health ticks should the election outlast the window
    # (a loaded CI host: both replicas answered 503 store_unavailable for a tick)
    with BootstrapClient([d.url for d in ds], timeout=10.0, retries=10) as client:
        regs = register_prefill(client, kvb, small_contract, name)
        etcd_cluster.kill(0)  # the first endpoint: every replica's current member
        try:
            more = register_prefill(client, kvb, small_contract, instance_name("q"))
            assert len(lookup(client, kvb, small_contract, name, room=1).ranks) == 2
            for reg in regs + more:
                client.heartbeat(reg)
                assert reg.reregistrations == 0
            assert client.health()["store"]["ok"]
        finally:
            etcd_cluster.restart(0)
            etcd_cluster.wait_healthy([0])


def test_quorum_lost_answers_503_naming_the_cause_and_resumes(etcd_cluster: Any, etcd_prefix: str,
                                                              start_daemon: Callable[..., Any], kvb: Any,
                                                              small_contract: RuntimeContract,
                                                              instance_name: Callable[[str], str]) -> None:
    (d,) = replicas(start_daemon, etcd_cluster, etcd_prefix, 1, "--etcd-timeout", "1")
    name = instance_name("p")
    with BootstrapClient(d.url, retries=0) as client:
        # leases of 12 s, not TTL: etcd renews every lease to its full TTL when a new leader is
        # elected, which happens as the first killed member rejoins; restarting the second and
        # waiting for all three to answer took over 3 s in a loaded CI run, and these ranks send
        # no heartbeat in the meantime (a fresh clone's make test failed so)
        regs = register_prefill(client, kvb, small_contract, name, ttl=12.0)
        etcd_cluster.kill(1)
        etcd_cluster.kill(2)
        try:
            def refused() -> str:
                r = httpx.post(f"{d.url}/v1/ranks", json=kvb.body(kvb.register_request(small_contract, "late")),
                               timeout=10, trust_env=False)
                assert r.status_code == 503, r.text
                return str(r.json()["error"]) + " " + r.json()["message"]

            text = eventually(refused, timeout=15)
            assert text.startswith("store_unavailable") and "quorum" in text and "etcd" in text
            r = httpx.post(f"{d.url}/v1/lookup", json=kvb.lookup_body(small_contract, name, room=5), timeout=10,
                           trust_env=False)
            assert r.status_code == 503 and r.json()["error"] == "store_unavailable"
            with pytest.raises(BootstrapUnavailable, match="quorum"):
                lookup(client, kvb, small_contract, name, room=6)
            assert httpx.get(f"{d.url}/v1/instances/{name}", trust_env=False).status_code == 200  # views: the cache
            assert httpx.get(f"{d.url}/healthz", trust_env=False).json()["status"] == "degraded"
        finally:
            etcd_cluster.restart(1)
            etcd_cluster.restart(2)
            etcd_cluster.wait_healthy([0, 1, 2])
        # quorum is back: the same daemon resumes, and the ranks kept their leases
        assert len(eventually(lambda: lookup(client, kvb, small_contract, name, room=7), timeout=20).ranks) == 2
        for reg in regs:
            client.heartbeat(reg)
        assert all(reg.reregistrations == 0 for reg in regs)
        client.register(kvb.register_request(small_contract, instance_name("after")))


def test_pipeline_stages_and_their_layers_live_in_etcd(etcd_cluster: Any, etcd_prefix: str,
                                                       start_daemon: Callable[..., Any], kvb: Any,
                                                       small_contract: RuntimeContract,
                                                       instance_name: Callable[[str], str]) -> None:
    """A stage's layer range is stored with its rank: another replica's look-up (from its watched
    cache) names each stage's layers, and that replica refuses a stage that disagrees with them."""
    d0, d1 = replicas(start_daemon, etcd_cluster, etcd_prefix, 2)
    name = instance_name("pp")
    sizes = (2, 1, 1, 2)  # DP 2 x PP 2; 2 target layers: [0, 1) and [1, 2)
    with BootstrapClient(d0.url) as a, BootstrapClient(d1.url) as b:
        for pp in range(2):
            a.register(kvb.register_request(small_contract, name, sizes=sizes, coords=(0, 0, 0, pp), lease_ttl_s=TTL))
        answer = eventually(lambda: lookup(b, kvb, small_contract, name, room=4))  # room 4: DP group 0
        assert b.last_replica == "r1"
        assert [(r.pp_rank, r.pp_layers.start, r.pp_layers.end) for r in answer.ranks] == [(0, 0, 1), (1, 1, 2)]
        with pytest.raises(TopologyError, match=r"stage pp1 declares layers \[0, 2\) here but \[1, 2\) on"):
            b.register(kvb.register_request(small_contract, name, sizes=sizes, coords=(1, 0, 0, 1), pp_layers=(0, 2),
                                            lease_ttl_s=TTL))
