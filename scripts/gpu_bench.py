#!/usr/bin/env python
"""kvbridge end to end vs raw Mooncake on GPU memory (one host, one or two GPUs).

For each transport (``tcp``: Mooncake TCP; ``nvlink``: ``MC_INTRANODE_NVLINK=true``
with protocol ``rdma``, Mooncake's intra-node NVLink transport) this runs:

    bootstrap daemon (process)
    prefill process: CP=2 PrefillEndpoints, pools on cuda:0, one Mooncake engine per rank
    decode process:  one DecodeEndpoint, pools on cuda:1 (cuda:0 with one GPU)

Two processes because the NVLink transport maps the peer's memory with CUDA IPC,
which a process cannot open on its own allocations. Allocation is contiguous on
both sides (prefill rank r: local pages 0..n_r-1 for its owned logical pages;
decode: one block of pages 0..n-1, ``--dst-order lane-major`` (default:
page_ids = OwnerLanes.lane_major(n), each CP rank's pages consecutive, one run per
rank) or ``logical`` (page_ids[l] = l, every page its own slice)), as in
``kvbridge.bench.rig``, so the methods move the same slices between the same buffers:

    kvbridge  decode receiver(room) .. init .. both CP ranks send .. Success, timed on
              the decode side from the receiver's creation (handshake) to commit
    raw       the plan's (src, dst, length) of each CP rank posted straight to the Mooncake
              binding, batch_transfer_sync_write of <= 1,024 slices, the two ranks in parallel
    engine    the same slices through kvbridge's engine adapter (submit_write + wait)

The first kvbridge room of each length is checked byte for byte on the host
(decode pools poisoned first). Geometry: DeepSeek V3.2 fp8 (target 656 B/token,
index-K 132 B/token, one NextN draft layer), 61 layers, page 64.

    python scripts/gpu_bench.py [--tokens 8192 32768] [--transports tcp nvlink] [--dst-order lane-major|logical]
                                [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import shutil
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET = "deepseek-v3.2-fp8"
PAGE = 64
CP = 2
CAP = 1024  # slices per Mooncake call
POLL_S = 0.0002
TRANSPORTS = {"tcp": ("tcp", {}), "nvlink": ("rdma", {"MC_INTRANODE_NVLINK": "true"})}
DST_ORDERS = ("lane-major", "logical")


def dst_pages(order: str, num_tokens: int) -> np.ndarray:
    """Decode page of each logical page (``page_ids``), as ``kvbridge.bench.rig.Rig.dst_pages``."""
    from kvbridge.layout import OwnerLanes

    num_pages = -(-num_tokens // PAGE)
    if order == "lane-major":
        return OwnerLanes(CP).lane_major(num_pages).astype(np.int32)
    return np.arange(num_pages, dtype=np.int32)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Child:
    """A role of this script in a child process, spoken to in JSON lines."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass
        self.lines.put({"eof": True, "rc": self.proc.wait()})

    def next(self, timeout: float) -> dict:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from child within {timeout:.0f}s") from None
        if msg.get("eof"):
            raise RuntimeError(f"child exited with {msg['rc']}")
        return msg

    def ask(self, timeout: float = 300, **cmd: Any) -> dict:
        self.send(**cmd)
        return self.next(timeout)

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def geometry(layers: int):
    from kvbridge.worker.resources import aux_schema_of, build_contract, build_specs

    specs = build_specs(PRESET, layers, PAGE, 1)
    contract = build_contract(PRESET, layers, PAGE, 1, "interleaved")
    return specs, contract, aux_schema_of(contract)


