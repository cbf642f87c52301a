"""Rooms of DeepSeek-V4's pools (window, compressed, state) against rooms of V3.2's paged pools:
a prefill and a decode endpoint in one process, two transfer engines, a bootstrap daemon; per
length, ``--reps`` rooms of each model, one chunk, prefill pages ascending, decode pages (and
entry pages) shuffled. Reports the bytes each room posted beside ``needed_bytes`` and the GB/s
from the first write posted to the room's success on prefill (``KVSender.stats``), median.

    .venv/bin/python scripts/kind_rooms_bench.py [--tokens 1K,8K] [--layers 4] [--reps 5] [--engine mooncake]

Host memory; ``--layers`` target layers of each model (V4 + 1 draft window layer, V3.2 fp8
+ its index K + 1 draft layer), page size 64. ``--device cuda:0``: every pool and both aux rows on
that GPU, and decode's endpoint in a process of its own (this script, started per model and length;
the receivers' pages drawn there), prefill's here; with ``--engine ipc`` (CUDA IPC), or ``--engine
mooncake --protocol rdma`` under ``MC_INTRANODE_NVLINK=true PYTORCH_NO_CUDA_MEMORY_CACHING=1``.
"""

from __future__ import annotations

import contextlib

import argparse
import json
import statistics
import subprocess
import sys
import time

from typing import Any

import numpy as np
import torch

import kvbridge as kvb

AUX = kvb.AuxSchema.standard(16, "float32", 0)


def _bufs(specs: dict, capacity: dict, device: str = "cpu") -> dict:
    return {(n, lid): torch.zeros(capacity[n] * s.bytes_per_page, dtype=torch.uint8, device=device)
            .view(getattr(torch, s.abi)) for n, s in specs.items() for lid in s.layer_ids}


