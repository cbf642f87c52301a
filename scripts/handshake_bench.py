#!/usr/bin/env python
"""Handshake benchmark of the bootstrap daemon.

Starts a daemon process on loopback (a free port the kernel picks), registers
64 ranks with the full DeepSeek-V3.2 fp8 contract (61 + 1 layers):

    prefill-bench   dp 2 x cp 4 x tp 4 x pp 1 = 32 ranks   (senders: 4 per DP group)
    decode-bench    dp 2 x cp 2 x tp 8 x pp 1 = 32 ranks

then runs a bounded number of lookups ("handshakes": full decode contract in,
senders + plan out) from several client threads and reports handshakes per
second with p50/p90/p99 latency (and the unloaded latency of one thread). The same run measures GET /healthz with the
same threads as the ceiling of the HTTP stack, and reports the ratio.

    .venv/bin/python scripts/handshake_bench.py [--requests 4000] [--threads 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Callable

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.contract import RuntimeContract, contract_from_preset
from kvbridge.bootstrap.schemas import RankIdentity, RegisterRequest
from kvbridge.bootstrap.topology import AuxDescriptor, PoolDescriptor
from kvbridge import start_bootstrap

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


def drive(url: str, threads: int, requests: int, op: Callable[[BootstrapClient, int], None]) -> tuple[float, list[float]]:
    """Run ``requests`` calls of ``op`` spread over ``threads`` threads; (wall seconds, latencies)."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    per_thread = [requests // threads + (1 if i < requests % threads else 0) for i in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        rng = random.Random(i)
        with BootstrapClient(url, timeout=10.0) as client:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000, help="lookups to time (default: 4000)")
    ap.add_argument("--threads", type=int, default=8, help="client threads (default: 8)")
    ap.add_argument("--layers", type=int, default=61, help="target layers of the contract (default: 61)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args()
    if args.requests < args.threads or args.threads < 1:
        ap.error("--requests must be at least --threads, which must be positive")

    contract = contract_from_preset("deepseek-v3.2-fp8", num_layers=args.layers)
    decode_rank = RankIdentity(instance=DECODE[0], role="decode", dp_size=2, cp_size=2, tp_size=8)
    with start_bootstrap(extra_args=("--lease-ttl", "120"), with_token=False) as (url, _token):
        with BootstrapClient(url, timeout=10.0) as client:
            t0 = time.perf_counter()
            ranks = register_instance(client, contract, *PREFILL) + register_instance(client, contract, *DECODE)
            register_s = time.perf_counter() - t0
            probe = client.lookup(PREFILL[0], room=1, contract=contract, rank=decode_rank)
        request_bytes = len(json.dumps({"prefill_instance": PREFILL[0], "room": 1, "contract": contract.model_dump(mode="json"),
                                        "rank": decode_rank.model_dump()}))
        response_bytes = len(probe.model_dump_json())

        def lookup(c: BootstrapClient, room: int) -> None:
            ans = c.lookup(PREFILL[0], room=room, contract=contract, rank=decode_rank)
            if len(ans.ranks) != 4:
                raise RuntimeError(f"expected 4 senders, got {len(ans.ranks)}")

        _, unloaded_lat = drive(url, 1, min(500, args.requests), lookup)
        lookup_wall, lookup_lat = drive(url, args.threads, args.requests, lookup)
        health_wall, health_lat = drive(url, args.threads, args.requests, lambda c, _room: c.health() and None)

    lookups_per_s = len(lookup_lat) / lookup_wall
    health_per_s = len(health_lat) / health_wall
    result = {
        "host": f"{platform.machine()} x{os.cpu_count()} cores, Python {platform.python_version()}",
        "ranks_registered": ranks,
        "register_s": round(register_s, 3),
        "threads": args.threads,
        "lookups": len(lookup_lat),
        "lookup_request_bytes": request_bytes,
        "lookup_response_bytes": response_bytes,
        "handshakes_per_s": round(lookups_per_s, 1),
        "lookup_p50_ms": round(pct(lookup_lat, 0.50) * 1e3, 2),
        "lookup_p90_ms": round(pct(lookup_lat, 0.90) * 1e3, 2),
        "lookup_p99_ms": round(pct(lookup_lat, 0.99) * 1e3, 2),
        "lookup_max_ms": round(lookup_lat[-1] * 1e3, 2),
        "unloaded_lookup_p50_ms": round(pct(unloaded_lat, 0.50) * 1e3, 2),
        "unloaded_lookup_p99_ms": round(pct(unloaded_lat, 0.99) * 1e3, 2),
        "healthz_per_s": round(health_per_s, 1),
        "healthz_p50_ms": round(pct(health_lat, 0.50) * 1e3, 2),
        "handshakes_vs_healthz": round(lookups_per_s / health_per_s, 3),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"kvbridge handshake benchmark ({result['host']})")
        print(f"  registered {ranks} ranks in {register_s:.2f} s ({PREFILL[0]} dp2 x cp4 x tp4, {DECODE[0]} dp2 x cp2 x tp8; "
              f"{args.layers}+1 layers, V3.2 fp8)")
        print(f"  lookup: request {request_bytes} B, response {response_bytes} B (4 senders x {len(probe.ranks[0].pools)} pool descriptors)")
        print(f"  {len(lookup_lat)} lookups, {args.threads} threads: {lookups_per_s:,.0f} handshakes/s, "
              f"p50 {result['lookup_p50_ms']} ms, p90 {result['lookup_p90_ms']} ms, p99 {result['lookup_p99_ms']} ms, "
              f"max {result['lookup_max_ms']} ms")
        print(f"  unloaded (1 thread, {len(unloaded_lat)} lookups): p50 {result['unloaded_lookup_p50_ms']} ms, "
              f"p99 {result['unloaded_lookup_p99_ms']} ms")
        print(f"  ceiling (GET /healthz, same threads): {health_per_s:,.0f} req/s, p50 {result['healthz_p50_ms']} ms; "
              f"handshakes reach {result['handshakes_vs_healthz']:.0%} of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
