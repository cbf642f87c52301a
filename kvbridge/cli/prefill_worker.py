"""``kvbridge prefill-worker``: a prefill rank that owns KV pools and sends them to decode ranks."""

from __future__ import annotations

import argparse

from kvbridge.worker.config import add_arguments, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefill-worker",
        help="run a prefill rank (synthetic KV, or a model with --model; ops channel)",
        description="Run a prefill rank: owns KV pools, registers with the bootstrap daemon, serves the "
        "control channel and, on Prefill ops, fills synthetic KV and sends it. With --model (tiny-qwen2, "
        "tiny-deepseek-v3 or a local Hugging Face directory; the 'model' extra) Prefill ops carry prompts: the "
        "rank runs them as batches (one shot or chunked), pages the KV it owns at random free pages and sends "
        "each chunk's completed pages, and the aux row from the owner of the last token. CP is simulated: "
        "each CP rank runs the whole prompt and stores only the pages it owns (page split, ownership, aux "
        "ownership and decode accounting are real; CP attention is not); so is TP: each TP rank runs the "
        "whole model and stores only its KV heads. Stops cleanly on SIGTERM.",
    )
    add_arguments(p, "prefill")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.worker.runtime import serve

    cfg = load_config("prefill", args)
    if cfg.model:
        from kvbridge.worker.model_prefill import ModelPrefillWorker as Worker
    else:
        from kvbridge.worker.prefill import PrefillWorker as Worker
    return serve(Worker(cfg))
