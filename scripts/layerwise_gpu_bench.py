#!/usr/bin/env python
"""Layer-wise against whole-request sends on a GPU (issue 33): TTFT and "forward end -> decode
commit" of a disaggregated pair whose prefill runs a forward pass of real size, every rank its
own process, both sides on one GPU (cuda:0) when there is one.

    prefill (--cp processes)  a synthetic DeepSeek V3.2-shaped model: ``--layers`` layers of
                              hidden 7168, each a dense MLP (``--ffn`` wide, bf16) and a KV
                              projection whose output is written as that layer's pages of the
                              V3.2 fp8 pools (656 B/token target + 132 B/token index-K, page 64,
                              one draft layer) at random local pages. Not DeepSeek's attention
                              or MoE: the layer count, the KV geometry and a per-layer compute
                              time of the right order. Each CP rank runs the forward on its
                              share of the tokens, as CP does; the two share the GPU.
                              whole: one send of every page, a CUDA event as its
                              ready_event; layer-wise: ``kvbridge.transfer.prefill.layerwise.
                              LayerPosts`` - after each layer's write ``layer_done(l)`` (an
                              event on the forward's stream per layer group, the sends made on
                              the poster thread), then the last send with the aux row.
                              Where the last send(s) are called (``--orders``): readback,
                              after the first token is read back (the forward has ended);
                              launch, as soon as the last layer's kernels are queued, with
                              an event recorded there (vLLM's order: its wait_for_save,
                              where kvbridge's vLLM worker sends; the only engine
                              integration with layer-wise sends). The tail is timed from
                              the forward's end in both
    decode (one process)      asks before the forward starts, poisons its pages, polls, reports
                              the monotonic time of Success and a checksum of each rank's pages
    all                       the real bootstrap daemon; the IPC engine (kvbridge's CUDA IPC
                              engine: its copy stream waits on the events) or Mooncake NVLink;
                              rooms alternate whole / layer-wise (and order by order)
                              after one warm-up of each

Per room: ``forward`` = the last rank's forward end - the first rank's start, ``tail`` = decode's
commit - the last forward end, ``ttft`` = decode's commit - the first start. Printed: the medians
per mode and their ratios, and the forward alone (no room) for the TTFT goal; then, per mode,
the prefill rank's own thread after the forward: until ``finish()`` returned (layer-wise) and
until the last ``send()`` returned. ``--trace-dir DIR``: every rank traced (KVBRIDGE_TRACE=1,
its lines in DIR) and the tail hop by hop (forward end -> the last post handed to the engine ->
write final -> decode's report -> commit -> decode's poll sees it); traced rooms pay for their
log lines. ``--profile FILE``: a cProfile of prefill rank 0's last send(s) per mode.

    python scripts/layerwise_gpu_bench.py [--tokens 1024 8192 32768] [--cp 1 2] [--rooms 6]
        [--layers 61] [--engine ipc|mooncake] [--orders readback launch] [--json out.json]
        [--trace-dir DIR] [--profile FILE]

Without CUDA it runs the same rooms on the CPU with a tiny model (``--cpu-smoke``: a check of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET, PAGE = "deepseek-v3.2-fp8", 64
ORDERS = ("readback", "launch")  # where the room's last send(s) are called: after the first token is read, or before
TARGET_B, INDEX_B = 656, 132  # bytes per token per layer of the two pools


def geometry(args):
    from kvbridge.worker.resources import aux_schema_of, build_contract, build_specs

    specs = build_specs(PRESET, args.layers, PAGE, 1)
    contract = build_contract(PRESET, args.layers, PAGE, 1, "interleaved")
    return specs, contract, aux_schema_of(contract)


def engine_of(args):
    import kvbridge as kvb

    if args.engine == "mooncake":
        if args.device != "cpu":  # Mooncake's intra-node transport: CUDA IPC between the processes
            os.environ.setdefault("MC_INTRANODE_NVLINK", "true")
        return kvb.create_engine("mooncake", protocol="rdma" if args.device != "cpu" else "tcp")
    return kvb.create_engine(args.engine)


def checksum(bufs, specs, pages: np.ndarray) -> int:
    """A position-weighted sum of the pages' bytes over every pool and layer (on the device)."""
    import torch

    total = 0
    idx = torch.as_tensor(pages, device=next(iter(bufs.values())).device)
    for (pool, layer), t in sorted(bufs.items()):
        u = t.view(torch.uint8).view(t.shape[0], -1)[idx].view(torch.int32).to(torch.int64)
        w = torch.arange(u.shape[1], device=u.device, dtype=torch.int64) % 9973 + 1
        total += int((u * w).sum()) * (2 * layer + (pool == "target") + 1)
    return total % (1 << 61)


