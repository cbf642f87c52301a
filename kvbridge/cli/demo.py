"""``kvbridge demo``: bootstrap + CP prefill + decode on loopback, N requests, every byte verified
(synthetic KV), or with ``--model`` a transformers model run colocated and disaggregated, compared."""

from __future__ import annotations

import argparse
import json

from kvbridge.errors import ConfigError
from kvbridge.layout.pools import PRESETS
from kvbridge.transfer.engine.registry import engine_names

MODEL_DEFAULTS = {"requests": 6, "tokens": "13,4,1,30,7,22", "page_size": 4, "chunk_tokens": 5}
SYNTHETIC_DEFAULTS = {"requests": 24, "tokens": "100,1000,2048,3000,4097", "page_size": 64, "chunk_tokens": 1024}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a whole PD deployment on loopback and verify every byte (or a real model's tokens)",
        description="Start a bootstrap daemon, a CP prefill instance and a decode instance as separate "
        "processes on 127.0.0.1, run requests of mixed lengths through them (target, index and draft "
        "pools), verify every byte on every decode rank, print a summary and stop everything. "
        "With --model (tiny-qwen2, tiny-deepseek-v3 or a local Hugging Face directory; the 'model' extra) "
        "every request runs twice: colocated in this process (no transfer) and disaggregated through the "
        "cluster (workers running the model, KV over Mooncake TCP into poisoned decode pages at random page "
        "ids), and each request reports bytes equal to the colocated cache, poison intact, logits bit-equal "
        "(target and draft), greedy tokens equal. CP and prefill TP are simulated: each prefill rank runs the "
        "whole prompt and stores only the pages (and KV heads) it owns; page split, ownership, aux ownership "
        "and decode accounting are real, CP/TP attention is not. With --decode-ranks > 1 and a GQA model, "
        "decode TP rank 0 gathers the head slices through shared memory and generates. "
        "Exits non-zero when any room fails or any request differs.",
    )
    p.add_argument("--requests", type=int, default=None,
                   help="number of requests (default 24; 6 with --model)")
    p.add_argument("--tokens", default=None,
                   help="request lengths: a list 'a,b,c' (cycled) or a range 'lo-hi' (default 100,1000,2048,3000,4097; "
                        "with --model 13,4,1,30,7,22)")
    p.add_argument("--cp", type=int, default=None,
                   help="prefill context-parallel size (processes) (default 2; 1 with --model). With --model, CP "
                        "attention is simulated: each CP rank runs the whole prompt and sends what it owns "
                        "(tiny-deepseek-v4: replicated lanes, rank 0 sends every page, entry and slot)")
    p.add_argument("--decode-ranks", type=int, default=1,
                   help="decode TP size (processes). Synthetic: each rank receives the full KV. --model: a GQA "
                        "model's k/v pools are head-sharded, so each rank receives its heads (default 1)")
    p.add_argument("--preset", choices=PRESETS, default="deepseek-v3.2-fp8", help="geometry preset (default %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="target layers (default 4, to stay quick)")
    p.add_argument("--draft-layers", type=int, default=1, help="draft layers (default 1)")
    p.add_argument("--page-size", type=int, default=None, help="tokens per page (default 64; 4 with --model)")
    p.add_argument("--engine", choices=("mooncake", *engine_names("in-process")), default="mooncake",
                   help="transfer engine: mooncake (worker processes), local (worker threads of this process) "
                        "(default mooncake)")
    p.add_argument("--concurrency", type=int, default=4, help="rooms in flight at once (default 4; synthetic)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="chunked-prefill size; 0: one chunk (default 1024; 5 with --model)")
    p.add_argument("--room-timeout", type=float, default=120.0, help="seconds before a room counts as lost")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    m = p.add_argument_group("model mode")
    m.add_argument("--model", default="", help="tiny-qwen2, tiny-deepseek-v3 or a local Hugging Face directory; "
                   "tiny-deepseek-v4: V4's window, compressed and state pools through the rooms (a prefill and a decode "
                   "endpoint in this process, two Mooncake engines), colocated against disaggregated")
    m.add_argument("--prefill-tp", type=int, default=1,
                   help="prefill TP ranks per CP rank (processes; each stores its KV heads) (default 1)")
    m.add_argument("--batch-size", type=int, default=3, help="requests prefilled together (default 3)")
    m.add_argument("--max-new-tokens", type=int, default=4, help="greedy steps after the first token (default 4)")
    m.add_argument("--device", default="cpu", help="where the prefill ranks compute (and, without --decode-device, the "
                   "decode ranks and the colocated run): cpu or cuda:N (default cpu)")
    m.add_argument("--decode-device", default="", help="decode ranks' device (and the colocated run's), when not "
                   "--device: e.g. --device cuda:0 --decode-device cuda:1")
    m.add_argument("--transport", choices=("tcp", "nvlink"), default="tcp",
                   help="Mooncake transport: tcp, or nvlink (intra-node, GPU memory; the CUDA build) (default tcp)")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype (default float32)")
    m.add_argument("--threads", type=int, default=1, help="torch threads of every process (default 1)")
    m.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.demo import parse_tokens
    from kvbridge.worker.runtime import quiet_http_logs

    quiet_http_logs()
    defaults = MODEL_DEFAULTS if args.model else SYNTHETIC_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cp is None:
        args.cp = 1 if args.model else 2
    for name in ("requests", "cp", "decode_ranks", "layers", "page_size", "concurrency", "prefill_tp", "batch_size",
                 "threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", field=name)
    try:
        tokens = parse_tokens(args.tokens, args.requests)
    except ValueError as exc:
        raise ConfigError(str(exc), field="tokens") from None
    if args.model:
        return run_model(args, tokens)
    from kvbridge.demo import format_summary, run_demo
    from kvbridge.worker.cluster import ClusterSpec

    max_pages = -(-max(tokens) // args.page_size)
    spec = ClusterSpec(
        cp=args.cp,
        decode_ranks=args.decode_ranks,
        preset=args.preset,
        layers=args.layers,
        draft_layers=args.draft_layers,
        page_size=args.page_size,
        pages=max_pages * args.concurrency + 8,
        engine=args.engine,
        transfer_timeout=args.room_timeout,
    )
    summary = run_demo(spec, tokens, args.concurrency, args.chunk_tokens, args.room_timeout, not args.no_progress)
    print(json.dumps(summary) if args.json else format_summary(summary))
    ok = summary["rooms_failed"] == 0 and summary["rooms_ok"] == summary["requests"]
    ok = ok and summary["bytes_verified"] == summary["bytes_moved"] > 0
    return 0 if ok else 1


def run_model(args: argparse.Namespace, tokens: list[int]) -> int:
    if args.model == "tiny-deepseek-v4":
        from kvbridge.demo_v4 import format_v4_summary, run_v4_demo

        summary = run_v4_demo(tokens, args.chunk_tokens, args.max_new_tokens, seed=args.seed, engine=args.engine,
                              threads=args.threads, cp=args.cp)
        print(json.dumps(summary) if args.json else format_v4_summary(summary))
        return 0 if summary["requests_ok"] == summary["requests"] > 0 else 1
    if args.engine != "mooncake":
        raise ConfigError("--model runs the workers as processes: use --engine mooncake", field="engine")
    if args.max_new_tokens < 0 or args.chunk_tokens < 0:
        raise ConfigError("--max-new-tokens and --chunk-tokens must be >= 0", field="max_new_tokens")
    from kvbridge.demo_model import ModelDemoSpec, format_model_summary, run_model_demo

    spec = ModelDemoSpec(model=args.model, cp=args.cp, prefill_tp=args.prefill_tp, decode_ranks=args.decode_ranks,
                         tokens=tuple(tokens), batch_size=args.batch_size, chunk_tokens=args.chunk_tokens,
                         page_size=args.page_size, max_new_tokens=args.max_new_tokens, device=args.device,
                         decode_device=args.decode_device, nvlink=args.transport == "nvlink",
                         dtype=args.dtype, threads=args.threads, seed=args.seed, room_timeout=args.room_timeout)
    summary = run_model_demo(spec, show_progress=not args.no_progress)
    print(json.dumps(summary) if args.json else format_model_summary(summary))
    return 0 if summary["requests_ok"] == summary["requests"] > 0 else 1
