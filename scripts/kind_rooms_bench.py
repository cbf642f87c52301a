"""Rooms of DeepSeek-V4's pools (window, compressed, state) against rooms of V3.2's paged pools:
a prefill and a decode endpoint in one process, two transfer engines, a bootstrap daemon; per
length, ``--reps`` rooms of each model, one chunk, prefill pages ascending, decode pages (and
entry pages) shuffled. Reports the bytes each room posted beside ``needed_bytes`` and the GB/s
from the first write posted to the room's success on prefill (``KVSender.stats``), median.

    .venv/bin/python scripts/kind_rooms_bench.py [--tokens 1K,8K] [--layers 4] [--reps 5] [--engine mooncake]

Host memory; ``--layers`` target layers of each model (V4 + 1 draft window layer, V3.2 fp8
+ its index K + 1 draft layer), page size 64.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import kvbridge as kvb

AUX = kvb.AuxSchema.standard(16, "float32", 0)


def _bufs(specs: dict, capacity: dict) -> dict:
    return {(n, lid): torch.zeros(capacity[n] * s.bytes_per_page, dtype=torch.uint8).view(getattr(torch, s.abi))
            for n, s in specs.items() for lid in s.layer_ids}


def _capacity(specs: dict, tokens: int) -> dict:
    out = {}
    for n, s in specs.items():
        rows = tokens // s.ratio if s.kind == "compressed" else tokens
        out[n] = 2 if s.kind == "state" else -(-rows // s.page_size) + 1
    return out


def run(model: str, specs: dict, tokens: int, reps: int, engine: str, url: str, token: str) -> list[dict]:
    cap = _capacity(specs, tokens)
    contract = kvb.contract_for(specs, model=model, aux=AUX)
    engines = [kvb.create_engine(engine)]
    engines.append(kvb.create_engine(engine, fabric=engines[0].fabric) if engine == "local" else kvb.create_engine(engine))
    clients = [kvb.BootstrapClient(url, token=token) for _ in "pd"]
    p = kvb.PrefillEndpoint(kvb.PrefillConfig(instance=f"{model}-p", staging="never"), engines[0], specs,
                            _bufs(specs, cap), contract, clients[0], AUX)
    d = kvb.DecodeEndpoint(kvb.DecodeConfig(instance=f"{model}-d", staging="never", transfer_timeout=120.0), engines[1],
                           specs, _bufs(specs, cap), contract, clients[1], torch.zeros((2, AUX.row_bytes), dtype=torch.uint8),
                           AUX)
    p.start()
    d.start()
    rng = np.random.default_rng(tokens)
    out = []
    try:
        ps = next(s.page_size for s in specs.values() if s.kind in ("paged", "window"))
        num_pages = -(-tokens // ps)
        for rep in range(reps):
            room = 1 + rep
            dunits = {n: (np.array([1]) if s.kind == "state" else rng.permutation(kvb.needed_extent(s, tokens).count))
                      for n, s in specs.items() if s.kind in ("compressed", "state")}
            punits = {n: (np.array([0]) if s.kind == "state" else np.arange(cap[n]))
                      for n, s in specs.items() if s.kind in ("compressed", "state")}
            with d.receiver(room, f"{model}-p") as rx, p.sender(room) as tx:
                rx.init(rng.permutation(num_pages), 0, tokens, kind_units=dunits or None)
                tx.init(tokens, kind_units=punits or None)
                row = dict(first_token=1, num_cached_tokens=tokens, hidden_is_cp_local=True,
                           hidden=np.zeros(16, np.float32), topk_ids=np.zeros(0, np.int32),
                           topk_probs=np.zeros(0, np.float32))
                tx.send(np.arange(num_pages), np.arange(num_pages), num_tokens_ready=tokens, is_last=True, aux=row)
                deadline = time.monotonic() + 120
                while (rx.poll() != kvb.KVPoll.Success or tx.poll() != kvb.KVPoll.Success) \
                        and time.monotonic() < deadline:
                    if kvb.KVPoll.Failed in (rx.poll(), tx.poll()):
                        raise SystemExit(f"{model} room {room} failed: {rx.failure_reason or tx.failure_reason}")
                    time.sleep(0.0005)
                st = tx.stats
                out.append({"bytes": st["bytes"] - AUX.row_bytes, "slices": st["slices"], "s": st["transfer_s"],
                            "needed": sum(kvb.needed_bytes(s, tokens) for s in specs.values())})
    finally:
        d.close(timeout=2)
        p.close(timeout=2)
        for c in clients:
            c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1K,8K")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", default="mooncake")
    args = ap.parse_args()
    lengths = [int(t[:-1]) * 1024 if t.endswith("K") else int(t) for t in args.tokens.split(",")]
    models = {"deepseek-v4": kvb.deepseek_v4_pools(args.layers, 64, draft_layers=1),
              "deepseek-v3.2-fp8": kvb.preset_pools("deepseek-v3.2-fp8", num_layers=args.layers, page_size=64)}
    print(f"{'model':<18} {'tokens':>7} {'moved MB':>9} {'needed MB':>9} {'slices':>7} {'ms':>8} {'GB/s':>6}")
    with kvb.start_bootstrap() as (url, token):
        for n in lengths:
            for model, specs in models.items():
                rows = run(f"{model}-{n}", specs, n, args.reps, args.engine, url, token)
                ms = statistics.median(r["s"] for r in rows) * 1e3
                mb = rows[0]["bytes"] / 1e6
                print(f"{model:<18} {n:>7} {mb:>9.2f} {rows[0]['needed'] / 1e6:>9.2f} {rows[0]['slices']:>7} "
                      f"{ms:>8.2f} {mb / ms:>6.2f}", flush=True)
                assert all(r["bytes"] == r["needed"] for r in rows) or "v3" in model


if __name__ == "__main__":
    main()
