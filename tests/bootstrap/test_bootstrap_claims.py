"""Claims are unique (issue 20, finding 1, the daemon half): a registration that claims a
transport session or an address range another live rank holds is refused with 409
``claim_held`` naming the holder, on the in-memory store and on a real three-member etcd
cluster (two replicas racing, a daemon restart, a lease running out). The rule itself
(``claims.find_conflict``) is checked against a brute-force overlap test."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from kvbridge.bootstrap.claims import Claim, claim_of, find_conflict
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.schemas import ScratchDescriptor
from kvbridge.bootstrap.topology import AuxDescriptor, AuxRegionDescriptor
from kvbridge.transfer.ownership import ProofKey

TTL = 3.0  # etcd's shortest leases are about 2 s
VICTIM_TTL = 30.0  # outlives stopping two replicas and starting a third (a fresh-clone CI run: over 12 s at load 7)
LEASE = "X-KVBridge-Lease"


# ---- the rule ---------------------------------------------------------------------------------

def _claim(rank: str, inst: str, ranges: list[tuple[int, int]], session: str = "s") -> Claim:
    r = np.array(ranges, dtype=np.uint64).reshape(-1, 2)
    return Claim(rank, f"{inst}/{rank}", inst, session, r[np.argsort(r[:, 0])] if len(r) else r)


def test_find_conflict_matches_brute_force() -> None:
    rng = np.random.default_rng(7)
    for trial in range(200):
        held = []
        for i in range(int(rng.integers(0, 6))):
            starts = rng.integers(0, 10_000, size=int(rng.integers(1, 5)))
            held.append(claim_of(f"r{i}", f"x/r{i}", "x", "S", [], None,
                                 [AuxRegionDescriptor(name=f"a{j}", base=int(s), capacity_rows=int(rng.integers(1, 50)),
                                                      row_bytes=4) for j, s in enumerate(starts)], None))
        new_starts = rng.integers(0, 10_000, size=3)
        new = claim_of("n", "x/n", "x", " s ", [], AuxDescriptor(base=int(new_starts[0]), capacity_rows=10, row_bytes=8),
                       [AuxRegionDescriptor(name="b", base=int(new_starts[1]), capacity_rows=5, row_bytes=8)],
                       ScratchDescriptor(base=int(new_starts[2]), nbytes=16))
        assert new.session == "s" and all(c.session == "s" for c in held)  # trimmed and lower-cased
        brute = [(c.rank_id, (int(a), int(b))) for c in held for a, b in c.ranges
                 for s, e in new.ranges if int(a) < int(e) and int(s) < int(b)]
        got = find_conflict(held, new)
        assert (got is None) == (not brute), (trial, brute, got)
        if got is not None:
            assert got[0].rank_id in {r for r, _ in brute}


def test_own_overlaps_merge_and_the_replaced_rank_holds_nothing() -> None:
    # an aux region inside the rank's own aux buffer is no conflict with itself
    c = claim_of("a", "i/a", "i", "S ", [], AuxDescriptor(base=100, capacity_rows=10, row_bytes=10),
                 [AuxRegionDescriptor(name="h", base=120, capacity_rows=2, row_bytes=10)], None)
    assert c.ranges.tolist() == [[100, 200]]
    old = _claim("old", "i", [(100, 200)], "s")
    assert find_conflict([old], c, exclude=("old",)) is None
    assert find_conflict([old], c) is not None
    # ranks of one instance may share a session (one process) with disjoint ranges
    assert find_conflict([_claim("b", "i", [(200, 300)], "s")], c) is None
    # another instance may not use the session at all, whatever its ranges
    held, why = find_conflict([_claim("v", "victim", [(5000, 6000)], "s")], c)  # type: ignore[misc]
    assert held.rank_id == "v" and "held by instance 'victim'" in why
    # other sessions do not count: addresses are per process
    assert find_conflict([_claim("v", "victim", [(100, 200)], "T")], c) is None


def test_thousands_of_ranks_cost_one_session() -> None:
    """A session shared by 2,000 ranks of one instance, 64 ranges each: the check is vectorised
    (the brute force would be 2,000 x 64 x 64 pairs in Python)."""
    held = [_claim(f"r{i}", "i", [(i * 1_000_000 + j * 1000, i * 1_000_000 + j * 1000 + 500) for j in range(64)])
            for i in range(2000)]
    free = _claim("n", "i", [(2000 * 1_000_000 + j * 1000, 2000 * 1_000_000 + j * 1000 + 10) for j in range(64)])
    assert find_conflict(held, free) is None
    clash = _claim("n", "i", [(1999 * 1_000_000 + 63 * 1000 + 499, 1999 * 1_000_000 + 63 * 1000 + 600)])
    got = find_conflict(held, clash)
    assert got is not None and got[0].rank_id == "r1999"


# ---- at the daemon (in-memory store) ------------------------------------------------------------

def _body(kvb: Any, contract: RuntimeContract, inst: str, role: str = "decode", **change: Any) -> dict[str, Any]:
    body = kvb.body(kvb.register_request(contract, inst, role))
    body.update(change)
    return body


def test_a_victims_session_is_refused_naming_the_holder(http: httpx.Client, kvb: Any, small_contract: RuntimeContract,
                                                        instance_name: Callable[[str], str]) -> None:
    victim, attacker = instance_name("victim"), instance_name("attacker")
    v = http.post("/v1/ranks", json=_body(kvb, small_contract, victim))
    assert v.status_code == 201, v.text
    vid = v.json()["rank_id"]
    stolen = _body(kvb, small_contract, victim)
    r = http.post("/v1/ranks", json=_body(kvb, small_contract, attacker, session_id=stolen["session_id"]))
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "claim_held" and vid in r.json()["holder"] and vid in r.json()["message"]
    # the same session spelt otherwise is the same process (every spelling: test_bootstrap_endpoints.py)
    host, port = stolen["session_id"].rsplit(":", 1)
    r = http.post("/v1/ranks", json=_body(kvb, small_contract, attacker, session_id=f"LOCALHOST.:0{port}"))
    assert r.status_code == 409 and r.json()["error"] == "claim_held", r.text
    r = http.post("/v1/ranks", json=_body(kvb, small_contract, attacker, session_id=f" {host}:{port} "))
    assert r.status_code == 400 and r.json()["error"] == "bad_endpoint", r.text  # blanks: malformed
    # the same rank re-registering its own coordinates with its lease secret is no conflict
    again = http.post("/v1/ranks", json=_body(kvb, small_contract, victim), headers={LEASE: v.json()["lease_secret"]})
    assert again.status_code == 201 and again.json()["replaced"] == vid, again.text
    # once the holder is gone, the session is free
    http.delete(f"/v1/ranks/{again.json()['rank_id']}", headers={LEASE: again.json()["lease_secret"]})
    r = http.post("/v1/ranks", json=_body(kvb, small_contract, attacker, session_id=stolen["session_id"]))
    assert r.status_code == 201, r.text


def test_overlapping_ranges_in_one_shared_session_are_refused(http: httpx.Client, kvb: Any,
                                                              small_contract: RuntimeContract,
                                                              instance_name: Callable[[str], str]) -> None:
    name = instance_name("dec")
    a = kvb.body(kvb.register_request(small_contract, name, "decode", sizes=(1, 1, 2, 1), coords=(0, 0, 0, 0)))
    b = kvb.body(kvb.register_request(small_contract, name, "decode", sizes=(1, 1, 2, 1), coords=(0, 0, 1, 0)))
    b["session_id"] = a["session_id"]  # one process, two ranks
    b["aux"] = {**b["aux"], "base": (1 << 45)}
    b["scratch"] = {"base": a["pools"][-1]["base"] + 16, "nbytes": 64}  # inside a's last pool buffer
    ra = http.post("/v1/ranks", json=a)
    assert ra.status_code == 201, ra.text
    r = http.post("/v1/ranks", json=b)
    assert r.status_code == 409 and r.json()["error"] == "claim_held", r.text
    assert ra.json()["rank_id"] in r.json()["holder"] and "overlaps" in r.json()["message"]
    # moved clear of a's memory, in the same process: accepted
    b["pools"] = [{**p, "base": p["base"] + (1 << 42)} for p in b["pools"]]
    b["scratch"] = {"base": 1 << 46, "nbytes": 64}
    assert http.post("/v1/ranks", json=b).status_code == 201


def test_a_staging_area_is_registered_read_back_and_claimed(http: httpx.Client, kvb: Any,
                                                             small_contract: RuntimeContract,
                                                             instance_name: Callable[[str], str]) -> None:
    """A decode rank's staging area: read back as registered (prefill checks requests against
    it), a whole number of slots, and no other rank of the session may overlap it."""
    name = instance_name("stg")
    a = kvb.body(kvb.register_request(small_contract, name, "decode", sizes=(1, 1, 2, 1), coords=(0, 0, 0, 0)))
    a["staging"] = {"base": 1 << 47, "nbytes": 4 * 4096, "slot_bytes": 4096}
    bad = http.post("/v1/ranks", json={**a, "staging": {**a["staging"], "slot_bytes": 3 * 4096}})
    assert bad.status_code == 409 and bad.json()["field"] == "staging.slot_bytes", bad.text  # inconsistent_request
    assert "not a whole number of 12288-byte slots" in bad.json()["message"]
    ra = http.post("/v1/ranks", json=a)
    assert ra.status_code == 201, ra.text
    assert http.get(f"/v1/ranks/{ra.json()['rank_id']}").json()["staging"] == a["staging"]
    b = kvb.body(kvb.register_request(small_contract, name, "decode", sizes=(1, 1, 2, 1), coords=(0, 0, 1, 0)))
    b.update(session_id=a["session_id"], aux={**b["aux"], "base": 1 << 45}, scratch={"base": 1 << 46, "nbytes": 64})
    b["pools"] = [{**p, "base": p["base"] + (1 << 42)} for p in b["pools"]]
    r = http.post("/v1/ranks", json={**b, "scratch": {"base": (1 << 47) + 4096, "nbytes": 64}})  # in a's area
    assert r.status_code == 409 and r.json()["error"] == "claim_held", r.text
    assert http.post("/v1/ranks", json=b).status_code == 201


# ---- on etcd: one transaction, two replicas, restarts, lease expiry -------------------------------

GRACE = 4.0
# One etcd request's timeout before the next member is tried: the default 2 s, doubled twice. These
# tests judge claims, not failover; on a loaded CI host (load 7+, a venv installing beside) a lease
# grant took over 2 s and every replica answered 503 (store unavailable) instead of 201/409.
ETCD_TIMEOUT_S = 8.0


def _replicas(start_daemon: Callable[..., Any], cluster: Any, prefix: str, n: int) -> list[Any]:
    return [start_daemon("--store", cluster.store_url, "--etcd-prefix", prefix, "--replica-name", f"r{i}",
                         "--lease-ttl", str(TTL), "--claim-grace-s", str(GRACE), "--etcd-timeout", str(ETCD_TIMEOUT_S))
            for i in range(n)]


def test_etcd_claims_hold_across_replicas_restarts_and_leases(etcd_cluster: Any, etcd_prefix: str,
                                                              start_daemon: Callable[..., Any], kvb: Any,
                                                              small_contract: RuntimeContract,
                                                              instance_name: Callable[[str], str]) -> None:
    r0, r1 = _replicas(start_daemon, etcd_cluster, etcd_prefix, 2)
    victim, attacker = instance_name("victim"), instance_name("attacker")
    key = ProofKey()
    vbody = _body(kvb, small_contract, victim, lease_ttl_s=VICTIM_TTL, proof_key=key.public_hex)  # outlives the restart
    vbody["proof_signature"] = key.sign_claim(victim, (0, 0, 0, 0)).hex()
    with httpx.Client(base_url=r0.url, trust_env=False) as h0, httpx.Client(base_url=r1.url, trust_env=False) as h1:
        v = h0.post("/v1/ranks", json=vbody)
        assert v.status_code == 201, v.text
        vid = v.json()["rank_id"]
        # through the other replica, whether or not its cache has seen the victim yet
        r = h1.post("/v1/ranks", json=_body(kvb, small_contract, attacker, session_id=vbody["session_id"]))
        assert r.status_code == 409 and r.json()["error"] == "claim_held" and vid in r.json()["holder"], r.text
        # the rank itself re-registers through the other replica with its lease secret
        again = h1.post("/v1/ranks", json=vbody, headers={LEASE: v.json()["lease_secret"]})
        assert again.status_code == 201 and again.json()["replaced"] == vid, again.text
        vid, secret = again.json()["rank_id"], again.json()["lease_secret"]
    # a restarted daemon reads the claims back from etcd
    r0.stop()
    r1.stop()
    (r2,) = _replicas(start_daemon, etcd_cluster, etcd_prefix, 1)
    with httpx.Client(base_url=r2.url, trust_env=False) as h2:
        r = h2.post("/v1/ranks", json=_body(kvb, small_contract, attacker, session_id=vbody["session_id"]))
        assert r.status_code == 409 and vid in r.json()["holder"], r.text
        # the rank re-registers through the new replica with a short lease (its secret read back from etcd)
        again = h2.post("/v1/ranks", json={**vbody, "lease_ttl_s": TTL}, headers={LEASE: secret})
        assert again.status_code == 201 and again.json()["replaced"] == vid, again.text
        vid, secret = again.json()["rank_id"], again.json()["lease_secret"]
        # the victim stops heartbeating: its rank goes with its lease, its claim stays its key's
        squat = _body(kvb, small_contract, attacker, session_id=vbody["session_id"], lease_ttl_s=TTL,
                      proof_key=key.public_hex)  # naming the victim's (public) key does not help
        deadline = time.monotonic() + 2 * TTL + 3
        while h2.get(f"/v1/ranks/{vid}").status_code == 200 and time.monotonic() < deadline:
            r = h2.post("/v1/ranks", json=squat)
            assert r.status_code == 409 and r.json()["error"] == "claim_held", r.text
            time.sleep(0.3)
        assert h2.post(f"/v1/ranks/{vid}/heartbeat", headers={LEASE: secret}).status_code == 404
        r = h2.post("/v1/ranks", json=squat)
        assert r.status_code == 409 and "lapsed" in r.json()["message"] and vid in r.json()["holder"], r.text
        back = h2.post("/v1/ranks", json={**vbody, "lease_ttl_s": TTL})  # its owner takes it back
        assert back.status_code == 201, back.text
        # lapsed again, then the grace passes: free
        deadline = time.monotonic() + TTL + GRACE + 8
        while time.monotonic() < deadline:
            r = h2.post("/v1/ranks", json=squat)
            if r.status_code == 201:
                break
            assert r.json()["error"] == "claim_held", r.text
            time.sleep(0.3)
        assert r.status_code == 201, r.text


def test_etcd_racing_replicas_cannot_both_accept_one_session(etcd_cluster: Any, etcd_prefix: str,
                                                             start_daemon: Callable[..., Any], kvb: Any,
                                                             small_contract: RuntimeContract,
                                                             instance_name: Callable[[str], str]) -> None:
    """Eight instances register one session at once, half through each replica: exactly one wins."""
    daemons = _replicas(start_daemon, etcd_cluster, etcd_prefix, 2)
    session = "127.0.0.1:64999"  # (a port no other rank of the test session has)
    results: list[int] = []
    gate = threading.Barrier(8)

    def one(i: int) -> None:
        body = _body(kvb, small_contract, instance_name(f"race{i}"), session_id=session, lease_ttl_s=TTL)
        with httpx.Client(base_url=daemons[i % 2].url, trust_env=False, timeout=20.0) as h:
            gate.wait(timeout=10)
            results.append(h.post("/v1/ranks", json=body).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [201] + [409] * 7, results


@pytest.fixture(autouse=True)
def _quiet_numpy() -> Any:
    with np.errstate(over="raise"):
        yield


def test_etcd_a_rank_that_moves_frees_its_old_session_at_once(etcd_cluster: Any, etcd_prefix: str,
                                                              start_daemon: Callable[..., Any], kvb: Any,
                                                              small_contract: RuntimeContract,
                                                              instance_name: Callable[[str], str]) -> None:
    """A restarted worker re-registers its coordinates (lease secret) from a new process (new
    session): its old claim goes in the same transaction, not when the old lease runs out."""
    (d,) = _replicas(start_daemon, etcd_cluster, etcd_prefix, 1)
    name, other = instance_name("mover"), instance_name("next")
    body = _body(kvb, small_contract, name, lease_ttl_s=VICTIM_TTL)
    restarted = "127.0.0.1:64998"  # the new process's session
    with httpx.Client(base_url=d.url, trust_env=False) as h:
        first = h.post("/v1/ranks", json=body)
        assert first.status_code == 201, first.text
        moved = h.post("/v1/ranks", json={**body, "session_id": restarted},
                       headers={LEASE: first.json()["lease_secret"]})
        assert moved.status_code == 201 and moved.json()["replaced"] == first.json()["rank_id"], moved.text
        r = h.post("/v1/ranks", json=_body(kvb, small_contract, other, session_id=body["session_id"]))
        assert r.status_code == 201, r.text
        r = h.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("late"),
                                           session_id=restarted))
        assert r.status_code == 409 and moved.json()["rank_id"] in r.json()["holder"], r.text


def test_a_staging_area_is_claimed_like_the_pools() -> None:
    """A decode rank's staging area is memory peers write into: another rank's range over it is a
    conflict, as over its pools."""
    from kvbridge.bootstrap.schemas import StagingDescriptor

    staged = claim_of("d", "i/d", "i", "S", [], None, [], None, StagingDescriptor(base=4096, nbytes=1024, slot_bytes=256))
    assert staged.ranges.tolist() == [[4096, 5120]]
    alias = claim_of("e", "i/e", "i", "S", [], AuxDescriptor(base=5000, capacity_rows=1, row_bytes=8), [], None)
    held, why = find_conflict([staged], alias)  # type: ignore[misc]
    assert held.rank_id == "d" and "overlaps [0x1000, 0x1400)" in why
