"""``kvbridge demo``: bootstrap + CP prefill + decode on loopback, N requests, every byte verified."""

from __future__ import annotations

import argparse
import json

from kvbridge.errors import ConfigError
from kvbridge.layout.pools import PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a whole PD deployment on loopback and verify every byte",
        description="Start a bootstrap daemon, a CP prefill instance and a decode instance as separate "
        "processes on 127.0.0.1, run requests of mixed lengths through them (target, index and draft "
        "pools), verify every byte on every decode rank, print a summary and stop everything. "
        "Exits non-zero when any room fails.",
    )
    p.add_argument("--requests", type=int, default=24, help="number of requests (default 24)")
    p.add_argument("--tokens", default="100,1000,2048,3000,4097",
                   help="request lengths: a list 'a,b,c' (cycled) or a range 'lo-hi' (default %(default)s)")
    p.add_argument("--cp", type=int, default=2, help="prefill context-parallel size (processes) (default 2)")
    p.add_argument("--decode-ranks", type=int, default=1,
                   help="decode TP size (processes); each rank receives the full KV (default 1)")
    p.add_argument("--preset", choices=PRESETS, default="deepseek-v3.2-fp8", help="geometry preset (default %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="target layers (default 4, to stay quick)")
    p.add_argument("--draft-layers", type=int, default=1, help="draft layers (default 1)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--engine", choices=("mooncake", "local"), default="mooncake", help="transfer engine (default mooncake)")
    p.add_argument("--concurrency", type=int, default=4, help="rooms in flight at once (default 4)")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="chunked-prefill size; 0: one chunk (default 1024)")
    p.add_argument("--room-timeout", type=float, default=120.0, help="seconds before a room counts as lost")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.demo import format_summary, parse_tokens, run_demo
    from kvbridge.worker.cluster import ClusterSpec
    from kvbridge.worker.runtime import quiet_http_logs

    quiet_http_logs()

    for name in ("requests", "cp", "decode_ranks", "layers", "page_size", "concurrency"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", field=name)
    try:
        tokens = parse_tokens(args.tokens, args.requests)
    except ValueError as exc:
        raise ConfigError(str(exc), field="tokens") from None
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
