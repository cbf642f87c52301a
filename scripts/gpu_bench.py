#!/usr/bin/env python
"""kvbridge on GPU memory: over Mooncake and over the IPC engine, against raw Mooncake on the
same slices and against the ceilings measured in the same run. One host, one or two GPUs.

Every rank is its own process (``kvbridge.bench``): a decode rank (cuda:1, or cuda:0 with
one GPU) and one process per prefill CP rank (cuda:0). Groups:

    mooncake-nvlink  kvbridge on Mooncake, protocol rdma + MC_INTRANODE_NVLINK=true (its
                     intra-node transport: CUDA IPC between the processes); raw Mooncake
    mooncake-tcp     the same over Mooncake TCP (the fallback when nvlink does not start)
    ipc              kvbridge on the IPC engine (slice kernel over CUDA IPC); the engine alone
    auto             kvbridge on the auto engine (IPC between these GPU processes, chosen by itself)
    nixl             kvbridge on NIXL (UCX: cuda_ipc between these GPU processes, UCX's own choice;
                     UCX_TLS overrides it), direct and staged; raw NIXL (the agent under kvbridge's
                     engine, prepared descriptor lists, one request per rank) on the same slices

For each allocation (contiguous: decode pages lane-major; random: both sides from a
shuffled free list) and length: fill, plan, then a checked warm-up and ``--reps`` turns
per method; every kvbridge room lands on poisoned pages and is checked on the GPU. On the
Mooncake groups the methods are kvbridge direct, kvbridge staged (the prefill ranks switched
to staging "always": the slice kernel gathers into a GPU gather slot, Mooncake carries whole
slots into decode's GPU staging slots, decode's kernel scatters; ``--staged-slot-mib`` slots,
``--gather-slots`` per prefill rank and ``--decode-slots`` on decode) and raw Mooncake on the same slices;
the staged table sets them beside the staging ceiling of the same pages (``--staged-ceilings``).

Ceilings (``--ceilings``, one process, both sides on cuda:0 -> decode's GPU): a
device-to-device copy, ``index_select`` + ``index_copy_`` of random 41,984 B pages, the
staging path (gather, one copy, scatter) and the slice kernel on the same pages (several
launch shapes), long contiguous slices by the kernel and by cudaMemcpyAsync, and kvbridge's
staged building blocks (``stage_plan`` chunks through ``CudaStager``: the whole path and each
part alone), and the staging ceiling of real rooms (``--tokens``, random allocation, CP 2: each
rank's plan staged through ``--slot-mib`` slots; gather, slot copy, scatter, the whole, against
the same slices in one slice-kernel launch).
``--staged-ceilings`` measures only those staged rooms' ceilings (not the copy ceilings).
``--trace-tokens N [M ...]`` adds rooms of those lengths run with KVBRIDGE_TRACE=1 and prints
where their time goes, hop by hop (kvbridge p50 minus raw p50 is the per-room fixed cost).

    python scripts/gpu_bench.py [--tokens 8192 32768 131072] [--alloc contiguous random]
        [--groups mooncake-nvlink ipc] [--reps 5] [--ceilings | --staged-ceilings] [--slot-mib 16 64]
        [--staged-slot-mib 256] [--decode-slots 4] [--gather-slots 2] [--trace-tokens 8192 131072]
        [--json out.json]

Geometry: DeepSeek V3.2 fp8 (target 656 B/token, index-K 132 B/token, one NextN draft
layer), 61 layers, page 64, CP=2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET = "deepseek-v3.2-fp8"
PAGE = 64
CP = 2
PAGE_BYTES = 656 * PAGE  # one fp8 MLA page
GROUPS = {
    "mooncake-nvlink": {"engine": "mooncake", "protocol": "rdma",
                        "env": {"MC_INTRANODE_NVLINK": "true", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
                        "aux": "device"},
    "mooncake-tcp": {"engine": "mooncake", "protocol": "tcp", "env": {}, "aux": "host"},
    "ipc": {"engine": "ipc", "protocol": "tcp", "env": {}, "aux": "device"},
    "auto": {"engine": "auto", "protocol": "tcp", "env": {}, "aux": "device"},  # IPC here: same host, GPU memory
    "nixl": {"engine": "nixl", "protocol": "tcp", "env": {}, "aux": "device"},  # UCX cuda_ipc here
}
RAW_BASELINE = ("mooncake", "nixl")  # engines whose binding the bench drives raw on the same slices
STAGED = ("mooncake", "nixl")  # engines whose rooms are also run staged (the IPC engine never stages)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- ceilings: one process ----------------------------------------------------------------------
def poison(*tensors: Any) -> None:
    """Fill ``tensors`` with 0x5A and wait for it: the fill runs on torch's current stream, and a
    copier's stream is ordered after nothing of it (a copy launched at once can land before the fill
    passes and be overwritten, or read source pages not yet generated)."""
    import torch

    for t in tensors:
        t.fill_(0x5A)
    torch.cuda.synchronize()


def _time(fn, reps: int = 5) -> float:
    """Median seconds of ``fn`` on the GPU (events around it), after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return float(np.median(out))


