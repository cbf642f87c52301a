"""``kvbridge demo --model M``: every request run colocated and disaggregated, compared.

    colocated        this process: prefill the batch (same chunks), greedy decode from the
                     model's own cache; no pages, no transfer
    disaggregated    a real local cluster: bootstrap daemon, CP x TP prefill workers and
                     decode TP workers, each a process running the model, KV moved by
                     Mooncake TCP on loopback into poisoned decode pools at random pages
    per request      bytes: every decode rank's rows (its heads) equal the colocated cache's;
                     poison: every byte past the valid rows, and every page before use, holds it;
                     logits: every decode step's (and the draft's), bit for bit; tokens: equal;
                     aux: the first token and last hidden state from the aux row equal

CP and TP are simulated on the prefill side (each rank runs the whole prompt and
stores what it owns); with decode TP > 1 and head-sharded pools, decode TP rank 0
gathers the head slices through shared memory and runs the whole model.
"""

from __future__ import annotations

import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbridge.worker import ops
from kvbridge.worker.cluster import Cluster, ClusterSpec
from kvbridge.worker.model_decode import out_path, rows_path

CHECKS = ("bytes_equal", "poison_intact", "logits_equal", "tokens_equal", "aux_equal")


@dataclass(frozen=True)
class ModelDemoSpec:
    model: str = "tiny-qwen2"
    cp: int = 1
    prefill_tp: int = 1
    decode_ranks: int = 1
    tokens: tuple[int, ...] = (13, 4, 1, 30, 7, 22)
    batch_size: int = 3
    chunk_tokens: int = 5  # 0: one shot
    page_size: int = 4
    max_new_tokens: int = 4
    device: str = "cpu"
    decode_device: str = ""  # decode ranks (and the colocated run), when not device
    nvlink: bool = False
    dtype: str = "float32"
    threads: int = 1
    seed: int = 0
    room_timeout: float = 120.0


