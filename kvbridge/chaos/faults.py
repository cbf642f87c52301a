"""One fault, injected during traffic, and what came of it.

    fault                          how                                   recovery
    <target> SIGKILL               kill -9                                 restart (same command line, lease file)
    <target> SIGSTOP               stop for longer than a lease, then CONT  none: it resumes
    <target> SIGTERM               graceful drain and exit                  restart
    engine errors                  SIGUSR1: a prefill rank's next writes    none
                                   fail inside its transfer engine
    target: prefill rank (the last CP rank), decode rank, bootstrap daemon

Worker faults are aimed at a moment with writes in flight: the prefill rank's SIGKILL by
the rank itself (SIGUSR2 arms its chaos engine to SIGKILL the process right after it posts
its next write), the others once the prefill rank's writes-in-flight gauge reads non-zero.

For each: the rooms it affected (not ok on every rank), how long until they were
Failed, whether every failure reason names the faulty process, the rooms served once
recovered, late writes into released decode pages (poisoned, checked before reuse),
and fds / threads / RSS of every process before and after. A fault *misbehaves*
(``problems``) on a late write, a room that never ends, no recovery, or a reason that
does not name the process at fault.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from kvbridge.chaos.cluster import ChaosCluster, Member
from kvbridge.chaos.names import FAULTS
from kvbridge.chaos.traffic import Room, Traffic

__all__ = ["FAULTS", "Fault", "FaultResult", "inject", "recover"]



@dataclass(frozen=True)
class Fault:
    name: str  # one of FAULTS

    @property
    def target(self) -> str:
        return "prefill" if self.name == "engine errors" else self.name.split()[0]

    @property
    def how(self) -> str:
        return "errors" if self.name == "engine errors" else self.name.split()[1]

    @property
    def hits_writes(self) -> bool:
        """Aimed at a moment with writes in flight (the rank's metrics say so)."""
        return self.target in ("prefill", "decode")


@dataclass
class FaultResult:
    fault: str
    target: str  # the process at fault
    rooms_affected: int = 0
    rooms_lost: int = 0  # parts of rooms that died with a process
    seconds_to_failed: float | None = None
    reason_names_rank: bool | None = None  # None: no room failed
    rooms_after_recovery: int = 0
    recovery_rooms: int = 0
    seconds_to_recover: float | None = None
    late_writes: int = 0
    writes_in_flight_at_fault: int = 0
    rooms_hung: int = 0
    reasons: list[str] = field(default_factory=list)  # a sample, from the processes that were not at fault
    own_reasons: list[str] = field(default_factory=list)  # a sample from the faulty process, if it answered
    resources: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        return d | {"ok": self.ok}


def _member(cluster: ChaosCluster, fault: Fault) -> Member:
    return {"prefill": cluster.prefill[-1], "decode": cluster.decode[0], "daemon": cluster.daemon}[fault.target]


# A prefill room whose decode rank died before it asked cannot know which rank that was:
# "no decode ranks asked for room N within 8.0s" is the whole truth, and is accepted.
NEVER_ASKED = re.compile(r"decode ranks? asked for room")


def _names_target(reason: str, cluster: ChaosCluster, m: Member) -> bool:
    """Does a failure reason name the process at fault? Ranks are named by instance and CP/TP
    rank (``chaos-p/dp0/cp1``, ``chaos-p/cp1``, ``chaos-d/dp0/tp0``), the daemon as the bootstrap."""
    if m.role == "decode" and NEVER_ASKED.search(reason):
        return True
    if m.role == "daemon":
        return "bootstrap" in reason or cluster.url in reason
    endpoint = (m.ready or {}).get("control", "\0")
    if m.role == "prefill":
        cp = cluster.prefill.index(m)
        named = cluster.prefill_instance in reason or endpoint in reason
        return named and re.search(rf"cp{cp}\b|cp rank {cp}\b", reason) is not None
    return cluster.decode_instance in reason


def _wait_for_writes(cluster: ChaosCluster, traffic: Traffic, fault: Fault, timeout: float) -> int:
    """Pump traffic until the target (prefill) or a prefill rank (decode target) has writes in flight."""
    watch = _member(cluster, fault) if fault.target == "prefill" else cluster.prefill[-1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = cluster.scrape(watch)
        inflight = int(samples.get(("kvbridge_worker_writes_in_flight", ()), 0))
        if inflight > 0:
            return inflight
        traffic.pump(0.002)
    return 0


def _kill_at_write(cluster: ChaosCluster, traffic: Traffic, m: Member, timeout: float) -> tuple[int, float]:
    """SIGUSR2 arms the prefill rank's engine (``FaultyEngine.arm_kill``) to SIGKILL its own process
    right after it posts its next write, so the kill lands with writes in flight whatever the host's
    load; traffic flows until the rank is gone. Returns the writes in flight at the kill (as the rank
    logged them just before) and when its exit was seen. Not gone within ``timeout`` (no write was
    posted): it is killed from outside, and 0 writes are reported."""
    from kvbridge.transfer.engine.faulty import killed_with_writes

    cluster.signal(m, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while m.alive and time.monotonic() < deadline:
        traffic.pump(0.005)
    t_seen = time.monotonic()
    if m.alive:
        cluster.signal(m, signal.SIGKILL)
        return 0, t_seen
    assert m.proc is not None
    return killed_with_writes(m.proc.log_path.read_text(errors="replace")), t_seen


def inject(cluster: ChaosCluster, traffic: Traffic, fault: Fault, *, stop_s: float, recovery_rooms: int,
           settle_s: float, recovery_timeout: float) -> FaultResult:
    t_start = time.monotonic()
    m = _member(cluster, fault)
    result = FaultResult(fault.name, m.name if m.role != "daemon" else "bootstrap daemon", recovery_rooms=recovery_rooms)
    before = cluster.resources()
    late_before = int(cluster.stats(cluster.decode[0]).get("late_writes", 0))
    traffic.flowing = True
    traffic.pump(0.3)
    # a prefill rank killed mid-write kills itself at its next post (its engine is chaos's)
    kill_at_write = fault.how == "SIGKILL" and m.role == "prefill" and cluster.kills_at_write
    if fault.hits_writes and not kill_at_write:
        # (found within a few scrapes on an idle host; a loaded one may need many: a miss is reported)
        result.writes_in_flight_at_fault = _wait_for_writes(cluster, traffic, fault, 10.0)
    first_room = max(traffic.rooms, default=0)
    open_at_fault = {r.room for r in traffic.open_rooms()}
    t_fault = time.monotonic()

    if kill_at_write:
        result.writes_in_flight_at_fault, t_fault = _kill_at_write(cluster, traffic, m, 20.0)
        traffic.flowing = False
        if cluster.wait_exit(m, 20.0) is None:
            result.problems.append(f"{m.name} still running 20s after SIGKILL")
        traffic.lose(m)
    elif fault.how == "errors":
        cluster.signal(m, signal.SIGUSR1)  # the next writes of this rank fail in its engine
        traffic.pump(1.0)
    elif fault.how == "SIGSTOP":
        cluster.signal(m, signal.SIGSTOP)
        traffic.flowing = m.role == "daemon"  # rooms through a stopped worker would only wait
        traffic.pump(stop_s)
        cluster.signal(m, signal.SIGCONT)
    else:
        cluster.signal(m, signal.SIGKILL if fault.how == "SIGKILL" else signal.SIGTERM)
        traffic.flowing = m.role == "daemon"  # a daemon outage is felt by rooms that start during it
        code = cluster.wait_exit(m, 20.0)
        if m.role != "daemon":
            traffic.lose(m)
        if code is None:
            result.problems.append(f"{m.name} still running 20s after {fault.how}")
        elif fault.how == "SIGTERM" and code != 0:
            result.problems.append(f"{m.name} exited {code} on SIGTERM (a clean drain exits 0)")
        if m.role == "daemon":
            traffic.pump(1.0)  # rooms that start while no daemon answers
    traffic.flowing = False
    hung = traffic.settle(settle_s)
    result.rooms_hung = len(hung)
    if hung:
        result.problems.append(f"{len(hung)} room(s) never ended: {[r.room for r in hung][:5]}")
        for r in hung:  # not carried into the next fault
            for name in list(r.waiting):
                r.results[name] = (time.monotonic(), None)
            r.waiting.clear()

    if fault.how in ("SIGKILL", "SIGTERM"):
        cluster.restart(m)
    t_recovered = time.monotonic()
    _account(result, cluster, traffic, m, first_room, open_at_fault, t_fault)
    recover(result, cluster, traffic, recovery_rooms, recovery_timeout, t_recovered)

    late_after = int(cluster.stats(cluster.decode[0]).get("late_writes", 0))
    decode_restarted = fault.target == "decode" and fault.how in ("SIGKILL", "SIGTERM")
    result.late_writes = late_after if decode_restarted else late_after - late_before
    if result.late_writes:
        result.problems.append(f"{result.late_writes} page(s) written after decode released them (hard rule 6)")
    after = cluster.resources()
    result.resources = {name: {"before": before.get(name), "after": after.get(name)} for name in sorted({*before, *after})}
    result.seconds = round(time.monotonic() - t_start, 2)
    return result


def _account(result: FaultResult, cluster: ChaosCluster, traffic: Traffic, m: Member, first_room: int,
             open_at_fault: set[int], t_fault: float) -> None:
    """Which rooms the fault hit, how fast they failed, and whether their reasons name it."""
    hit: list[Room] = [r for n, r in traffic.rooms.items() if (n in open_at_fault or n > first_room) and not r.ok]
    result.rooms_affected = len(hit)
    result.rooms_lost = sum(len(r.lost) for r in hit)
    times = [t for r in hit for _, t, _ in r.failures]
    result.seconds_to_failed = round(max(times) - t_fault, 3) if times else None
    # the surviving side's reasons; the faulty process's own (if it answered at all) need not name itself
    reasons = [reason for r in hit for name, _, reason in r.failures if name != m.name]
    result.reasons = sorted(set(reasons))[:4]
    result.own_reasons = sorted({reason for r in hit for name, _, reason in r.failures if name == m.name})[:2]
    if reasons:
        result.reason_names_rank = all(_names_target(x, cluster, m) for x in reasons)
        if not result.reason_names_rank:
            bad = next(x for x in reasons if not _names_target(x, cluster, m))
            result.problems.append(f"a failure reason does not name {result.target}: {bad[:200]}")


def recover(result: FaultResult, cluster: ChaosCluster, traffic: Traffic, n: int, timeout: float,
             t_recovered: float) -> None:
    """Rooms served once the fault is over: batches until one is all ok (or the time is up)."""
    if not cluster.wait_registered(timeout):
        result.problems.append(f"ranks not all registered again within {timeout:.0f}s")
    deadline = time.monotonic() + timeout
    while True:
        rooms = traffic.batch(n, max(1.0, deadline - time.monotonic()))
        result.rooms_after_recovery = sum(r.ok for r in rooms)
        if result.rooms_after_recovery == n or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if result.rooms_after_recovery == n:
        result.seconds_to_recover = round(time.monotonic() - t_recovered, 3)
    else:
        failed = [x for r in rooms for _, _, x in r.failures][:2]
        result.problems.append(f"only {result.rooms_after_recovery}/{n} rooms served after recovery: {failed}")
