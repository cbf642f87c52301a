"""``kvbridge doctor``: check, from this host, every hop a room between two instances needs,
and say what to fix.

    bootstrap   the daemon answers                      token     it accepts our token (reads, writes)
    clock       its clock agrees with ours               instance  both instances registered, every rank
    contract    their contracts are equal (else the diff)
    lease       every rank's lease is fresh
    control     every prefill sender's control endpoint answers a Ping with our cluster secret
    engine      every rank's transfer-engine session takes a probe write into its scratch region
                and gives it back (probes.py)

``run_doctor`` returns a ``DoctorReport``; the command prints it as a table (or JSON) and
exits 1 when any hop failed. Hops that need an earlier one (the instances need reads)
are skipped, with the reason, when it failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.doctor.checks import FAIL, OK, SKIP, Check, bootstrap_checks, contract_check, instance_checks, lease_checks
from kvbridge.errors import KVBridgeError

__all__ = ["DoctorSpec", "DoctorReport", "Check", "run_doctor", "format_table", "OK", "FAIL", "SKIP"]


@dataclass(frozen=True)
class DoctorSpec:
    bootstrap: str
    prefill: str
    decode: str
    token: str | None = None
    secret: bytes | None = None
    host: str = "127.0.0.1"  # where doctor's own transfer engine listens
    timeout: float = 3.0  # per probe
    max_skew_s: float = 2.0
    engine: bool = True  # probe the transfer-engine sessions (needs Mooncake)


@dataclass
class DoctorReport:
    spec: DoctorSpec
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "bootstrap": self.spec.bootstrap, "prefill": self.spec.prefill, "decode": self.spec.decode,
                "failed": len(self.failed), "seconds": round(self.seconds, 3), "checks": [c.as_dict() for c in self.checks]}


def run_doctor(spec: DoctorSpec) -> DoctorReport:
    t0 = time.monotonic()
    report = DoctorReport(spec)
    rows, reads_ok = [], True
    for url in [u.strip() for u in spec.bootstrap.split(",") if u.strip()]:  # every replica listed
        got, ok = bootstrap_checks(url, spec.token, spec.timeout, spec.max_skew_s)
        rows, reads_ok = rows + got, reads_ok and ok
    report.checks += rows
    if not reads_ok:
        report.checks.append(Check("instance", f"{spec.prefill}, {spec.decode}", SKIP, "needs the daemon and a token "
                                   "it accepts for reads (above)"))
        report.seconds = time.monotonic() - t0
        return report
    with BootstrapClient(spec.bootstrap, token=spec.token, timeout=spec.timeout, retries=1) as client:
        (p_check, prefill), (d_check, decode) = (instance_checks(client, spec.prefill, "prefill"),
                                                 instance_checks(client, spec.decode, "decode"))
        report.checks += [p_check, d_check]
        try:
            report.checks.append(contract_check(client.fingerprints(), spec.prefill, spec.decode))
        except KVBridgeError as exc:
            report.checks.append(Check("contract", f"{spec.prefill} vs {spec.decode}", FAIL, str(exc)[:300],
                                       "check the daemon"))
    views = [v for v in (prefill, decode) if v is not None]
    for view in views:
        report.checks += lease_checks(view)
    report.checks += _data_path(spec, prefill, views, lambda rank_id: _rank_detail(spec, rank_id))
    report.seconds = time.monotonic() - t0
    return report


def _rank_detail(spec: DoctorSpec, rank_id: str) -> Any:
    """A rank's registration (what a NIXL session's probe loads its metadata from)."""
    with BootstrapClient(spec.bootstrap, token=spec.token, timeout=spec.timeout, retries=1) as client:
        return client.rank(rank_id)


def _data_path(spec: DoctorSpec, prefill: Any, views: list[Any], detail: Any) -> list[Check]:
    from kvbridge.doctor.probes import EngineProbe, NixlProbe, control_checks

    out: list[Check] = []
    if prefill is not None:
        senders = [(f"{prefill.name}/dp{r.dp_rank}/cp{r.cp_rank}/tp{r.tp_rank}/pp{r.pp_rank}", r.control_endpoint)
                   for r in prefill.ranks if r.tp_rank == 0]  # tp 0 of each (dp, cp, pp) sends (MLA: replicated)
        out += control_checks(senders, spec.secret, spec.timeout)
    if not spec.engine:
        return out + [Check("engine", "all sessions", SKIP, "--no-engine: transfer-engine sessions not probed")]
    ranks = [(f"{v.name}/dp{r.dp_rank}/cp{r.cp_rank}/tp{r.tp_rank}/pp{r.pp_rank}", r) for v in views for r in v.ranks]
    nixl = [(label, r) for label, r in ranks if r.session_id.startswith("nixl:")]  # NIXL agents' sessions
    mooncake = [(label, r) for label, r in ranks if not r.session_id.startswith("nixl:")]
    for kind, probe_cls, todo, fix in (
            ("Mooncake", EngineProbe, mooncake, "install mooncake-transfer-engine (the cpu or gpu extra)"),
            ("NIXL", NixlProbe, nixl, "install kvbridge[nixl] (scripts/setup.sh)")):
        if not todo:
            continue
        try:
            probe = probe_cls(spec.host)
        except (ImportError, KVBridgeError) as exc:
            out.append(Check("engine", "doctor", FAIL, f"doctor's own {kind} engine did not start: {exc}"[:300],
                             f"{fix}, or pass --no-engine"))
            continue
        try:
            for label, r in todo:
                out.append(probe.check(label, r, spec.timeout) if probe_cls is EngineProbe
                           else probe.check(label, r, detail, spec.timeout))
        finally:
            probe.close()
    return out


def format_table(report: DoctorReport) -> str:
    rows = [("HOP", "TARGET", "STATUS", "DETAIL")] + [(c.hop, c.target, c.status, c.detail) for c in report.checks]
    widths = [min(48, max(len(r[i]) for r in rows)) for i in range(3)]
    lines = ["  ".join(r[i][:48].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    fixes = [f"  - {c.hop} {c.target}: {c.fix}" for c in report.failed if c.fix]
    verdict = (f"all {len(report.checks)} checks passed" if report.ok else
               f"{len(report.failed)} of {len(report.checks)} checks FAILED")
    return "\n".join(lines + ["", f"{verdict} in {report.seconds:.2f}s"] + (["what to fix:", *fixes] if fixes else []))

