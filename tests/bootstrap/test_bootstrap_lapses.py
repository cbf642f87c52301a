"""A claim outlives its lease for its owner (issue 32, second finding): a victim stopped past its
lease, or a daemon restarted, no longer hands its transport session to whoever registers next.
Only the key that held the claim takes it back within the grace; naming that (public) key
without its signature does not; after the grace, or once the owner deregisters, the session is
free. The rules run in one process on fake clocks; a real daemon with a claims file is restarted
(the etcd store's half is in test_bootstrap_claims.py, on the real etcd cluster)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbridge.bootstrap.lapses import signature_ok
from kvbridge.bootstrap.metrics import Metrics
from kvbridge.bootstrap.registry import Registry
from kvbridge.bootstrap.schemas import RegisterRequest
from kvbridge.bootstrap.store_memory import MemoryStore
from kvbridge.errors import ClaimHeld
from kvbridge.transfer.ownership import ProofKey

GRACE = 30.0
SESSION = "127.0.0.1:47001"


def keyed(req: RegisterRequest, key: ProofKey | None, *, sign_with: ProofKey | None = None,
          session: str = SESSION) -> RegisterRequest:
    """``req`` naming ``key`` (public) and carrying ``sign_with``'s claim signature (default ``key``'s)."""
    signer = sign_with or key
    sig = signer.sign_claim(req.rank.instance, req.rank.coords).hex() if signer is not None else None
    return req.model_copy(update={"session_id": session, "proof_key": key.public_hex if key else None,
                                  "proof_signature": sig})


class Clocks:
    def __init__(self) -> None:
        self.mono, self.wall = 100.0, 1_000_000.0

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s


def registry(clocks: Clocks, claims_file: Path | None = None) -> Registry:
    store = MemoryStore(clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall, claims_file=claims_file,
                        claim_grace_s=GRACE)
    store.start()
    return Registry(metrics=Metrics(), clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall, store=store,
                    claim_grace_s=GRACE)


def test_the_claim_signature_is_the_keys_own(kvb: Any, small_contract: Any) -> None:
    k, other = ProofKey(), ProofKey()
    req = keyed(kvb.register_request(small_contract, "v", "decode"), k)
    assert signature_ok(req.proof_key, req.proof_signature, "v", req.rank.coords)
    assert not signature_ok(req.proof_key, req.proof_signature, "w", req.rank.coords)  # another instance
    assert not signature_ok(req.proof_key, req.proof_signature, "v", (0, 0, 0, 1))  # other coordinates
    forged = keyed(kvb.register_request(small_contract, "v", "decode"), k, sign_with=other)
    assert not signature_ok(forged.proof_key, forged.proof_signature, "v", req.rank.coords)
    assert not signature_ok(req.proof_key, None, "v", req.rank.coords)


def test_a_lapsed_claim_is_its_owners_for_the_grace_and_nobody_elses(kvb: Any, small_contract: Any) -> None:
    clocks, k = Clocks(), ProofKey()
    reg = registry(clocks)
    victim = keyed(kvb.register_request(small_contract, "victim", "decode", lease_ttl_s=3.0), k)
    first = reg.register(victim)
    clocks.advance(6.0)  # stopped 3 s past its lease
    reg.expire()
    assert reg.counts() == (0, 0)  # the rank is gone ...
    squatters = {
        "no key": keyed(kvb.register_request(small_contract, "squat", "decode"), None),
        "its own key": keyed(kvb.register_request(small_contract, "squat", "decode"), ProofKey()),
        "the victim's public key, no signature": kvb.register_request(small_contract, "squat", "decode").model_copy(
            update={"session_id": SESSION, "proof_key": k.public_hex}),
        "the victim's public key, its own signature": keyed(kvb.register_request(small_contract, "squat", "decode"), k,
                                                            sign_with=ProofKey()),
        "the victim's own instance name, another key": keyed(
            kvb.register_request(small_contract, "victim", "decode"), ProofKey()),
    }
    for why, req in squatters.items():  # ... its claim is not
        with pytest.raises(ClaimHeld, match="lapsed claim") as refused:
            reg.register(req)
        assert first.rank_id in refused.value.holder, why
    back = reg.register(victim)  # the owner takes it back at once
    assert back.rank_id != first.rank_id
    clocks.advance(1.0)
    with pytest.raises(ClaimHeld, match=back.rank_id):
        reg.register(squatters["no key"])  # live again
    # once it lapses and the grace passes with no owner, the session is free
    clocks.advance(3.0 + GRACE + 1)
    reg.expire()
    assert reg.register(squatters["its own key"]).rank_id


def test_deregistering_lets_go_at_once(kvb: Any, small_contract: Any) -> None:
    clocks, k = Clocks(), ProofKey()
    reg = registry(clocks)
    r = reg.register(keyed(kvb.register_request(small_contract, "victim", "decode"), k))
    reg.deregister(r.rank_id, lease_secret=r.lease_secret)
    assert reg.register(keyed(kvb.register_request(small_contract, "next", "decode"), ProofKey())).rank_id


def test_a_restarted_daemon_reads_claims_back_before_anything(kvb: Any, small_contract: Any, tmp_path: Path) -> None:
    clocks, k = Clocks(), ProofKey()
    path = tmp_path / "claims.json"
    reg = registry(clocks, path)
    victim = keyed(kvb.register_request(small_contract, "victim", "decode", lease_ttl_s=60.0), k)
    first = reg.register(victim)
    lapsing = reg.register(keyed(kvb.register_request(small_contract, "other", "decode", lease_ttl_s=2.0),
                                 ProofKey(), session="127.0.0.1:47002"))
    clocks.advance(3.0)
    reg.expire()  # "other" lapses before the restart: its claim is kept lapsed too
    again = registry(clocks, path)  # the daemon restarts (a new store reads the file in start())
    assert again.counts() == (0, 0)
    with pytest.raises(ClaimHeld, match=first.rank_id):
        again.register(keyed(kvb.register_request(small_contract, "squat", "decode"), ProofKey()))
    with pytest.raises(ClaimHeld, match=lapsing.rank_id):
        again.register(keyed(kvb.register_request(small_contract, "squat", "decode"), ProofKey(),
                             session="127.0.0.1:47002"))
    assert again.register(victim).rank_id  # its owner takes it back
    clocks.advance(GRACE + 1)
    again.expire()
    assert again.register(keyed(kvb.register_request(small_contract, "squat", "decode"), ProofKey(),
                                session="127.0.0.1:47002")).rank_id


def test_a_real_daemon_restarted_keeps_a_claim_for_its_owner(start_daemon: Callable[..., Any], kvb: Any,
                                                              small_contract: Any, tmp_path: Path) -> None:
    d = start_daemon("--claims-file", str(tmp_path / "claims.json"), "--claim-grace-s", "60")
    k = ProofKey()
    victim = kvb.body(keyed(kvb.register_request(small_contract, "victim", "decode"), k))
    squat = kvb.body(keyed(kvb.register_request(small_contract, "squat", "decode"), ProofKey()))
    with httpx.Client(base_url=d.url, trust_env=False) as h:
        v = h.post("/v1/ranks", json=victim)
        assert v.status_code == 201, v.text
    d.restart()
    with httpx.Client(base_url=d.url, trust_env=False) as h:
        r = h.post("/v1/ranks", json=squat)
        assert r.status_code == 409 and r.json()["error"] == "claim_held", r.text
        assert v.json()["rank_id"] in r.json()["holder"] and "lapsed" in r.json()["message"]
        assert h.post("/v1/ranks", json=victim).status_code == 201  # the owner, first try
        assert h.post("/v1/ranks", json=squat).status_code == 409


def test_ranks_and_engine_metadata_held_are_capped_in_all(kvb: Any, small_contract: Any) -> None:
    """Issue 32: 512 registrations of 512 Ki characters of engine_metadata each added +259 MiB to
    the daemon. The daemon now holds at most max_ranks ranks and max_metadata_chars characters of
    engine_metadata, every instance together (429, naming the field); a replacement counts once."""
    from kvbridge.errors import LimitExceeded

    clocks = Clocks()
    reg = Registry(metrics=Metrics(), clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall,
                   max_ranks=3, max_metadata_chars=100_000)
    md = "A" * 40_000
    held = [reg.register(kvb.register_request(small_contract, f"i{i}", "decode").model_copy(
        update={"engine_metadata": md, "session_id": f"127.0.0.1:{47100 + i}"})) for i in range(2)]
    with pytest.raises(LimitExceeded, match="max-metadata-chars") as over:
        reg.register(kvb.register_request(small_contract, "i2", "decode").model_copy(
            update={"engine_metadata": md, "session_id": "127.0.0.1:47102"}))
    assert over.value.field == "engine_metadata"
    # the same rank re-registering (its lease secret) replaces its own metadata: no double count
    again = kvb.register_request(small_contract, "i0", "decode").model_copy(
        update={"engine_metadata": md, "session_id": "127.0.0.1:47100"})
    assert reg.register(again, lease_secret=held[0].lease_secret).replaced == held[0].rank_id
    reg.register(kvb.register_request(small_contract, "i3", "decode").model_copy(update={"session_id": "127.0.0.1:47103"}))
    with pytest.raises(LimitExceeded, match="max-ranks") as many:
        reg.register(kvb.register_request(small_contract, "i4", "decode").model_copy(update={"session_id": "127.0.0.1:47104"}))
    assert many.value.field == "rank"
