"""A prefill CP rank in its own process, driven over stdin/stdout (test harness).

Started by ``_cluster.PrefillProc``. Prints ``READY`` once serving, then one JSON
line per finished room: ``{"room", "state", "reason"}``. Commands (JSON lines):

    {"op": "send", "room": R, "num_tokens": N, "chunks": [t1, ..., N], "pause": s}
        fill this rank's owned pages of R with synthetic KV (compute-padding rows
        hold PAD_BYTE), then send them chunk by chunk: chunk i carries the owned
        pages that start below t_i, with num_tokens_ready=t_i (kvbridge holds a
        page the chunk ends inside until a later chunk completes it); ``pause``
        seconds between chunks. The aux row goes with the last chunk if this rank
        owns the last valid token.
        ``"layers": [[a, b], ...]``: the last chunk's pages go per layer range
        (``send(..., layers=)``), then a send without pages carries ``is_last`` and the aux row
        (``"last_with_range": true``: the last range carries them); a refused send reports
        ``{"state": "Refused", "error": class name, "reason"}`` and leaves the room open (abort it).
    {"op": "abort", "room": R}
    {"op": "quit"}

``--model kv-fp32`` runs the k/v float32 model of ``_models.py`` instead of a preset,
with the aux rows in the engine's own per-region tensors (``send(aux_slot=...)``).
``--model kv-heads --tp-rank t --tp-size p`` runs TP rank t of a head-sharded k/v model
(4 KV heads): its pools hold its heads of every row. ``--pp-rank s --pp-size p --pp-layers
a,b`` runs pipeline stage s, holding (and sending) target layers [a, b) only.
``--device cuda:0`` puts the pools on that GPU (preset and kv-heads models): synthetic KV is made
in host mirrors and copied to the room's pages on the GPU before they are sent.
"""

from __future__ import annotations

import faulthandler
import signal

# first, before the heavy imports: SIGUSR1 writes every thread's stack to stderr (_cluster.ChildProc
# sends it to a start that has not answered in time, and quotes that stderr)
faulthandler.register(signal.SIGUSR1, all_threads=True)

import argparse  # noqa: E402
import json
import sys
import threading
import time

import numpy as np

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.errors import KVBridgeError
from kvbridge.layout import OwnerLanes, stage_specs
from kvbridge.transfer.engine import create_engine
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint
from kvbridge.layout import RawBuffer
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs
from kvbridge.worker.synthetic import fill_pages, make_aux

from _models import kv_fp32, kv_heads, region_tensors, token_major_buffers, write_region_row

_out_lock = threading.Lock()


