#!/usr/bin/env python
"""The staging ceiling in the staged rooms' own process layout (issue 33): does one GPU shared by
three processes (two prefill CP ranks gathering, one decode rank scattering, as
``scripts/gpu_bench.py``'s staged rooms run on one GPU) bound the staged rooms, or is the bound
kvbridge's?

The same work, four layouts, on one GPU:

    one stream     one process, every chunk gathered then scattered in turn on one stream
                   (gpu_bench's ``--staged-ceilings`` reading, less the slot copy)
    three streams  one process (one CUDA context), the two gathers and the scatter each on
                   its own stream at once (what one process of three threads could reach)
    three procs    three processes (three CUDA contexts) at once: rank 0 gathers, rank 1
                   gathers, decode scatters, each in its own loop, started at one barrier
    chained        the same three processes, each chunk waiting for what a staged room's chunk
                   waits for: a free gather slot, decode's grant (asked for, ``ask``, as
                   kvbridge's protocol does, or sent unasked, ``ahead``), the end of its write
                   before it is reported landed, the end of its scatter before the slot is
                   granted again (``--gather-slots`` per rank, ``--decode-slots`` on decode). A
                   pipe message and a busy-polled CUDA event are each step's only host work, so
                   the chain costs what its dependencies cost on this GPU and nothing of
                   kvbridge's; the last room lands on poisoned pages and every byte is checked
                   (``chained``; on the CPU it runs in host memory, how a test checks it)

Work: DeepSeek V3.2 fp8 pools (``deepseek-v3.2-fp8``, 61 + 1 draft layers, page 64), CP 2,
random allocation (``kvbridge.bench.alloc.allocate``, the bench's seed per length), each rank's
plan staged by ``stage_plan`` into ``--slot-mib`` slots; a gather copies a chunk's slices into a
slot, a scatter copies a slot's slices into decode's pages (the slice kernel,
``CudaStager``). With ``--wire`` (the default) each gathered chunk is also copied into decode's
slot (``cudaMemcpyAsync``, the slot write of a staged room on one GPU; across the three processes
into decode's slots opened over CUDA IPC); ``--no-wire`` compares the gathers and the scatter
alone. In the first three layouts nothing orders a scatter after its chunk's copy (a throughput
ceiling: the bytes are not checked). GB/s = payload bytes of one room (each byte gathered once
and scattered once) / wall time of ``--reps`` rooms, from the first start to the last end; chained:
payload bytes / the median room (after a warm-up room), timed on decode from a barrier to its last
scatter's end.

    python scripts/staged_layout_bench.py [--tokens 8192 32768 131072] [--slot-mib 64] [--reps 5]
        [--device cuda:0] [--no-wire] [--no-chain] [--gather-slots 2] [--decode-slots 4] [--json out.json]

Without CUDA it says so and exits 0 (nothing to measure on the CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import struct
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET, PAGE, CP, LAYERS = "deepseek-v3.2-fp8", 64, 2, 61


def build(tokens: int, slot_mib: int, device: str, layers: int = LAYERS, slot_bytes: int = 0,
          slots: bool = True) -> dict[str, Any]:
    """Pools, the random allocation, and each rank's staged plan (the same in every process).
    ``slot_bytes`` (a test's small slots) overrides ``slot_mib``. ``slots``: the unchained layouts'
    double-buffered slots, one per rank and one for decode (``w["slots"]``); ``slots=False`` leaves
    them out (``None``), for the chained layout, which sizes its own from its slot counts."""
    import torch

    from kvbridge.bench.alloc import allocate
    from kvbridge.layout import OwnerLanes, describe_buffer, plan_transfer, preset_pools, stage_plan

    slot_bytes = slot_bytes or slot_mib << 20
    specs = preset_pools(PRESET, num_layers=layers, page_size=PAGE, draft_layers=1)
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
    staged = [stage_plan(p, slot_bytes) for p in plans]
    bufs = [torch.zeros(2 * slot_bytes, dtype=torch.uint8, device=device) for _ in range(CP + 1)] if slots else None
    return {"src": src, "dst": dst, "staged": staged, "slots": bufs, "slot_bytes": slot_bytes,
            "bytes": sum(int(p.length.sum()) for p in plans), "specs": specs, "alloc": alloc}


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


# -- the chained layout: the staged rooms' dependencies, with as little host work as a chunk can have ----------

ASK, GRANT, LANDED = struct.Struct("<q"), struct.Struct("<q"), struct.Struct("<qq")
GRANTS = ("ask", "ahead")


class _Copies:
    """Gather, slot write and scatter on one process's stream (CUDA), or done on return (CPU: the
    host stager and a memmove into decode's shared slots, how a test runs the chain without a GPU)."""

    def __init__(self, device: str) -> None:
        import torch

        from kvbridge.transfer.staging.stagers import CudaStager, HostStager

        self.cuda = device.startswith("cuda")
        self.stager = CudaStager(torch.device(device).index or 0) if self.cuda else HostStager()

    def gather(self, sp: Any, k: int, slot: int) -> Any:
        return self.stager.gather(sp, k, slot)

    def write(self, dst: int, src: int, nbytes: int) -> Any:
        if not self.cuda:
            ctypes.memmove(dst, src, nbytes)
            return None
        self.stager.copier.copy_async(dst, src, nbytes)
        return self.stager.copier.record()

    def scatter(self, sp: Any, k: int, slot: int) -> Any:
        return self.stager.scatter(sp, k, slot)

    @staticmethod
    def done(event: Any) -> bool:
        return event is None or bool(event.query())

    def drain(self) -> None:
        if self.cuda:
            self.stager.copier.stream.synchronize()


def _prefill_room(conn: Any, copies: _Copies, sp: Any, gather_base: int, decode_base: int, slot_bytes: int,
                  gather_slots: int, grants: str, deadline: float) -> None:
    """One rank's chunks: each gathered as soon as a gather slot is free (and, ``ask``, asked for
    then), written into the decode slot its grant names, and reported landed once the write's event
    completed; the gather slot is free again then. Busy-polls its pipe and its events, until
    ``deadline`` (monotonic) at the latest."""
    n, span = sp.num_chunks, sp.chunk_span
    free_g, gathered, inflight, granted = deque(range(gather_slots)), deque(), deque(), deque()
    k_next = landed = 0
    while landed < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"chained prefill: {landed} of {n} chunks landed by the deadline")
        while conn.poll():
            granted.append(GRANT.unpack(conn.recv_bytes())[0])
        while free_g and k_next < n:
            g = free_g.popleft()
            copies.gather(sp, k_next, gather_base + g * slot_bytes)
            if grants == "ask":
                conn.send_bytes(ASK.pack(k_next))
            gathered.append((g, k_next))
            k_next += 1
        while gathered and granted:
            (g, k), d = gathered.popleft(), granted.popleft()
            inflight.append((copies.write(decode_base + d * slot_bytes, gather_base + g * slot_bytes, int(span[k])),
                             g, d, k))
        while inflight and copies.done(inflight[0][0]):
            _, g, d, k = inflight.popleft()
            conn.send_bytes(LANDED.pack(k, d))
            free_g.append(g)
            landed += 1


