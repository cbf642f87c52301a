#!/usr/bin/env python
"""Issue 33: is the staged rooms' bound on one GPU the three processes sharing it, or kvbridge's
own per-slot cycle? The same staged rooms in two process layouts, beside the staging ceiling in
those layouts, all in one run:

    procs    every rank its own process (two prefill CP ranks, one decode rank: three CUDA
             contexts time-slicing one GPU), as ``scripts/gpu_bench.py`` runs them
    threads  every rank a thread of one process (``RigSpec.in_process``: the same rank classes
             and commands, one CUDA context), nothing else changed

Rooms: ``kvbridge.bench`` (DeepSeek V3.2 fp8, 61 + 1 layers, page 64, CP 2, random allocation,
every room landed on poisoned pages and checked), staged through ``--slot-mib`` slots,
``--gather-slots`` per prefill rank and ``--decode-slots`` on decode; kvbridge direct on the same
pages beside them. Engines: the IPC engine (CUDA IPC between processes, the address itself within
one; its slot writes are copies on its stream) and Mooncake NVLink (``protocol rdma`` with
``MC_INTRANODE_NVLINK=true``; in one process Mooncake must open its own memory over CUDA IPC,
which may fail: the row then says so). Each (engine, layout) runs in a fresh process of this
script, so no CUDA state or allocator setting carries from one to the next.

Ceiling: ``scripts/staged_layout_bench.py``'s gathers, slot copies and scatters of the same pages
and slots, in one process on one stream, in one process on three streams, and in three processes
at once (two gathering and copying into decode's slots over CUDA IPC, one scattering). Beside it
the same three processes *chained* (``staged_layout_bench.chained``): each chunk waits for what a
staged room's chunk waits for (a free gather slot, decode's grant, its write's end, the scatter's
end before the slot is granted again), with a pipe message and a busy-polled event as the only
host work per step, with grants asked for (``ask``, kvbridge's protocol) and sent unasked
(``ahead``); the same ``--gather-slots`` and ``--decode-slots``, the last room's bytes checked. The
staged rooms over the chained ceiling is what kvbridge's own host work costs; the chained ceiling
over the unchained one is what the chain of dependencies costs on this GPU.

    python scripts/staged_process_bench.py [--tokens 8192 32768 131072] [--engines ipc mooncake-nvlink]
        [--layouts procs threads] [--slot-mib 64] [--gather-slots 2] [--decode-slots 4] [--granted-slots 0] [--reps 3]
        [--rooms-in-flight 1] [--json out.json]

``--rooms-in-flight K`` (K > 1): beside the rooms one at a time, the same rooms K at once, staged and
direct (``kvbridge bench --rooms-in-flight``: decode asks for all K, each on its own pages, then both
prefill ranks send them from one instant), the K rooms' bytes over the time to the last Success: the
throughput of a loaded pair, where one room's host work overlaps another's copies. Beside it what
each rank's threads were busy with over that time (CPU seconds over the load's seconds: the
endpoint's loop, the thread that calls send(), the engine's pump; the whole process): a thread near
1.0 was never idle, and that loop is what bounds the loaded pair.

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET, PAGE, CP = "deepseek-v3.2-fp8", 64, 2
ENGINES = {
    "ipc": {"engine": "ipc", "protocol": "tcp", "env": {}},
    "mooncake-nvlink": {"engine": "mooncake", "protocol": "rdma",
                        "env": {"MC_INTRANODE_NVLINK": "true", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}},
}


def one(args: argparse.Namespace) -> None:
    """Child: one (engine, layout) over every length; one JSON line of rows on stdout."""
    from kvbridge.bench.sweep import BenchSpec, run_sweep
    from kvbridge.worker.cluster import start_bootstrap

    g = ENGINES[args.engine]
    spec = BenchSpec(tokens=args.tokens, cps=[CP], layers=args.layers, preset=PRESET, page_size=PAGE, reps=args.reps,
                     engine=g["engine"], protocol=g["protocol"], verify=True, verify_every=True, allocs=["random"],
                     raw_mooncake=False, device=args.device, decode_device=args.device,
                     prefill_aux=args.device, decode_aux=args.device, env=dict(g["env"]), staged=True, staging_slot_bytes=args.slot_mib << 20,
                     staging_slots=(args.gather_slots, args.decode_slots), in_process=args.layout == "threads",
                     staging_granted_slots=args.granted_slots, rooms_in_flight=args.rooms_in_flight)
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _):
        rows = run_sweep(spec, url, None, show_progress=False)
    keep = ("tokens", "bytes", "slices", "kvbridge_gbps", "staged_gbps", "engine_gbps", "staged_p50_ms",
            "kvbridge_p50_ms", "staged_slices", "rooms_verified", "kvbridge_failures", "verify_errors",
            "rooms_in_flight", "staged_load_gbps", "staged_load_room_p50_ms", "kvbridge_load_gbps",
            "kvbridge_load_room_p50_ms", "staged_load_busy", "staged_load_busiest", "kvbridge_load_busy",
            "kvbridge_load_busiest")
    print("ROWS " + json.dumps([{k: r.get(k) for k in keep} for r in rows]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--engines", nargs="+", default=["ipc", "mooncake-nvlink"], choices=sorted(ENGINES))
    ap.add_argument("--layouts", nargs="+", default=["procs", "threads"], choices=["procs", "threads"])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--slot-mib", type=int, default=64)
    ap.add_argument("--gather-slots", type=int, default=2)
    ap.add_argument("--decode-slots", type=int, default=4)
    ap.add_argument("--granted-slots", type=int, default=0,
                    help="of the decode slots, kept for grants sent with a room's request (DecodeConfig."
                         "staging_granted_slots: each prefill rank's first chunk written without a SlotGrant)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rooms-in-flight", type=int, default=1,
                    help="K > 1: the same rooms K at once too (staged and direct), their bytes over the time to the last")
    ap.add_argument("--ceiling-reps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=240, help="seconds for each (engine, layout)")
    ap.add_argument("--no-ceiling", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # the child's
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)  # the child's (cpu: a check of the code)
    args = ap.parse_args()
    if args.engine:
        one(args)
        return
    try:
        import torch

        have_cuda = torch.cuda.is_available()
    except ImportError:
        have_cuda = False
    if not have_cuda:
        print("staged_process_bench: no CUDA device here; nothing measured")
        return
    result: dict[str, Any] = {"rooms": {}, "ceiling": [], "errors": []}
    common = ["--tokens", *map(str, args.tokens), "--layers", str(args.layers), "--slot-mib", str(args.slot_mib),
              "--gather-slots", str(args.gather_slots), "--decode-slots", str(args.decode_slots),
              "--reps", str(args.reps), "--granted-slots", str(args.granted_slots),
              "--rooms-in-flight", str(args.rooms_in_flight)]
    for engine in args.engines:
        for layout in args.layouts:
            key = f"{engine}/{layout}"
            env = dict(os.environ, **ENGINES[engine]["env"], GLOG_minloglevel="2")
            try:
                p = subprocess.run([sys.executable, __file__, *common, "--engine", engine, "--layout", layout],
                                   capture_output=True, text=True, timeout=args.timeout, env=env)
                line = next((x for x in p.stdout.splitlines() if x.startswith("ROWS ")), None)
                if line is None:
                    tail = "\n".join((p.stdout + p.stderr).splitlines()[-8:])
                    raise RuntimeError(f"exit {p.returncode}, no rows; the output ends:\n{tail}")
                result["rooms"][key] = json.loads(line[5:])
            except Exception as exc:  # noqa: BLE001 - reported in the table, the others still run
                result["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            for r in result["rooms"].get(key, []):
                print(f"  {key} {r['tokens']}: staged {r['staged_gbps']} GB/s (p50 {r['staged_p50_ms']} ms), direct "
                      f"{r['kvbridge_gbps']}, engine {r['engine_gbps']}, verified {r['rooms_verified']}, failures "
                      f"{r['kvbridge_failures'] + r['verify_errors']}", flush=True)
                if r.get("rooms_in_flight"):
                    print(f"  {key} {r['tokens']}, {r['rooms_in_flight']} rooms at once: staged {r['staged_load_gbps']} "
                          f"GB/s (each room p50 {r['staged_load_room_p50_ms']} ms), direct {r['kvbridge_load_gbps']} "
                          f"(p50 {r['kvbridge_load_room_p50_ms']} ms)", flush=True)
                    for m in ("staged_load", "kvbridge_load"):  # CPU over the load's time, per rank and thread
                        print(f"    {m} busiest {r.get(m + '_busiest')}; busy {r.get(m + '_busy')}", flush=True)
    if not args.no_ceiling:
        import staged_layout_bench as slb

        for n in args.tokens:
            try:
                row = {"tokens": n, **slb.one_process(n, args.slot_mib, args.ceiling_reps, "cuda:0"),
                       **slb.three_processes(n, args.slot_mib, args.ceiling_reps, "cuda:0")}
                for grants in ("ask", "ahead"):
                    row.update(slb.chained(n, args.slot_mib, args.ceiling_reps, "cuda:0", args.gather_slots,
                                           args.decode_slots, grants))
                    if not row[f"chain_{grants}_verified"]:
                        result["errors"].append(f"chained {grants} {n}: {row[f'chain_{grants}_error'] or 'nothing checked'}")
            except Exception as exc:  # noqa: BLE001
                result["errors"].append(f"ceiling {n}: {type(exc).__name__}: {exc}")
                continue
            result["ceiling"].append(row)
            print(f"  ceiling {n}: {json.dumps(row)}", flush=True)
    ceil = {r["tokens"]: r for r in result["ceiling"]}
    print(f"\nstaged rooms by process layout (one GPU, both sides on cuda:0; {args.slot_mib} MiB slots, "
          f"{args.gather_slots} per prefill rank / {args.decode_slots} on decode, {args.granted_slots} of them granted "
          f"with requests; random pages, CP {CP}, "
          f"{args.layers}+1 layers; GB/s of payload, median of {args.reps}; ceiling: gather + slot copy + scatter "
          "of the same chunks in one process one stream / three streams / three processes; chained: the same three "
          "processes with the rooms' dependencies, grants asked for / sent ahead, every last room checked)")
    print("| engine | tokens | staged, procs | staged, threads | threads / procs | direct, procs | direct, threads "
          "| ceiling 1 proc 1 stream / 3 streams / 3 procs | chained, ask / ahead | staged procs / 3-proc ceiling | "
          "staged procs / chained ask | staged threads / 1-proc 3-stream ceiling |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def f(v: Any, spec: str = ".1f") -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    def ratio(a: Any, b: Any) -> Any:
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    for engine in args.engines:
        by = {lay: {r["tokens"]: r for r in result["rooms"].get(f"{engine}/{lay}", [])} for lay in ("procs", "threads")}
        for n in args.tokens:
            p, t, c = by["procs"].get(n, {}), by["threads"].get(n, {}), ceil.get(n, {})
            print(f"| {engine} | {n} | {f(p.get('staged_gbps'))} | {f(t.get('staged_gbps'))} | "
                  f"{f(ratio(t.get('staged_gbps'), p.get('staged_gbps')), '.2f')} | {f(p.get('kvbridge_gbps'))} | "
                  f"{f(t.get('kvbridge_gbps'))} | {f(c.get('one_stream_gbps'))} / {f(c.get('three_streams_gbps'))} / "
                  f"{f(c.get('three_procs_gbps'))} | {f(c.get('chain_ask_gbps'))} / {f(c.get('chain_ahead_gbps'))} | "
                  f"{f(ratio(p.get('staged_gbps'), c.get('three_procs_gbps')), '.2f')} | "
                  f"{f(ratio(p.get('staged_gbps'), c.get('chain_ask_gbps')), '.2f')} | "
                  f"{f(ratio(t.get('staged_gbps'), c.get('three_streams_gbps')), '.2f')} |")
    for e in result["errors"]:
        print(f"error: {e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
