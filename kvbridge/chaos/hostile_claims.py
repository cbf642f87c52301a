"""The hostile checks on claims and the daemon's caps (issue 32), over the running chaos cluster:

- ``lease_squat``: the decode worker is stopped (SIGSTOP) past its lease; a write-token holder
  registers its exact session (with the victim's pools and scratch, its own proof key, and again
  naming the victim's public key) while it is stopped; then it resumes. Defended when no squat is
  accepted, the victim re-registers (its lapsed claim is its key's) and a real room succeeds.
- ``nixl_metadata``: a real NIXL engine in this process registers as a victim decode rank; the
  attacker registers renamed copies of its metadata (the agent name changed in the envelope and
  in NIXL's serialisation). Defended when every copy is refused (the UCX worker address is the
  victim's claim) and the victim's own re-registration is not.
- ``metadata_flood``: new instances, each with the largest ``engine_metadata`` a registration may
  carry, until the daemon refuses (429); defended when what it holds stays within its cap, its
  RSS grows at most the cap's worth plus a slack, and a real room succeeds afterwards.

Each reports bytes written into memory the attacker does not own (0 when nothing it registered
was accepted: no room is asked for), the daemon's or the victim's RSS, and whether a legitimate
rank still got in.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from typing import Any

import httpx
import msgspec

from kvbridge.bootstrap.reach import nixl_worker_addresses
from kvbridge.bootstrap.schemas import ENGINE_METADATA_MAX
from kvbridge.chaos.hostile_identity import contract_of, victim_of
from kvbridge.transfer.ownership import ProofKey

__all__ = ["lease_squat", "metadata_flood", "nixl_metadata"]

DEFENDED, VULNERABLE = "defended", "vulnerable"
METADATA_SLACK_MIB = 32.0  # the daemon's own allocations around what it holds


def _post(h: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{h.c.url}/v1/ranks", json=body, headers=h.auth, timeout=10.0, trust_env=False)


def _drop(h: Any, reg: dict[str, Any]) -> None:
    httpx.delete(f"{h.c.url}/v1/ranks/{reg['rank_id']}", timeout=5.0, trust_env=False,
                 headers={**h.auth, "X-KVBridge-Lease": reg.get("lease_secret", "")})


def lease_squat(h: Any, out: Any) -> None:
    victim_m, victim, victim_id = victim_of(h)
    out.target = victim_m.name
    out.rss_before_mib = h.rss(victim_m)
    contract = contract_of(h)
    lease = float(victim.get("lease_ttl_s") or 2.0)
    body = {"control_endpoint": "tcp://127.0.0.1:9", "session_id": victim["session_id"], "pools": victim["pools"],
            "aux": victim["aux"], "aux_regions": victim["aux_regions"], "contract": contract, "lease_ttl_s": 60.0,
            "scratch": victim["scratch"]}
    if victim.get("engine_metadata"):  # (NIXL: what the engine reaches, copied whole)
        body["engine_metadata"] = victim["engine_metadata"]
    statuses: dict[str, int] = {}
    accepted: list[dict[str, Any]] = []
    os.kill(victim_m.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + lease + 6.0
        while h.get(f"/v1/ranks/{victim_id}").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        lapsed = h.get(f"/v1/ranks/{victim_id}").status_code == 404
        for i, (name, key) in enumerate((("own key", ProofKey().public_hex), ("victim's key", victim["proof_key"]),
                                         ("no key", None))):
            squat = {**body, "rank": {"instance": f"hostile-squat-{i}", "role": "decode"}}
            if key is not None:
                squat["proof_key"] = key
            r = _post(h, squat)
            statuses[name] = r.status_code
            if r.status_code == 201:
                accepted.append(r.json())
    finally:
        os.kill(victim_m.pid, signal.SIGCONT)  # type: ignore[arg-type]
        for reg in accepted:
            _drop(h, reg)
    ok, seconds, why = h.room_within(20.0)
    out.rss_after_mib = h.rss(victim_m)
    out.details = {"victim_lapsed_while_stopped": lapsed, "squat_statuses": statuses, "squats_accepted": len(accepted),
                   "legit_room_ok": ok, "legit_room_seconds": seconds, "legit_room_failure": why}
    out.outcome = DEFENDED if lapsed and not accepted and ok else VULNERABLE


def _renamed(metadata: str, agent: str) -> str:
    info = msgspec.msgpack.decode(base64.b64decode(metadata))
    old, _ = nixl_worker_addresses(info["md"])
    head = b"nixlSerDes|Agent" + len(old.encode()).to_bytes(8, "little") + old.encode() + b"|"
    md = b"nixlSerDes|Agent" + len(agent.encode()).to_bytes(8, "little") + agent.encode() + b"|" + info["md"][len(head):]
    return base64.b64encode(msgspec.msgpack.encode({**info, "agent": agent, "md": md})).decode()


def nixl_metadata(h: Any, out: Any) -> None:
    import numpy as np

    from kvbridge.transfer.engine import create_engine

    out.target = "bootstrap"
    out.rss_before_mib = h.rss(h.c.daemon)
    contract = contract_of(h)
    engine = create_engine("nixl")
    buf = np.zeros(1 << 20, np.uint8)
    regs: list[dict[str, Any]] = []
    statuses: dict[str, int] = {}
    try:
        engine.register(buf.ctypes.data, buf.nbytes)
        metadata = base64.b64encode(engine.metadata).decode()
        shape = victim_of(h)[1]
        base = {"control_endpoint": "tcp://127.0.0.1:9", "pools": shape["pools"], "aux": shape["aux"],
                "aux_regions": shape["aux_regions"], "contract": contract, "lease_ttl_s": 60.0}
        victim = _post(h, {**base, "rank": {"instance": "hostile-nixl-victim", "role": "decode"},
                           "session_id": engine.session_id, "engine_metadata": metadata})
        statuses["victim"] = victim.status_code
        if victim.status_code == 201:
            regs.append(victim.json())
        for i, agent in enumerate(("attacker", engine.session_id[5:] + "x", "kvb-127.0.0.1-1-000000000000")):
            r = _post(h, {**base, "rank": {"instance": f"hostile-nixl-{i}", "role": "decode"},
                          "session_id": f"nixl:{agent}", "engine_metadata": _renamed(metadata, agent)})
            statuses[f"renamed as {agent}"] = r.status_code
            if r.status_code == 201:
                regs.append(r.json())
    finally:
        for reg in regs:
            _drop(h, reg)
        engine.close()
    forged = [k for k, v in statuses.items() if k != "victim" and v == 201]
    ok, seconds, why = h.room_ok()
    out.rss_after_mib = h.rss(h.c.daemon)
    out.details = {"statuses": statuses, "forgeries_accepted": forged, "legit_room_ok": ok, "legit_room_seconds": seconds,
                   "legit_room_failure": why}
    out.outcome = DEFENDED if statuses.get("victim") == 201 and not forged and ok else VULNERABLE


def metadata_flood(h: Any, out: Any) -> None:
    out.target = "bootstrap"
    before = out.rss_before_mib = h.rss(h.c.daemon)
    contract = contract_of(h)
    shape = victim_of(h)[1]
    metadata = "A" * ENGINE_METADATA_MAX
    regs: list[dict[str, Any]] = []
    statuses: dict[str, int] = {}
    peak = before or 0.0
    try:
        for i in range(h.spec.metadata_registrations):
            r = _post(h, {"rank": {"instance": f"hostile-md-{i}", "role": "decode"},
                          "control_endpoint": "tcp://127.0.0.1:9", "session_id": f"127.0.0.1:{30000 + i}",
                          "pools": shape["pools"], "aux": shape["aux"], "aux_regions": shape["aux_regions"],
                          "contract": contract, "lease_ttl_s": 300.0, "engine_metadata": metadata})
            key = str(r.status_code) if r.status_code < 300 else f"{r.status_code} {r.json().get('error')}"
            statuses[key] = statuses.get(key, 0) + 1
            if r.status_code == 201:
                regs.append(r.json())
            elif r.status_code == 429:
                break
        peak = max(peak, h.rss(h.c.daemon) or 0.0)
    finally:
        for reg in regs:
            _drop(h, reg)
    held_mib = len(regs) * ENGINE_METADATA_MAX / (1 << 20)
    ok, seconds, why = h.room_ok()
    out.rss_after_mib = h.rss(h.c.daemon)
    growth = round(peak - (before or 0.0), 1)
    cap_mib = float(h.spec.max_metadata_mi)  # the daemon's --max-metadata-chars (Mi characters: MiB held)
    bound = cap_mib + METADATA_SLACK_MIB  # the cap and the daemon's own slack
    out.details = {"statuses": statuses, "accepted": len(regs), "metadata_held_mib": round(held_mib, 1),
                   "rss_peak_mib": peak, "rss_growth_mib": growth, "rss_bound_mib": bound, "cap_mib": cap_mib, "legit_room_ok": ok,
                   "legit_room_seconds": seconds, "legit_room_failure": why}
    capped = any(k.startswith("429") for k in statuses)
    out.outcome = DEFENDED if capped and growth <= bound and ok else VULNERABLE
