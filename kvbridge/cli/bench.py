"""``kvbridge bench``: kvbridge end to end vs raw Mooncake batch writes vs memcpy of the same slices."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.layout.hybrid import KIND_PRESETS
from kvbridge.layout.pools import PRESETS
from kvbridge.transfer.engine.registry import engine_entry, engine_names

MEMORY_BUDGET_GB = 10.0


def _ints(text: str) -> list[int]:
    try:
        values = [int(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (8K allowed)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} needs positive integers")
    return values


def _allocs(text: str) -> list[str]:
    from kvbridge.bench.alloc import ALLOCS

    values = [x for x in text.split(",") if x]
    bad = [x for x in values if x not in ALLOCS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(ALLOCS)}")
    return values


ENGINES = engine_names("network", "same-host", "composite")  # the registry's, less in-process ones


def _engines(text: str) -> list[str]:
    values = [x for x in text.split(",") if x]
    bad = [x for x in values if x not in ENGINES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(ENGINES)}")
    return list(dict.fromkeys(values))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure kvbridge against raw Mooncake and memcpy on the same slices",
        description="Every rank in its own process, on the same buffers: kvbridge end to end (handshake to "
        "commit), raw Mooncake batch writes of exactly the same slices (the plan's src/dst/length, posted from the "
        "prefill ranks together), the engine alone on them, and a memcpy of the same bytes (host memory). Sweeps "
        "request length, allocation and CP size; reports GB/s, slices per room, planning time, latency p50/p99 "
        "and the ratios; --trace adds where a room's time goes, hop by hop. Starts its own bootstrap daemon.",
    )
    p.add_argument("--quick", action="store_true",
                   help="1K, 8K, 32K, 128K tokens, cp 1 and 2, 4 layers, 5 rooms per method (about three minutes "
                        "on 2 idle cores; 13 minutes were measured on 2 cores at load average 15)")
    p.add_argument("--tokens", type=_ints, default=None, help="request lengths, e.g. 1K,8K,128K (default: 1K..128K)")
    p.add_argument("--cp", type=_ints, default=None, help="CP sizes to sweep (default: 1,2,4; quick: 1,2)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"target layers (default: quick 4; else the most that fit {MEMORY_BUDGET_GB:.0f} GB, <= 61)")
    p.add_argument("--draft-layers", type=int, default=1, help="draft layers (default 1)")
    p.add_argument("--preset", choices=PRESETS + KIND_PRESETS, default="deepseek-v3.2-fp8",
                   help="geometry preset (default %(default)s); deepseek-v4: bytes per room from the plans at full "
                   "size (43+1 layers against V3.2's 61+1, bf16) beside what decode needs and V3.2's, 1M tokens from "
                   "the layout; then GB/s of V4 rooms and V3.2-fp8 rooms through a prefill and a decode endpoint "
                   "(one process, or decode in its own with --split; --layers layers each, default 4; --reps timed "
                   "rooms, 2 at >= 64K; V4 and V3.2 rooms alternating), their bytes checked against what decode "
                   "needs (exit 1 otherwise), and V4's GB/s over V3.2's")
    p.add_argument("--max-move-tokens", type=int, default=128 * 1024,
                   help="deepseek-v4: the longest length moved through the rooms for GB/s (default 128K; longer "
                   "ones are planned only)")
    p.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                   help="deepseek-v4: decode's endpoints in a process of their own (its pid is printed), and "
                   "decode's own room time (its receiver() to Success) beside prefill's; default on with --device "
                   "cuda:N (required there: Mooncake's NVLink transport could not read its own process's GPU "
                   "memory on one H200), off on cpu")
    p.add_argument("--protocol", default="tcp",
                   help="Mooncake's transport (default %(default)s); rdma with MC_INTRANODE_NVLINK=true and "
                   "PYTORCH_NO_CUDA_MEMORY_CACHING=1 in the environment: NVLink between GPUs of one host")
    p.add_argument("--reps", type=int, default=None, help="timed rooms per method and configuration (default 5)")
    p.add_argument("--memory-gb", type=float, default=MEMORY_BUDGET_GB, help="pool memory budget for --layers' default")
    p.add_argument("--engine", type=_engines, default=["mooncake"],
                   help="transfer engine(s) kvbridge runs on, comma-separated, swept in turn on the same pages: "
                   "mooncake (raw: the Mooncake binding), nixl (raw: the NIXL agent, prepared descriptor lists), "
                   "ipc (same host, GPU memory; needs --device cuda:N), auto (IPC where it reaches, Mooncake for "
                   "the rest; the route shows in --json's engine stats); e.g. mooncake,nixl")
    p.add_argument("--alloc", type=_allocs, default=["contiguous"],
                   help="page allocation(s), comma-separated: contiguous (decode pages in --dst-order) and/or "
                   "random (both sides from a shuffled free list, as an engine's allocator after some traffic)")
    p.add_argument("--dst-order", choices=("lane-major", "logical"), default="lane-major",
                   help="decode page order inside the contiguous destination block: lane-major (each CP rank's "
                   "pages consecutive, one run per rank) or logical (one slice per page when cp > 1) "
                   "(default %(default)s)")
    p.add_argument("--device", default="cpu", help="pool device of every rank: cpu (default) or cuda:N")
    p.add_argument("--no-staged", action="store_true",
                   help="skip the staged method (kvbridge rooms through staging slots, beside kvbridge direct); "
                   "on GPU pages (--device cuda) it runs on the Mooncake engine only (the IPC engine never stages)")
    p.add_argument("--aux-written", action="store_true",
                   help="decode takes each room's aux row as a write into its aux rows, one slice more per room "
                   "(default: in the report that carries it, DecodeConfig.aux_inline)")
    p.add_argument("--ask-first", action="store_true",
                   help="an engine's order: decode asks first (its request, and at CP > 1 the room's ticket, reach "
                   "prefill 50 ms before the sends), then every prefill rank calls send() at one instant; a room's "
                   "time runs from that instant to decode seeing Success (default: prefill's sends queue first and "
                   "the time runs from decode's receiver(), a request that comes last)")
    p.add_argument("--rooms-in-flight", type=int, default=1, metavar="K",
                   help="also move K rooms at once (K > 1; direct, and staged unless --no-staged): decode asks for "
                   "all K, each on its own pages, then every prefill rank sends them from one instant; columns 'kvb "
                   "load GB/s' / 'stg load GB/s' are the K rooms' bytes over the time to the last Success, 'load p50 "
                   "ms' each room's own, 'load busiest' the rank's loop or send() thread with the most CPU time over "
                   "that time (1.00: never idle; every rank's threads in --json) (default 1: rooms one at a time "
                   "only)")
    p.add_argument("--no-verify", action="store_true", help="skip the byte check of the first kvbridge room")
    p.add_argument("--verify-every", action="store_true", help="check every kvbridge room, not only the first")
    p.add_argument("--trace", action="store_true",
                   help="run the ranks with KVBRIDGE_TRACE=1 and print the per-room hop breakdown (slower rooms)")
    p.add_argument("--poll-ms", type=float, default=0.0,
                   help="decode's wait for a room: 0 (default) blocks in KVReceiver.wait(); > 0 polls every that "
                   "many ms instead, like an engine's scheduler step (on a 2-core host the polling competes with "
                   "the transfer's threads)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the rows and settings as JSON")
    p.add_argument("--plot", metavar="FILE", default=None, help="write a PNG chart (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: errors only, unless asked otherwise
    from kvbridge.bench.report import format_table, write_json, write_plot
    from kvbridge.bench.sweep import FULL_TOKENS, QUICK_LAYERS, QUICK_TOKENS, BenchSpec, layers_that_fit, run_sweep
    from kvbridge.worker.cluster import start_bootstrap
    from kvbridge.worker.runtime import quiet_http_logs

    quiet_http_logs()

    tokens = args.tokens or list(QUICK_TOKENS if args.quick else FULL_TOKENS)
    if args.rooms_in_flight < 1:
        raise ConfigError(f"--rooms-in-flight {args.rooms_in_flight}: K must be at least 1", field="rooms_in_flight")
    if args.rooms_in_flight > 1 and args.preset in KIND_PRESETS:
        raise ConfigError(f"--rooms-in-flight is not run with --preset {args.preset}: its rooms go one at a time",
                          field="rooms_in_flight")
    if args.preset in KIND_PRESETS:
        return _run_kinds(args, tokens)
    if args.split is not None:
        raise ConfigError("--split/--no-split is for --preset deepseek-v4 (every rank of the other presets runs in "
                          "its own process already)", field="split")
    cps = args.cp or ([1, 2] if args.quick else [1, 2, 4])
    note = ""
    if args.layers is not None:
        layers = args.layers
    elif args.quick:
        layers = QUICK_LAYERS
        note = f"quick mode: {layers} target layers instead of 61 (throughput per byte is what is compared)"
    else:
        layers = layers_that_fit(args.preset, max(tokens), int(args.memory_gb * 1e9), draft_layers=args.draft_layers)
        if layers < 61:
            note = f"{layers} target layers instead of 61 so that {max(tokens)} tokens fit {args.memory_gb:.0f} GB"
    if layers < 1 or args.draft_layers < 0:
        raise ConfigError("--layers must be >= 1 and --draft-layers >= 0", field="layers")
    same_host = [e for e in args.engine if engine_entry(e).kind == "same-host"]
    if same_host and not args.device.startswith("cuda"):
        raise ConfigError(f"--engine {same_host[0]} moves GPU memory between processes: add --device cuda:N",
                          field="engine")
    log_dir = tempfile.mkdtemp(prefix="kvbridge-bench-") if args.trace else ""
    gpu = str(args.device).startswith("cuda")
    specs = [BenchSpec(
        tokens=tokens, cps=cps, layers=layers, draft_layers=args.draft_layers, preset=args.preset,
        reps=args.reps or 5, engine=engine, verify=not args.no_verify, verify_every=args.verify_every,
        quick=args.quick, dst_order=args.dst_order, allocs=args.alloc, device=args.device, decode_device=args.device,
        decode_aux=args.device if engine_entry(engine).kind in ("same-host", "composite") else "cpu",
        poll_s=args.poll_ms / 1e3,
        env={"KVBRIDGE_TRACE": "1"} if args.trace else {}, log_dir=log_dir,
        staged=not args.no_staged and (not gpu or engine_entry(engine).kind == "network"), protocol=args.protocol,
        aux_inline=not args.aux_written, ask_first=args.ask_first, rooms_in_flight=args.rooms_in_flight,
    ) for engine in args.engine]  # fmt: skip
    spec = specs[0]
    meta = {
        "preset": spec.preset, "layers": layers, "draft_layers": spec.draft_layers, "page_size": spec.page_size,
        "engine": ",".join(args.engine), "reps": spec.reps, "quick": spec.quick, "tokens": list(tokens),
        "cps": list(cps), "note": note, "dst_order": args.dst_order, "poll_ms": args.poll_ms,
        "allocs": list(args.alloc), "device": args.device, "staged": spec.staged, "protocol": args.protocol,
        "ask_first": args.ask_first, "rooms_in_flight": args.rooms_in_flight,
    }  # fmt: skip
    rows = []
    with start_bootstrap() as (url, token):
        for one in specs:  # one engine after the other, on the same pages (allocation seeds are the lengths)
            rows += run_sweep(one, url, token, show_progress=not args.no_progress)
    print(format_table(rows, meta))
    if args.trace:
        from kvbridge.bench.trace import breakdown, format_breakdown, parse

        traced = parse(line for path in sorted(Path(log_dir).glob("*.log")) for line in path.read_text().splitlines())
        for row in rows:
            row["trace"] = breakdown({room: traced[room] for room in row["room_ids"] if room in traced})
            print()
            print(format_breakdown(row["trace"], f"cp={row['cp']} {row['alloc']} {row['tokens']} tokens: where a "
                                   f"timed room's time goes (kvbridge p50 {row['kvbridge_p50_ms']} ms, raw p50 "
                                   f"{row['raw_p50_ms']} ms)"))
        print(f"\ntrace logs: {log_dir}")
    if args.json:
        write_json(args.json, rows, meta)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(args.plot, rows, meta)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(not r["verify_errors"] and not r["kvbridge_failures"] for r in rows) else 1


def _run_kinds(args: argparse.Namespace, tokens: list[int]) -> int:
    """``--preset deepseek-v4``: bytes from the plans at full size (and 1M tokens from the layout),
    GB/s of V4 and V3.2 rooms through the room endpoints."""
    import json

    from kvbridge.bench.kinds import byte_rows, format_bytes, format_rooms, layout_row, room_rows
    from kvbridge.worker.cluster import start_bootstrap

    engine = args.engine[0]
    gpu = str(args.device).startswith("cuda")
    split = gpu if args.split is None else args.split
    if len(args.engine) > 1:
        raise ConfigError("--preset deepseek-v4 runs on one engine: mooncake, or ipc/auto with --device cuda:N",
                          field="engine")
    if engine == "nixl" or (engine != "mooncake" and not gpu):
        raise ConfigError(f"--preset deepseek-v4 does not run on --engine {engine} with --device {args.device}: "
                          "mooncake (cpu or cuda:N), or ipc/auto with --device cuda:N", field="engine")
    if gpu and not split:
        # Mooncake's NVLink transport could not read decode's memory proof from prefill's process
        # on one H200 (docs/performance.md); a GPU run is the production layout, two processes
        raise ConfigError("--no-split puts prefill and decode in one process, host memory only: drop --no-split "
                          "for --device cuda:N (decode in a process of its own)", field="split")
    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device {args.device}: no CUDA device here (torch.cuda.is_available() is False); "
                              "--split runs the same layout in host memory", field="device")
    layers = args.layers or 4
    if layers < 1:
        raise ConfigError("--layers must be >= 1", field="layers")
    load = os.getloadavg()
    rows = byte_rows(tokens)
    one_m = layout_row(1 << 20)
    print(format_bytes(rows))
    print(f"{one_m['tokens']:>7} (layout: needed_bytes) V4 {one_m['v4_needed'] / 1e9:,.2f} GB, V3.2 "
          f"{one_m['v32_needed'] / 1e9:,.2f} GB, V4/V3.2 {one_m['ratio']:.3f}; fp8: V4 "
          f"{one_m['v4_fp8_needed'] / 1e9:,.2f} GB, V3.2-fp8 {one_m['v32_fp8_needed'] / 1e9:,.2f} GB, V4/V3.2 "
          f"{one_m['ratio_fp8']:.3f}")
    moved = [n for n in tokens if n <= args.max_move_tokens]
    speed = []
    if moved:
        with start_bootstrap() as (url, token):
            speed = room_rows(engine, moved, layers, args.reps or 5, url, token, device=args.device,
                              protocol=args.protocol, split=split)
    print()
    print(format_rooms(speed, engine))
    after = os.getloadavg()
    print(f"load average (1/5/15 min) before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after "
          f"{after[0]:.2f} {after[1]:.2f} {after[2]:.2f}; {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": rows, "layout_1m": one_m, "rooms": speed,
                                               "load": [load, after]}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    ok = all(r["v4_moved"] == r["v4_needed"] and r["v4_fp8_moved"] == r["v4_fp8_needed"] for r in rows) and \
        all(r["bytes_equal"] for r in speed)
    return 0 if ok else 1