def ceilings(src_dev: str, dst_dev: str, num_pages: int) -> dict[str, Any]:
    """Copy rates on these GPUs, payload GB/s (bytes moved once), for the same random pages."""
    import torch

    from kvbridge.transfer.engine.slicecopy import CudaCopier

    torch.cuda.set_device(src_dev)
    nbytes = num_pages * PAGE_BYTES
    src = torch.randint(0, 256, (num_pages, PAGE_BYTES), dtype=torch.uint8, device=src_dev)
    dst = torch.empty((num_pages, PAGE_BYTES), dtype=torch.uint8, device=dst_dev)
    g = torch.Generator(device="cpu").manual_seed(5)
    perm_s, perm_d = torch.randperm(num_pages, generator=g), torch.randperm(num_pages, generator=g)
    ps, pd = perm_s.to(src_dev), perm_d.to(dst_dev)
    out: dict[str, Any] = {"pages": num_pages, "page_bytes": PAGE_BYTES, "bytes": nbytes, "src": src_dev,
                           "dst": dst_dev, "note": "payload GB/s: bytes moved once (not read + write)"}

    def rate(seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 1)

    def ok() -> bool:
        return bool(torch.equal(dst.index_select(0, pd), src.index_select(0, ps).to(dst_dev)))

    out["d2d_copy_gbps"] = rate(_time(lambda: dst.copy_(src)))
    staging = torch.empty_like(src)
    landing = torch.empty_like(dst)
    out["index_copy_gbps"] = rate(_time(lambda: dst.index_copy_(0, pd, landing)))

    def staged() -> None:  # option (a): gather on prefill, one large copy, scatter on decode
        torch.index_select(src, 0, ps, out=staging)
        landing.copy_(staging)
        dst.index_copy_(0, pd, landing)

    dst.fill_(0x5A)
    out["staging_gbps"] = rate(_time(staged))
    out["staging_ok"] = ok()
    # option (b): the slice kernel, one (src, dst, 41,984) slice per page, several launch shapes
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    s_addr = (base_s + perm_s.numpy().astype(np.uint64) * PAGE_BYTES).astype(np.uint64)
    d_addr = (base_d + perm_d.numpy().astype(np.uint64) * PAGE_BYTES).astype(np.uint64)
    length = np.full(num_pages, PAGE_BYTES, np.uint64)
    variants = {}
    for words, warps, per_sm in ((2048, 4, 4), (4096, 4, 4), (2048, 8, 4), (2048, 4, 8), (1024, 4, 8)):
        copier = CudaCopier(torch.device(src_dev).index or 0, words=words, num_warps=warps, programs_per_sm=per_sm)

        def kernel() -> None:
            copier.launch(s_addr, d_addr, length)
            copier.stream.synchronize()

        poison(dst)
        t0 = time.perf_counter()
        seconds = []
        kernel()  # compile + warm-up
        for _ in range(5):
            t = time.perf_counter()
            kernel()
            seconds.append(time.perf_counter() - t)
        name = f"words{words}-warps{warps}-sm{per_sm}"
        variants[name] = {"gbps": rate(float(np.median(seconds))), "ok": ok(),
                          "first_call_s": round(time.perf_counter() - t0 - sum(seconds), 2)}
    out["kernel_random_pages"] = variants
    # long contiguous slices: 64 runs of 1/64 of the buffer each (43 MB), the kernel vs the copy engines
    runs = 64
    run_bytes = nbytes // runs // 16 * 16
    cs = (base_s + np.arange(runs, dtype=np.uint64) * run_bytes).astype(np.uint64)
    cd = (base_d + np.arange(runs, dtype=np.uint64) * run_bytes).astype(np.uint64)
    cl = np.full(runs, run_bytes, np.uint64)
    for label, direct in (("kernel", 0), ("memcpy", 1)):
        copier = CudaCopier(torch.device(src_dev).index or 0, direct_min_bytes=direct)

        def contiguous() -> None:
            copier.launch(cs, cd, cl)
            copier.stream.synchronize()

        contiguous()
        seconds = []
        for _ in range(5):
            t = time.perf_counter()
            contiguous()
            seconds.append(time.perf_counter() - t)
        out[f"contiguous_{label}_gbps"] = round(runs * run_bytes / float(np.median(seconds)) / 1e9, 1)
    out["contiguous_ok"] = bool(torch.equal(dst.view(-1)[: runs * run_bytes], src.view(-1)[: runs * run_bytes]))
    # unaligned slices (byte path): 4,096 random (offset, length) slices, checked on the host
    rng = np.random.default_rng(9)
    k = 4096
    span = nbytes // k
    lens = rng.integers(1, min(span - 32, 20_000), k).astype(np.uint64)
    so = (np.arange(k, dtype=np.uint64) * span + rng.integers(0, 16, k).astype(np.uint64))
    do = (rng.permutation(k).astype(np.uint64) * span + rng.integers(0, 16, k).astype(np.uint64))
    poison(dst)
    copier = CudaCopier(torch.device(src_dev).index or 0)
    copier.launch(base_s + so, base_d + do, lens)
    copier.stream.synchronize()
    hs, hd = src.view(-1).cpu().numpy(), dst.view(-1).cpu().numpy()
    out["unaligned_ok"] = all(np.array_equal(hs[a:a + n], hd[b:b + n]) for a, b, n in
                              zip(so.tolist(), do.tolist(), lens.tolist()))
    out["launch_overhead_us"] = launch_overhead(src, dst, s_addr, d_addr)
    try:
        out["staged_blocks"] = staged_blocks(src, dst, s_addr, d_addr, length, rate, ok)
    except Exception as exc:  # noqa: BLE001 - reported beside the other ceilings
        out["staged_blocks"] = {"error": f"{type(exc).__name__}: {exc}"}
    del src, dst, staging, landing
    torch.cuda.empty_cache()
    return out


