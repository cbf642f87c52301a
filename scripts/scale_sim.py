#!/usr/bin/env python
"""Control-plane simulation: many ranks as lightweight clients against the bootstrap daemon.

``--prefill`` + ``--decode`` ranks (1,000 + 1,000 by default; instances of 8 TP ranks)
are coroutines on one event loop: each registers, heartbeats every ``--lease-ttl``/3,
and the decode ranks look up a prefill instance at ``--rooms-per-s`` rooms per second
in all. No KV moves. Per store:

    memory   one daemon, in-memory store
    etcd1    one daemon replica on a local three-member etcd cluster
    etcd3    three replicas on it (each rank starts at replica ``i % 3``)

Reported: registration time, p50/p99 of look-ups and heartbeats over the steady
window, the replicas' request rate to etcd (their own counter, /healthz), and the
re-registration storm after every replica restarts at once (on the same ports): the
time until every rank is back (a heartbeat answered, or registered again where the
daemon forgot it) and the errors the clients saw meanwhile. Clients fail over to the
next replica at once and, after a round of failures, back off ``0.05 s * 2**k``
(up to 2 s) times a random 0.5-1.5, so that the ranks do not come back in step.

    .venv/bin/python scripts/scale_sim.py [--stores memory,etcd1,etcd3] [--prefill 1000 --decode 1000]
        [--rooms-per-s 100] [--lease-ttl 30] [--steady-s 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvbridge.bootstrap.contract import contract_from_preset

TP = 8  # ranks per instance
HOST = "127.0.0.1"


class Daemon:
    """One ``kvbridge bootstrap`` process, restartable on its port."""

    def __init__(self, workdir: Path, name: str, args: list[str]) -> None:
        self.workdir, self.name, self.args = workdir, name, args
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        port_file = self.workdir / f"{self.name}.port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kvbridge.cli.main", "--log-level", "WARNING", "bootstrap", "--host", HOST,
               "--port", str(self.port), "--port-file", str(port_file), "--replica-name", self.name,
               "--max-lookups-per-s", "0", *self.args]
        with open(self.workdir / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}")
            if port_file.exists() and port_file.read_text().strip():
                self.port = int(port_file.read_text())
                try:
                    if httpx.get(f"{self.url}/healthz", timeout=1.0, trust_env=False).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready within {timeout}s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@dataclass
class Stats:
    lookups: list[float] = field(default_factory=list)
    heartbeats: list[float] = field(default_factory=list)
    errors: int = 0
    refused: dict[int, int] = field(default_factory=dict)  # status -> count, answers no retry changes
    reregistrations: int = 0


class Rank:
    def __init__(self, sim: Sim, i: int, role: str) -> None:
        self.sim, self.i, self.role = sim, i, role
        self.instance = f"sim-{role[0]}-{i // TP}"
        self.body = {"rank": {"instance": self.instance, "role": role, "tp_size": TP, "tp_rank": i % TP},
                     "control_endpoint": f"tcp://127.0.0.1:{20000 + i}", "session_id": f"127.0.0.1:{30000 + i}",
                     "pools": [], "contract": sim.contract, "lease_ttl_s": sim.ttl}
        self.rank_id = ""
        self.secret = ""
        self.replica = i  # where this rank starts: replica i % n
        self.busy = False  # one heartbeat (or re-registration) at a time, as a real rank's lease thread

    async def register(self) -> None:
        r = await self.sim.call(self, "POST", "/v1/ranks", json=self.body,
                                headers={"X-KVBridge-Lease": self.secret} if self.secret else None)
        if r is not None:
            answer = r.json()
            self.rank_id, self.secret = answer["rank_id"], answer["lease_secret"]

    async def heartbeat(self) -> None:
        if self.busy or not self.rank_id:
            return
        self.busy = True
        try:
            t0 = time.perf_counter()
            r = await self.sim.call(self, "POST", f"/v1/ranks/{self.rank_id}/heartbeat",
                                    headers={"X-KVBridge-Lease": self.secret}, ok=(200, 404))
            if r is None:
                return
            if r.status_code == 404:  # the daemon forgot this rank (an in-memory daemon restarted)
                self.sim.stats.reregistrations += 1
                await self.register()
            else:
                self.sim.stats.heartbeats.append(time.perf_counter() - t0)
            self.sim.back.add(self.i)
        finally:
            self.busy = False


class Sim:
    def __init__(self, urls: list[str], args: argparse.Namespace) -> None:
        self.urls = urls
        self.ttl = args.lease_ttl
        self.contract = contract_from_preset("deepseek-v3.2-fp8", num_layers=2, page_size=16).model_dump(mode="json")
        self.http = httpx.AsyncClient(timeout=30.0, trust_env=False,
                                      limits=httpx.Limits(max_connections=args.connections))
        self.stats = Stats()
        self.back: set[int] = set()
        self.ranks = [Rank(self, i, "prefill") for i in range(args.prefill)]
        self.ranks += [Rank(self, args.prefill + i, "decode") for i in range(args.decode)]
        self.prefill_instances = sorted({r.instance for r in self.ranks if r.role == "prefill"})
        self.decode_ranks = [r for r in self.ranks if r.role == "decode"]

    async def call(self, rank: Rank, method: str, path: str, *, ok: tuple[int, ...] = (200, 201),
                   **kw: Any) -> httpx.Response | None:
        """Fail over to the next replica at once; after a round of failures, back off with jitter.
        None (counted as an error) for an answer no retry changes (a 4xx other than 409)."""
        n, k = len(self.urls), 0
        while True:
            url = self.urls[rank.replica % n]
            try:
                r = await self.http.request(method, url + path, **kw)
                if r.status_code in ok:
                    return r
                self.stats.errors += 1
                if r.status_code < 500 and r.status_code != 409:
                    self.stats.refused[r.status_code] = self.stats.refused.get(r.status_code, 0) + 1
                    return None
            except httpx.TransportError:
                self.stats.errors += 1
            rank.replica += 1
            k += 1
            if k % n == 0:
                await asyncio.sleep(min(2.0, 0.05 * 2 ** (k // n - 1)) * random.uniform(0.5, 1.5))

    async def lookup(self, rank: Rank, room: int) -> None:
        body = {"prefill_instance": random.choice(self.prefill_instances), "room": room, "contract": self.contract,
                "rank": rank.body["rank"]}
        t0 = time.perf_counter()
        if await self.call(rank, "POST", "/v1/lookup", json=body) is not None:
            self.stats.lookups.append(time.perf_counter() - t0)

    async def heartbeats(self, until: float) -> None:
        """Every rank every ttl/3, spread evenly."""
        period = self.ttl / 3
        gap = period / len(self.ranks)
        tasks: set[asyncio.Task[None]] = set()
        i = 0
        start = time.monotonic()
        try:
            while time.monotonic() < until:
                rank = self.ranks[i % len(self.ranks)]
                t = asyncio.create_task(rank.heartbeat())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
            await asyncio.gather(*tasks)
        finally:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def rooms(self, rate: float, until: float) -> None:
        tasks: set[asyncio.Task[None]] = set()
        start, i = time.monotonic(), 0
        while time.monotonic() < until:
            t = asyncio.create_task(self.lookup(random.choice(self.decode_ranks), i))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))] * 1e3, 2)


def store_requests(urls: list[str]) -> int:
    total = 0
    for u in urls:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            total += int(httpx.get(f"{u}/healthz", timeout=5, trust_env=False).json()["store"]["requests"])
    return total


async def run_mode(daemons: list[Daemon], args: argparse.Namespace) -> dict[str, Any]:
    urls = [d.url for d in daemons]
    sim = Sim(urls, args)
    try:
        t0 = time.monotonic()
        sem = asyncio.Semaphore(args.connections)
        hb = asyncio.create_task(sim.heartbeats(float("inf")))  # from the start: ranks renew while others register

        async def reg(rank: Rank) -> None:
            async with sem:
                await rank.register()

        await asyncio.gather(*(reg(r) for r in sim.ranks))
        register_s = time.monotonic() - t0
        errors_at_start = sim.stats.errors + sum(sim.stats.refused.values())
        sim.stats = Stats()
        req0, w0 = store_requests(urls), time.monotonic()
        await sim.rooms(args.rooms_per_s, time.monotonic() + args.steady_s)
        etcd_rate = (store_requests(urls) - req0) / (time.monotonic() - w0)
        steady = sim.stats

        # the storm: every replica restarts at once; time until every rank is back
        sim.stats, sim.back = Stats(), set()
        loop = asyncio.get_running_loop()
        for d in daemons:
            await loop.run_in_executor(None, d.stop)
        t_down = time.monotonic()
        storm_until = t_down + args.storm_timeout_s
        await loop.run_in_executor(None, lambda: [d.start() for d in daemons])
        t_up = time.monotonic()
        while len(sim.back) < len(sim.ranks) and time.monotonic() < storm_until:
            await asyncio.sleep(0.05)
        back_s = time.monotonic() - t_up
        everyone = len(sim.back) == len(sim.ranks)
        hb.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hb
        return {
            "replicas": len(daemons),
            "ranks": len(sim.ranks),
            "register_all_s": round(register_s, 2),
            "register_errors": errors_at_start,
            "rooms_per_s": args.rooms_per_s,
            "heartbeats_per_s": round(len(sim.ranks) / (args.ttl_hb), 1),
            "lookups": len(steady.lookups),
            "lookup_p50_ms": pct(steady.lookups, 0.5),
            "lookup_p99_ms": pct(steady.lookups, 0.99),
            "heartbeat_p50_ms": pct(steady.heartbeats, 0.5),
            "heartbeat_p99_ms": pct(steady.heartbeats, 0.99),
            "steady_errors": steady.errors,
            "steady_refused": steady.refused,
            "etcd_requests_per_s": round(etcd_rate, 1),
            "storm_restart_s": round(t_up - t_down, 2),
            "storm_all_back_s": round(back_s, 2) if everyone else None,
            "storm_back": len(sim.back),
            "storm_reregistrations": sim.stats.reregistrations,
            "storm_errors": sim.stats.errors,
            "storm_refused": sim.stats.refused,
            "storm_within_2_ttl": everyone and back_s <= 2 * args.lease_ttl,
        }
    finally:
        await sim.http.aclose()


@contextlib.contextmanager
def started(mode: str, etcd_url: str | None, workdir: Path, args: argparse.Namespace) -> Iterator[list[Daemon]]:
    extra = ["--lease-ttl", str(args.lease_ttl)]
    if mode != "memory":
        extra += ["--store", str(etcd_url), "--etcd-prefix", f"/sim-{mode}-{random.randrange(1 << 30)}/"]
    n = 3 if mode == "etcd3" else 1
    ds = [Daemon(workdir, f"{mode}-r{i}", extra) for i in range(n)]
    try:
        for d in ds:
            d.start()
        yield ds
    finally:
        for d in ds:
            d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default="memory,etcd1,etcd3")
    ap.add_argument("--prefill", type=int, default=1000, help="prefill ranks (default: 1000)")
    ap.add_argument("--decode", type=int, default=1000, help="decode ranks (default: 1000)")
    ap.add_argument("--rooms-per-s", type=float, default=100.0, help="look-ups per second, all decode ranks together")
    ap.add_argument("--lease-ttl", type=float, default=30.0, help="every rank's lease; heartbeats every third of it")
    ap.add_argument("--steady-s", type=float, default=20.0, help="seconds of steady traffic measured")
    ap.add_argument("--storm-timeout-s", type=float, default=90.0, help="give up waiting for the ranks after this")
    ap.add_argument("--connections", type=int, default=64, help="HTTP connections of the simulator (all ranks)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.ttl_hb = args.lease_ttl / 3
    modes = [m.strip() for m in args.stores.split(",") if m.strip()]
    if set(modes) - {"memory", "etcd1", "etcd3"} or args.prefill < TP or args.decode < TP:
        ap.error("stores are memory, etcd1, etcd3; at least 8 prefill and 8 decode ranks")
    result: dict[str, Any] = {"host": f"{platform.machine()} x{os.cpu_count()} cores, Python {platform.python_version()}"}
    with tempfile.TemporaryDirectory(prefix="kvbridge-sim-") as tmp, contextlib.ExitStack() as stack:
        etcd_url = None
        if any(m != "memory" for m in modes):
            from kvbridge.chaos.etcd import EtcdCluster

            etcd_url = stack.enter_context(EtcdCluster(Path(tmp) / "etcd", members=3)).store_url
        for mode in modes:
            with started(mode, etcd_url, Path(tmp), args) as ds:
                result[mode] = asyncio.run(run_mode(ds, args))
            if not args.json:
                print(mode, json.dumps(result[mode]), flush=True)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
