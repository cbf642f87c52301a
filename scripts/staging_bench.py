#!/usr/bin/env python
"""Staged transfers' building blocks against the direct path, on Mooncake TCP loopback (or NIXL).

Two engines in this process (Mooncake: TCP on 127.0.0.1; ``--engine nixl``: NIXL/UCX): the
prefill pools and send staging area registered with one, the decode pools and receive staging
area with the other. One CP
rank, V3.2 fp8 latent geometry by default (656 B per token per layer, page 64: 41,984 B pages;
--page-tokens and --kv-dtype change it), random
allocation on both sides (every page of every layer its own slice). Per room size:

    direct       kvbridge's Mooncake engine, the plan's slices as they are (submit_write + wait)
    raw          the Mooncake binding, the same slices, <= 1,024 per batch_transfer_sync_write
                 (Mooncake only: on NIXL the column is left out)
    staged       StagedWriter: gather -> wire pieces -> scatter, pipelined by chunks
    ceiling      the staged path's parts alone: every gather, one contiguous write of the
                 room's bytes (in slot-sized pieces), every scatter; serial sum and the slowest
    contiguous   kvbridge's engine on contiguous pages (one slice per layer)

then a crossover sweep: slices of one size (1 to 64 pages) and counts, direct vs staged,
which sets the engine's staging thresholds (its entry in ``kvbridge/transfer/engine/registry.py``).
Every staged room is checked byte for byte against the source. Figures are the best of --reps.

    PYTHONPATH=$PWD .venv/bin/python scripts/staging_bench.py [--engine nixl] [--tokens 8K,32K] [--layers 61] [--reps 2]
        [--page-tokens 16 --kv-dtype bf16]   # vLLM's CPU MLA pages (block 16, 18,432 B)
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvbridge.layout import RawBuffer, TransferPlan, deepseek_pools, describe_buffer, plan_transfer, stage_plan
from kvbridge.transfer.engine import create_engine, tensor_region
from kvbridge.transfer.staging import HostStager, StagedWriter, copy_slices
from kvbridge.transfer.staging.area import StagingArea

CAP = 1024


def tokens(text: str) -> list[int]:
    return [int(t[:-1]) * 1024 if t.upper().endswith("K") else int(t) for t in text.split(",")]


class Rig:
    def __init__(self, layers: int, capacity: int, slot_bytes: int, num_slots: int, piece_bytes: int,
                 engine: str = "mooncake", page_tokens: int = 64, kv_dtype: str = "fp8") -> None:
        self.page_tokens = page_tokens
        self.specs = {"target": deepseek_pools(num_layers=layers, page_size=page_tokens, kv_dtype=kv_dtype, index=False,
                                               draft_layers=0)["target"]}
        spec = self.specs["target"]
        self.engine = engine
        self.a = create_engine(engine, max_slices_per_call=CAP if engine == "mooncake" else None)
        self.b = create_engine(engine, max_slices_per_call=CAP if engine == "mooncake" else None)
        rng = np.random.default_rng(0)
        self.src = {lid: rng.integers(0, 256, (capacity, spec.bytes_per_page), dtype=np.uint8)
                    for lid in spec.layer_ids}
        # np.ones, not zeros: every page is touched now, not on the first copy into it
        self.dst = {lid: np.ones((capacity, spec.bytes_per_page), np.uint8) for lid in spec.layer_ids}
        self.send = np.ones(slot_bytes * num_slots, np.uint8)
        self.recv = np.ones(slot_bytes * num_slots, np.uint8)
        for arr in [*self.src.values(), self.send]:
            self.a.register(*tensor_region(arr))
        for arr in [*self.dst.values(), self.recv]:
            self.b.register(*tensor_region(arr))
        self.a.add_peer(self.b.session_id, self.b.metadata)  # NIXL: the writer loads its target (a no-op elsewhere)
        # as addresses (RawBuffer): the pages are bytes here, whatever the pool's dtype (numpy has no bfloat16)
        def raw(arr: np.ndarray) -> RawBuffer:
            return RawBuffer(arr.ctypes.data, arr.nbytes)

        self.src_descs = [describe_buffer(spec, lid, raw(arr)) for lid, arr in self.src.items()]
        self.dst_descs = [describe_buffer(spec, lid, raw(arr)) for lid, arr in self.dst.items()]
        self.slot_bytes, self.num_slots, self.piece_bytes = slot_bytes, num_slots, piece_bytes

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def plan(self, num_pages: int, alloc: str, seed: int = 1) -> TransferPlan:
        capacity = len(next(iter(self.src.values())))
        rng = np.random.default_rng(seed)
        if alloc == "random":
            sp, dp = rng.permutation(capacity)[:num_pages], rng.permutation(capacity)[:num_pages]
        else:
            sp = dp = np.arange(num_pages)
        return plan_transfer(self.specs, self.src_descs, self.dst_descs, np.arange(num_pages), sp, dp,
                             num_pages * self.page_tokens)

    def writer(self) -> StagedWriter:
        return StagedWriter(self.a, self.b.session_id, send_stager=HostStager(),
                            send_area=StagingArea(self.num_slots, self.slot_bytes), send_base=self.send.ctypes.data,
                            recv_stager=HostStager(), recv_area=StagingArea(self.num_slots, self.slot_bytes),
                            recv_base=self.recv.ctypes.data)

    def direct(self, plan: TransferPlan) -> None:
        self.a.write(self.b.session_id, plan.src, plan.dst, plan.length, timeout=300)

    def raw(self, plan: TransferPlan) -> None:
        if self.engine != "mooncake":
            return
        mc = self.a._mc  # the binding itself: no adapter in the way
        for s, d, n in plan.batches(CAP):
            if mc.batch_transfer_sync_write(self.b.session_id, s.tolist(), d.tolist(), n.tolist()) != 0:
                raise SystemExit("raw Mooncake write failed")

    def staged(self, plan: TransferPlan) -> dict:
        staged = stage_plan(plan, self.slot_bytes, max_piece_bytes=self.piece_bytes)
        t = time.perf_counter()
        stats = self.writer().write(staged, room=1, timeout=300)
        return {"s": time.perf_counter() - t, "chunks": stats.chunks, "wire_pieces": stats.wire_pieces,
                "gather_slices": stats.gather_slices, "scatter_slices": stats.scatter_slices,
                "slot_waits": stats.slot_waits}

    def ceiling(self, plan: TransferPlan) -> dict:
        """The staged path's parts alone: gathers, one contiguous write, scatters (seconds each)."""
        staged = stage_plan(plan, self.slot_bytes, max_piece_bytes=self.piece_bytes)
        out = {"gather": 0.0, "wire": 0.0, "scatter": 0.0}
        for k in range(staged.num_chunks):
            t = time.perf_counter()
            copy_slices(*staged.gather(k, self.send.ctypes.data))
            out["gather"] += time.perf_counter() - t
            t = time.perf_counter()
            copy_slices(*staged.scatter(k, self.recv.ctypes.data))
            out["scatter"] += time.perf_counter() - t
        n = plan.num_bytes
        p = self.piece_bytes
        length = np.full(-(-n // p), p, np.uint64)
        length[-1] = n - p * (len(length) - 1)
        per_round = self.num_slots * (self.slot_bytes // p)
        # the room's bytes as slot-sized pieces from the send area into the receive area, a round
        # of one write per area's worth (what the wire of the staged path carries, nothing else)
        t = time.perf_counter()
        for k in range(0, len(length), per_round):
            m = length[k : k + per_round]
            off = np.arange(len(m), dtype=np.uint64) * np.uint64(p)
            self.a.write(self.b.session_id, np.uint64(self.send.ctypes.data) + off,
                         np.uint64(self.recv.ctypes.data) + off, m, timeout=300)
        out["wire"] = time.perf_counter() - t
        return out

    def check(self, plan: TransferPlan, num_pages: int, seed: int = 1) -> None:
        capacity = len(next(iter(self.src.values())))
        rng = np.random.default_rng(seed)
        sp, dp = rng.permutation(capacity)[:num_pages], rng.permutation(capacity)[:num_pages]
        for lid in self.src:
            if not (self.dst[lid][dp] == self.src[lid][sp]).all():
                raise SystemExit(f"layer {lid}: staged bytes differ from the source")


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def room_rows(rig: Rig, num_tokens: int, reps: int) -> dict:
    """One room size, every method once per turn, turns interleaved (load from elsewhere on the
    machine hits every method alike); the best turn of each."""
    num_pages = num_tokens // rig.page_tokens
    plan = rig.plan(num_pages, "random")
    contiguous = rig.plan(num_pages, "contiguous")
    gb = plan.num_bytes / 1e9
    row = {"tokens": num_tokens, "MB": round(plan.num_bytes / 1e6), "slices": plan.num_slices,
           "contiguous_slices": contiguous.num_slices}
    runs: dict[str, list] = {"direct": [], "raw": [], "staged": [], "ceiling": [], "contiguous": []}
    for _ in range(reps):
        runs["direct"].append(timed(lambda: rig.direct(plan)))
        runs["raw"].append(timed(lambda: rig.raw(plan)))
        for d in rig.dst.values():
            d[:] = 1
        runs["staged"].append(rig.staged(plan))
        rig.check(plan, num_pages)
        runs["ceiling"].append(rig.ceiling(plan))
        runs["contiguous"].append(timed(lambda: rig.direct(contiguous)))
    for name in ("direct", "raw", "contiguous"):
        row[name] = gb / min(runs[name]) if rig.engine == "mooncake" or name != "raw" else float("nan")
    fastest = min(runs["staged"], key=lambda r: r["s"])
    row["staged"] = gb / fastest["s"]
    row.update({k: fastest[k] for k in ("chunks", "wire_pieces", "gather_slices", "scatter_slices", "slot_waits")})
    parts = {k: min(p[k] for p in runs["ceiling"]) for k in ("gather", "wire", "scatter")}
    row["ceiling_serial"] = gb / sum(parts.values())
    row["ceiling_slowest"] = gb / max(parts.values())
    row.update({f"{k}_GBps": gb / v for k, v in parts.items()})
    return row


def sweep(rig: Rig, total_bytes: int, reps: int, counts: tuple[int, ...] = (16, 64, 256, 1024)) -> list[dict]:
    """Slices of ``run`` pages each at random places of random layers, about ``total_bytes`` per
    room; then page-sized slices in growing numbers: direct vs staged."""
    spec = rig.specs["target"]
    lids = list(rig.src)
    capacity = len(rig.src[lids[0]])
    page = spec.bytes_per_page
    src_base = np.array([rig.src[lid].ctypes.data for lid in lids], dtype=np.uint64)
    dst_base = np.array([rig.dst[lid].ctypes.data for lid in lids], dtype=np.uint64)
    rows = []
    rng = np.random.default_rng(2)
    cases = [(run, max(1, total_bytes // (run * page))) for run in (1, 4, 16, 64)]
    cases += [(1, n) for n in counts]
    for run, count in cases:
        blocks = capacity // run * len(lids)  # (layer, block) places, each used once per side
        if count > blocks:
            continue
        places = [rng.permutation(blocks)[:count] for _ in range(2)]
        (sl, sb), (dl, db) = ((p % len(lids), (p // len(lids)).astype(np.uint64)) for p in places)
        plan = TransferPlan(src_base[sl] + sb * np.uint64(run * page), dst_base[dl] + db * np.uint64(run * page),
                            np.full(count, run * page, np.uint64))
        gb = plan.num_bytes / 1e9
        direct, staged = [], []
        for _ in range(reps):  # interleaved turns, best of each
            direct.append(timed(lambda: rig.direct(plan)))
            staged.append(rig.staged(plan)["s"])
        direct, staged = gb / min(direct), gb / min(staged)
        rows.append({"slice_bytes": run * page, "slices": count, "MB": round(plan.num_bytes / 1e6, 1),
                     "direct": direct, "staged": staged, "staged/direct": staged / direct})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8K,32K")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slot-mib", type=int, default=16, help="staging slot size (MiB)")
    ap.add_argument("--slots", type=int, default=4, help="slots per staging area")
    ap.add_argument("--piece-mib", type=int, default=4, help="largest wire piece (MiB)")
    ap.add_argument("--sweep-mib", type=int, default=48, help="bytes per crossover room (MiB)")
    ap.add_argument("--engine", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--counts", default="16,64,256,1024",
                    help="page-sized slice counts of the crossover's second part (comma-separated)")
    ap.add_argument("--page-tokens", type=int, default=64, help="tokens per page (64: SGLang's; 16: vLLM's CPU MLA)")
    ap.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8",
                    help="latent dtype: fp8 656 B/token (41,984 B pages at 64), bf16 1,152 B/token (18,432 B at 16)")
    ap.add_argument("--no-rooms", action="store_true", help="the crossover sweep only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = tokens(args.tokens)
    capacity = max(sizes) // args.page_tokens * 5 // 4
    rig = Rig(args.layers, capacity, args.slot_mib << 20, args.slots, args.piece_mib << 20, args.engine,
              args.page_tokens, args.kv_dtype)
    counts = tuple(int(c) for c in args.counts.split(","))
    try:
        rows = [] if args.no_rooms else [room_rows(rig, n, args.reps) for n in sizes]
        cross = sweep(rig, args.sweep_mib << 20, max(args.reps, 5), counts)  # small rooms: noisier, cheaper
    finally:
        rig.close()
    if args.json:
        print(json.dumps({"rooms": rows, "crossover": cross}, indent=1))
        return
    print(f"{'Mooncake TCP' if args.engine == 'mooncake' else 'NIXL/UCX'} loopback, 2 engines in one process, {args.layers} layers x "
          f"{rig.specs['target'].bytes_per_page:,} B pages, "
          f"staging {args.slots} x {args.slot_mib} MiB per side, wire pieces <= {args.piece_mib} MiB, best of {args.reps}")
    print("| tokens | MB | slices | direct | raw | staged | ceiling serial / slowest | gather / wire / scatter "
          "| contiguous | staged/direct | staged/raw | staged/contiguous | chunks, wire pieces |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tokens'] // 1024}K | {r['MB']:,} | {r['slices']:,} | {r['direct']:.2f} | {r['raw']:.2f} | "
              f"{r['staged']:.2f} | {r['ceiling_serial']:.2f} / {r['ceiling_slowest']:.2f} | "
              f"{r['gather_GBps']:.1f} / {r['wire_GBps']:.2f} / {r['scatter_GBps']:.1f} | {r['contiguous']:.2f} | "
              f"{r['staged'] / r['direct']:.2f} | {r['staged'] / r['raw']:.2f} | {r['staged'] / r['contiguous']:.2f} | "
              f"{r['chunks']}, {r['wire_pieces']} |")
    print("\ncrossover (GB/s)\n| slice bytes | slices | MB | direct | staged | staged/direct |\n| --- | --- | --- | --- | --- | --- |")
    for r in cross:
        print(f"| {r['slice_bytes']:,} | {r['slices']:,} | {r['MB']} | {r['direct']:.2f} | {r['staged']:.2f} | "
              f"{r['staged/direct']:.2f} |")


if __name__ == "__main__":
    main()
