"""``kvbridge decode-worker``: a decode rank that receives KV pages and checks every byte."""

from __future__ import annotations

import argparse

from kvbridge.worker.config import add_arguments, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode-worker",
        help="run a decode rank (receives and verifies synthetic KV, or runs a model with --model)",
        description="Run a decode rank: owns KV pools, registers with the bootstrap daemon and, on Decode "
        "ops, allocates pages, receives a room and verifies every byte. With --model (tiny-qwen2, "
        "tiny-deepseek-v3 or a local Hugging Face directory; the 'model' extra) the pools are the model's cache: "
        "decode receives into poisoned pages, rebuilds the model's cache from them and generates greedily "
        "(with decode TP > 1, TP rank 0 gathers the head slices through --exchange-dir and runs the whole "
        "model: a stand-in for TP attention). Stops cleanly on SIGTERM.",
    )
    add_arguments(p, "decode")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.worker.runtime import serve

    cfg = load_config("decode", args)
    if cfg.model:
        from kvbridge.worker.model_decode import ModelDecodeWorker as Worker
    else:
        from kvbridge.worker.decode import DecodeWorker as Worker
    return serve(Worker(cfg))