def emit(obj: dict) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--instance", default="prefill")
    ap.add_argument("--cp-rank", type=int, default=0)
    ap.add_argument("--cp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--lane-rule", default="interleaved")
    ap.add_argument("--preset", default="deepseek-v3.2-fp8")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--engine", default="mooncake")
    ap.add_argument("--lease-ttl", type=float, default=2.0)
    ap.add_argument("--kernel-abi", default="")
    ap.add_argument("--secret", default="")
    ap.add_argument("--target-timeout", type=float, default=30.0)
    ap.add_argument("--model", default="", help="kv-fp32: the k/v float32 model of _models.py (public API only), "
                                                 "with the aux rows in the engine's own per-region tensors")
    ap.add_argument("--staging", default="auto", help="PrefillConfig.staging: auto, always or never")
    ap.add_argument("--staging-bytes", type=int, default=16 << 20)
    ap.add_argument("--staging-slot-bytes", type=int, default=8 << 20)
    ap.add_argument("--random-local", type=int, default=0, help="a seed: local pages drawn at random, not bumped")
    ap.add_argument("--device", default="cpu", help="where the pools live (cuda:N: not with --model kv-fp32)")
    ap.add_argument("--raw-buffers", action="store_true",
                    help="hand the pools to the endpoint as RawBuffer addresses (as the SGLang backend does)")
    ap.add_argument("--pp-rank", type=int, default=0)
    ap.add_argument("--pp-size", type=int, default=1)
    ap.add_argument("--pp-layers", default="", help="start,end: this pipeline stage's target layers")
    args = ap.parse_args()

    engine_aux = None
    if args.model == "kv-fp32":
        specs, contract, aux_schema = kv_fp32(args.layers, args.page_size, args.lane_rule)
        buffers = token_major_buffers(specs, args.pages)
        engine_aux = region_tensors(aux_schema, 64)
    elif args.model == "kv-heads":
        specs, contract, aux_schema = kv_heads(args.layers, args.page_size, args.tp_size, args.tp_rank, args.lane_rule)
        buffers = allocate_buffers(specs, args.pages, device=args.device)
    else:
        specs = build_specs(args.preset, args.layers, args.page_size, 1)
        contract = build_contract(args.preset, args.layers, args.page_size, 1, args.lane_rule)
        if args.kernel_abi:  # a deliberately different contract, for the mismatch test
            contract = contract.model_copy(update={"kernel": contract.kernel.model_copy(update={"abi": args.kernel_abi})})
        aux_schema = aux_schema_of(contract)
        buffers = allocate_buffers(specs, args.pages, device=args.device)
    pp_layers = tuple(int(v) for v in args.pp_layers.split(",")) if args.pp_layers else None
    if pp_layers is not None:  # a pipeline stage holds (and fills) its own layers only
        buffers = allocate_buffers(stage_specs(specs, pp_layers, contract.model.target_layers), args.pages,
                                   device=args.device)
    last_stage = args.pp_rank == args.pp_size - 1
    # host mirrors of device pools: fill_pages writes host memory; fill() copies the pages over
    mirrors = {k: b.cpu() for k, b in buffers.items()} if args.device != "cpu" else buffers

    def fill(room: int, owned: np.ndarray, local: np.ndarray, n: int) -> None:
        for (pool, layer), buf in mirrors.items():
            fill_pages(specs[pool], buf, room, layer, owned, local, n)
        if mirrors is not buffers:
            import torch

            idx = torch.as_tensor(np.asarray(local, dtype=np.int64))
            for key, gpu in buffers.items():
                gpu[idx.to(gpu.device)] = mirrors[key][idx].to(gpu.device)
            torch.cuda.synchronize(args.device)

    cfg = PrefillConfig(instance=args.instance, cp_rank=args.cp_rank, cp_size=args.cp_size, tp_rank=args.tp_rank,
                        tp_size=args.tp_size, pp_rank=args.pp_rank, pp_size=args.pp_size, pp_layers=pp_layers, lane_rule=args.lane_rule,
                        lease_ttl=args.lease_ttl, housekeeping_interval=0.2, target_timeout=args.target_timeout,
                        secret=args.secret.encode() or None, staging=args.staging,
                        staging_bytes=args.staging_bytes, staging_slot_bytes=args.staging_slot_bytes)
    handed = buffers
    if args.raw_buffers:  # the tensors stay alive here; the endpoint sees addresses only
        from kvbridge.transfer.engine import tensor_region

        handed = {k: RawBuffer(*tensor_region(b), device=str(getattr(b, "device", "cpu"))) for k, b in buffers.items()}
    ep = PrefillEndpoint(cfg, create_engine(args.engine), specs, handed, contract, BootstrapClient(args.bootstrap),
                         aux_schema, aux_buffer=engine_aux)
    ep.start()
    aux_slots = iter(range(10**9))
    lanes = OwnerLanes(args.cp_size, args.lane_rule)
    page_size = args.page_size
    next_free = [0]
    order = (np.random.default_rng(args.random_local).permutation(args.pages) if args.random_local
             else np.arange(args.pages))
    alloc_lock = threading.Lock()
    senders = {}

    def run_room(cmd: dict) -> None:
        room, n = cmd["room"], cmd["num_tokens"]
        num_pages = -(-n // page_size)
        owned = lanes.owned_pages(args.cp_rank, num_pages)
        with alloc_lock:  # bump allocation, wrapping: tests keep far fewer pages in flight than --pages
            if next_free[0] + owned.size > args.pages:
                next_free[0] = 0
            local = order[next_free[0]: next_free[0] + owned.size]  # scattered with --random-local
            next_free[0] += owned.size
        fill(room, owned, local, n)
        sender = senders[room] = ep.sender(room)
        sender.init(n)
        owns_last = last_stage and lanes.owner_of_token(n - 1, page_size, num_pages) == args.cp_rank
        sent = np.zeros(owned.size, dtype=bool)
        chunks = cmd.get("chunks") or [n]
        for i, upto in enumerate(chunks):
            last = i == len(chunks) - 1
            ready = ~sent & ((owned * page_size < upto) | last)
            aux, aux_slot = (make_aux(aux_schema, room, n), None) if last and owns_last else (None, None)
            if aux is not None and engine_aux is not None:  # the row is in the engine's own tensors
                aux_slot = next(aux_slots) % 64
                write_region_row(engine_aux, aux_schema, aux_slot, aux)
                aux = None
            if last and cmd.get("layers"):
                try:
                    send_layers(sender, owned[ready], local[ready], n, cmd, aux, aux_slot)
                except KVBridgeError as exc:
                    emit({"room": room, "state": "Refused", "error": type(exc).__name__, "reason": str(exc),
                          "field": exc.field})
                    return
            else:
                sender.send(owned[ready], local[ready], num_tokens_ready=n if last else upto, is_last=last, aux=aux,
                            aux_slot=aux_slot)
            sent |= ready
            if not last:  # pause between chunks, as a long prefill would; stop if the room ended meanwhile
                until = time.monotonic() + cmd.get("pause", 0.0)
                while time.monotonic() < until and sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                    time.sleep(0.01)
                if sender.poll() == KVPoll.Failed:
                    break
        deadline = time.monotonic() + 60
        while sender.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.005)
        st = sender.stats
        emit({"room": room, "state": sender.poll().name, "reason": sender.failure_reason,
              "paths": st.get("paths", {}), "chunks": st.get("chunks", 0), "bytes_staged": st.get("bytes_staged", 0),
              "slices": st.get("slices", 0)})

    def send_layers(sender, logical, local, n, cmd, aux, aux_slot) -> None:
        ranges = [tuple(r) for r in cmd["layers"]]
        with_range = cmd.get("last_with_range", False)
        for i, span in enumerate(ranges):
            end = with_range and i == len(ranges) - 1
            sender.send(logical, local, num_tokens_ready=n, layers=span, is_last=end, aux=aux if end else None,
                        aux_slot=aux_slot if end else None)
        if not with_range:
            empty = np.zeros(0, dtype=np.int64)
            sender.send(empty, empty, num_tokens_ready=n, is_last=True, aux=aux, aux_slot=aux_slot)

    def guarded(cmd: dict) -> None:
        try:
            run_room(cmd)
        except Exception as exc:  # report, never die silently
            emit({"room": cmd.get("room"), "state": "Error", "reason": f"{type(exc).__name__}: {exc}"})

    def burst(cmd: dict) -> None:
        n = cmd["num_tokens"]
        num_pages = -(-n // page_size)
        owned = lanes.owned_pages(args.cp_rank, num_pages)
        owns_last = last_stage and lanes.owner_of_token(n - 1, page_size, num_pages) == args.cp_rank
        live = {}
        for i, room in enumerate(cmd["rooms"]):
            local = (np.arange(owned.size) + i * owned.size) % args.pages
            fill(room, owned, local, n)
            s = live[room] = ep.sender(room)
            s.init(n)
            s.send(owned, local, is_last=True, aux=make_aux(aux_schema, room, n) if owns_last else None)
        deadline = time.monotonic() + 120
        while live and time.monotonic() < deadline:
            for room in [k for k, s in live.items() if s.poll() in (KVPoll.Success, KVPoll.Failed)]:
                s = live.pop(room)
                emit({"room": room, "state": s.poll().name, "reason": s.failure_reason})
            time.sleep(0.01)

    emit({"ready": True, "endpoint": ep.endpoint})
    threads = []
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "send":
            t = threading.Thread(target=guarded, args=(cmd,), daemon=True)
            t.start()
            threads.append(t)
        elif cmd["op"] == "burst":  # many rooms from one thread (the 1,000-rooms test)
            t = threading.Thread(target=burst, args=(cmd,), daemon=True)
            t.start()
            threads.append(t)
        elif cmd["op"] == "abort":  # the room's send thread may not have made its sender yet (a loaded host)
            deadline = time.monotonic() + 30
            while cmd["room"] not in senders and time.monotonic() < deadline:
                time.sleep(0.005)
            try:
                senders[cmd["room"]].abort(cmd.get("reason", "aborted by prefill test"))
            except Exception as exc:  # report, never die silently (a dead rank fails every later test of its module)
                emit({"abort_error": cmd["room"], "reason": f"{type(exc).__name__}: {exc}"})
        elif cmd["op"] == "quit":
            break
    for t in threads:
        t.join(10)
    ep.close(timeout=5)
    emit({"bye": True})


if __name__ == "__main__":
    main()
