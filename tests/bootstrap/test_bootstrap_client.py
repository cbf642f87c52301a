"""BootstrapClient against a real daemon: error mapping, retries, LeaseKeeper,
and automatic re-registration after the daemon process restarts."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.client import BootstrapClient, LeaseKeeper
from kvbridge.bootstrap.contract import RuntimeContract, fingerprint
from kvbridge.bootstrap.diff import FieldDiff
from kvbridge.bootstrap.schemas import RankIdentity
from kvbridge.errors import (
    BootstrapUnavailable,
    ContractMismatch,
    InstanceIncomplete,
    TopologyError,
    UnknownInstance,
)

DECODE = RankIdentity(instance="decode-c", role="decode")


def _wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_register_lookup_heartbeat_deregister(daemon: Any, kvb: Any, small_contract: RuntimeContract,
                                              instance_name: Callable[[str], str]) -> None:
    name = instance_name("prefill")
    with BootstrapClient(daemon.url) as client:
        regs = [client.register(kvb.register_request(small_contract, name, sizes=(1, 2, 1, 1), coords=(0, cp, 0, 0)))
                for cp in range(2)]
        assert regs[0].fingerprint == fingerprint(small_contract)
        ans = client.lookup(name, room=42, contract=small_contract, rank=DECODE)
        assert ans.plan.cp_size == 2 and ans.plan.rule == "interleaved"
        assert [s.rank_id for s in ans.ranks] == [r.rank_id for r in regs]
        assert client.heartbeat(regs[0]).reregistrations == 0
        assert [i.name for i in client.instances() if i.name == name] == [name]
        assert client.instance(name).complete
        assert any(f.instance == name for f in client.fingerprints())
        assert client.health()["status"] == "ok"
        assert "kvbridge_bootstrap_lookups_total" in client.metrics_text()
        for r in regs:
            client.deregister(r)
        client.deregister(regs[0])  # already gone: fine
        with pytest.raises(UnknownInstance, match="no prefill instance"):
            client.lookup(name, room=42, contract=small_contract, rank=DECODE)


def test_client_raises_contract_mismatch_with_diff(daemon: Any, kvb: Any, small_contract: RuntimeContract,
                                                   instance_name: Callable[[str], str], all_mutations: list[Any]) -> None:
    name = instance_name("prefill")
    other = next(m for m in all_mutations if m.path == "pools.index.layout").apply(small_contract)
    with BootstrapClient(daemon.url) as client:
        client.register(kvb.register_request(small_contract, name))
        with pytest.raises(ContractMismatch) as exc:
            client.lookup(name, room=1, contract=other, rank=DECODE)
        assert exc.value.diff == [FieldDiff(path="pools.index.layout", prefill="values_then_scales", decode="rows",
                                            breaks="index-K pages would be read with the wrong in-page layout")]
        assert "409" in str(exc.value)
        recent = client.mismatches(limit=5)
        assert recent[0].right.fingerprint == fingerprint(other) and recent[0].diff == exc.value.diff
        metrics = httpx.get(f"{daemon.url}/metrics", trust_env=False).text  # counted by field
        assert re.search(r'kvbridge_bootstrap_contract_refusals_total\{field="pools.index",kind="lookup"\} [1-9]',
                         metrics), metrics[-2000:]

        with pytest.raises(TopologyError) as topo:
            client.register(kvb.register_request(small_contract, name, sizes=(1, 2, 1, 1), coords=(0, 1, 0, 0)))
        assert [d.path for d in topo.value.diff] == ["topology.cp_size"]  # type: ignore[attr-defined]


def test_client_raises_instance_incomplete_with_missing(daemon: Any, kvb: Any, small_contract: RuntimeContract,
                                                        instance_name: Callable[[str], str]) -> None:
    name = instance_name("prefill")
    with BootstrapClient(daemon.url) as client:
        client.register(kvb.register_request(small_contract, name, sizes=(2, 2, 1, 1), coords=(1, 0, 0, 0)))
        with pytest.raises(InstanceIncomplete) as exc:
            client.lookup(name, room=3, contract=small_contract, rank=DECODE)  # dp 1
        assert exc.value.missing == [f"{name}/dp1/cp1/tp0/pp0"]  # type: ignore[attr-defined]


def test_unreachable_daemon_raises_after_retries() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with BootstrapClient(f"http://127.0.0.1:{port}", retries=2, backoff=0.05, timeout=0.5) as client:
        with pytest.raises(BootstrapUnavailable, match="after 3 attempt"):
            client.health()
    assert 0.1 <= time.monotonic() - t0 < 5.0  # backoff 0.05 + 0.1 was slept


def test_lease_keeper_keeps_a_short_lease_alive_and_stops(daemon: Any, kvb: Any, small_contract: RuntimeContract,
                                                          instance_name: Callable[[str], str]) -> None:
    name = instance_name("prefill")
    with BootstrapClient(daemon.url) as client:
        reg = client.register(kvb.register_request(small_contract, name, lease_ttl_s=0.6))
        keeper = LeaseKeeper(client, reg).start()
        time.sleep(1.5)  # 2.5 leases
        assert keeper.beats >= 3 and keeper.last_error is None
        assert client.instance(name).num_ranks == 1 and reg.reregistrations == 0
        keeper.stop(deregister=True)
        assert not keeper.alive
        with pytest.raises(UnknownInstance):
            client.instance(name)


def test_ranks_register_again_after_the_daemon_restarts(start_daemon: Callable[..., Any], kvb: Any,
                                                        small_contract: RuntimeContract) -> None:
    d = start_daemon()
    name = "prefill-restart"
    client = BootstrapClient(d.url, retries=2, backoff=0.05, timeout=1.0)
    regs = [client.register(kvb.register_request(small_contract, name, sizes=(1, 2, 1, 1), coords=(0, cp, 0, 0), lease_ttl_s=0.9))
            for cp in range(2)]
    old_ids = {r.rank_id for r in regs}
    keepers = [LeaseKeeper(client, r, interval_s=0.2).start() for r in regs]
    try:
        d.restart()  # a fresh process on the same port: it knows nothing
        assert _wait_until(lambda: all(r.reregistrations >= 1 for r in regs))
        assert {r.rank_id for r in regs}.isdisjoint(old_ids)
        ans = client.lookup(name, room=0, contract=small_contract, rank=DECODE)
        assert [s.rank_id for s in ans.ranks] == [r.rank_id for r in regs]
        assert all(k.alive for k in keepers)
    finally:
        for k in keepers:
            k.stop()
        client.close()
