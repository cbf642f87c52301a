"""Layer-wise against whole-request sends on a model worker (CPU): what sending each layer as
the forward pass computes it saves between the end of prefill's forward pass and decode's
commit, and in TTFT.

    prefill (this process)   a tiny random Llama (transformers), one prompt of --tokens tokens
                             per room; a forward hook on each decoder layer copies that layer's
                             K and V out of transformers' cache into kvbridge's paged k/v pools
                             at random local pages, and (layer-wise rooms) sends that layer:
                             ``KVSender.send(..., layers=(i, i + 1))``; whole rooms send every
                             page of every layer after the forward pass, as vLLM's connector does
                             with ``layerwise: false``
    decode (a child process) a DecodeEndpoint whose pools take the room at random pages; it asks
                             before the forward starts, polls, and reports the monotonic time
                             of its commit (Success), then a digest of the pages it received
    both                     the real bootstrap daemon, Mooncake TCP on loopback; rooms alternate
                             whole / layer-wise after one warm-up room of each

Figures per room: ``tail`` = decode's commit - the end of prefill's forward pass (plus the
first token's lm head), ``ttft`` = decode's commit - the forward's start (decode holds the
first token then: it rides in the aux row). Printed: each room, the medians, their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import kvbridge as kvb


def pools(args):
    row_bytes = args.kv_heads * args.head_dim * 4
    specs = [kvb.PoolSpec(n, "float32", "float32", row_bytes, args.page_size, tuple(range(args.layers)))
             for n in ("k", "v")]
    aux = kvb.AuxSchema((kvb.AuxRegion("room", "uint64", ()), kvb.AuxRegion("first_token", "int32", ())))
    contract = kvb.contract_for(specs, model="bench/tiny-llama", aux=aux, lane_rule="interleaved",
                                kernel={"attention_backend": "sdpa", "abi": "kv-token-major"})
    bufs = {(s.name, i): torch.zeros((args.pages * args.page_size, args.kv_heads, args.head_dim))
            for s in specs for i in s.layer_ids}
    return {s.name: s for s in specs}, contract, aux, bufs


def digest(bufs, layers: int, pages: np.ndarray, page_size: int) -> str:
    h = hashlib.sha256()
    for name in ("k", "v"):
        for i in range(layers):
            paged = bufs[(name, i)].view(-1, page_size, *bufs[(name, i)].shape[1:])
            h.update(paged[torch.as_tensor(pages)].contiguous().numpy().tobytes())
    return h.hexdigest()


def decode_main(args) -> None:
    specs, contract, aux, bufs = pools(args)
    client = kvb.BootstrapClient(args.bootstrap, token=args.token)
    engine = kvb.create_engine("mooncake")
    aux_rows = torch.zeros((4, aux.row_bytes), dtype=torch.uint8)
    ep = kvb.DecodeEndpoint(kvb.DecodeConfig(instance="bench-d", transfer_timeout=120.0), engine, specs, bufs,
                            contract, client, aux_rows, aux)
    ep.start()
    print(json.dumps({"ready": True}), flush=True)
    rng = np.random.default_rng(1)
    num_pages = -(-args.tokens // args.page_size)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        page_ids = rng.permutation(args.pages)[:num_pages]
        r = ep.receiver(cmd["room"], "bench-p")
        r.init(page_ids, 0, args.tokens)
        print(json.dumps({"asked": cmd["room"]}), flush=True)
        while r.poll() not in (kvb.KVPoll.Success, kvb.KVPoll.Failed):
            time.sleep(0.0002)
        commit = time.monotonic()
        state, reason = r.poll().name, r.failure_reason
        out = {"room": cmd["room"], "state": state, "reason": reason, "commit": commit,
               "digest": digest(bufs, args.layers, page_ids, args.page_size)}
        r.close()
        print(json.dumps(out), flush=True)
    ep.close(timeout=3)
    engine.close()
    client.close()


def model_of(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.heads * args.head_dim, intermediate_size=4 * args.heads
                      * args.head_dim, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=args.tokens,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def prefill_main(args) -> None:
    torch.set_num_threads(args.threads)
    specs, contract, aux, bufs = pools(args)
    model = model_of(args)
    with kvb.start_bootstrap() as (url, token):
        child = subprocess.Popen([sys.executable, __file__, "--decode", "--bootstrap", url, "--token", token,
                                  *sys.argv[1:]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(child.stdout.readline()).get("ready")
            engine = kvb.create_engine("mooncake")
            ep = kvb.PrefillEndpoint(kvb.PrefillConfig(instance="bench-p", target_timeout=120.0), engine, specs, bufs,
                                     contract, kvb.BootstrapClient(url, token=token), aux)
            ep.start()
            try:
                rows = run_rooms(args, model, ep, bufs, child)
            finally:
                ep.close(timeout=3)
                engine.close()
        finally:
            if child.poll() is None:
                child.stdin.write(json.dumps({"op": "quit"}) + "\n")
                child.stdin.flush()
                child.wait(20)
    report(args, rows)


def run_rooms(args, model, ep, bufs, child) -> list[dict]:
    num_pages = -(-args.tokens // args.page_size)
    logical = np.arange(num_pages, dtype=np.int64)
    rng = np.random.default_rng(0)
    prompt = torch.as_tensor(rng.integers(3, 1000, args.tokens)).reshape(1, -1)
    state: dict = {}

    def hook(i):
        def on_layer(module, a, kwargs, output):
            cache = kwargs["past_key_values"]
            for name, t in (("k", cache.layers[i].keys), ("v", cache.layers[i].values)):
                rows = t[0].transpose(0, 1)  # [tokens, kv heads, head dim]
                paged = bufs[(name, i)].view(-1, args.page_size, args.kv_heads, args.head_dim)
                paged[state["local_t"]] = rows.reshape(num_pages, args.page_size, args.kv_heads, args.head_dim)
            if state["mode"] == "layerwise":
                state["sender"].send(logical, state["local"], num_tokens_ready=args.tokens, layers=(i, i + 1))
        return on_layer

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(hook(i), with_kwargs=True)
    modes = ["whole", "layerwise"] * (1 + args.rooms // 2 + args.rooms % 2)
    rows = []
    for n in range(2 + args.rooms):
        mode, room = modes[n], 9000 + n
        local = rng.permutation(args.pages)[:num_pages].astype(np.int64)
        state.update(mode=mode, local=local, local_t=torch.as_tensor(local))
        child.stdin.write(json.dumps({"room": room}) + "\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline())["asked"] == room
        sender = state["sender"] = ep.sender(room)
        sender.init(args.tokens)
        while sender.poll() == kvb.KVPoll.Bootstrapping:  # decode's request is here: both modes start alike
            time.sleep(0.001)
        t0 = time.monotonic()
        with torch.no_grad():
            out = model(prompt, use_cache=True, logits_to_keep=1)
        first = int(out.logits[0, -1].argmax())
        t_fwd = time.monotonic()
        row = {"room": room, "first_token": first}
        if mode == "whole":
            sender.send(logical, local, is_last=True, aux=row)
        else:
            empty = np.zeros(0, dtype=np.int64)
            sender.send(empty, empty, is_last=True, aux=row)
        got = json.loads(child.stdout.readline())
        ok = got["state"] == "Success" and got["digest"] == digest(bufs, args.layers, local, args.page_size)
        while sender.poll() not in (kvb.KVPoll.Success, kvb.KVPoll.Failed):
            time.sleep(0.001)
        stats = sender.stats
        sender.close()
        rows.append({"room": room, "mode": mode, "warmup": n < 2, "ok": ok, "reason": got.get("reason"),
                     "forward_s": t_fwd - t0, "tail_s": got["commit"] - t_fwd, "ttft_s": got["commit"] - t0,
                     "bytes": stats["bytes"], "layer_sends": stats["layer_sends"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def report(args, rows: list[dict]) -> None:
    counted = [r for r in rows if not r["warmup"]]
    bad = [r for r in rows if not r["ok"]]
    med = {m: {k: statistics.median(r[k] for r in counted if r["mode"] == m) for k in ("forward_s", "tail_s", "ttft_s")}
           for m in ("whole", "layerwise")}
    n = {m: sum(1 for r in counted if r["mode"] == m) for m in med}
    mib = rows[0]["bytes"] / 2**20
    print(f"\n{args.tokens} tokens, {args.layers} layers, {mib:.1f} MiB per room, rooms per mode {n}, "
          f"bytes equal: {'all' if not bad else f'NOT {len(bad)}'}")
    print("| mode | forward (ms) | forward end -> decode commit (ms) | TTFT (ms) |")
    print("| --- | --- | --- | --- |")
    for m in ("whole", "layerwise"):
        d = med[m]
        print(f"| {m} | {d['forward_s'] * 1e3:.1f} | {d['tail_s'] * 1e3:.1f} | {d['ttft_s'] * 1e3:.1f} |")
    print(f"layerwise / whole: tail {med['layerwise']['tail_s'] / med['whole']['tail_s']:.2f}, "
          f"TTFT {med['layerwise']['ttft_s'] / med['whole']['ttft_s']:.2f}")
    if bad:
        sys.exit(f"rooms not byte-equal or failed: {[(r['room'], r['reason']) for r in bad]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rooms", type=int, default=6, help="rooms counted (alternating), after one warm-up of each")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the prefill forward pass")
    ap.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    ap.add_argument("--token", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.pages = 2 * -(-args.tokens // args.page_size)
    (decode_main if args.decode else prefill_main)(args)


if __name__ == "__main__":
    main()
