"""``run_chaos``: start the chaos cluster, run every fault in turn with traffic, stop
everything, and return the report (see the package docstring)."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbridge.chaos.cluster import ChaosCluster
from kvbridge.chaos.faults import Fault, inject
from kvbridge.chaos.names import ALL_FAULTS, FAULTS, STORE_FAULTS
from kvbridge.chaos.store_faults import inject_store_fault
from kvbridge.chaos.traffic import Traffic

__all__ = ["ChaosSpec", "run_chaos", "format_report"]


@dataclass(frozen=True)
class ChaosSpec:
    faults: tuple[str, ...] = FAULTS
    cp: int = 2
    layers: int = 2
    tokens: int = 16384  # a room: 16K tokens x (2 layers target + index, 1 draft) = 36 MB per decode rank
    chunk_tokens: int = 4096
    concurrency: int = 3
    lease_ttl: float = 1.0
    peer_timeout: float = 2.0
    stop_s: float = 4.0  # SIGSTOP: longer than a lease, and than peer_timeout + a lease check
    failed_writes: int = 4  # engine errors: writes failed per SIGUSR1
    recovery_rooms: int = 3
    settle_s: float = 30.0  # rooms hit by a fault must end within this
    recovery_timeout: float = 20.0
    warmup_timeout: float = 60.0  # the fresh cluster must serve one whole batch within this, before any fault
    transfer_timeout: float = 20.0
    workdir: str | None = None  # keep the processes' logs here
    engine: str = "mooncake"  # the workers' transfer engine: a "network" engine of the registry

    @classmethod
    def quick(cls, **kw: Any) -> ChaosSpec:
        return cls(**({"tokens": 8192, "concurrency": 2, "recovery_rooms": 2, "transfer_timeout": 8.0,
                       "settle_s": 15.0} | kw))

    @property
    def pages(self) -> int:
        per_room = -(-self.tokens // 64)
        return per_room * (self.concurrency + self.recovery_rooms) * 2 + 64  # failed rooms hold theirs a while


def run_chaos(spec: ChaosSpec, progress: Any = None) -> dict[str, Any]:
    unknown = [f for f in spec.faults if f not in ALL_FAULTS]
    if unknown:
        from kvbridge.errors import ConfigError

        raise ConfigError(f"unknown fault(s) {unknown}; faults are {list(ALL_FAULTS)}", field="faults")
    store_mode = any(f in STORE_FAULTS for f in spec.faults)  # three daemon replicas on a three-member etcd
    t0 = time.monotonic()
    tmp = None if spec.workdir else tempfile.TemporaryDirectory(prefix="kvbridge-chaos-")
    workdir = Path(spec.workdir or tmp.name)  # type: ignore[union-attr]
    cluster = ChaosCluster(workdir, cp=spec.cp, layers=spec.layers, pages=spec.pages, lease_ttl=spec.lease_ttl,
                           peer_timeout=spec.peer_timeout, transfer_timeout=spec.transfer_timeout,
                           failed_writes=spec.failed_writes, replicas=3 if store_mode else 0, engine=spec.engine)
    results = []
    try:
        cluster.start()
        traffic = Traffic(cluster, spec.tokens, spec.chunk_tokens, spec.concurrency)
        warm_ok, warm_failures = warm_up(traffic, spec.recovery_rooms, spec.warmup_timeout)
        for name in spec.faults:
            injector = inject_store_fault if name in STORE_FAULTS else (
                lambda c, t, n, **kw: inject(c, t, Fault(n), **kw))
            res = injector(cluster, traffic, name, stop_s=spec.stop_s, recovery_rooms=spec.recovery_rooms,
                           settle_s=spec.settle_s, recovery_timeout=spec.recovery_timeout)
            results.append(res)
            if progress is not None:
                progress(res)
    finally:
        exit_codes = cluster.close()
        exit_problems = cluster.exit_problems(exit_codes)
        if tmp is not None:
            tmp.cleanup()
    in_flight = any(r.writes_in_flight_at_fault > 0 for r in results)
    problems = [f"{r.fault}: {p}" for r in results for p in r.problems]
    if not warm_ok:
        problems.insert(0, f"no batch of {spec.recovery_rooms} rooms served within {spec.warmup_timeout:.0f}s "
                           f"before any fault was injected: {warm_failures[-3:]}")
    problems += exit_problems
    if results and not in_flight and not all(r.fault in STORE_FAULTS for r in results):
        problems.append("no fault hit a moment with writes in flight")
    return {
        "ok": not problems,
        "faults": [r.as_dict() for r in results],
        "problems": problems,
        "writes_in_flight_hit": in_flight,
        "warmup_failures": warm_failures,
        "rooms": len(traffic.rooms) if results else 0,
        "late_writes": sum(r.late_writes for r in results),
        "rooms_lost": sum(r.rooms_lost for r in results),
        "store": "etcd (3 members), 3 daemon replicas" if store_mode else "memory",
        "exit_codes": exit_codes,
        "seconds": round(time.monotonic() - t0, 1),
        "spec": asdict(spec),
    }


def warm_up(traffic: Traffic, n: int, timeout: float) -> tuple[bool, list[str]]:
    """Batches of ``n`` rooms until one is served whole (the cluster is up), or ``timeout``; returns
    whether one was, and every failure seen on the way as ``room N: member: reason``. A freshly
    started rank on a loaded machine can be silent past the decode rank's peer timeout on its
    first room (its start-up and first contact compete for the CPU): that room fails, correctly,
    and says so; it is not a fault's doing, so the run is judged from the first whole batch."""
    deadline = time.monotonic() + timeout
    failures: list[str] = []
    while True:
        rooms = traffic.batch(n, max(1.0, deadline - time.monotonic()))
        failures += [f"room {r.room}: {name}: {reason}" for r in rooms for name, _, reason in r.failures]
        failures += [f"room {r.room}: {name}: no answer" for r in rooms for name in r.waiting]
        if all(r.ok for r in rooms):
            return True, failures
        if time.monotonic() >= deadline:
            return False, failures
        time.sleep(0.2)


def format_report(report: dict[str, Any]) -> str:
    head = ("fault", "affected", "to Failed s", "names rank", "after recovery", "late writes", "in flight", "ok")
    rows = [head]
    for f in report["faults"]:
        to_failed = "-" if f["seconds_to_failed"] is None else f"{f['seconds_to_failed']:.2f}"
        names = "-" if f["reason_names_rank"] is None else ("yes" if f["reason_names_rank"] else "NO")
        rows.append((f["fault"], str(f["rooms_affected"]), to_failed, names,
                     f"{f['rooms_after_recovery']}/{f['recovery_rooms']}", str(f["late_writes"]),
                     str(f["writes_in_flight_at_fault"]), "ok" if f["ok"] else "MISBEHAVED"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("")
    lines.append(f"{report['rooms']} rooms, {report['late_writes']} late writes, {report['seconds']}s: "
                 + ("every fault behaved" if report["ok"] else f"{len(report['problems'])} problem(s)"))
    lines += [f"  - {p}" for p in report["problems"]]
    return "\n".join(lines)