def staged_blocks(src: Any, dst: Any, s_addr: np.ndarray, d_addr: np.ndarray, length: np.ndarray, rate: Any,
                  ok: Any) -> dict[str, Any]:
    """kvbridge's staged building blocks on the same random pages: ``stage_plan`` chunks (64 MiB
    slots), the slice kernel gathering into a send slot (``CudaStager``), one copy slot -> slot
    (the wire on one GPU), the kernel scattering, two slots per side, in order on the copier's
    stream (each launch fills the GPU); then each part alone."""
    import torch

    from kvbridge.layout import TransferPlan, stage_plan
    from kvbridge.transfer.staging.stagers import CudaStager

    slot_bytes = 64 << 20
    staged = stage_plan(TransferPlan(s_addr, d_addr, length), slot_bytes)
    send = torch.empty(2 * slot_bytes, dtype=torch.uint8, device=src.device)
    recv = torch.empty(2 * slot_bytes, dtype=torch.uint8, device=dst.device)
    stager = CudaStager(src.device.index or 0)
    copier = stager.copier

    def run(gather: bool = True, wire: bool = True, scatter: bool = True) -> None:
        for k in range(staged.num_chunks):
            off = (k % 2) * slot_bytes
            if gather:
                stager.gather(staged, k, send.data_ptr() + off)
            if wire:
                copier.copy_async(recv.data_ptr() + off, send.data_ptr() + off, int(staged.chunk_span[k]))
            if scatter:
                stager.scatter(staged, k, recv.data_ptr() + off)
        copier.stream.synchronize()

    poison(dst)
    run()
    out: dict[str, Any] = {"chunks": staged.num_chunks, "ok": ok(), **{k: int(v) for k, v in staged.stats().items()}}
    for name, kw in (("staged", {}), ("gather", {"wire": False, "scatter": False}),
                     ("wire", {"gather": False, "scatter": False}), ("scatter", {"gather": False, "wire": False})):
        out[f"{name}_gbps"] = rate(_time(lambda kw=kw: run(**kw)))
    del send, recv
    return out