def make_prompts(spec: ModelDemoSpec, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(spec.seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in spec.tokens]


def run_colocated(lm: Any, spec: ModelDemoSpec, prompts: list[list[int]]) -> list[tuple[Any, Any]]:
    """(Prefilled, Decoded) per request, batch by batch, in this process."""
    from kvbridge.integrations.transformers import decode, prefill

    out = []
    for b in range(0, len(prompts), spec.batch_size):
        pre = prefill(lm, prompts[b: b + spec.batch_size], chunk_size=spec.chunk_tokens or None)
        out += [(p, decode(lm, p.cache, p.draft_cache, p.first_token, p.num_tokens, spec.max_new_tokens)) for p in pre]
    return out


def run_cluster(spec: ModelDemoSpec, prompts: list[list[int]], exchange: Path, progress: Any) -> dict[str, Any]:
    """Every request through the cluster; returns rooms, replies per room and exit codes."""
    pages = sum(-(-n // spec.page_size) for n in spec.tokens) + 8
    cspec = ClusterSpec(cp=spec.cp, decode_ranks=spec.decode_ranks, page_size=spec.page_size, pages=pages,
                        model=spec.model, prefill_tp=spec.prefill_tp, model_device=spec.device,
                        decode_model_device=spec.decode_device, nvlink=spec.nvlink,
                        model_dtype=spec.dtype, threads=spec.threads, exchange_dir=str(exchange),
                        transfer_timeout=spec.room_timeout, prefill_instance="model-prefill",
                        decode_instance="model-decode")
    rooms = [secrets.randbits(63) for _ in prompts]
    replies: dict[int, list[ops.Reply]] = {room: [] for room in rooms}
    with Cluster(cspec) as cluster:
        pending = []
        for q, (room, prompt) in enumerate(zip(rooms, prompts)):
            first = q - q % spec.batch_size  # requests [first, first + batch_size) run as one batch
            size = min(spec.batch_size, len(prompts) - first)
            op = ops.Prefill(room, len(prompt), spec.chunk_tokens, prompt=prompt, batch_id=first + 1, batch_size=size)
            pending += [(room, w, w.client.submit(op)) for w in cluster.prefill]
            dop = ops.Decode(room, len(prompt), cspec.prefill_instance, max_new_tokens=spec.max_new_tokens)
            pending += [(room, w, w.client.submit(dop)) for w in cluster.decode]
        deadline = time.monotonic() + spec.room_timeout * max(1, -(-len(prompts) // spec.batch_size))
        left = {room: len(cluster.workers) for room in rooms}
        while pending and time.monotonic() < deadline:  # bounded by the deadline
            cluster.poll(0.02)
            still = []
            for room, w, rid in pending:
                reply = w.client.take(rid)
                if reply is None:
                    still.append((room, w, rid))
                    continue
                replies[room].append(reply)
                left[room] -= 1
                if not left[room] and progress is not None:
                    progress.update(1)
            pending = still
        for room, w, _ in pending:
            replies[room].append(ops.OpError(f"room {room}: no reply from {w.ready.get('rank')} in time"))
        codes = cluster.close()
    return {"rooms": rooms, "replies": replies, "exit_codes": codes}


def compare(lm: Any, spec: ModelDemoSpec, q: int, room: int, colocated: tuple[Any, Any], replies: list[ops.Reply],
            exchange: Path) -> dict[str, Any]:
    """One request's verdict."""
    from kvbridge.integrations.transformers import bits_equal, cache_geometry, colocated_rows, rows_diff

    pre, coloc = colocated
    problems = [r.reason if isinstance(r, ops.OpError) else f"{r.rank}: {r.reason}"
                for r in replies if isinstance(r, ops.OpError) or not r.ok]
    verdict = {"index": q, "room": room, "num_tokens": pre.num_tokens, **{c: False for c in CHECKS}}
    files = [rows_path(exchange, room, j) for j in range(spec.decode_ranks)]
    if not all(f.exists() for f in files) or not out_path(exchange, room).exists():
        verdict["detail"] = "; ".join(problems) or "the decode ranks wrote no result"
        verdict["ok"] = False
        return verdict
    diffs, poison = [], []
    for j, f in enumerate(files):
        got = torch.load(f)
        geom = cache_geometry(lm.model, tp_size=spec.decode_ranks, tp_rank=j)
        diff = rows_diff(colocated_rows(geom, pre, list(got["rows"])), got["rows"], spec.page_size)
        if diff:
            diffs.append(f"decode tp{j}: {diff}")
        poison += [f"decode tp{j}: {p}" for p in got["problems"]]
    out = torch.load(out_path(exchange, room), weights_only=False)
    target = bits_equal(coloc.logits, out["logits"].to(coloc.logits.device))
    draft = out["draft_logits"]
    draft_ok = bits_equal(coloc.draft_logits, None if draft is None else draft.to(coloc.logits.device))
    hidden = pre.hidden.detach().cpu()
    want_hidden = hidden.view(torch.int16).numpy().view(np.uint16) if hidden.dtype == torch.bfloat16 else hidden.numpy()
    aux = out["aux"]
    aux_ok = aux["first_token"] == pre.first_token and aux["num_cached_tokens"] == pre.num_tokens and \
        np.asarray(aux["hidden"]).tobytes() == want_hidden.tobytes()
    finite = bool(coloc.logits.isfinite().all())
    verdict.update(bytes_equal=not diffs, poison_intact=not poison, logits_equal=target and draft_ok and finite,
                   tokens_equal=out["tokens"] == coloc.tokens, aux_equal=aux_ok, tokens=out["tokens"])
    details = problems + diffs + poison
    if not target:
        details.append("target logits differ")
    if not draft_ok:
        details.append("draft logits differ")
    if not finite:
        details.append("the colocated logits are not finite")
    if not verdict["tokens_equal"]:
        details.append(f"tokens {out['tokens']} != colocated {coloc.tokens}")
    if not aux_ok:
        details.append("aux row differs from the colocated first token / hidden state")
    verdict["ok"] = all(verdict[c] for c in CHECKS) and not problems
    verdict["detail"] = "; ".join(dict.fromkeys(details))
    return verdict


def run_model_demo(spec: ModelDemoSpec, show_progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from kvbridge.integrations.transformers import load_model

    torch.set_num_threads(spec.threads)  # bit-equal logits: the workers run with the same count
    # the colocated run computes where decode does: bit-equal logits need the same kernels
    lm = load_model(spec.model, dtype=spec.dtype, device=spec.decode_device or spec.device)
    prompts = make_prompts(spec, int(lm.config.vocab_size))
    t0 = time.monotonic()
    colocated = run_colocated(lm, spec, prompts)
    coloc_s = time.monotonic() - t0
    shm = Path("/dev/shm")
    exchange = Path(tempfile.mkdtemp(prefix="kvbridge-demo-", dir=shm if shm.is_dir() else None))
    try:
        with tqdm(total=len(prompts), desc="rooms", unit="room", file=sys.stderr, disable=not show_progress) as bar:
            t0 = time.monotonic()
            run = run_cluster(spec, prompts, exchange, bar)
            disagg_s = time.monotonic() - t0
        per_request = [compare(lm, spec, q, room, colocated[q], run["replies"][room], exchange)
                       for q, room in enumerate(run["rooms"])]
    finally:
        shutil.rmtree(exchange, ignore_errors=True)
    return {
        "model": spec.model, "device": spec.device, "decode_device": spec.decode_device or spec.device,
        "transport": "mooncake-nvlink" if spec.nvlink else "mooncake-tcp", "dtype": spec.dtype, "threads": spec.threads,
        "cp": spec.cp, "prefill_tp": spec.prefill_tp, "decode_ranks": spec.decode_ranks,
        "batch_size": spec.batch_size, "chunk_tokens": spec.chunk_tokens, "page_size": spec.page_size,
        "max_new_tokens": spec.max_new_tokens, "engine": "mooncake",
        "requests": len(per_request), "requests_ok": sum(r["ok"] for r in per_request),
        **{c: sum(r[c] for r in per_request) for c in CHECKS},
        "colocated_s": round(coloc_s, 3), "cluster_s": round(disagg_s, 3),
        "per_request": per_request, "exit_codes": run["exit_codes"],
    }


def format_model_summary(s: dict[str, Any]) -> str:
    lines = [
        f"kvbridge demo --model {s['model']}: prefill cp={s['cp']} x tp={s['prefill_tp']}, decode tp={s['decode_ranks']}, "
        f"batch {s['batch_size']}, chunk {s['chunk_tokens'] or 'one shot'}, page {s['page_size']}, "
        f"{s['max_new_tokens']} new tokens, {s['device']}->{s['decode_device']} {s['transport']} {s['dtype']}",
        "(CP/TP simulated: each prefill rank runs the whole prompt and stores what it owns)",
        "",
        f"{'req':>4} {'tokens':>6} {'bytes':>6} {'poison':>7} {'logits':>7} {'tokens':>7} {'aux':>4}  generated",
    ]
    mark = {True: "=", False: "DIFF"}
    for r in s["per_request"]:
        lines.append(f"{r['index']:>4} {r['num_tokens']:>6} {mark[r['bytes_equal']]:>6} {mark[r['poison_intact']]:>7} "
                     f"{mark[r['logits_equal']]:>7} {mark[r['tokens_equal']]:>7} {mark[r['aux_equal']]:>4}  "
                     f"{r.get('tokens', '')}")
    lines += ["", f"requests {s['requests']}: ok {s['requests_ok']}, tokens equal {s['tokens_equal']}, logits equal "
                  f"{s['logits_equal']}, bytes equal {s['bytes_equal']}, poison intact {s['poison_intact']}",
              f"colocated {s['colocated_s']:.2f} s, cluster (start, transfer, decode, stop) {s['cluster_s']:.2f} s"]
    for r in s["per_request"]:
        if not r["ok"]:
            lines.append(f"FAILED request {r['index']} ({r['num_tokens']} tokens): {r['detail'][:500]}")
    return "\n".join(lines)