def _decode_room(conns: list[Any], copies: _Copies, staged: list[Any], decode_base: int, slot_bytes: int,
                 decode_slots: int, grants: str, deadline: float, drop: bool = False) -> list[float]:
    """Decode's side of one room: a free slot goes to the oldest ask (``ask``) or, unasked, to the
    rank with the most chunks not yet granted (``ahead``); a landed chunk is scattered at once, and
    its slot is free again when the scatter's event completed. Returns each chunk's slot hold
    (grant -> scatter complete, ms). ``drop``: a test's fault, the first landed chunk is not scattered
    (its pages keep what they held; the check must say so)."""
    ungranted = [sp.num_chunks for sp in staged]
    total = sum(ungranted)
    free_d, asks, scatters = deque(range(decode_slots)), deque(), deque()
    since: dict[int, float] = {}
    holds: list[float] = []
    while len(holds) < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"chained decode: {len(holds)} of {total} chunks scattered by the deadline")
        for r, c in enumerate(conns):
            while c.poll():
                body = c.recv_bytes()
                if len(body) == ASK.size:
                    asks.append(r)
                    continue
                k, d = LANDED.unpack(body)
                ev = None if drop else copies.scatter(staged[r], k, decode_base + d * slot_bytes)
                scatters.append((ev, d))
                drop = False
        while scatters and copies.done(scatters[0][0]):
            d = scatters.popleft()[1]
            holds.append((time.perf_counter() - since.pop(d)) * 1e3)
            free_d.append(d)
        while free_d and (asks if grants == "ask" else any(ungranted)):
            r = asks.popleft() if grants == "ask" else max(range(CP), key=lambda i: ungranted[i])
            ungranted[r] -= 1
            d = free_d.popleft()
            since[d] = time.perf_counter()
            conns[r].send_bytes(GRANT.pack(d))
    return holds


