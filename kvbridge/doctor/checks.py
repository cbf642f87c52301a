"""The bootstrap hops of ``kvbridge doctor``: the daemon, its tokens, the instances, their
contracts, leases and clocks. Each check returns ``Check`` rows; none raises."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.diff import diff_contracts
from kvbridge.bootstrap.schemas import InstanceFingerprint, InstanceView
from kvbridge.errors import KVBridgeError

__all__ = ["Check", "OK", "FAIL", "SKIP", "bootstrap_checks", "instance_checks", "contract_check", "lease_checks"]

OK, FAIL, SKIP = "ok", "FAIL", "skip"


@dataclass
class Check:
    """One hop a room needs, as seen from here."""

    hop: str  # bootstrap, token, instance, contract, lease, clock, control, engine
    target: str  # what was checked: a URL, an instance, a rank label
    status: str  # OK / FAIL / SKIP
    detail: str
    fix: str = ""  # what to do when it failed
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status != FAIL

    def as_dict(self) -> dict[str, Any]:
        out = {"hop": self.hop, "target": self.target, "status": self.status, "ok": self.ok, "detail": self.detail,
               "fix": self.fix, "seconds": round(self.seconds, 4)}
        return out | ({"data": self.data} if self.data else {})


def bootstrap_checks(url: str, token: str | None, timeout: float, max_skew_s: float) -> tuple[list[Check], bool]:
    """The daemon answers, our clock agrees with its clock, and it accepts our token for reads
    and writes. Returns the rows and whether reads work (the later checks need them)."""
    out: list[Check] = []
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url, timeout=timeout, trust_env=False, headers=headers) as http:
        t0 = time.time()
        try:
            health = http.get("/healthz")
            health.raise_for_status()
            body = health.json()
        except (httpx.HTTPError, ValueError) as exc:
            out.append(Check("bootstrap", url, FAIL, f"daemon not answering: {exc!r}"[:300],
                             "start `kvbridge bootstrap`, or fix --bootstrap / KVBRIDGE_BOOTSTRAP and the network path"))
            return out, False
        t1 = time.time()
        out.append(Check("bootstrap", url, OK, f"kvbridge {body.get('version')}, {body.get('ranks')} rank(s) in "
                         f"{body.get('instances')} instance(s), answered in {1000 * (t1 - t0):.1f} ms", seconds=t1 - t0))
        out.append(_clock(url, body, t0, t1, max_skew_s))
        store = body.get("store")
        if isinstance(store, dict) and store.get("kind") == "etcd":
            out.append(Check("store", url, OK if store.get("ok") else FAIL,
                             f"etcd store {'available' if store.get('ok') else 'UNAVAILABLE: ' + str(store.get('cause'))}"
                             f" ({len(store.get('replicas', []))} replica(s) known)"[:300],
                             "" if store.get("ok") else "bring the etcd members back until a quorum answers"))
        reads = _token_check(http, "GET", "/v1/instances", None, "read", token)
        writes = _token_check(http, "POST", "/v1/lookup", {}, "write", token)  # {} is invalid: nothing changes
        out += [reads, writes]
    return out, reads.status == OK


def _clock(url: str, health: dict[str, Any], t0: float, t1: float, max_skew_s: float) -> Check:
    daemon = health.get("time")
    if not isinstance(daemon, (int, float)):
        return Check("clock", url, SKIP, "this daemon does not report its time (older than doctor)")
    skew = float(daemon) - (t0 + t1) / 2
    detail = f"daemon clock {skew:+.3f}s from this host's (round trip {1000 * (t1 - t0):.1f} ms)"
    if abs(skew) > max_skew_s:
        return Check("clock", url, FAIL, detail, f"synchronise clocks (NTP/chrony); leases use the daemon's monotonic "
                     f"clock, but logs, refusal times and deadlines compare wall clocks (limit {max_skew_s:g}s)",
                     data={"skew_s": skew})
    return Check("clock", url, OK, detail, data={"skew_s": skew})


def _token_check(http: httpx.Client, method: str, path: str, body: Any, what: str, token: str | None) -> Check:
    t0 = time.monotonic()
    try:
        r = http.request(method, path, json=body)
    except httpx.HTTPError as exc:
        return Check("token", f"{what}s", FAIL, f"{method} {path}: {exc!r}"[:300], "check the daemon and the network")
    seconds = time.monotonic() - t0
    if r.status_code == 401:
        given = "no token given" if not token else "the token given was refused"
        return Check("token", f"{what}s", FAIL, f"{method} {path}: 401, {given}", seconds=seconds,
                     fix=f"pass the daemon's {what} token: --token or KVBRIDGE_BOOTSTRAP_TOKEN"
                     + (" (or the read/admin token for reads)" if what == "read" else ""))
    return Check("token", f"{what}s", OK, f"{method} {path} accepted ({'token' if token else 'no token needed'})",
                 seconds=seconds)


def instance_checks(client: BootstrapClient, name: str, role: str) -> tuple[Check, InstanceView | None]:
    t0 = time.monotonic()
    try:
        view = client.instance(name)
    except KVBridgeError as exc:
        return Check("instance", name, FAIL, f"not registered: {exc}"[:300],
                     f"start the {role} instance's ranks (or check the instance name)"), None
    seconds = time.monotonic() - t0
    if view.role != role:
        return Check("instance", name, FAIL, f"is a {view.role} instance, not {role}", "swap --prefill and --decode",
                     seconds=seconds), view
    if not view.complete:
        have = {(r.dp_rank, r.cp_rank, r.tp_rank, r.pp_rank) for r in view.ranks}
        t = view.topology
        missing = [f"{name}/dp{d}/cp{c}/tp{k}/pp{p}" for d in range(t.dp_size) for c in range(t.cp_size)
                   for k in range(t.tp_size) for p in range(t.pp_size) if (d, c, k, p) not in have]
        return Check("instance", name, FAIL, f"{view.num_ranks}/{view.expected_ranks} ranks registered; missing "
                     f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}", "start the missing ranks",
                     seconds=seconds, data={"missing": missing}), view
    return Check("instance", name, OK, f"{role}, {view.topology.shape}, all {view.num_ranks} ranks registered",
                 seconds=seconds), view


def contract_check(fingerprints: list[InstanceFingerprint], prefill: str, decode: str) -> Check:
    by_name = {f.instance: f for f in fingerprints}
    p, d = by_name.get(prefill), by_name.get(decode)
    target = f"{prefill} vs {decode}"
    if p is None or d is None:
        return Check("contract", target, SKIP, "an instance is not registered (see above)")
    if p.fingerprint == d.fingerprint:
        return Check("contract", target, OK, f"equal ({p.fingerprint[:23]}...)")
    diff = diff_contracts(p.contract, d.contract)
    fields = "; ".join(f"{x.path}: prefill {x.prefill!r} / decode {x.decode!r}" for x in diff[:6])
    return Check("contract", target, FAIL, f"{len(diff)} field(s) differ: {fields}"[:600],
                 "run both instances with the same model, geometry and kvbridge version "
                 "(`kvbridge contract diff` shows what each field breaks)",
                 data={"diff": [x.model_dump(mode="json") for x in diff]})


def lease_checks(view: InstanceView) -> list[Check]:
    """A rank heartbeats every third of its lease: less than a third left means two missed beats."""
    out = []
    for r in view.ranks:
        label = f"{view.name}/dp{r.dp_rank}/cp{r.cp_rank}/tp{r.tp_rank}/pp{r.pp_rank}"
        detail = f"{r.lease_remaining_s:.1f}s of {r.lease_ttl_s:.1f}s left"
        if r.lease_remaining_s < r.lease_ttl_s / 3:
            out.append(Check("lease", label, FAIL, detail + ": heartbeats are late", "the rank is stalled or cannot "
                             "reach the daemon: check its process and its log", data={"rank_id": r.rank_id}))
        else:
            out.append(Check("lease", label, OK, detail))
    return out