def _wall(fn, reps: int = 5) -> float:
    """Median wall seconds of ``fn`` (which ends synchronised), after one warm-up: the host's
    launches count, as they do for a sender."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def staged_rooms(tokens: list[int], layers: int, slot_mib: list[int], device: str) -> list[dict[str, Any]]:
    """The staging ceiling of real rooms: the bench's geometry (``PRESET``, ``layers`` + 1 draft
    layer, page 64, CP 2 with each prefill rank's own pools) and its random allocation
    (``kvbridge.bench.alloc.allocate`` with the rig's seed and capacities: the same pages as the
    groups' random rows of the same ``tokens``), all pools in one process on ``device`` (both sides).
    Per room and slot size: each rank's plan staged by ``stage_plan``, then gather (slice kernel
    into a send slot), slot copy (cudaMemcpyAsync, the wire on one GPU), scatter (slice kernel),
    two slots per side, in order on the copier's stream; the whole and each part alone, wall
    time (the host's launches included); the plan's slices in one slice-kernel launch (the IPC
    engine's path) beside it. Every staged room equals the direct copy, byte for byte."""
    import torch

    from kvbridge.bench.alloc import allocate
    from kvbridge.layout import OwnerLanes, describe_buffer, plan_transfer, preset_pools, stage_plan
    from kvbridge.transfer.staging.stagers import CudaStager

    specs = preset_pools(PRESET, num_layers=layers, page_size=PAGE, draft_layers=1)
    lanes = OwnerLanes(CP)
    max_pages = -(-max(tokens) // PAGE)
    src_cap = max(1, len(lanes.owned_pages(0, max_pages)))
    keys = [(s.name, lid) for s in specs.values() for lid in s.layer_ids]
    gen = torch.Generator(device=device).manual_seed(3)
    src = [{k: torch.randint(0, 256, (src_cap, specs[k[0]].bytes_per_page), dtype=torch.uint8, device=device,
                             generator=gen) for k in keys} for _ in range(CP)]
    dst = {k: torch.empty((max_pages, specs[k[0]].bytes_per_page), dtype=torch.uint8, device=device) for k in keys}

    def descs(bufs: dict) -> list:
        return [describe_buffer(specs[p], lid, t) for (p, lid), t in bufs.items()]

    stager = CudaStager(torch.device(device).index or 0)
    copier = stager.copier
    rows: list[dict[str, Any]] = []
    for n in tokens:
        num_pages = -(-n // PAGE)
        alloc = allocate("random", num_pages, lanes, src_cap, max_pages, seed=n)
        plans = [plan_transfer(specs, descs(src[r]), descs(dst), alloc.owned[r], alloc.local[r],
                               alloc.page_ids[alloc.owned[r]], n) for r in range(CP)]
        nbytes = sum(int(p.length.sum()) for p in plans)
        slices = sum(len(p.length) for p in plans)
        both = [np.concatenate([getattr(p, a) for p in plans]) for a in ("src", "dst", "length")]

        def poison_all() -> None:
            poison(*dst.values())

        def direct() -> None:
            copier.launch(*both)
            copier.stream.synchronize()

        poison_all()
        direct()
        want = {k: t.clone() for k, t in dst.items()}
        row: dict[str, Any] = {"tokens": n, "bytes": nbytes, "plan_slices": slices, "device": device,
                               "kernel_direct_gbps": round(nbytes / _wall(direct) / 1e9, 1)}
        for mib in slot_mib:
            slot_bytes = mib << 20
            t = time.perf_counter()
            staged = [stage_plan(p, slot_bytes) for p in plans]
            plan_ms = (time.perf_counter() - t) * 1e3
            send = torch.empty(2 * slot_bytes, dtype=torch.uint8, device=device)
            recv = torch.empty(2 * slot_bytes, dtype=torch.uint8, device=device)

            def run(gather: bool = True, wire: bool = True, scatter: bool = True) -> None:
                for sp in staged:  # one rank after the other, as two senders sharing one GPU would
                    for k in range(sp.num_chunks):
                        off = (k % 2) * slot_bytes
                        if gather:
                            stager.gather(sp, k, send.data_ptr() + off)
                        if wire:
                            copier.copy_async(recv.data_ptr() + off, send.data_ptr() + off, int(sp.chunk_span[k]))
                        if scatter:
                            stager.scatter(sp, k, recv.data_ptr() + off)
                copier.stream.synchronize()

            poison_all()
            run()
            ok = all(torch.equal(dst[k], want[k]) for k in keys)
            stats = [sp.stats() for sp in staged]
            part = {"slot_mib": mib, "ok": ok, "stage_plan_ms": round(plan_ms, 1),
                    **{k: sum(st[k] for st in stats) for k in ("chunks", "gather_slices", "wire_pieces",
                                                               "scatter_slices")}}
            for name, kw in (("staged", {}), ("gather", {"wire": False, "scatter": False}),
                             ("wire", {"gather": False, "scatter": False}),
                             ("scatter", {"gather": False, "wire": False})):
                part[f"{name}_gbps"] = round(nbytes / _wall(lambda kw=kw: run(**kw)) / 1e9, 1)
            serial = sum(nbytes / (part[f"{x}_gbps"] * 1e9) for x in ("gather", "wire", "scatter"))
            part["serial_sum_gbps"] = round(nbytes / serial / 1e9, 1)
            row[f"slot{mib}"] = part
            del send, recv
        rows.append(row)
        log(f"  staged room {n}: {json.dumps(row)}")
        del want
    del src, dst
    torch.cuda.empty_cache()
    return rows


def launch_overhead(src: Any, dst: Any, s_addr: np.ndarray, d_addr: np.ndarray) -> dict[str, float]:
    """Host microseconds (median of 20) to enqueue a copy, and an IPC engine's submit -> DONE with a
    peer in this process, for 123 slices (a contiguous room: one per layer and pool) and 15,744 slices
    (an 8K-token room of scattered pages, both ranks)."""
    import torch

    from kvbridge.transfer.engine import create_engine, tensor_region
    from kvbridge.transfer.engine.slicecopy import CudaCopier

    out: dict[str, float] = {}
    copier = CudaCopier(src.device.index or 0)
    a, b = create_engine("ipc"), create_engine("ipc")
    try:
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        for n in (123, 15744):
            length = np.full(n, PAGE_BYTES, np.uint64)
            launch, engine = [], []
            for _ in range(20):
                t = time.perf_counter()
                copier.launch(s_addr[:n], d_addr[:n], length)
                launch.append(time.perf_counter() - t)
                copier.stream.synchronize()
                t = time.perf_counter()
                a.write(b.session_id, s_addr[:n], d_addr[:n], length)
                engine.append(time.perf_counter() - t)
            out[f"launch_{n}"] = round(float(np.median(launch)) * 1e6, 1)
            out[f"engine_write_{n}"] = round(float(np.median(engine)) * 1e6, 1)
            out[f"copy_time_{n}"] = round(n * PAGE_BYTES / 1.0e12 * 1e6, 1)  # at 1 TB/s, for scale
    finally:
        a.close()
        b.close()
        torch.cuda.synchronize()
    return out


# ---- groups: every rank its own process --------------------------------------------------------
def run_group(name: str, args: argparse.Namespace, url: str, tokens: list[int], allocs: list[str], reps: int,
              trace_dir: str = "") -> list[dict[str, Any]]:
    import torch

    from kvbridge.bench.sweep import BenchSpec, run_sweep

    g = GROUPS[name]
    gpus = torch.cuda.device_count()
    src_dev, dst_dev = "cuda:0", ("cuda:1" if gpus >= 2 else "cuda:0")
    env = dict(g["env"])
    if trace_dir:
        env["KVBRIDGE_TRACE"] = "1"
    spec = BenchSpec(tokens=tokens, cps=[CP], layers=args.layers, preset=PRESET, page_size=PAGE, reps=reps,
                     engine=g["engine"], protocol=g["protocol"], verify=True, verify_every=not args.verify_first,
                     allocs=allocs, raw_mooncake=g["engine"] in RAW_BASELINE, device=src_dev, decode_device=dst_dev,
                     prefill_aux=src_dev if g["aux"] == "device" else "cpu",
                     decode_aux=dst_dev if g["aux"] == "device" else "cpu", env=env, log_dir=trace_dir,
                     # staged rooms where the engine is Mooncake (the IPC engine's kernel copies scattered
                     # pages in one launch: never staged there); traced rooms stay direct unless --trace-staged
                     staged=g["engine"] in STAGED and (not trace_dir or args.trace_staged),
                     staging_slot_bytes=args.staged_slot_mib << 20, staging_slots=(args.gather_slots, args.decode_slots),
                     aux_inline=not args.aux_written, ask_first=args.ask_first, send_early_ms=args.send_early,
                     send_early_host=args.send_early_on == "host")

    def show(row: dict[str, Any]) -> None:
        log(f"  {name} {row['alloc']} {row['tokens']}: kvbridge {row['kvbridge_gbps']} GB/s (p50 "
            f"{row['kvbridge_p50_ms']} ms, {row['kvbridge_slices']} slices), staged {row.get('staged_gbps')} "
            f"({row.get('staged_slices')} pieces), raw {row['raw_gbps']}, engine {row['engine_gbps']}, verified "
            f"{row['rooms_verified']} rooms, failures {row['kvbridge_failures'] + row['verify_errors']}, send() p50 "
            f"{row['send_p50_ms']} ms, forward's tail p50 {row['forward_p50_ms']} ms")

    rows = run_sweep(spec, url, None, show_progress=False, on_row=show)
    for row in rows:
        row.update(group=name, src_device=src_dev, dst_device=dst_dev, gpus=gpus)
    return rows


def traced(name: str, args: argparse.Namespace, url: str, tokens: int) -> dict[str, Any]:
    from kvbridge.bench.trace import breakdown, format_breakdown, parse

    folder = tempfile.mkdtemp(prefix=f"gpu-bench-trace-{name}-")
    alloc = "random" if args.trace_staged else "contiguous"
    rows = run_group(name, args, url, [tokens], [alloc], args.trace_reps, trace_dir=folder)
    lines = [line for p in sorted(Path(folder).glob("*.log")) for line in p.read_text(errors="replace").splitlines()]
    rooms = parse(lines)
    row = rows[0]
    hops = breakdown({r: rooms[r] for r in row["room_ids"] if r in rooms})
    log(format_breakdown(hops, f"{name}, {tokens} tokens {alloc}, KVBRIDGE_TRACE=1: kvbridge p50 "
                               f"{row['kvbridge_p50_ms']} ms, raw p50 {row['raw_p50_ms']} ms, engine p50 "
                               f"{row['engine_p50_ms']} ms"))
    if args.trace_out:
        Path(args.trace_out).mkdir(parents=True, exist_ok=True)
        (Path(args.trace_out) / f"trace-{name}-{alloc}-{tokens}.log").write_text("\n".join(
            line for line in lines if "trace " in line)[-2_000_000:] + "\n")
    return {"group": name, "tokens": tokens, "row": row, "hops": hops}


# ---- main ----------------------------------------------------------------------------------------
def _minus(a: Any, b: Any) -> float | None:
    """The per-room fixed cost: kvbridge p50 minus its baseline's p50 on the same slices."""
    return a - b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None


def table(rows: list[dict[str, Any]]) -> str:
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["alloc"], r["tokens"]), {})[r["group"]] = r
    head = (f"{'alloc':>10} {'tokens':>6} {'MB':>7} {'slices':>7} {'kvb/mc':>7} {'raw mc':>7} {'kvb/ipc':>8} "
            f"{'ipc eng':>8} {'ipc/raw':>7} {'mc p50':>7} {'raw p50':>7} {'ipc p50':>7} {'eng p50':>7} "
            f"{'mc fix':>6} {'ipc fix':>7} {'mc snd':>6} {'ipc snd':>7} {'verified':>8}")
    lines = [head]

    def f(v: Any, spec: str = ".1f") -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    for (alloc, n), groups in sorted(by_key.items()):
        mc = groups.get("mooncake-nvlink") or groups.get("mooncake-tcp") or {}
        ipc = groups.get("ipc") or groups.get("auto") or {}
        any_row = mc or ipc or next(iter(groups.values()))  # a run of other groups only (--groups nixl)
        ratio = ipc.get("kvbridge_gbps") / mc["raw_gbps"] if ipc.get("kvbridge_gbps") and mc.get("raw_gbps") else None
        ok = all(not g["verify_errors"] and not g["kvbridge_failures"] and g["rooms_verified"] for g in groups.values())
        lines.append(
            f"{alloc:>10} {n:>6} {any_row['bytes'] / 1e6:>7.0f} {any_row['slices']:>7} {f(mc.get('kvbridge_gbps')):>7} "
            f"{f(mc.get('raw_gbps')):>7} {f(ipc.get('kvbridge_gbps')):>8} {f(ipc.get('engine_gbps')):>8} "
            f"{f(ratio, '.2f'):>7} {f(mc.get('kvbridge_p50_ms'), '.2f'):>7} {f(mc.get('raw_p50_ms'), '.2f'):>7} "
            f"{f(ipc.get('kvbridge_p50_ms'), '.2f'):>7} {f(ipc.get('engine_p50_ms'), '.2f'):>7} "
            f"{f(_minus(mc.get('kvbridge_p50_ms'), mc.get('raw_p50_ms')), '.2f'):>6} "
            f"{f(_minus(ipc.get('kvbridge_p50_ms'), ipc.get('engine_p50_ms')), '.2f'):>7} "
            f"{f(mc.get('send_p50_ms'), '.2f'):>6} {f(ipc.get('send_p50_ms'), '.2f'):>7} "
            f"{('yes' if ok else 'NO'):>8}")
        for g in groups.values():
            for why in g["kvbridge_failures"] + g["verify_errors"]:
                lines.append(f"    {g['group']} {alloc} {n}: {why}")
    return "\n".join(lines)


def nixl_table(rows: list[dict[str, Any]]) -> str:
    """The NIXL group beside Mooncake's on the same pages, with the issue-27 goals: random 128K staged on
    NIXL >= 0.8x staged on Mooncake; contiguous 128K kvbridge on NIXL >= 0.85x raw NIXL."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["alloc"], r["tokens"]), {})[r["group"]] = r

    def f(v: Any, spec: str = ".1f") -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    def ratio(a: Any, b: Any) -> float | None:
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    lines = [f"{'alloc':>10} {'tokens':>6} {'kvb nixl':>8} {'stg nixl':>8} {'raw nixl':>8} {'nixl eng':>8} "
             f"{'kvb/raw':>7} {'stg/raw':>7} {'kvb mc':>7} {'stg mc':>7} {'stg n/mc':>8} {'verified':>8}"]
    goals = []
    for (alloc, n), groups in sorted(by_key.items()):
        nx = groups.get("nixl")
        if not nx:
            continue
        mc = groups.get("mooncake-nvlink") or groups.get("mooncake-tcp") or {}
        ok = not nx["verify_errors"] and not nx["kvbridge_failures"] and nx["rooms_verified"]
        stg_vs_mc = ratio(nx.get("staged_gbps"), mc.get("staged_gbps"))
        kvb_vs_raw = ratio(nx.get("kvbridge_gbps"), nx.get("raw_gbps"))
        lines.append(f"{alloc:>10} {n:>6} {f(nx.get('kvbridge_gbps')):>8} {f(nx.get('staged_gbps')):>8} "
                     f"{f(nx.get('raw_gbps')):>8} {f(nx.get('engine_gbps')):>8} {f(kvb_vs_raw, '.2f'):>7} "
                     f"{f(ratio(nx.get('staged_gbps'), nx.get('raw_gbps')), '.2f'):>7} {f(mc.get('kvbridge_gbps')):>7} "
                     f"{f(mc.get('staged_gbps')):>7} {f(stg_vs_mc, '.2f'):>8} {('yes' if ok else 'NO'):>8}")
        if n >= 131072 and alloc == "random" and stg_vs_mc is not None:
            goals.append(f"goal random {n} staged on NIXL >= 0.8x staged on Mooncake: {stg_vs_mc:.2f}x -> "
                         f"{'met' if stg_vs_mc >= 0.8 else 'NOT met'}")
        if n >= 131072 and alloc == "contiguous" and kvb_vs_raw is not None:
            goals.append(f"goal contiguous {n} kvbridge on NIXL >= 0.85x raw NIXL: {kvb_vs_raw:.2f}x -> "
                         f"{'met' if kvb_vs_raw >= 0.85 else 'NOT met'}")
        for why in nx["kvbridge_failures"] + nx["verify_errors"]:
            lines.append(f"    nixl {alloc} {n}: {why}")
    return "\n".join(lines + goals)


def staged_table(rows: list[dict[str, Any]], ceilings: list[dict[str, Any]], slot_mib: int) -> str:
    """The Mooncake rows' staged method against direct, raw Mooncake, the staging ceiling of the same
    pages (``staged_rooms``, slots of ``slot_mib``) and kvbridge on contiguous pages, with the goals."""
    ceiling = {r["tokens"]: r.get(f"slot{slot_mib}", {}).get("staged_gbps") for r in ceilings}
    contiguous = {r["tokens"]: r["kvbridge_gbps"] for r in rows if r["alloc"] == "contiguous"}
    head = (f"{'alloc':>10} {'tokens':>6} {'MB':>7} {'direct':>7} {'slices':>7} {'staged':>7} {'pieces':>6} "
            f"{'raw mc':>7} {'ceiling':>7} {'stg/dir':>7} {'stg/raw':>7} {'stg/ceil':>8} {'stg/contig':>10} "
            f"{'verified':>8}")
    lines = [head]

    def f(v: Any, spec: str = ".1f") -> str:
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    def ratio(a: Any, b: Any) -> float | None:
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    goals = []
    for r in sorted(rows, key=lambda r: (r["alloc"], r["tokens"])):
        if not r.get("staged_gbps") and not r.get("kvbridge_gbps"):
            continue
        ceil = ceiling.get(r["tokens"]) if r["alloc"] == "random" else None
        ok = not r["verify_errors"] and not r["kvbridge_failures"] and r["rooms_verified"]
        lines.append(
            f"{r['alloc']:>10} {r['tokens']:>6} {r['bytes'] / 1e6:>7.0f} {f(r['kvbridge_gbps']):>7} "
            f"{f(r['kvbridge_slices'], 'd'):>7} {f(r.get('staged_gbps')):>7} {f(r.get('staged_slices'), 'd'):>6} "
            f"{f(r['raw_gbps']):>7} {f(ceil):>7} {f(ratio(r.get('staged_gbps'), r['kvbridge_gbps']), '.2f'):>7} "
            f"{f(ratio(r.get('staged_gbps'), r['raw_gbps']), '.2f'):>7} "
            f"{f(ratio(r.get('staged_gbps'), ceil), '.2f'):>8} "
            f"{f(ratio(r.get('staged_gbps'), contiguous.get(r['tokens'])), '.2f'):>10} {('yes' if ok else 'NO'):>8}")
        for why in r["kvbridge_failures"] + r["verify_errors"]:
            lines.append(f"    {r['alloc']} {r['tokens']}: {why}")
        if r["alloc"] == "random" and r.get("staged_gbps"):
            bar = {8192: 100.0, 131072: 300.0}.get(r["tokens"])
            if bar:
                goals.append(f"goal {r['tokens']} tokens random >= {bar:.0f} GB/s: staged {r['staged_gbps']:.1f} "
                             f"({'met' if r['staged_gbps'] >= bar else 'not met'})")
            c = ratio(r["staged_gbps"], ceil)
            if c is not None:
                goals.append(f"goal {r['tokens']} tokens random >= 0.8x the staging ceiling: {c:.2f} "
                             f"({'met' if c >= 0.8 else 'not met'})")
    return "\n".join(lines + goals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--alloc", nargs="+", default=["contiguous", "random"], choices=["contiguous", "random"])
    ap.add_argument("--groups", nargs="*", default=["mooncake-nvlink", "ipc"], choices=sorted(GROUPS),
                    help="mooncake-nvlink falls back to mooncake-tcp when it cannot move a room")
    ap.add_argument("--mooncake-alloc", nargs="+", default=None, choices=["contiguous", "random"],
                    help="allocations for the Mooncake groups (default: --alloc)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--verify-first", action="store_true", help="check only the first room of each length")
    ap.add_argument("--ceilings", action="store_true", help="measure the copy ceilings first (one process)")
    ap.add_argument("--ceiling-pages", type=int, default=65536)
    ap.add_argument("--slot-mib", type=int, nargs="+", default=[16, 64],
                    help="staging slot sizes (MiB) for the staged rooms of --ceilings (the staged rows' own is added)")
    ap.add_argument("--staged-ceilings", action="store_true",
                    help="measure only the staging ceiling of the rooms' pages (not the copy ceilings)")
    ap.add_argument("--staged-slot-mib", type=int, default=256, help="the staged rooms' slots (MiB), both sides")
    ap.add_argument("--decode-slots", type=int, default=4, help="decode's staging slots for the staged rooms")
    ap.add_argument("--gather-slots", type=int, default=2, help="each prefill rank's gather slots for the staged rooms")
    ap.add_argument("--trace-tokens", type=int, nargs="*", default=[],
                    help="also run traced rooms of these lengths (contiguous), every group")
    ap.add_argument("--trace-reps", type=int, default=10)
    ap.add_argument("--trace-staged", action="store_true",
                    help="traced rooms on random pages, staged ones too (Mooncake groups): the chunk timeline")
    ap.add_argument("--trace-out", default="", help="copy the trace lines here")
    ap.add_argument("--aux-written", action="store_true",
                    help="decode takes each room's aux row as a write into its aux rows (one slice more per room), "
                         "not in the report that carries it (DecodeConfig.aux_inline, the default)")
    ap.add_argument("--ask-first", action="store_true",
                    help="an engine's order: decode asks first (its request and the room's ticket in on every prefill "
                         "rank 50 ms before the sends), every prefill rank calls send() at one instant, and a room's "
                         "time runs from it to decode seeing Success (default: decode asks last and the time runs "
                         "from its receiver(); the raw baselines are timed from their posts either way)")
    ap.add_argument("--send-early", type=float, default=0.0, metavar="MS",
                    help="with --ask-first: every prefill rank queues MS ms of GPU work (a sleep kernel: the forward's "
                         "last layers, simulated) and calls send() at once with that work's event as ready_event, as "
                         "vLLM's wait_for_save does (its event follows the forward's launches; SGLang sends early "
                         "only a cached prefix); a room's time runs from the end of that work (timed by CUDA events) "
                         "to decode seeing Success, so send()'s own checks and plan run while the GPU computes")
    ap.add_argument("--send-early-on", choices=("device", "host"), default="device",
                    help="--send-early's tail: a sleep kernel on the rank's GPU (device: an engine's own form; on "
                         "ONE GPU the ranks' processes take turns on it, so their tails end apart and the room's clock, "
                         "started at the last, misses what the first rank moved before it) or a host timer ending at "
                         "one instant on every rank (host: Mooncake's pump waits on the host either way; the IPC engine "
                         "then waits on the caller's thread and launches after the KV is whole, where a CUDA event "
                         "waits on the GPU)")
    ap.add_argument("--json", default="", help="write everything here")
    args = ap.parse_args()
    if args.send_early and not args.ask_first:
        ap.error("--send-early needs --ask-first (decode's request comes while the forward runs)")
    os.environ.setdefault("GLOG_minloglevel", "2")
    import torch

    from kvbridge.worker.cluster import start_bootstrap

    result: dict[str, Any] = {"info": {"gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0),
                                       "torch": torch.__version__, "layers": args.layers, "cp": CP,
                                       "one_gpu": torch.cuda.device_count() < 2, "ask_first": args.ask_first,
                                       "send_early_ms": args.send_early, "send_early_on": args.send_early_on},
                              "rows": [], "errors": []}
    if result["info"]["one_gpu"]:
        log("# ONE GPU: prefill and decode processes share cuda:0 (CUDA IPC within one device)")

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    if args.staged_slot_mib not in args.slot_mib:
        args.slot_mib = [*args.slot_mib, args.staged_slot_mib]
    if args.ceilings:
        t = time.perf_counter()
        try:
            result["ceilings"] = ceilings("cuda:0", "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0",
                                          args.ceiling_pages)
        except Exception as exc:  # noqa: BLE001 - reported, the groups still run
            result["errors"].append(f"ceilings: {type(exc).__name__}: {exc}")
        log(f"# ceilings ({time.perf_counter() - t:.0f}s): {json.dumps(result.get('ceilings'))}")
        save()
    if args.ceilings or args.staged_ceilings:
        t = time.perf_counter()
        try:
            result["staged_rooms"] = staged_rooms(args.tokens, args.layers, args.slot_mib, "cuda:0")
        except Exception as exc:  # noqa: BLE001 - reported, the groups still run
            result["errors"].append(f"staged rooms: {type(exc).__name__}: {exc}")
        log(f"# staged rooms ({time.perf_counter() - t:.0f}s)")
        save()
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _):
        for name in args.groups:
            t = time.perf_counter()
            allocs = args.mooncake_alloc if name.startswith("mooncake") and args.mooncake_alloc else args.alloc
            try:
                rows = run_group(name, args, url, args.tokens, allocs, args.reps)
                if name == "mooncake-nvlink" and all(r["kvbridge_gbps"] is None for r in rows):
                    raise RuntimeError(f"no room moved: {rows[0]['kvbridge_failures']}")
            except Exception as exc:  # noqa: BLE001 - reported; nvlink falls back to tcp
                result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                log(f"# {name} failed: {exc}")
                if name != "mooncake-nvlink":
                    continue
                name = "mooncake-tcp"  # about 1 GB/s: 128K-token rooms would take most of the run
                rows = run_group(name, args, url, [t for t in args.tokens if t <= 32768] or args.tokens, allocs,
                                 args.reps)
            log(f"# {name}: {time.perf_counter() - t:.0f}s")
            result["rows"] += rows
            save()
        if args.trace_tokens:
            result["trace"] = []
            for name in args.groups:
                if name == "mooncake-nvlink" and any(r["group"] == "mooncake-tcp" for r in result["rows"]):
                    name = "mooncake-tcp"
                for tokens in args.trace_tokens:
                    try:
                        result["trace"].append(traced(name, args, url, tokens))
                    except Exception as exc:  # noqa: BLE001
                        result["errors"].append(f"trace {name} {tokens}: {type(exc).__name__}: {exc}")
                    save()
    if result["rows"]:
        print(f"\nkvbridge on GPU memory: {PRESET}, {args.layers}+1 layers, page {PAGE}, CP={CP}, every rank its own "
              f"process, {'ONE GPU (both sides on cuda:0)' if result['info']['one_gpu'] else 'cuda:0 -> cuda:1'}; "
              f"GB/s of payload, median of {args.reps}; kvb/mc: kvbridge on Mooncake "
              f"({'nvlink' if any(r['group'] == 'mooncake-nvlink' for r in result['rows']) else 'tcp'}), raw mc: raw "
              f"Mooncake on the same slices, kvb/ipc: kvbridge on the IPC engine, ipc eng: that engine alone; "
              "mc snd / ipc snd: the slowest prefill rank's send() call (p50 ms); "
              + (f"decode asks first and every prefill rank calls send() {args.send_early:g} ms before its KV is "
                 "whole (vLLM's order): kvbridge timed from the KV whole to decode seeing Success"
                 if args.send_early else
                 "decode asks first (an engine's order): kvbridge timed from the prefill ranks' send() to decode "
                 "seeing Success" if args.ask_first else "decode asks last: kvbridge timed from its receiver()"))
        print(table(result["rows"]))
    if any(r["group"] == "nixl" for r in result["rows"]):
        where = "ONE GPU: both sides on cuda:0" if result["info"]["one_gpu"] else "cuda:0 -> cuda:1"
        print(f"\nkvbridge on NIXL (UCX; {where}), beside Mooncake on the same pages; GB/s of payload, median of "
              f"{args.reps}; raw nixl: the NIXL agent on the same slices; stg n/mc: staged on NIXL over staged on "
              "Mooncake")
        print(nixl_table(result["rows"]))
    if result.get("ceilings"):
        c = result["ceilings"]
        best = max(c["kernel_random_pages"].items(), key=lambda kv: kv[1]["gbps"])
        print(f"ceilings (same run, one process): d2d copy {c['d2d_copy_gbps']} GB/s; random pages: index_copy_ "
              f"{c['index_copy_gbps']}, staging (gather+copy+scatter) {c['staging_gbps']}, slice kernel "
              f"{best[1]['gbps']} ({best[0]}); contiguous 64 runs: kernel {c['contiguous_kernel_gbps']}, memcpy "
              f"{c['contiguous_memcpy_gbps']}; checks ok: staging {c['staging_ok']}, unaligned {c['unaligned_ok']}, "
              f"contiguous {c['contiguous_ok']}")
        print(f"staged blocks (stage_plan + CudaStager, 64 MiB slots): {json.dumps(c.get('staged_blocks'))}")
    for r in result.get("staged_rooms") or []:
        for mib in args.slot_mib:
            p = r[f"slot{mib}"]
            print(f"staged room {r['tokens']} tokens ({r['bytes'] / 1e6:.0f} MB, {r['plan_slices']} slices, random, "
                  f"{r['device']} both sides), {mib} MiB slots x2: staged {p['staged_gbps']} GB/s (gather "
                  f"{p['gather_gbps']}, slot copy {p['wire_gbps']}, scatter {p['scatter_gbps']}; serial sum "
                  f"{p['serial_sum_gbps']}); slice kernel direct {r['kernel_direct_gbps']}; {p['chunks']} chunks, "
                  f"{p['wire_pieces']} pieces; ok {p['ok']}")
    mc_rows = [r for r in result["rows"] if r["group"].startswith("mooncake")]
    if any(r.get("staged_gbps") for r in mc_rows):
        where = "ONE GPU: both sides on cuda:0" if result["info"]["one_gpu"] else "cuda:0 -> cuda:1"
        print(f"\nstaged rooms end to end ({mc_rows[0]['group']}; {where}; "
              f"{args.staged_slot_mib} MiB slots, {args.gather_slots} per prefill rank, {args.decode_slots} on "
              f"decode); direct / "
              f"staged / raw: GB/s of payload, median of {args.reps}; slices: kvbridge direct's per room, pieces: "
              f"staged wire pieces per room; ceiling: the staging ceiling of the same pages (one process, "
              f"{args.staged_slot_mib} MiB slots); stg/contig: staged over kvbridge direct on contiguous pages")
        print(staged_table(mc_rows, result.get("staged_rooms") or [], args.staged_slot_mib))
    for e in result["errors"]:
        print(f"error: {e}")
    save()


if __name__ == "__main__":
    main()