def _chain_proc(role: int, tokens: int, slot_mib: int, reps: int, device: str, gather_slots: int, decode_slots: int,
                grants: str, layers: int, slot_bytes: int, barrier: Any, out: Any, slots: Any, conn: Any,
                fault: str, timeout: float) -> None:
    """One process of the chain: role < CP a prefill rank, role CP decode (``conn``: its pipes). Every
    wait is bounded by ``timeout`` (a peer that died leaves this one raising, not spinning)."""
    import torch

    from kvbridge.bench import pattern

    w = build(tokens, slot_mib, device, layers, slot_bytes, slots=False)  # its slots are its own, below
    sb, specs, alloc, seed = w["slot_bytes"], w["specs"], w["alloc"], tokens
    copies = _Copies(device)
    if role == CP:
        mine = torch.zeros(decode_slots * sb, dtype=torch.uint8, device=device).share_memory_()
        for _ in range(CP):
            slots.put(mine)
        base = mine.data_ptr()
    else:
        for (pool, lid), buf in w["src"][role].items():
            pattern.fill(specs[pool], buf, seed, lid, alloc.owned[role], alloc.local[role])
        mine = torch.zeros(gather_slots * sb, dtype=torch.uint8, device=device)
        theirs = slots.get(timeout=timeout)  # decode's slots, mapped here (CUDA IPC, or shared host memory)
        base, decode_base = mine.data_ptr(), theirs.data_ptr()
    room_ms: list[float] = []
    holds: list[float] = []
    checked, error = 0, ""
    for rep in range(reps + 1):  # a warm-up room first: the kernel compiled, the tables sized
        last = rep == reps
        if fault == "die" and role == 0 and last:  # a test's fault: a prefill process gone mid-run
            os._exit(3)
        if role == CP and last:  # the last room lands on poisoned pages and is checked
            for (pool, lid), buf in w["dst"].items():
                pattern.poison(buf, alloc.page_ids)
        torch.cuda.synchronize() if copies.cuda else None
        barrier.wait(timeout)
        t0, deadline = time.perf_counter(), time.monotonic() + timeout
        if role == CP:
            h = _decode_room(conn, copies, w["staged"], base, sb, decode_slots, grants, deadline,
                             last and fault == "drop")
            copies.drain()  # inside the room's time
            if rep:
                room_ms.append((time.perf_counter() - t0) * 1e3)
                holds += h
        else:
            _prefill_room(conn, copies, w["staged"][role], base, decode_base, sb, gather_slots, grants, deadline)
            copies.drain()
    if role == CP:
        for (pool, lid), buf in w["dst"].items():
            n, why = pattern.check(specs[pool], buf, seed, lid, alloc.page_ids, tokens)
            checked += n
            error = error or why
        out.put({"room_ms": room_ms, "holds": holds, "bytes": w["bytes"], "checked": checked, "error": error,
                 "chunks": sum(sp.num_chunks for sp in w["staged"])})
    barrier.wait(timeout)  # decode's slots stay allocated until every writer into them is done