# ---- decode process ------------------------------------------------------------------------------
def decode_role(args: argparse.Namespace) -> None:
    import torch

    from kvbridge.bootstrap.client import BootstrapClient
    from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
    from kvbridge.transfer.engine import create_engine
    from kvbridge.transfer.poll import KVPoll
    from kvbridge.worker.resources import allocate_buffers
    from kvbridge.worker.synthetic import SENTINEL_BYTE, verify_pages

    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    specs, contract, aux_schema = geometry(args.layers)
    max_pages = -(-args.max_tokens // PAGE)
    buffers = allocate_buffers(specs, max_pages, device=args.device)
    aux = torch.zeros((4, aux_schema.row_bytes), dtype=torch.uint8, device=args.aux_device)
    engine = create_engine("mooncake", protocol=args.mc_protocol, max_slices_per_call=CAP)
    client = BootstrapClient(args.bootstrap)
    ep = DecodeEndpoint(DecodeConfig(instance=f"gpu-bench-decode-{args.transport}", peer_timeout=30.0,
                                     transfer_timeout=120.0), engine, specs, buffers, contract, client, aux, aux_schema)
    ep.start()
    emit({"ready": True, "session": engine.session_id, "buffers": [d.to_list() for d in ep.buffers.descs]})

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize(args.device)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "poison":
            for buf in buffers.values():
                buf.view(torch.uint8).fill_(SENTINEL_BYTE)
            sync()
            emit({"ok": True})
        elif op == "recv":
            room, n = cmd["room"], cmd["tokens"]
            page_ids = dst_pages(args.dst_order, n)
            t0 = time.perf_counter()
            r = ep.receiver(room, cmd["prefill"])
            r.init(page_ids, 0, n)
            deadline = time.monotonic() + 120
            while (state := r.poll()) not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            elapsed = time.perf_counter() - t0
            if state not in (KVPoll.Success, KVPoll.Failed):
                r.abort("bench timeout")
            emit({"room": room, "state": r.poll().name, "reason": r.failure_reason, "seconds": elapsed,
                  "aux_room": None if r.aux is None else int(r.aux.room), "stats": r.stats})
            del r
        elif op == "verify":
            sync()
            n = cmd["tokens"]
            page_ids = dst_pages(args.dst_order, n)
            checked, errors = 0, []
            for (pool, layer), buf in buffers.items():
                v = verify_pages(specs[pool], buf[:page_ids.size].cpu(), cmd["fill_room"], layer, page_ids, n)
                checked += v.bytes_checked
                if not v.ok:
                    errors.append(v.first_error)
            emit({"checked": checked, "errors": errors[:3], "bad_layers": len(errors)})
    ep.close()
    engine.close()
    client.close()


# ---- prefill process (drives one transport) ------------------------------------------------------
def prefill_role(args: argparse.Namespace) -> None:
    import torch

    from kvbridge.bench.sweep import percentile_ms
    from kvbridge.bootstrap.client import BootstrapClient
    from kvbridge.errors import EngineError
    from kvbridge.layout import BufferDesc, OwnerLanes, describe_buffer, plan_transfer
    from kvbridge.layout.aux import owner_of_last_token
    from kvbridge.transfer.engine import create_engine
    from kvbridge.transfer.poll import KVPoll
    from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint
    from kvbridge.worker.resources import allocate_buffers
    from kvbridge.worker.synthetic import fill_pages, make_aux

    transport = args.transport
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    src_device = args.device
    dst_device = "cuda:1" if gpus >= 2 else args.device
    if src_device.startswith("cuda"):
        torch.cuda.set_device(src_device)
    specs, contract, aux_schema = geometry(args.layers)
    lanes = OwnerLanes(CP)
    max_pages = -(-max(args.tokens) // PAGE)
    instance = f"gpu-bench-prefill-{transport}"
    info: dict[str, Any] = {"transport": transport, "dst_order": args.dst_order,
                            "mooncake_protocol": args.mc_protocol, "src_device": src_device,
                            "dst_device": dst_device, "gpus": gpus,
                            "env": {k: os.environ.get(k) for k in ("MC_INTRANODE_NVLINK", "PYTORCH_NO_CUDA_MEMORY_CACHING")}}
    if src_device.startswith("cuda"):
        info["gpu_name"] = torch.cuda.get_device_name(0)
        if gpus >= 2:
            info["peer_access_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))

    engines = [create_engine("mooncake", protocol=args.mc_protocol, max_slices_per_call=CAP) for _ in range(CP)]
    # Can this transport register host memory (the aux rows' default home)?
    probe = np.zeros(1 << 16, dtype=np.uint8)
    try:
        engines[0].register(probe.ctypes.data, probe.nbytes)
        engines[0].unregister(probe.ctypes.data)
        host_ok = True
    except EngineError as exc:
        host_ok = False
        info["host_register_error"] = str(exc)
    info["host_memory_registers"] = host_ok
    aux_src = "cpu" if host_ok else src_device
    aux_dst = "cpu" if host_ok else dst_device
    info["aux_rows"] = {"prefill": aux_src, "decode": aux_dst}
    emit({"info": info})

    child = Child(["--role", "decode", "--transport", transport, "--mc-protocol", args.mc_protocol, "--bootstrap",
                   args.bootstrap, "--device", dst_device, "--aux-device", aux_dst, "--layers", str(args.layers),
                   "--dst-order", args.dst_order,
                   "--max-tokens", str(max(args.tokens))], dict(os.environ), Path(args.log_dir) / f"decode-{transport}.log")
    eps: list[Any] = []
    try:
        ready = child.next(180)
        session = ready["session"]
        dst_descs = [BufferDesc.from_list(d) for d in ready["buffers"]]
        src_bufs, mirrors = [], []
        for rank in range(CP):
            n_local = max(1, lanes.owned_pages(rank, max_pages).size)
            src_bufs.append(allocate_buffers(specs, n_local, device=src_device))
            mirrors.append(allocate_buffers(specs, n_local))
            cfg = PrefillConfig(instance=instance, cp_rank=rank, cp_size=CP, max_slices_per_call=CAP,
                                aux_device=aux_src)
            ep = PrefillEndpoint(cfg, engines[rank], specs, src_bufs[rank], contract, BootstrapClient(args.bootstrap),
                                 aux_schema)
            ep.start()
            eps.append(ep)
        rooms = random.Random(1234)

        def owned(rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
            logical = lanes.owned_pages(rank, -(-n // PAGE))
            return logical, np.arange(logical.size, dtype=np.int64)

        def run_kvbridge(n: int) -> tuple[float, int, dict]:
            room = rooms.getrandbits(63)
            aux_owner = owner_of_last_token(n, PAGE, lanes)
            slices_before = sum(ep.counters["slices"] for ep in eps)
            senders = []
            for rank, ep in enumerate(eps):  # queued now; posted when decode's request arrives
                s = ep.sender(room)
                s.init(n)
                logical, local = owned(rank, n)
                s.send(logical, local, is_last=True, aux=make_aux(aux_schema, room, n) if rank == aux_owner else None)
                senders.append(s)
            res = child.ask(op="recv", room=room, tokens=n, prefill=instance)
            deadline = time.monotonic() + 60
            while any(s.poll() not in (KVPoll.Success, KVPoll.Failed) for s in senders) and time.monotonic() < deadline:
                time.sleep(0.001)
            if res["state"] != "Success" or res["aux_room"] != room:
                raise RuntimeError(f"kvbridge room {room} {res['state']}: {res['reason']} (aux room {res['aux_room']})")
            return res["seconds"], sum(ep.counters["slices"] for ep in eps) - slices_before, res["stats"]

        for n in args.tokens:
            fill_room = rooms.getrandbits(63)
            t0 = time.perf_counter()
            for rank in range(CP):
                logical, local = owned(rank, n)
                for (pool, layer), buf in mirrors[rank].items():
                    fill_pages(specs[pool], buf, fill_room, layer, logical, local, n)
                for key, gpu in src_bufs[rank].items():
                    gpu.copy_(mirrors[rank][key])
            if src_device.startswith("cuda"):
                torch.cuda.synchronize()
            fill_s = time.perf_counter() - t0
            page_ids = dst_pages(args.dst_order, n)
            plans = []
            for rank in range(CP):
                src = [describe_buffer(specs[p], lid, b) for (p, lid), b in src_bufs[rank].items()]
                logical, local = owned(rank, n)
                plans.append(plan_transfer(specs, src, dst_descs, logical, local, page_ids[logical], n))
            num_bytes = sum(p.num_bytes for p in plans)
            calls = [[(b[0].tolist(), b[1].tolist(), b[2].tolist()) for b in p.batches(CAP)] for p in plans]

            def run_raw() -> float:
                errors: list[str] = []

                def post(rank: int) -> None:
                    mc = engines[rank]._mc
                    for s, d, ln in calls[rank]:
                        rc = mc.batch_transfer_sync_write(session, s, d, ln)
                        if rc != 0:
                            errors.append(f"cp{rank}: batch_transfer_sync_write returned {rc}")
                            return

                threads = [threading.Thread(target=post, args=(r,)) for r in range(CP)]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                if errors:
                    raise RuntimeError("; ".join(errors))
                return time.perf_counter() - t

            def run_engine() -> float:
                t = time.perf_counter()
                handles = [(eng, eng.submit_write(session, p.src, p.dst, p.length)) for eng, p in zip(engines, plans)]
                for eng, h in handles:
                    eng.wait(h, 120)
                return time.perf_counter() - t

            row: dict[str, Any] = {"transport": transport, "dst_order": args.dst_order, "tokens": n, "layers": args.layers, "bytes": num_bytes,
                                   "plan_slices": sum(p.num_slices for p in plans), "fill_s": round(fill_s, 2),
                                   "failures": []}
            try:
                child.ask(op="poison")
                _, kv_slices, stats = run_kvbridge(n)  # warm-up, checked byte for byte
                row["kvbridge_slices"] = kv_slices
                row["kvbridge_stats"] = stats
                v = child.ask(op="verify", fill_room=fill_room, tokens=n, timeout=600)
                row["bytes_verified"], row["verify_errors"] = v["checked"], v["errors"]
            except Exception as exc:  # noqa: BLE001 - reported in the row
                row["failures"].append(f"kvbridge warm-up: {type(exc).__name__}: {exc}")
            kv_t, raw_t, eng_t = [], [], []
            for method, fn, out in (("raw", run_raw, raw_t), ("engine", run_engine, eng_t)):
                try:
                    fn()  # warm-up
                except Exception as exc:  # noqa: BLE001
                    row["failures"].append(f"{method} warm-up: {type(exc).__name__}: {exc}")
            for _ in range(args.reps):
                for method, fn, out in (("kvbridge", lambda: run_kvbridge(n)[0], kv_t), ("raw", run_raw, raw_t),
                                        ("engine", run_engine, eng_t)):
                    try:
                        out.append(fn())
                    except Exception as exc:  # noqa: BLE001
                        row["failures"].append(f"{method}: {type(exc).__name__}: {exc}")
            for name, times in (("kvbridge", kv_t), ("raw", raw_t), ("engine", eng_t)):
                row[f"{name}_gbps"] = round(num_bytes / float(np.median(times)) / 1e9, 3) if times else None
                row[f"{name}_p50_ms"] = percentile_ms(times, 50) if times else None
                row[f"{name}_runs"] = len(times)
            if row["kvbridge_gbps"] and row["raw_gbps"]:
                row["ratio_kvbridge_raw"] = round(row["kvbridge_gbps"] / row["raw_gbps"], 3)
            row["failures"] = row["failures"][:4]
            emit({"row": row})
    finally:
        for ep in eps:
            ep.close()
        child.stop()
        for eng in engines:
            eng.close()


# ---- main: daemon + one prefill process per transport -------------------------------------------
def table(rows: list[dict]) -> str:
    head = (f"{'transport':>9} {'tokens':>6} {'MB':>8} {'slices/room':>11} {'kvb GB/s':>9} {'raw GB/s':>9} "
            f"{'engine GB/s':>11} {'kvb/raw':>7} {'kvb p50 ms':>10} {'raw p50 ms':>10} {'verified':>8}")
    lines = [head]
    for r in rows:
        ok = "yes" if r.get("bytes_verified") and not r.get("verify_errors") else "NO"

        def f(v: Any, spec: str) -> str:
            return format(v, spec) if isinstance(v, (int, float)) else "-"
        lines.append(f"{r['transport']:>9} {r['tokens']:>6} {r['bytes'] / 1e6:>8.1f} "
                     f"{f(r.get('kvbridge_slices'), 'd'):>11} {f(r.get('kvbridge_gbps'), '.3f'):>9} "
                     f"{f(r.get('raw_gbps'), '.3f'):>9} {f(r.get('engine_gbps'), '.3f'):>11} "
                     f"{f(r.get('ratio_kvbridge_raw'), '.3f'):>7} {f(r.get('kvbridge_p50_ms'), '.1f'):>10} "
                     f"{f(r.get('raw_p50_ms'), '.1f'):>10} {ok:>8}")
        for why in r.get("failures", []) + r.get("verify_errors", []):
            lines.append(f"    {r['transport']} {r['tokens']}: {why}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--transports", nargs="+", default=["tcp", "nvlink"], choices=sorted(TRANSPORTS))
    ap.add_argument("--dst-order", choices=DST_ORDERS, default="lane-major",
                    help="decode page_ids: lane-major (one run per CP rank) or logical (page_ids[l] = l)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda:0", help="prefill device (decode: cuda:1 when there are two GPUs)")
    ap.add_argument("--json", default="", help="write rows and run info here")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per transport")
    ap.add_argument("--trace-dir", default="",
                    help="copy the prefill/decode logs (with KVBRIDGE_TRACE=1 timelines) into this folder")
    ap.add_argument("--keep-caching-allocator", action="store_true",
                    help="nvlink: keep torch's CUDA caching allocator (buffers may share cudaMalloc segments)")
    # child roles (internal)
    ap.add_argument("--role", default="main", choices=["main", "prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="tcp", help=argparse.SUPPRESS)
    ap.add_argument("--mc-protocol", default="tcp", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    ap.add_argument("--aux-device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--log-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "decode":
        return decode_role(args)
    if args.role != "main" and os.environ.get("KVBRIDGE_TRACE") == "1":
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.role == "prefill":
        return prefill_role(args)

    workdir = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    from kvbridge.worker.cluster import start_bootstrap

    rows: list[dict] = []
    infos: list[dict] = []
    with start_bootstrap(extra_args=("--lease-ttl", "30"), with_token=False) as (url, _token):
        for transport in args.transports:
            mc_protocol, extra_env = TRANSPORTS[transport]
            env = dict(os.environ, **extra_env)
            if args.trace_dir:
                env["KVBRIDGE_TRACE"] = "1"
            env.setdefault("GLOG_minloglevel", "1")
            if transport == "nvlink" and not args.keep_caching_allocator:
                # A precaution: CUDA IPC exports whole cudaMalloc allocations, and the caching allocator
                # packs small tensors into shared segments. (With mooncake-transfer-engine-cuda13 0.3.14 a
                # run that kept the caching allocator also verified byte for byte.)
                env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
            cmd = ["--role", "prefill", "--transport", transport, "--mc-protocol", mc_protocol, "--bootstrap", url,
                   "--device", args.device, "--layers", str(args.layers), "--reps", str(args.reps),
                   "--dst-order", args.dst_order,
                   "--log-dir", str(workdir), "--tokens", *map(str, args.tokens)]
            print(f"# {transport}: mooncake protocol {mc_protocol} {extra_env or ''}", file=sys.stderr, flush=True)
            child = Child(cmd, env, workdir / f"prefill-{transport}.log")
            deadline = time.monotonic() + args.timeout
            try:
                while True:
                    msg = child.next(max(1.0, deadline - time.monotonic()))
                    if "info" in msg:
                        infos.append(msg["info"])
                        print(f"# {json.dumps(msg['info'])}", file=sys.stderr, flush=True)
                    elif "row" in msg:
                        rows.append(msg["row"])
                        print("\n".join(table([msg["row"]]).splitlines()[1:]), file=sys.stderr, flush=True)
            except (TimeoutError, RuntimeError) as exc:
                if child.proc.poll() not in (0, None) or isinstance(exc, TimeoutError):
                    infos.append({"transport": transport, "error": str(exc)})
                    print(f"# {transport}: {exc}", file=sys.stderr, flush=True)
            finally:
                child.stop()
                for name in (f"prefill-{transport}.log", f"decode-{transport}.log"):
                    path = workdir / name
                    if path.exists() and args.trace_dir:
                        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                        shutil.copy(path, Path(args.trace_dir) / name)
                    if path.exists():
                        tail = path.read_text(errors="replace").splitlines()[-25:]
                        if any("rror" in line or "Traceback" in line for line in tail):
                            print(f"# --- tail of {name}\n" + "\n".join(tail), file=sys.stderr, flush=True)
    print(f"\nkvbridge vs raw Mooncake on GPU memory: {PRESET}, {args.layers} target + 1 draft layers, page {PAGE}, "
          f"CP={CP} prefill -> 1 decode, contiguous allocation, decode pages {args.dst_order}, median of {args.reps}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"info": infos, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