def _capacity(specs: dict, tokens: int) -> dict:
    out = {}
    for n, s in specs.items():
        rows = tokens // s.ratio if s.kind == "compressed" else tokens
        out[n] = 2 if s.kind == "state" else -(-rows // s.page_size) + 1
    return out


def _decode_endpoint(model: str, specs: dict, tokens: int, engine: Any, client: Any, device: str) -> Any:
    d = kvb.DecodeEndpoint(kvb.DecodeConfig(instance=f"{model}-d", staging="never", transfer_timeout=120.0), engine,
                           specs, _bufs(specs, _capacity(specs, tokens), device),
                           kvb.contract_for(specs, model=model, aux=AUX), client,
                           torch.zeros((2, AUX.row_bytes), dtype=torch.uint8, device=device), AUX)
    d.start()
    return d


def _receive(d: Any, model: str, specs: dict, tokens: int, room: int, rng: np.random.Generator) -> Any:
    """Decode's receiver of ``room``: its pages (and entry pages) shuffled, initialised."""
    ps = next(s.page_size for s in specs.values() if s.kind in ("paged", "window"))
    dunits = {n: (np.array([1]) if s.kind == "state" else rng.permutation(kvb.needed_extent(s, tokens).count))
              for n, s in specs.items() if s.kind in ("compressed", "state")}
    rx = d.receiver(room, f"{model}-p")
    rx.init(rng.permutation(-(-tokens // ps)), 0, tokens, kind_units=dunits or None)
    return rx


def serve_decode(args: argparse.Namespace) -> None:
    """``--serve-decode MODEL TOKENS``: decode's side of ``run`` in this process; a JSON line per room."""
    model, tokens = args.serve_decode[0], int(args.serve_decode[1])
    specs = _models(args.layers)[model.rsplit("-", 1)[0]]
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    client = kvb.BootstrapClient(args.url, token=args.token or None)
    d = _decode_endpoint(model, specs, tokens, kvb.create_engine(args.engine, protocol=args.protocol), client,
                         args.device)
    rng = np.random.default_rng(tokens)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for rep in range(args.reps):
            sys.stdin.readline()  # prefill's sends of the room are queued: go
            t0 = time.perf_counter()
            with _receive(d, model, specs, tokens, 1 + rep, rng) as rx:
                state = rx.wait(120)
                print(json.dumps({"room": 1 + rep, "state": state.name, "reason": rx.failure_reason or "",
                                  "s": time.perf_counter() - t0}), flush=True)
    finally:
        d.close(timeout=2)
        client.close()


def run(model: str, specs: dict, tokens: int, reps: int, engine: str, url: str, token: str, device: str = "cpu",
        protocol: str = "tcp", layers: int = 4, split: bool = False) -> list[dict]:
    cap = _capacity(specs, tokens)
    contract = kvb.contract_for(specs, model=model, aux=AUX)
    own = not (split or device.startswith("cuda"))  # on a GPU decode is a process of its own
    engines = [kvb.create_engine(engine, protocol=protocol)]
    if own:
        engines.append(kvb.create_engine(engine, fabric=engines[0].fabric) if engine == "local" else kvb.create_engine(engine))
    clients = [kvb.BootstrapClient(url, token=token) for _ in ("p", "d")[: 1 + own]]
    p = kvb.PrefillEndpoint(kvb.PrefillConfig(instance=f"{model}-p", staging="never", aux_device=device), engines[0],
                            specs, _bufs(specs, cap, device), contract, clients[0], AUX)
    p.start()
    d = child = None
    if own:
        d = _decode_endpoint(model, specs, tokens, engines[1], clients[1], device)
    else:
        child = subprocess.Popen([sys.executable, __file__, "--serve-decode", model, str(tokens), "--reps", str(reps),
                                  "--layers", str(layers), "--engine", engine, "--protocol", protocol, "--device",
                                  device, "--url", url, "--token", token or ""], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert json.loads(child.stdout.readline() or "{}").get("ready"), f"{model}: decode's process did not start"
    rng = np.random.default_rng(tokens)
    out = []
    try:
        ps = next(s.page_size for s in specs.values() if s.kind in ("paged", "window"))
        num_pages = -(-tokens // ps)
        for rep in range(reps):
            room = 1 + rep
            punits = {n: (np.array([0]) if s.kind == "state" else np.arange(cap[n]))
                      for n, s in specs.items() if s.kind in ("compressed", "state")}
            with (_receive(d, model, specs, tokens, room, rng) if own else contextlib.nullcontext()) as rx, \
                    p.sender(room) as tx:
                tx.init(tokens, kind_units=punits or None)
                row = dict(first_token=1, num_cached_tokens=tokens, hidden_is_cp_local=True,
                           hidden=np.zeros(16, np.float32), topk_ids=np.zeros(0, np.int32),
                           topk_probs=np.zeros(0, np.float32))
                tx.send(np.arange(num_pages), np.arange(num_pages), num_tokens_ready=tokens, is_last=True, aux=row)
                if child is not None:
                    child.stdin.write("go\n")
                    child.stdin.flush()
                deadline = time.monotonic() + 120
                while ((rx is not None and rx.poll() != kvb.KVPoll.Success) or tx.poll() != kvb.KVPoll.Success) \
                        and time.monotonic() < deadline:
                    if kvb.KVPoll.Failed in ((rx.poll() if rx is not None else None), tx.poll()):
                        raise SystemExit(f"{model} room {room} failed: {tx.failure_reason or rx.failure_reason}")
                    time.sleep(0.0005)
                got = {}
                if child is not None:  # decode's own verdict on the room
                    got = json.loads(child.stdout.readline() or "{}")
                    if got.get("state") != "Success":
                        raise SystemExit(f"{model} room {room} on decode: {got or 'its process ended'}")
                st = tx.stats
                out.append({"bytes": st["bytes"] - AUX.row_bytes, "slices": st["slices"], "s": st["transfer_s"],
                            "needed": sum(kvb.needed_bytes(s, tokens) for s in specs.values()),
                            "room_s": got.get("s")})
    finally:
        if d is not None:
            d.close(timeout=2)
        if child is not None:
            child.wait(30)
        p.close(timeout=2)
        for c in clients:
            c.close()
    return out


def _models(layers: int) -> dict:
    return {"deepseek-v4": kvb.deepseek_v4_pools(layers, 64, draft_layers=1),
            "deepseek-v3.2-fp8": kvb.preset_pools("deepseek-v3.2-fp8", num_layers=layers, page_size=64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1K,8K")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", default="mooncake")
    ap.add_argument("--protocol", default="tcp", help="Mooncake's (rdma + MC_INTRANODE_NVLINK=true: NVLink on one host)")
    ap.add_argument("--device", default="cpu", help="cuda:N: pools and aux rows on that GPU, decode in its own process")
    ap.add_argument("--split", action="store_true", help="decode in its own process on the CPU too (host memory)")
    ap.add_argument("--serve-decode", nargs=2, metavar=("MODEL", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--token", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_decode:
        return serve_decode(args)
    lengths = [int(t[:-1]) * 1024 if t.endswith("K") else int(t) for t in args.tokens.split(",")]
    models = _models(args.layers)
    print(f"{'model':<18} {'tokens':>7} {'moved MB':>9} {'needed MB':>9} {'slices':>7} {'ms':>8} {'GB/s':>6}")
    with kvb.start_bootstrap() as (url, token):
        for n in lengths:
            for model, specs in models.items():
                rows = run(f"{model}-{n}", specs, n, args.reps, args.engine, url, token, args.device, args.protocol,
                           args.layers, args.split)
                ms = statistics.median(r["s"] for r in rows) * 1e3
                mb = rows[0]["bytes"] / 1e6
                print(f"{model:<18} {n:>7} {mb:>9.2f} {rows[0]['needed'] / 1e6:>9.2f} {rows[0]['slices']:>7} "
                      f"{ms:>8.2f} {mb / ms:>6.2f}", flush=True)
                if rows[0]["room_s"] is not None:  # decode in its own process: its receiver() -> Success too
                    room_ms = statistics.median(r["room_s"] for r in rows) * 1e3
                    print(f"{'':<18} {'':>7} decode's room (receiver -> Success, prefill's sends queued): "
                          f"{room_ms:.2f} ms, {mb / room_ms:.2f} GB/s", flush=True)
                assert all(r["bytes"] == r["needed"] for r in rows) or "v3" in model


if __name__ == "__main__":
    main()
