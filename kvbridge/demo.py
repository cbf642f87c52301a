"""``kvbridge demo``: a whole PD deployment on loopback, N requests, every byte checked.

    bootstrap daemon  <-- register --  prefill-worker x cp (one instance, CP shared KV)
                      <-- register --  decode-worker x decode_ranks (each receives the full KV)
    demo (this process) -- ops --> Prefill(room) to every prefill rank, Decode(room) to every decode rank

A room is ok when every rank reports ok and every decode rank verified every
byte of every pool and layer (and the aux row) against the synthetic KV.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.worker import ops
from kvbridge.worker.cluster import Cluster, ClusterSpec


def parse_tokens(text: str, requests: int, seed: int = 0) -> list[int]:
    """``"a,b,c"`` cycles through the list; ``"lo-hi"`` draws uniformly from the range."""
    text = text.strip()
    if "-" in text and "," not in text:
        lo, hi = (int(x) for x in text.split("-", 1))
        if not 1 <= lo <= hi:
            raise ValueError(f"token range {text!r} must be 1 <= lo <= hi")
        rng = random.Random(seed)
        return [rng.randint(lo, hi) for _ in range(requests)]
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"token list {text!r} must hold positive integers")
    return [values[i % len(values)] for i in range(requests)]


@dataclass
class RoomOutcome:
    room: int
    num_tokens: int
    started: float
    pending: list[tuple[Any, int]]
    results: list[ops.Reply] = field(default_factory=list)
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        return all(isinstance(r, ops.RoomResult) and r.ok for r in self.results)

    @property
    def reasons(self) -> list[str]:
        out = []
        for r in self.results:
            if isinstance(r, ops.OpError):
                out.append(r.reason)
            elif isinstance(r, ops.RoomResult) and not r.ok:
                out.append(f"{r.rank}: {r.reason}")
        return out

    def decode_results(self) -> list[ops.RoomResult]:
        return [r for r in self.results if isinstance(r, ops.RoomResult) and r.bytes_verified]


def run_requests(
    cluster: Cluster, tokens: list[int], concurrency: int, chunk_tokens: int, timeout: float, progress: Any = None
) -> list[RoomOutcome]:
    """Run every request with at most ``concurrency`` rooms in flight; rooms get distinct random 63-bit ids."""
    rng = random.Random()
    todo = list(tokens)
    live: list[RoomOutcome] = []
    done: list[RoomOutcome] = []
    while todo or live:
        while todo and len(live) < concurrency:
            room = rng.getrandbits(63)
            n = todo.pop(0)
            live.append(RoomOutcome(room, n, time.monotonic(), cluster.submit_room(room, n, chunk_tokens)))
        cluster.poll(0.01)
        for outcome in list(live):
            still = []
            for worker, request_id in outcome.pending:
                reply = worker.client.take(request_id)
                if reply is None:
                    still.append((worker, request_id))
                else:
                    outcome.results.append(reply)
            outcome.pending = still
            if still and time.monotonic() - outcome.started > timeout:
                outcome.results.append(ops.OpError(f"room {outcome.room}: no reply within {timeout:.0f}s"))
                outcome.pending = []
            if not outcome.pending:
                outcome.ended = time.monotonic()
                live.remove(outcome)
                done.append(outcome)
                if progress is not None:
                    progress.update(1)
    return done


def summarise(outcomes: list[RoomOutcome], wall_s: float, spec: ClusterSpec) -> dict[str, Any]:
    lat_ms = np.array([(o.ended - o.started) * 1000 for o in outcomes]) if outcomes else np.zeros(1)
    moved = sum(r.num_bytes for o in outcomes for r in o.decode_results())
    verified = sum(r.bytes_verified for o in outcomes for r in o.decode_results())
    failed = [o for o in outcomes if not o.ok]
    by_len: dict[int, list[RoomOutcome]] = {}
    for o in outcomes:
        by_len.setdefault(o.num_tokens, []).append(o)
    return {
        "requests": len(outcomes),
        "rooms_ok": len(outcomes) - len(failed),
        "rooms_failed": len(failed),
        "bytes_moved": moved,
        "bytes_verified": verified,
        "wall_s": round(wall_s, 3),
        "gbps": round(moved / wall_s / 1e9, 4) if wall_s > 0 else 0.0,
        "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
        "p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
        "cp": spec.cp,
        "decode_ranks": spec.decode_ranks,
        "preset": spec.preset,
        "layers": spec.layers,
        "draft_layers": spec.draft_layers,
        "engine": spec.engine,
        "by_length": [
            {
                "tokens": n,
                "rooms": len(group),
                "ok": sum(o.ok for o in group),
                "mb": round(sum(r.num_bytes for o in group for r in o.decode_results()) / 1e6, 2),
                "p50_ms": round(float(np.median([(o.ended - o.started) * 1000 for o in group])), 2),
            }
            for n, group in sorted(by_len.items())
        ],
        "failures": [{"room": o.room, "tokens": o.num_tokens, "reasons": o.reasons} for o in failed[:10]],
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"kvbridge demo: {s['preset']}, {s['layers']} layers + {s['draft_layers']} draft, "
        f"prefill cp={s['cp']}, decode ranks={s['decode_ranks']}, engine={s['engine']}",
        "",
        f"{'tokens':>8} {'rooms':>6} {'ok':>4} {'MB':>10} {'p50 ms':>9}",
    ]
    for row in s["by_length"]:
        lines.append(f"{row['tokens']:>8} {row['rooms']:>6} {row['ok']:>4} {row['mb']:>10.2f} {row['p50_ms']:>9.1f}")
    lines += [
        "",
        f"requests {s['requests']}  ok {s['rooms_ok']}  failed {s['rooms_failed']}",
        f"moved {s['bytes_moved'] / 1e6:.1f} MB  verified {s['bytes_verified'] / 1e6:.1f} MB  "
        f"in {s['wall_s']:.2f} s  ({s['gbps']:.3f} GB/s aggregate)",
        f"room latency p50 {s['p50_ms']:.1f} ms  p99 {s['p99_ms']:.1f} ms  (op sent -> every byte verified, synthetic fill and check included)",
    ]
    for f in s["failures"]:
        lines.append(f"FAILED room {f['room']} ({f['tokens']} tokens): {'; '.join(f['reasons'])[:500]}")
    return "\n".join(lines)


def run_demo(spec: ClusterSpec, tokens: list[int], concurrency: int = 4, chunk_tokens: int = 0,
             room_timeout: float = 120.0, show_progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    with Cluster(spec) as cluster:
        with tqdm(total=len(tokens), desc="rooms", unit="room", file=sys.stderr, disable=not show_progress) as bar:
            t0 = time.monotonic()
            outcomes = run_requests(cluster, tokens, concurrency, chunk_tokens, room_timeout, bar)
            wall = time.monotonic() - t0
        summary = summarise(outcomes, wall, spec)
        codes = cluster.close()
    summary["exit_codes"] = codes
    return summary