def chained(tokens: int, slot_mib: int, reps: int, device: str, gather_slots: int = 2, decode_slots: int = 4,
            grants: str = "ask", layers: int = LAYERS, slot_bytes: int = 0, timeout: float = 300,
            fault: str = "") -> dict[str, Any]:
    """The staged rooms' chain of dependencies in their process layout (two prefill processes, one
    decode process), with a pipe message and an event query as each step's only host work.

    Per chunk, as a kvbridge staged room: prefill gathers it into a free gather slot (ahead of any
    grant) and, with ``grants="ask"``, asks decode for a slot; decode grants a free slot; prefill
    writes the chunk into it (a copy on its stream into decode's slot, opened over CUDA IPC) and,
    once that copy completed, reports it landed; decode scatters it into the pages, and the slot
    is free again once the scatter completed. ``grants="ahead"``: decode grants free slots unasked
    (no ask trip). Every process busy-polls its pipes and events, so no step waits on a wake-up.
    Each room's time runs on decode from a barrier to its last scatter's end; the last room lands on
    poisoned pages and decode checks every byte. Returns ``chain_*`` keys."""
    import torch.multiprocessing as tmp  # its queues pass CUDA tensors as CUDA IPC handles

    if grants not in GRANTS:
        raise ValueError(f"grants must be one of {GRANTS}, got {grants!r}")
    ctx = tmp.get_context("spawn")
    barrier, out, slots = ctx.Barrier(CP + 1), ctx.Queue(), ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(CP)]  # (decode's end, the prefill rank's end)
    procs = [ctx.Process(target=_chain_proc, args=(role, tokens, slot_mib, reps, device, gather_slots, decode_slots,
                                                   grants, layers, slot_bytes, barrier, out, slots,
                                                   [p[0] for p in pipes] if role == CP else pipes[role][1], fault,
                                                   timeout))
             for role in range(CP + 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout * (reps + 3)  # each room's waits are bounded by ``timeout``
    got = None
    try:
        while got is None:
            try:
                got = out.get(timeout=1)
            except queue.Empty:
                dead = [f"{'decode' if r == CP else f'prefill cp{r}'} exited {p.exitcode}"
                        for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"chained rooms ({tokens} tokens): " + ("; ".join(dead) or "no result in time"))
    finally:
        for p in procs:
            if got is not None:
                p.join(timeout)  # the last barrier, then exit
            if p.is_alive():
                p.kill()
            p.join(10)
    ms = sorted(got["room_ms"])
    holds = sorted(got["holds"])
    p50 = ms[len(ms) // 2]
    return {f"chain_{grants}_gbps": round(got["bytes"] / p50 / 1e6, 1), f"chain_{grants}_room_ms": round(p50, 2),
            f"chain_{grants}_hold_ms": round(holds[len(holds) // 2], 3) if holds else None,
            f"chain_{grants}_verified": bool(got["checked"]) and not got["error"],
            f"chain_{grants}_error": got["error"], "chunks": got["chunks"], "bytes": got["bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--slot-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--wire", action=argparse.BooleanOptionalAction, default=True,
                    help="copy each gathered chunk into decode's slot (across processes: over CUDA IPC)")
    ap.add_argument("--chain", action=argparse.BooleanOptionalAction, default=True,
                    help="the chained layout too (grants asked for, and sent ahead)")
    ap.add_argument("--gather-slots", type=int, default=2, help="chained: gather slots per prefill rank")
    ap.add_argument("--decode-slots", type=int, default=4, help="chained: slots on decode")
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
    print("| tokens | one stream (GB/s) | three streams, one process | three processes | chained, ask / ahead | "
          "gather0 / gather1 / scatter alone (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.tokens:
        row = {"tokens": n, "slot_mib": args.slot_mib, "wire": args.wire,
               **one_process(n, args.slot_mib, args.reps, args.device, args.wire),
               **three_processes(n, args.slot_mib, args.reps, args.device, args.wire)}
        for grants in GRANTS if args.chain else ():
            row.update(chained(n, args.slot_mib, args.reps, args.device, args.gather_slots, args.decode_slots, grants))
        rows.append(row)
        chain = " / ".join(f"{row[f'chain_{g}_gbps']}{'' if row[f'chain_{g}_verified'] else ' (bytes WRONG)'}"
                           for g in GRANTS) if args.chain else "-"
        print(f"| {n} | {row['one_stream_gbps']} | {row['three_streams_gbps']} | {row['three_procs_gbps']} | {chain} | "
              f"{row['gather0_ms']} / {row['gather1_ms']} / {row['scatter_ms']} |", flush=True)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
