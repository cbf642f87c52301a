#!/usr/bin/env python
"""Raw Mooncake loopback throughput between two processes, and the cost of a call.

This process writes; a child process (this script with --serve) owns the
destination buffer. Both run Mooncake TCP bound to 127.0.0.1. For each slice
size, the same bytes move two ways:

    raw      the Python binding directly: batch_transfer_sync_write, <= --cap slices a call
    kvbridge create_engine("mooncake"): submit_write + wait (queue, pump thread, status)

Destinations are a random permutation of the slices (no accidental contiguity).
Throughput is the best of --repeat runs; the ceiling is a numpy copy of the same
bytes in this process, measured in the same run.

    .venv/bin/python scripts/engine_bench.py [--total-mib 256] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zlib

import numpy as np

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
CALL_SLICES = [1, 16, 128, 1024]
TINY = 64


def serve(nbytes: int) -> None:
    """Child: register a buffer, print where it is, answer "crc" until stdin closes."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake initialize failed")
    buf = np.zeros(nbytes, np.uint8)
    if engine.register_memory(buf.ctypes.data, nbytes) != 0:
        raise SystemExit("mooncake register_memory failed")
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data}), flush=True)
    for line in sys.stdin:
        if line.strip() == "crc":
            print(zlib.crc32(buf), flush=True)


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per run (default 256 MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cap", type=int, default=1024, help="slices per call")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 runs")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.quick:
        args.total_mib, args.repeat = 64, 2

    from mooncake.engine import TransferEngine as RawEngine

    from kvbridge.transfer.engine import create_engine

    total = args.total_mib << 20
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(total)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    raw = adapter = None
    try:
        peer = json.loads(child.stdout.readline())
        session, base = peer["session"], peer["addr"]
        src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
        scratch = np.empty_like(src)
        raw = RawEngine()
        raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        raw.register_memory(src.ctypes.data, total)
        adapter = create_engine("mooncake", max_slices_per_call=args.cap)
        adapter.register(src.ctypes.data, total)

        ceiling = total / best_of(args.repeat, lambda: np.copyto(scratch, src)) / 1e9
        print(f"# Mooncake TCP loopback, two processes (writer -> child receiver), {args.total_mib} MiB per run, "
              f"best of {args.repeat}, <= {args.cap} slices per call")
        print(f"# ceiling: numpy copy of the same bytes in one process = {ceiling:.2f} GB/s\n")
        print(f"{'slice':>8} {'slices':>7} {'calls':>6} {'raw GB/s':>9} {'kvbridge GB/s':>14} "
              f"{'raw/ceil':>9} {'us/call':>8} {'check':>6}")
        for size in SIZES:
            n = total // size
            perm = np.random.default_rng(size).permutation(n)
            offsets = np.arange(n, dtype=np.uint64) * size
            s_ptrs, d_ptrs = src.ctypes.data + offsets, base + offsets[perm]
            lens = np.full(n, size, dtype=np.uint64)
            calls = [
                (s_ptrs[i : i + args.cap].tolist(), d_ptrs[i : i + args.cap].tolist(), lens[i : i + args.cap].tolist())
                for i in range(0, n, args.cap)
            ]

            def run_raw() -> None:
                for s, d, ln in calls:
                    if raw.batch_transfer_sync_write(session, s, d, ln) != 0:
                        raise SystemExit(f"raw write of {size}-byte slices failed")

            t_raw = best_of(args.repeat, run_raw)
            t_adapter = best_of(args.repeat, lambda: adapter.write(session, s_ptrs, d_ptrs, lens, timeout=600))
            expected = np.empty_like(src)
            expected.reshape(-1, size)[perm] = src.reshape(-1, size)
            child.stdin.write("crc\n")
            child.stdin.flush()
            ok = int(child.stdout.readline()) == zlib.crc32(expected)
            print(f"{_size(size):>8} {n:>7} {len(calls):>6} {total / t_raw / 1e9:>9.2f} {total / t_adapter / 1e9:>14.2f} "
                  f"{total / t_raw / 1e9 / ceiling:>9.1%} {t_raw / len(calls) * 1e6:>8.0f} {'ok' if ok else 'BAD':>6}")

        print(f"\n# cost of one call: {TINY}-byte slices, raw batch_transfer_sync_write, best of 200 calls")
        print(f"{'slices/call':>11} {'us/call':>8} {'us/slice':>9}")
        for k in CALL_SLICES:
            s = (src.ctypes.data + np.arange(k, dtype=np.uint64) * TINY).tolist()
            d = (base + np.arange(k, dtype=np.uint64) * TINY).tolist()
            ln = [TINY] * k
            t = best_of(200, lambda: raw.batch_transfer_sync_write(session, s, d, ln))
            print(f"{k:>11} {t * 1e6:>8.0f} {t / k * 1e6:>9.2f}")
        t_sub = best_of(200, lambda: adapter.wait(adapter.submit_write(session, [src.ctypes.data], [base], [TINY]), 10))
        print(f"\n# kvbridge submit_write + wait of one {TINY}-byte slice: {t_sub * 1e6:.0f} us")
    finally:
        if adapter is not None:
            adapter.close()
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


if __name__ == "__main__":
    main()
