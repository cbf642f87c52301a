"""``kvbridge prefill-worker``: a prefill rank that owns KV pools and sends them to decode ranks."""

from __future__ import annotations

import argparse

from kvbridge.worker.config import add_arguments, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefill-worker",
        help="run a prefill rank (synthetic KV, ops channel)",
        description="Run a prefill rank: owns KV pools, registers with the bootstrap daemon, serves the "
        "control channel and, on Prefill ops, fills synthetic KV and sends it. Stops cleanly on SIGTERM.",
    )
    add_arguments(p, "prefill")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.worker.prefill import PrefillWorker
    from kvbridge.worker.runtime import serve

    return serve(PrefillWorker(load_config("prefill", args)))
