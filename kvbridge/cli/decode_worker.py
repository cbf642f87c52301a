"""``kvbridge decode-worker``: a decode rank that receives KV pages and checks every byte."""

from __future__ import annotations

import argparse

from kvbridge.worker.config import add_arguments, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode-worker",
        help="run a decode rank (receives and verifies synthetic KV)",
        description="Run a decode rank: owns KV pools, registers with the bootstrap daemon and, on Decode "
        "ops, allocates pages, receives a room and verifies every byte. Stops cleanly on SIGTERM.",
    )
    add_arguments(p, "decode")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.worker.decode import DecodeWorker
    from kvbridge.worker.runtime import serve

    return serve(DecodeWorker(load_config("decode", args)))
