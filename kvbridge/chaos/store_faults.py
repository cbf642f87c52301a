"""Faults of the store mode, injected during traffic (three daemon replicas on a
three-member etcd cluster), reported like the others (``FaultResult``).

    fault                  how                                          recovery
    replica SIGKILL        kill -9 the replica the workers ask first    restart it on its port
    etcd member SIGKILL    kill -9 one etcd member (quorum kept)        restart it on its data
    etcd quorum loss       kill -9 two of three members for ``stop_s``  restart both

Goals: 0 rooms lost (no worker dies), 0 late writes, every rank registered again and
rooms served after recovery. A replica or a member lost should affect no room at all
(clients fail over, the store retries another member); during a quorum loss new
look-ups answer 503 naming the cause, so rooms that start then may fail, with a
reason that names the bootstrap daemon or its store.
"""

from __future__ import annotations

import time

from kvbridge.chaos.cluster import ChaosCluster
from kvbridge.chaos.faults import FaultResult, recover
from kvbridge.chaos.traffic import Traffic

__all__ = ["inject_store_fault"]

_STORE_WORDS = ("bootstrap", "etcd", "store", "quorum")


def inject_store_fault(cluster: ChaosCluster, traffic: Traffic, name: str, *, stop_s: float, recovery_rooms: int,
                       settle_s: float, recovery_timeout: float) -> FaultResult:
    if cluster.etcd is None or not cluster.replicas:
        raise RuntimeError(f"fault {name!r} needs the store mode (replicas on etcd)")
    t_start = time.monotonic()
    target = {"replica SIGKILL": cluster.replicas[0].name, "etcd member SIGKILL": "etcd m0",
              "etcd quorum loss": "etcd m1+m2"}[name]
    result = FaultResult(name, target, recovery_rooms=recovery_rooms)
    before = cluster.resources()
    late_before = int(cluster.stats(cluster.decode[0]).get("late_writes", 0))
    traffic.flowing = True
    traffic.pump(0.3)
    first_room = max(traffic.rooms, default=0)
    open_at_fault = {r.room for r in traffic.open_rooms()}
    t_fault = time.monotonic()

    if name == "replica SIGKILL":
        m = cluster.replicas[0]
        m.proc.popen.kill()  # type: ignore[union-attr]
        cluster.wait_exit(m, 20.0)
        traffic.pump(stop_s)
        cluster.restart(m)
    elif name == "etcd member SIGKILL":
        cluster.etcd.kill(0)
        traffic.pump(stop_s)
        cluster.etcd.restart(0)
        cluster.etcd.wait_healthy([0])
    else:
        cluster.etcd.kill(1)
        cluster.etcd.kill(2)
        traffic.pump(stop_s)
        cluster.etcd.restart(1)
        cluster.etcd.restart(2)
        cluster.etcd.wait_healthy([0, 1, 2])
    traffic.flowing = False
    hung = traffic.settle(settle_s)
    result.rooms_hung = len(hung)
    if hung:
        result.problems.append(f"{len(hung)} room(s) never ended: {[r.room for r in hung][:5]}")
        for r in hung:
            for member in list(r.waiting):
                r.results[member] = (time.monotonic(), None)
            r.waiting.clear()

    hit = [r for n, r in traffic.rooms.items() if (n in open_at_fault or n > first_room) and not r.ok]
    result.rooms_affected = len(hit)
    result.rooms_lost = sum(len(r.lost) for r in hit)
    times = [t for r in hit for _, t, _ in r.failures]
    result.seconds_to_failed = round(max(times) - t_fault, 3) if times else None
    reasons = sorted({reason for r in hit for _, _, reason in r.failures})
    result.reasons = reasons[:4]
    if reasons:
        result.reason_names_rank = all(any(w in x.lower() for w in _STORE_WORDS) for x in reasons)
        if not result.reason_names_rank:
            bad = next(x for x in reasons if not any(w in x.lower() for w in _STORE_WORDS))
            result.problems.append(f"a failure reason does not name the daemon or its store: {bad[:200]}")
    if result.rooms_lost:
        result.problems.append(f"{result.rooms_lost} room part(s) lost")
    if name != "etcd quorum loss" and result.rooms_affected:
        result.problems.append(f"{result.rooms_affected} room(s) failed although the cluster kept serving")

    recover(result, cluster, traffic, recovery_rooms, recovery_timeout, time.monotonic())
    result.late_writes = int(cluster.stats(cluster.decode[0]).get("late_writes", 0)) - late_before
    if result.late_writes:
        result.problems.append(f"{result.late_writes} page(s) written after decode released them (hard rule 6)")
    after = cluster.resources()
    result.resources = {n: {"before": before.get(n), "after": after.get(n)} for n in sorted({*before, *after})}
    result.seconds = round(time.monotonic() - t_start, 2)
    return result
