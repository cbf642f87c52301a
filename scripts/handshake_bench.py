#!/usr/bin/env python
"""Handshake benchmark of the bootstrap daemon, per store, in one run.

    memory   one daemon, in-memory store (the default)
    etcd1    one daemon replica on a local three-member etcd cluster
    etcd3    three daemon replicas on that cluster (client threads spread over them)

For each: daemon processes on loopback (free ports the kernel picks); registrations
timed from the client threads (``--registrations`` ranks of 8-rank instances, full
contract each), then 64 ranks with the full DeepSeek-V3.2 fp8 contract (61 + 1 layers):

    prefill-bench   dp 2 x cp 4 x tp 4 x pp 1 = 32 ranks   (senders: 4 per DP group)
    decode-bench    dp 2 x cp 2 x tp 8 x pp 1 = 32 ranks

then runs a bounded number of lookups ("handshakes": full decode contract in,
senders + plan out) from several client threads and reports handshakes per
second with p50/p90/p99 latency (and the unloaded latency of one thread). The same run measures GET /healthz with the
same threads as the ceiling of the HTTP stack, and reports the ratio.

    .venv/bin/python scripts/handshake_bench.py [--stores memory,etcd1,etcd3] [--requests 4000] [--threads 8] [--json]

The etcd modes need Debian's etcd-server (scripts/setup.sh installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.contract import RuntimeContract, contract_from_preset
from kvbridge.bootstrap.schemas import RankIdentity, RegisterRequest
from kvbridge.bootstrap.topology import AuxDescriptor, PoolDescriptor
from kvbridge import start_bootstrap
from kvbridge.errors import KVBridgeError

PREFILL = ("prefill-bench", "prefill", (2, 4, 4, 1))
DECODE = ("decode-bench", "decode", (2, 2, 8, 1))


def register_instance(client: BootstrapClient, contract: RuntimeContract, name: str, role: str,
                      sizes: tuple[int, int, int, int]) -> int:
    dp_size, cp_size, tp_size, pp_size = sizes
    count = 0
    for dp in range(dp_size):
        for cp in range(cp_size):
            for tp in range(tp_size):
                base = (1 + count) << 40
                pools = []
                for pool in contract.pools:
                    for layer in pool.layer_ids:
                        pools.append(PoolDescriptor(pool=pool.name, layer_id=layer, base=base, capacity_pages=4096,
                                                    bytes_per_page=pool.bytes_per_page))
                        base += 4096 * pool.bytes_per_page
                rank = RankIdentity(instance=name, role=role, dp_size=dp_size, cp_size=cp_size, tp_size=tp_size,
                                    pp_size=pp_size, dp_rank=dp, cp_rank=cp, tp_rank=tp)
                port = 30000 + count
                client.register(RegisterRequest(
                    rank=rank, control_endpoint=f"tcp://127.0.0.1:{port}", session_id=f"127.0.0.1:{port + 10000}",
                    pools=pools, aux=AuxDescriptor(base=base, capacity_rows=1024, row_bytes=contract.aux.row_bytes),
                    contract=contract, lease_ttl_s=120.0,
                ))
                count += 1
    return count


def drive(url: str | list[str], threads: int, requests: int,
          op: Callable[[BootstrapClient, int], None]) -> tuple[float, list[float]]:
    """Run ``requests`` calls of ``op`` spread over ``threads`` threads; (wall seconds, latencies).
    With several replica URLs, thread i starts at replica i (mod n)."""
    urls = [url] if isinstance(url, str) else url
    latencies: list[list[float]] = [[] for _ in range(threads)]
    per_thread = [requests // threads + (1 if i < requests % threads else 0) for i in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        rng = random.Random(i)
        k = i % len(urls)
        with BootstrapClient(urls[k:] + urls[:k], timeout=10.0) as client:
            op(client, rng.randrange(1 << 62))  # open the connection before timing
            barrier.wait()
            for _ in range(per_thread[i]):
                t0 = time.perf_counter()
                op(client, rng.randrange(1 << 62))
                latencies[i].append(time.perf_counter() - t0)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    return time.perf_counter() - t0, sorted(x for lat in latencies for x in lat)


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def register_many(urls: list[str], contract: RuntimeContract, threads: int, n: int, tag: str) -> tuple[float, list[float]]:
    """``n`` registrations (instances of 8 TP ranks, one instance per 8) from ``threads`` threads."""
    counter = iter(range(n))
    lock = threading.Lock()

    def op(client: BootstrapClient, _room: int) -> None:
        with lock:
            k = next(counter, None)
        if k is None:
            return
        rank = RankIdentity(instance=f"reg-{tag}-{k // 8}", role="prefill", tp_size=8, tp_rank=k % 8)
        client.register(RegisterRequest(rank=rank, control_endpoint=f"tcp://127.0.0.1:{20000 + k}",
                                         session_id=f"127.0.0.1:{40000 + k}", pools=[], contract=contract,
                                         lease_ttl_s=120.0))

    warm = threads  # drive() calls op once per thread untimed: those are registrations too
    wall, lat = drive(urls, threads, n - warm, op)
    return wall, lat


def measure(urls: list[str], contract: RuntimeContract, args: argparse.Namespace, tag: str) -> dict[str, object]:
    decode_rank = RankIdentity(instance=DECODE[0], role="decode", dp_size=2, cp_size=2, tp_size=8)
    reg_wall, reg_lat = register_many(urls, contract, args.threads, args.registrations, tag)
    with BootstrapClient(urls, timeout=10.0) as client:
        ranks = register_instance(client, contract, *PREFILL) + register_instance(client, contract, *DECODE)
        deadline = time.monotonic() + 10
        while True:  # replicas learn of the registrations through their watches
            try:
                probe = client.lookup(PREFILL[0], room=1, contract=contract, rank=decode_rank)
                break
            except KVBridgeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def lookup(c: BootstrapClient, room: int) -> None:
        ans = c.lookup(PREFILL[0], room=room, contract=contract, rank=decode_rank)
        if len(ans.ranks) != 4:
            raise RuntimeError(f"expected 4 senders, got {len(ans.ranks)}")

    _, unloaded_lat = drive(urls, 1, min(500, args.requests), lookup)
    lookup_wall, lookup_lat = drive(urls, args.threads, args.requests, lookup)
    return {
        "replicas": len(urls),
        "ranks_registered": ranks + args.registrations,
        "registrations_per_s": round(len(reg_lat) / reg_wall, 1),
        "register_p50_ms": round(pct(reg_lat, 0.50) * 1e3, 2),
        "register_p99_ms": round(pct(reg_lat, 0.99) * 1e3, 2),
        "lookups": len(lookup_lat),
        "lookup_response_bytes": len(probe.model_dump_json()),
        "handshakes_per_s": round(len(lookup_lat) / lookup_wall, 1),
        "lookup_p50_ms": round(pct(lookup_lat, 0.50) * 1e3, 2),
        "lookup_p99_ms": round(pct(lookup_lat, 0.99) * 1e3, 2),
        "unloaded_lookup_p50_ms": round(pct(unloaded_lat, 0.50) * 1e3, 2),
    }


@contextlib.contextmanager
def daemons(mode: str, etcd_url: str | None) -> Iterator[list[str]]:
    """The daemon URLs of ``mode`` for the ``with`` block (every process stopped after)."""
    with contextlib.ExitStack() as stack:
        if mode == "memory":
            args: tuple[str, ...] = ("--lease-ttl", "120")
            n = 1
        else:
            prefix = f"/bench-{mode}-{random.randrange(1 << 30)}/"
            args = ("--lease-ttl", "120", "--store", str(etcd_url), "--etcd-prefix", prefix)
            n = 3 if mode == "etcd3" else 1
        urls = [stack.enter_context(start_bootstrap(extra_args=(*args, "--replica-name", f"r{i}"), with_token=False))[0]
                for i in range(n)]
        yield urls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default="memory,etcd1,etcd3", help="comma-separated: memory, etcd1, etcd3 (default: all)")
    ap.add_argument("--requests", type=int, default=4000, help="lookups to time per store (default: 4000)")
    ap.add_argument("--registrations", type=int, default=256, help="registrations to time per store (default: 256)")
    ap.add_argument("--threads", type=int, default=8, help="client threads (default: 8)")
    ap.add_argument("--layers", type=int, default=61, help="target layers of the contract (default: 61)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args()
    modes = [m.strip() for m in args.stores.split(",") if m.strip()]
    if args.requests < args.threads or args.threads < 1 or args.registrations <= args.threads:
        ap.error("--requests and --registrations must exceed --threads, which must be positive")
    if set(modes) - {"memory", "etcd1", "etcd3"}:
        ap.error(f"unknown store(s) {sorted(set(modes) - {'memory', 'etcd1', 'etcd3'})}")

    contract = contract_from_preset("deepseek-v3.2-fp8", num_layers=args.layers)
    result: dict[str, object] = {"host": f"{platform.machine()} x{os.cpu_count()} cores, Python {platform.python_version()}",
                                 "threads": args.threads}
    with contextlib.ExitStack() as stack:
        etcd_url = None
        if any(m.startswith("etcd") for m in modes):
            from kvbridge.chaos.etcd import EtcdCluster

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbridge-etcd-"))
            etcd_url = stack.enter_context(EtcdCluster(Path(tmp), members=3)).store_url
        for mode in modes:
            with daemons(mode, etcd_url) as urls:
                result[mode] = measure(urls, contract, args, mode)
    base = result.get("memory")
    if isinstance(base, dict):
        for mode in modes:
            r = result[mode]
            assert isinstance(r, dict)
            r["lookups_vs_memory"] = round(float(r["handshakes_per_s"]) / float(base["handshakes_per_s"]), 3)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvbridge handshake benchmark ({result['host']}, {args.threads} client threads, "
          f"{args.layers}+1 layers V3.2 fp8 contract)")
    head = ("store", "replicas", "reg/s", "reg p50/p99 ms", "lookups/s", "lookup p50/p99 ms", "vs memory")
    rows = [head]
    for mode in modes:
        r = result[mode]
        assert isinstance(r, dict)
        rows.append((mode, str(r["replicas"]), f"{r['registrations_per_s']:,.0f}",
                     f"{r['register_p50_ms']} / {r['register_p99_ms']}", f"{r['handshakes_per_s']:,.0f}",
                     f"{r['lookup_p50_ms']} / {r['lookup_p99_ms']}", str(r.get("lookups_vs_memory", "-"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