# ---- decode ----------------------------------------------------------------------------------
def decode_main(args) -> None:
    import torch

    import kvbridge as kvb
    from kvbridge.layout import OwnerLanes
    from kvbridge.worker.resources import allocate_buffers

    specs, contract, aux = geometry(args)
    max_pages = -(-max(args.tokens) // PAGE)
    bufs = allocate_buffers(specs, 2 * max_pages, device=args.device)
    aux_rows = torch.zeros((4, aux.row_bytes), dtype=torch.uint8, device=args.aux_device)
    client = kvb.BootstrapClient(args.bootstrap, token=args.token)
    engine = engine_of(args)
    ep = kvb.DecodeEndpoint(kvb.DecodeConfig(instance="lw-d", transfer_timeout=120.0, aux_inline=not args.aux_written),
                            engine, specs, bufs, contract, client, aux_rows, aux)
    ep.start()
    print(json.dumps({"ready": True}), flush=True)
    rng = np.random.default_rng(1)
    trace = logging.getLogger("kvbridge.bench.layerwise")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        n, cp = cmd["tokens"], cmd["cp"]
        num_pages = -(-n // PAGE)
        page_ids = rng.permutation(2 * max_pages)[:num_pages].astype(np.int64)
        for t in bufs.values():
            t.view(torch.uint8).view(t.shape[0], -1)[torch.as_tensor(page_ids, device=t.device)] = 0x5A
        torch.cuda.synchronize() if args.device != "cpu" else None
        r = ep.receiver(cmd["room"], "lw-p")
        r.init(page_ids, 0, n)
        print(json.dumps({"asked": cmd["room"]}), flush=True)
        deadline = time.monotonic() + 120
        while r.poll() not in (kvb.KVPoll.Success, kvb.KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.0001)
        commit = time.monotonic()
        state, reason = r.poll().name, r.failure_reason
        trace.info("trace room=%d bench commit seen @%.6f", cmd["room"], commit)
        lanes = OwnerLanes(cp)
        sums = [checksum(bufs, specs, page_ids[lanes.owned_pages(k, num_pages)]) for k in range(cp)]
        r.close()
        print(json.dumps({"room": cmd["room"], "state": state, "reason": reason, "commit": commit, "sums": sums}),
              flush=True)
    ep.close(timeout=3)
    engine.close()
    client.close()


# ---- prefill ---------------------------------------------------------------------------------
class Model:
    """``layers`` x (dense MLP + KV projection) at hidden ``hidden``; ``forward`` writes each
    layer's KV into the pools at ``local`` and calls ``on_layer(l)`` after each write."""

    def __init__(self, args, specs, device):
        import torch

        self.torch, self.args, self.specs, self.device = torch, args, specs, device
        dt = torch.bfloat16 if device != "cpu" else torch.float32
        g = torch.Generator(device=device).manual_seed(0)
        h, f = args.hidden, args.ffn
        self.w1 = (torch.randn(h, f, device=device, dtype=dt, generator=g) / h**0.5)
        self.w2 = (torch.randn(f, h, device=device, dtype=dt, generator=g) / f**0.5)
        self.wkv = (torch.randn(h, (TARGET_B + INDEX_B) // 2, device=device, dtype=dt, generator=g) / h**0.5)
        self.dt = dt
        # --forward-stream side: the forward on a stream of its own (torch's streams are non-blocking), not the
        # legacy default stream, which every synchronous cudaMemcpy of the process waits behind
        self.stream = torch.cuda.Stream(device=device) if device != "cpu" and args.forward_stream == "side" else None

    def forward(self, tokens: int, bufs, local: np.ndarray, on_layer, launched=None) -> int:
        torch = self.torch
        n_pad = -(-tokens // PAGE) * PAGE
        x = torch.ones(n_pad, self.args.hidden, device=self.device, dtype=self.dt) * 0.01
        idx = torch.as_tensor(local, device=self.device)
        draft = self.args.layers  # the draft layer's id: written with the last target layer
        with torch.no_grad(), (torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()):
            for layer in range(self.args.layers):
                x = x + torch.nn.functional.silu(x @ self.w1) @ self.w2
                kv = (x @ self.wkv).to(torch.bfloat16).view(torch.uint8).view(n_pad, TARGET_B + INDEX_B)
                last = layer == self.args.layers - 1  # the draft layer is written with it
                writes = [("target", layer, 0, TARGET_B), ("index", layer, TARGET_B, TARGET_B + INDEX_B)]
                if last:
                    writes.append(("draft", draft, 0, TARGET_B))
                for pool, lid, lo, hi in writes:
                    t = bufs[(pool, lid)]
                    t.view(torch.uint8).view(t.shape[0], -1)[idx] = kv[:, lo:hi].reshape(idx.numel(), -1)
                on_layer(layer)
            if launched is not None:  # every layer's kernels queued, none waited for (vLLM's wait_for_save)
                launched()
            return int(x[-1, :64].float().argmax())  # the first token: read back, the forward's end


def prefill_main(args) -> None:
    import torch

    import kvbridge as kvb
    from kvbridge.layout import OwnerLanes
    from kvbridge.transfer.prefill.layerwise import LayerPosts, RoomSend
    from kvbridge.worker.resources import allocate_buffers
    from kvbridge.worker.synthetic import make_aux

    specs, contract, aux = geometry(args)
    if set(specs) != {"target", "index", "draft"}:
        raise SystemExit(f"pools of {PRESET} are {sorted(specs)}, this bench writes target, index and draft")
    cp, rank = args.cp_size, args.cp_rank
    lanes = OwnerLanes(cp)
    max_pages = -(-max(args.tokens) // PAGE)
    cap = 2 * len(lanes.owned_pages(rank, max_pages)) + 2
    bufs = allocate_buffers(specs, cap, device=args.device)
    model = Model(args, specs, args.device)
    client = kvb.BootstrapClient(args.bootstrap, token=args.token)
    engine = engine_of(args)
    ep = kvb.PrefillEndpoint(kvb.PrefillConfig(instance="lw-p", cp_rank=rank, cp_size=cp, target_timeout=120.0,
                                               aux_device=args.aux_device, staging=args.staging),
                             engine, specs, bufs, contract, client, aux)
    ep.start()
    sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
    prof = None
    if args.profile and rank == 0:
        import cProfile

        prof = {f"{o}/{m}": cProfile.Profile() for o in args.orders for m in ("whole", "layerwise")}
    posts = {}
    rng = np.random.default_rng(10 + rank)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        n, mode, room = cmd["tokens"], cmd["mode"], cmd["room"]
        order = cmd.get("order", "readback")
        num_pages = -(-n // PAGE)
        owned = lanes.owned_pages(rank, num_pages).astype(np.int64)
        local = rng.permutation(cap)[: owned.size].astype(np.int64)
        my_tokens = max(PAGE, owned.size * PAGE)  # this rank's share of the prompt (CP)
        if cmd.get("op") == "forward":  # the forward alone, no room
            sync()
            t0 = time.monotonic()
            model.forward(my_tokens, bufs, local, lambda layer: None)
            print(json.dumps({"forward_s": time.monotonic() - t0}), flush=True)
            continue
        sender = ep.sender(room)
        sender.init(n)
        deadline = time.monotonic() + 60
        while sender.poll() == kvb.KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.0005)
        print(json.dumps({"armed": room}), flush=True)
        assert json.loads(sys.stdin.readline())["op"] == "go"
        layer_bytes = n // cp * (TARGET_B + INDEX_B)
        if mode == "layerwise":
            key = (n, cp)
            if key not in posts:
                posts[key] = LayerPosts(args.layers, max(1, layer_bytes), device=args.device,
                                        min_bytes=args.min_group_mib << 20)
            lp = posts[key]
            lp.begin([RoomSend(sender, owned, local, n)])
            on_layer = lp.layer_done
        else:
            lp, on_layer = None, (lambda layer: None)

        def last_sends() -> tuple[float | None, float]:
            """The room's last send(s) with an event recorded now on the forward's stream: layer-wise,
            every group with the sender (``finish``), then the end with the aux row; whole, every page."""
            event = None
            if args.device != "cpu":
                event = torch.cuda.Event()
                event.record(model.stream)  # the forward's stream (None: the current one)
            if prof is not None:
                prof[order + "/" + mode].enable()  # this thread's last send: checks, plan, aux staging, post
            t_fin = None
            if lp is not None:
                lp.finish()  # every layer group is with the sender
                t_fin = time.monotonic()
                empty = np.zeros(0, dtype=np.int64)
                sender.send(empty, empty, is_last=True, aux=row, ready_event=event)
            else:
                sender.send(owned, local, num_tokens_ready=n, is_last=True, aux=row, ready_event=event)
            t_sent = time.monotonic()
            if prof is not None:
                prof[order + "/" + mode].disable()
            return t_fin, t_sent

        ends = []
        row = make_aux(aux, room, n) if sender.writes_aux else None  # the forward's row: ready when it ends
        sync()
        t0 = time.monotonic()
        model.forward(my_tokens, bufs, local, on_layer,
                      launched=(lambda: ends.append(last_sends())) if order == "launch" else None)
        t_fwd = time.monotonic()
        logging.getLogger("kvbridge.bench.layerwise").info("trace room=%d rank=cp%d bench forward end @%.6f", room,
                                                           rank, t_fwd)
        if order == "readback":
            ends.append(last_sends())
        t_fin, t_sent = ends[0]
        while sender.poll() not in (kvb.KVPoll.Success, kvb.KVPoll.Failed):
            time.sleep(0.0005)
        stats = sender.stats
        ok = sender.poll() == kvb.KVPoll.Success
        sender.close()
        print(json.dumps({"room": room, "t0": t0, "t_fwd": t_fwd, "t_fin": t_fin, "t_sent": t_sent, "ok": ok,
                          "sum": checksum(bufs, specs, local),
                          "layer_sends": stats.get("layer_sends"), "groups": len(lp.groups) if lp else 0}),
              flush=True)
    if prof is not None:
        import io
        import pstats

        out = io.StringIO()
        for mode, p in prof.items():
            out.write(f"==== {mode}: the room's last send(s), prefill rank 0's thread\n")
            try:
                pstats.Stats(p, stream=out).sort_stats("cumulative").print_stats(45)
            except TypeError:  # no room of this mode
                out.write("(none)\n")
        Path(args.profile).write_text(out.getvalue())
    for lp in posts.values():
        lp.close()
    ep.close(timeout=3)
    engine.close()
    client.close()


# ---- the driver ------------------------------------------------------------------------------
def child(args, role: str, *extra: str):
    argv = [sys.executable, __file__, "--role", role, "--bootstrap", args.bootstrap, "--token", args.token, *extra,
            *args.passthrough]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(p, msg: dict) -> None:
    p.stdin.write(json.dumps(msg) + "\n")
    p.stdin.flush()


def answer(p) -> dict:
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("a bench process exited")
        if line.startswith("{"):
            return json.loads(line)


def run_cp(args, cp: int, room_base: int) -> list[dict]:
    decode = child(args, "decode")
    prefill = [child(args, "prefill", "--cp-rank", str(r), "--cp-size", str(cp)) for r in range(cp)]
    procs = [decode, *prefill]
    rows = []
    try:
        for p in procs:
            assert answer(p).get("ready")
        room = room_base
        for n in args.tokens:
            for p in prefill:  # the forward alone, after a warm-up
                ask(p, {"op": "forward", "tokens": n, "mode": "", "room": 0})
                answer(p)
            alone = []
            for _ in range(3):
                for p in prefill:
                    ask(p, {"op": "forward", "tokens": n, "mode": "", "room": 0})
                alone.append(max(answer(p)["forward_s"] for p in prefill))
            kinds = [(o, m) for o in args.orders for m in ("whole", "layerwise")]  # alternating, same conditions
            for k in range(len(kinds) * (1 + -(-args.rooms // 2))):  # one warm-up of each kind first
                order, mode = kinds[k % len(kinds)]
                room += 1
                ask(decode, {"room": room, "tokens": n, "cp": cp})
                assert answer(decode)["asked"] == room
                for p in prefill:
                    ask(p, {"op": "room", "room": room, "tokens": n, "mode": mode, "order": order})
                for p in prefill:
                    assert answer(p)["armed"] == room
                for p in prefill:
                    ask(p, {"op": "go"})
                got = answer(decode)
                sent = [answer(p) for p in prefill]
                sums_equal = got["sums"] == [s["sum"] for s in sent]
                ok = got["state"] == "Success" and all(s["ok"] for s in sent) and sums_equal
                t0, t_fwd = min(s["t0"] for s in sent), max(s["t_fwd"] for s in sent)
                rows.append({"tokens": n, "cp": cp, "order": order, "mode": mode, "room": room,
                             "warmup": k < len(kinds), "ok": ok,
                             "reason": got.get("reason"), "forward_s": t_fwd - t0, "tail_s": got["commit"] - t_fwd,
                             "ttft_s": got["commit"] - t0, "forward_alone_s": statistics.median(alone),
                             "finish_s": (max(s["t_fin"] for s in sent) - t_fwd) if mode == "layerwise" else None,
                             "last_send_s": max(s["t_sent"] for s in sent) - t_fwd,
                             "layer_sends": sent[0].get("layer_sends"), "groups": sent[0].get("groups"),
                             "min_group_mib": args.min_group_mib})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    ask(p, {"op": "quit"})
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows


def by_kind(rows: list[dict], *fields: str) -> dict[tuple, list[dict]]:
    """The rows by their values of ``fields`` (``order`` first): the orders as ``ORDERS`` lists them,
    then by value."""
    kinds: dict[tuple, list[dict]] = {}
    for r in rows:
        kinds.setdefault(tuple(r[f] for f in fields), []).append(r)
    return dict(sorted(kinds.items(), key=lambda kv: (ORDERS.index(kv[0][0]), kv[0][1:])))


def report(rows: list[dict]) -> None:
    print("\n| order | tokens | CP | forward alone (ms) | whole: TTFT / fwd end -> commit (ms) | layer-wise: TTFT / "
          "fwd end -> commit (ms) | tail lw/whole | TTFT lw / forward alone | groups | verified |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (order, n, cp), mine in by_kind(rows, "order", "tokens", "cp").items():
        sel = [r for r in mine if not r["warmup"]]
        med = {m: {k: statistics.median(r[k] for r in sel if r["mode"] == m) for k in ("tail_s", "ttft_s")}
               for m in ("whole", "layerwise")}
        alone = sel[0]["forward_alone_s"]
        ok = all(r["ok"] for r in mine)
        groups = next(r["groups"] for r in sel if r["mode"] == "layerwise")
        w, lw = med["whole"], med["layerwise"]
        print(f"| {order} | {n} | {cp} | {alone * 1e3:.1f} | {w['ttft_s'] * 1e3:.1f} / {w['tail_s'] * 1e3:.2f} | "
              f"{lw['ttft_s'] * 1e3:.1f} / {lw['tail_s'] * 1e3:.2f} | {lw['tail_s'] / w['tail_s']:.2f} | "
              f"{lw['ttft_s'] / alone:.2f} | {groups} | {'all' if ok else 'NO'} |")


TAIL = (("forward end", "posted", "last post handed to the engine (prefill)"),
        ("posted", "written", "transfer + completion seen (prefill)"),
        ("written", "reported", "report trip (the last rank -> decode's loop)"),
        ("reported", "committed", "ledger + aux row read or write + commit (decode)"),
        ("committed", "commit seen", "until decode's poll sees it"))


def send_times(rows: list[dict]) -> None:
    """On the prefill ranks' own thread (the latest rank), from the forward's end: until ``finish``
    returned (layer-wise: every group with its sender) and until the last ``send`` returned; in the
    launch order both come before the forward's end (negative)."""
    print("\n| order | tokens | CP | mode | fwd end -> finish() returned (ms) | fwd end -> last send() returned (ms) "
          "| tail (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (order, n, cp, mode), mine in by_kind(rows, "order", "tokens", "cp", "mode").items():
        sel = [r for r in mine if not r["warmup"]]
        fin = "-" if mode != "layerwise" else f"{statistics.median(r['finish_s'] for r in sel) * 1e3:.2f}"
        print(f"| {order} | {n} | {cp} | {mode} | {fin} | {statistics.median(r['last_send_s'] for r in sel) * 1e3:.2f} | "
              f"{statistics.median(r['tail_s'] for r in sel) * 1e3:.2f} |")


def tail_hops(rows: list[dict], folder: str) -> None:
    """The tail (forward end -> decode sees Success) hop by hop, p50 per (tokens, CP, mode), from
    every rank's trace lines: each event at its last occurrence in the room (the last rank, the
    last layer group)."""
    from kvbridge.bench.trace import parse

    lines = [ln for f in sorted(Path(folder).glob("*.log")) for ln in f.read_text().splitlines()]
    events = parse(lines)
    for ln in lines:  # this bench's own lines
        if "bench forward end" in ln or "bench commit seen" in ln:
            room, at = int(ln.split("room=")[1].split()[0]), float(ln.rsplit("@", 1)[1])
            events[room]["forward end" if "forward end" in ln else "commit seen"].append(at)
    print("\n| order | tokens | CP | mode | " + " | ".join(f"{a} -> {b}" for a, b, _ in TAIL)
          + " | tail (traced) | rooms |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in TAIL) + " | --- | --- |")
    for (order, n, cp, mode), mine in by_kind(rows, "order", "tokens", "cp", "mode").items():
        rooms = [events[r["room"]] for r in mine if not r["warmup"]]
        rooms = [ev for ev in rooms if all(ev.get(k) for k in ("forward end", "posted", "written", "reported",
                                                               "committed", "commit seen"))]
        if not rooms:
            print(f"| {order} | {n} | {cp} | {mode} | (no complete trace) |")
            continue
        cells = [statistics.median((max(ev[b]) - max(ev[a])) * 1e3 for ev in rooms) for a, b, _ in TAIL]
        total = statistics.median((max(ev["commit seen"]) - max(ev["forward end"])) * 1e3 for ev in rooms)
        print(f"| {order} | {n} | {cp} | {mode} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {total:.2f} | {len(rooms)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rooms", type=int, default=6, help="rooms counted per length and order (whole and layer-wise alternating), after a "
                         "warm-up room of each kind")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=4096, help="the dense MLP's width (sets the forward's time)")
    ap.add_argument("--min-group-mib", type=int, default=8, help="layer-wise: the least bytes one post carries")
    ap.add_argument("--engine", choices=("ipc", "mooncake"), default="ipc")
    ap.add_argument("--orders", nargs="+", choices=ORDERS, default=["readback"],
                    help="where each room's last send(s) are called, alternating room by room when both are "
                         "given: readback (after the first token is read back: the forward has ended) or launch "
                         "(after the last layer's kernels are queued, while the GPU still runs them, with an event recorded "
                         "there: where vLLM calls the connector's wait_for_save, kvbridge's vLLM worker sends "
                         "the end of a layer-wise room and a whole room)")
    ap.add_argument("--staging", choices=("auto", "never", "always"), default="auto",
                    help="the prefill ranks' staging (PrefillConfig.staging): auto chooses per write, by its slices")
    ap.add_argument("--forward-stream", choices=("default", "side"), default="default",
                    help="the stream the prefill's forward runs on: default (the legacy default stream, as the "
                         "rounds before) or side (a stream of its own, non-blocking)")
    ap.add_argument("--aux-written", action="store_true",
                    help="decode takes the aux row as a write into its aux rows (DecodeConfig(aux_inline=False)), "
                         "not in the report that carries it (the default since wire 14)")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="cProfile of prefill rank 0's whole sends (its thread) to this file")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny CPU run (a check of the script)")
    ap.add_argument("--trace-dir", default="",
                    help="KVBRIDGE_TRACE=1 in every rank, their trace lines to this folder, and the tail's hop table "
                         "(forward end -> posted -> written -> reported -> committed -> seen) per mode; traced "
                         "rooms pay for their log lines, so read the hops beside each other, not against untraced rows")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    ap.add_argument("--token", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cp-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cp-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.device:
        try:
            import torch

            args.device = "cuda:0" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
        except ImportError:
            args.device = "cpu"
    if args.device == "cpu":
        if not args.cpu_smoke and not args.role:
            print("layerwise_gpu_bench: no CUDA device; pass --cpu-smoke for a tiny CPU run (not a measurement)")
            return
        args.engine = "mooncake"  # the IPC engine needs a GPU
        if not args.role:
            args.layers, args.hidden, args.ffn = min(args.layers, 4), 64, 64
    args.aux_device = args.device  # aux rows and the scratch where the pages are (Mooncake NVLink: device memory only)
    if args.role and args.trace_dir:
        logging.basicConfig(level=logging.INFO, format="%(message)s",
                            filename=str(Path(args.trace_dir) / f"{args.role}-{args.cp_rank}-{os.getpid()}.log"))
    if args.role == "decode":
        return decode_main(args)
    if args.role == "prefill":
        return prefill_main(args)
    args.passthrough = ["--tokens", *map(str, args.tokens), "--layers", str(args.layers), "--hidden", str(args.hidden),
                        "--ffn", str(args.ffn), "--min-group-mib", str(args.min_group_mib), "--engine", args.engine,
                        "--orders", *args.orders, "--forward-stream", args.forward_stream,
                        "--staging", args.staging,
                        "--device", args.device, *(["--profile", args.profile] if args.profile else []),
                        *(["--trace-dir", args.trace_dir] if args.trace_dir else []),
                        *(["--aux-written"] if args.aux_written else [])]
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        os.environ["KVBRIDGE_TRACE"] = "1"
    import kvbridge as kvb

    rows = []
    with kvb.start_bootstrap() as (url, token):
        args.bootstrap, args.token = url, token
        for i, cp in enumerate(args.cp):
            rows += run_cp(args, cp, 7000 + 1000 * i)
    report(rows)
    send_times(rows)
    if args.trace_dir:
        tail_hops(rows, args.trace_dir)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not r["ok"]]
    if bad:
        sys.exit(f"rooms failed or not equal: {[(r['room'], r['reason']) for r in bad]}")


if __name__ == "__main__":
    main()
