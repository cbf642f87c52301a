"""``kvbridge demo --model tiny-deepseek-v4``: DeepSeek-V4's window, compressed and state pools
moved room by room between a prefill and a decode endpoint, every request colocated against
disaggregated.

    colocated        prefill (same chunks), greedy decode from the model's own cache
    disaggregated    a room per request (``integrations/transformers/v4_rooms.py``): after every
                     chunk the prefill side writes its cache into its pools and sends the chunk's
                     pages; the rooms carry each kind's share (the window's pages, complete
                     entries, the compressor state with the last chunk) into poisoned decode pools
                     at reversed units; decode rebuilds its cache from them and decodes from the
                     aux row's first token
    per request      bytes moved = bytes decode needs; logits bit-equal; tokens equal

In one process: a bootstrap daemon (a child process), the endpoints and their transfer engines
(Mooncake, TCP on loopback, by default). ``cp`` > 1: that many prefill endpoints (CP attention
simulated: one prefill pass writes every rank's pools); V4's compressed pools need replicated
lanes (docs/concepts.md), so rank 0 sends everything and the others take part and send nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def run_v4_demo(tokens: list[int], chunk_tokens: int, steps: int, seed: int = 0, engine: str = "mooncake",
                threads: int = 1, cp: int = 1) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)  # bit-equal logits need one thread count on both sides; and it is faster here

    import kvbridge as kvb
    from kvbridge.integrations.transformers.v4 import tiny_v4_model
    from kvbridge.integrations.transformers.v4_rooms import V4Rooms

    model = tiny_v4_model()
    rng = np.random.default_rng(seed)
    per_request = []
    with kvb.start_bootstrap() as (url, token):
        rooms = V4Rooms(model, url, token=token, engine=engine, cp_size=cp)
        try:
            for n in tokens:
                ids = torch.from_numpy(rng.integers(0, model.config.vocab_size, (1, n)))
                cuts = list(range(chunk_tokens, n, chunk_tokens)) if chunk_tokens else []
                per_request.append(rooms.run(ids, cuts, steps=steps))
        finally:
            rooms.close()
    ok = [r for r in per_request if r["logits_equal"] and r["tokens_equal"] and r["bytes_moved"] == r["bytes_needed"]]
    return {"model": "tiny-deepseek-v4", "engine": engine, "cp": cp, "requests": len(per_request), "requests_ok": len(ok),
            "logits_equal": sum(r["logits_equal"] for r in per_request),
            "tokens_equal": sum(r["tokens_equal"] for r in per_request),
            "bytes_equal": sum(r["bytes_moved"] == r["bytes_needed"] for r in per_request),
            "per_request": per_request}


def format_v4_summary(summary: dict[str, Any]) -> str:
    lines = [f"{'req':>4} {'tokens':>6} {'moved B':>9} {'needed B':>9} {'logits':>7} {'tokens':>7}  generated"]
    for i, r in enumerate(summary["per_request"]):
        eq = "=" if r["bytes_moved"] == r["bytes_needed"] else "!"
        lines.append(f"{i:>4} {r['tokens']:>6} {r['bytes_moved']:>9} {r['bytes_needed']:>8}{eq} "
                     f"{'=' if r['logits_equal'] else '!':>7} {'=' if r['tokens_equal'] else '!':>7}  {r['generated']}")
    lines.append(f"requests {summary['requests']}: ok {summary['requests_ok']}, tokens equal {summary['tokens_equal']}, "
                 f"logits equal {summary['logits_equal']}, bytes moved = needed {summary['bytes_equal']} "
                 f"(window, compressed and state pools through the rooms; prefill CP {summary.get('cp', 1)}"
                 f"{' (simulated: replicated lanes, rank 0 sends)' if summary.get('cp', 1) > 1 else ''}; one process, "
                 f"{summary['engine']} engines)")
    return "\n".join(lines)
