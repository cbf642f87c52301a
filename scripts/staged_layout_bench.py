#!/usr/bin/env python
"""The staging ceiling in the staged rooms' own process layout (issue 33): does one GPU shared by
three processes (two prefill CP ranks gathering, one decode rank scattering, as
``scripts/gpu_bench.py``'s staged rooms run on one H200) bound the staged rooms, or is the bound
kvbridge's?

The same work, three layouts, on one GPU:

    one stream     one process, every chunk gathered then scattered in turn on one stream
                   (gpu_bench's ``--staged-ceilings`` reading, less the slot copy)
    three streams  one process (one CUDA context), the two gathers and the scatter each on
                   its own stream at once (what one process of three threads could reach)
    three procs    three processes (three CUDA contexts) at once: rank 0 gathers, rank 1
                   gathers, decode scatters, each in its own loop, started at one barrier

Work: DeepSeek V3.2 fp8 pools (``deepseek-v3.2-fp8``, 61 + 1 draft layers, page 64), CP 2,
random allocation (``kvbridge.bench.alloc.allocate``, the bench's seed per length), each rank's
plan staged by ``stage_plan`` into ``--slot-mib`` slots; a gather copies a chunk's slices into a
slot, a scatter copies a slot's slices into decode's pages (the slice kernel,
``CudaStager``). With ``--wire`` (the default) each gathered chunk is also copied into decode's
slot (``cudaMemcpyAsync``, the slot write of a staged room on one GPU; across the three processes
into decode's slots opened over CUDA IPC); ``--no-wire`` compares the gathers and the scatter
alone. Nothing orders a scatter after its chunk's copy (a throughput ceiling: the bytes are not
checked). GB/s = payload bytes of one room (each byte gathered once
and scattered once) / wall time of ``--reps`` rooms, from the first start to the last end.

    python scripts/staged_layout_bench.py [--tokens 8192 32768 131072] [--slot-mib 64] [--reps 5]
        [--device cuda:0] [--no-wire] [--json out.json]

Without CUDA it says so and exits 0 (nothing to measure on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET, PAGE, CP, LAYERS = "deepseek-v3.2-fp8", 64, 2, 61


def build(tokens: int, slot_mib: int, device: str) -> dict[str, Any]:
    """Pools, the random allocation, and each rank's staged plan (the same in every process)."""
    import torch

    from kvbridge.bench.alloc import allocate
    from kvbridge.layout import OwnerLanes, describe_buffer, plan_transfer, preset_pools, stage_plan

    specs = preset_pools(PRESET, num_layers=LAYERS, page_size=PAGE, draft_layers=1)
    lanes = OwnerLanes(CP)
    num_pages = -(-tokens // PAGE)
    src_cap = max(1, len(lanes.owned_pages(0, num_pages)))
    keys = [(s.name, lid) for s in specs.values() for lid in s.layer_ids]
    src = [{k: torch.zeros((src_cap, specs[k[0]].bytes_per_page), dtype=torch.uint8, device=device) for k in keys}
           for _ in range(CP)]
    dst = {k: torch.zeros((num_pages, specs[k[0]].bytes_per_page), dtype=torch.uint8, device=device) for k in keys}

    def descs(bufs: dict) -> list:
        return [describe_buffer(specs[p], lid, t) for (p, lid), t in bufs.items()]

    alloc = allocate("random", num_pages, lanes, src_cap, num_pages, seed=tokens)
    plans = [plan_transfer(specs, descs(src[r]), descs(dst), alloc.owned[r], alloc.local[r],
                           alloc.page_ids[alloc.owned[r]], tokens) for r in range(CP)]
    staged = [stage_plan(p, slot_mib << 20) for p in plans]
    slots = [torch.zeros(2 * (slot_mib << 20), dtype=torch.uint8, device=device) for _ in range(CP + 1)]
    return {"src": src, "dst": dst, "staged": staged, "slots": slots, "slot_bytes": slot_mib << 20,
            "bytes": sum(int(p.length.sum()) for p in plans)}


def gather_all(stager: Any, w: dict, rank: int) -> None:
    """Rank ``rank``'s chunks gathered into its slots, each then copied into decode's (``w["wire"]``)."""
    sp, slot = w["staged"][rank], w["slots"][rank]
    recv = w["slots"][CP].data_ptr()
    for k in range(sp.num_chunks):
        off = (k % 2) * w["slot_bytes"]
        stager.gather(sp, k, slot.data_ptr() + off)
        if w.get("wire"):
            stager.copier.copy_async(recv + off, slot.data_ptr() + off, int(sp.chunk_span[k]))


def scatter_all(stager: Any, w: dict) -> None:
    slot = w["slots"][CP]
    for sp in w["staged"]:
        for k in range(sp.num_chunks):
            stager.scatter(sp, k, slot.data_ptr() + (k % 2) * w["slot_bytes"])


def one_process(tokens: int, slot_mib: int, reps: int, device: str, wire: bool = True) -> dict[str, float]:
    import torch

    from kvbridge.transfer.staging.stagers import CudaStager

    w = build(tokens, slot_mib, device)
    w["wire"] = wire
    index = torch.device(device).index or 0
    one = CudaStager(index)
    three = [CudaStager(index) for _ in range(CP + 1)]  # each its own copier stream

    def serial() -> None:
        for r in range(CP):
            gather_all(one, w, r)
        scatter_all(one, w)
        one.copier.stream.synchronize()

    def streams() -> None:
        for r in range(CP):
            gather_all(three[r], w, r)
        scatter_all(three[CP], w)
        for s in three:
            s.copier.stream.synchronize()

    def parts() -> dict[str, float]:
        out = {}
        for name, fn in (("gather0", lambda: gather_all(one, w, 0)), ("gather1", lambda: gather_all(one, w, 1)),
                         ("scatter", lambda: scatter_all(one, w))):
            fn()
            one.copier.stream.synchronize()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            one.copier.stream.synchronize()
            out[f"{name}_ms"] = round((time.perf_counter() - t) / reps * 1e3, 2)
        return out

    res = {}
    for name, fn in (("one_stream", serial), ("three_streams", streams)):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        res[f"{name}_gbps"] = round(w["bytes"] * reps / (time.perf_counter() - t) / 1e9, 1)
    res.update(parts())
    res["bytes"] = w["bytes"]
    res["chunks"] = sum(sp.num_chunks for sp in w["staged"])
    del w
    torch.cuda.empty_cache()
    return res


def _proc(role: int, tokens: int, slot_mib: int, reps: int, device: str, barrier: Any, out: Any, slots: Any,
          wire: bool) -> None:
    """One process of the three: role 0 / 1 gathers that rank's chunks (and copies each into decode's
    slots, opened over CUDA IPC, with ``wire``), role CP scatters all."""
    import torch

    from kvbridge.transfer.staging.stagers import CudaStager

    w = build(tokens, slot_mib, device)
    w["wire"] = wire
    if role == CP:  # decode: its slots, shared with the gathering processes
        for _ in range(CP):
            slots.put(w["slots"][CP])
    elif wire:
        w["slots"][CP] = slots.get(timeout=120)  # decode's slots, mapped here by CUDA IPC
    stager = CudaStager(torch.device(device).index or 0)

    def work() -> None:
        gather_all(stager, w, role) if role < CP else scatter_all(stager, w)

    work()  # warm-up: the kernel compiled, the tables sized
    stager.copier.stream.synchronize()
    torch.cuda.synchronize()
    barrier.wait()
    t0 = time.monotonic()
    for _ in range(reps):
        work()
    stager.copier.stream.synchronize()
    out.put((role, t0, time.monotonic(), w["bytes"]))
    barrier.wait()  # decode's slots stay allocated until every writer into them is done


def three_processes(tokens: int, slot_mib: int, reps: int, device: str, wire: bool = True) -> dict[str, float]:
    import torch.multiprocessing as tmp  # its queues pass CUDA tensors as CUDA IPC handles

    ctx = tmp.get_context("spawn")
    barrier, out, slots = ctx.Barrier(CP + 1), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_proc, args=(r, tokens, slot_mib, reps, device, barrier, out, slots, wire))
             for r in range(CP + 1)]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    start, end = min(g[1] for g in got), max(g[2] for g in got)
    nbytes = got[0][3]
    each = {f"proc{g[0]}_ms": round((g[2] - g[1]) / reps * 1e3, 2) for g in sorted(got)}
    return {"three_procs_gbps": round(nbytes * reps / (end - start) / 1e9, 1), **each}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--slot-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--wire", action=argparse.BooleanOptionalAction, default=True,
                    help="copy each gathered chunk into decode's slot (across processes: over CUDA IPC)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    try:
        import torch

        have_cuda = torch.cuda.is_available()
    except ImportError:
        have_cuda = False
    if not have_cuda:
        print("staged_layout_bench: no CUDA device here; nothing measured")
        return
    rows = []
    print("| tokens | one stream (GB/s) | three streams, one process | three processes | gather0 / gather1 / "
          "scatter alone (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.tokens:
        row = {"tokens": n, "slot_mib": args.slot_mib, "wire": args.wire,
               **one_process(n, args.slot_mib, args.reps, args.device, args.wire),
               **three_processes(n, args.slot_mib, args.reps, args.device, args.wire)}
        rows.append(row)
        print(f"| {n} | {row['one_stream_gbps']} | {row['three_streams_gbps']} | {row['three_procs_gbps']} | "
              f"{row['gather0_ms']} / {row['gather1_ms']} / {row['scatter_ms']} |", flush=True)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
