"""The bench sweep: request lengths x CP sizes, three methods on the same buffers and slices.

For each CP size one Rig (in-process endpoints and engines, sized for the
longest request); for each length: fill synthetic KV once, plan, then ``reps``
rooms of kvbridge end to end, ``reps`` raw Mooncake batch writes of the plan's
slices, ``reps`` memcpys of the same slices; the first kvbridge room is checked
byte for byte. Throughput uses the median time; rows carry the ratios.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.bench.rig import Rig, RigSpec
from kvbridge.errors import KVBridgeError
from kvbridge.layout.pools import preset_pools

QUICK_TOKENS = (1024, 8192, 32768, 131072)
FULL_TOKENS = (1024, 4096, 8192, 16384, 32768, 65536, 131072)
QUICK_LAYERS = 4


@dataclass(frozen=True)
class BenchSpec:
    tokens: Sequence[int]
    cps: Sequence[int]
    layers: int
    draft_layers: int = 1
    preset: str = "deepseek-v3.2-fp8"
    page_size: int = 64
    reps: int = 5
    engine: str = "mooncake"
    verify: bool = True
    quick: bool = False
    dst_order: str = "lane-major"


def bytes_per_token_all_layers(preset: str, layers: int, page_size: int, draft_layers: int) -> int:
    specs = preset_pools(preset, num_layers=layers, page_size=page_size, draft_layers=draft_layers)
    return sum(s.bytes_per_token * s.num_layers for s in specs.values())


def layers_that_fit(preset: str, max_tokens: int, budget_bytes: int, page_size: int = 64, draft_layers: int = 1) -> int:
    """Most target layers (<= 61) whose prefill + decode pools for ``max_tokens`` fit ``budget_bytes``."""
    for layers in range(61, 0, -1):
        if 2 * max_tokens * bytes_per_token_all_layers(preset, layers, page_size, draft_layers) <= budget_bytes:
            return layers
    return 1


def percentile_ms(seconds: list[float], q: float) -> float:
    return round(float(np.percentile(np.array(seconds) * 1000, q)), 3)


def measure(rig: Rig, num_tokens: int, spec: BenchSpec, rooms: random.Random) -> dict[str, Any]:
    fill_room = rooms.getrandbits(63)
    rig.fill(fill_room, num_tokens)
    t0 = time.perf_counter()
    plans = rig.plans(num_tokens)
    plan_ms = (time.perf_counter() - t0) * 1000
    num_bytes = sum(p.num_bytes for p in plans)
    # warm-up (connections, page faults), checked byte for byte; then the methods take turns
    failures: list[str] = []
    stats: dict[str, Any] = {}
    try:
        _, stats = rig.run_kvbridge(rooms.getrandbits(63), num_tokens)
        verified, problems = rig.verify(fill_room, num_tokens) if spec.verify else (0, [])
    except KVBridgeError as exc:
        failures.append(str(exc))
        verified, problems = 0, [f"warm-up room failed: {exc}"]
    rig.run_raw(plans)
    rig.run_memcpy(plans)
    kv_times, raw_times, mem_times = [], [], []
    for _ in range(spec.reps):
        try:
            kv_times.append(rig.run_kvbridge(rooms.getrandbits(63), num_tokens)[0])
        except KVBridgeError as exc:  # counted and shown; the sweep goes on
            failures.append(str(exc))
        raw_times.append(rig.run_raw(plans))
        mem_times.append(rig.run_memcpy(plans))
    gbps = {name: num_bytes / float(np.median(t)) / 1e9 if t else 0.0 for name, t in
            (("kvbridge", kv_times), ("raw", raw_times), ("memcpy", mem_times))}  # fmt: skip
    return {
        "cp": rig.spec.cp,
        "tokens": num_tokens,
        "layers": spec.layers,
        "draft_layers": spec.draft_layers,
        "bytes": num_bytes,
        "slices": sum(p.num_slices for p in plans),
        "kvbridge_slices": int(stats.get("slices", 0)) or None,
        "ideal_slices": rig.ideal_slices(num_tokens),
        "plan_ms": round(plan_ms, 3),
        "kvbridge_gbps": round(gbps["kvbridge"], 4),
        "raw_gbps": round(gbps["raw"], 4),
        "memcpy_gbps": round(gbps["memcpy"], 4),
        "kvbridge_p50_ms": percentile_ms(kv_times, 50) if kv_times else None,
        "kvbridge_p99_ms": percentile_ms(kv_times, 99) if kv_times else None,
        "kvbridge_failures": failures[:3],
        "raw_p50_ms": percentile_ms(raw_times, 50),
        "raw_p99_ms": percentile_ms(raw_times, 99),
        "memcpy_p50_ms": percentile_ms(mem_times, 50),
        "ratio_vs_raw": round(gbps["kvbridge"] / gbps["raw"], 4),
        "ratio_vs_memcpy": round(gbps["kvbridge"] / gbps["memcpy"], 4),
        "bytes_verified": verified,
        "verify_errors": problems[:3],
    }


def run_sweep(spec: BenchSpec, bootstrap: str, token: str | None, show_progress: bool = True) -> list[dict[str, Any]]:
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    rooms = random.Random()
    steps = len(spec.cps) * len(spec.tokens)
    with tqdm(total=steps, desc="bench", unit="cfg", file=sys.stderr, disable=not show_progress) as bar:
        for cp in spec.cps:
            rig = Rig(RigSpec(cp=cp, max_tokens=max(spec.tokens), preset=spec.preset, layers=spec.layers,
                              draft_layers=spec.draft_layers, page_size=spec.page_size, engine=spec.engine,
                              bootstrap=bootstrap, token=token, dst_order=spec.dst_order))  # fmt: skip
            try:
                for n in spec.tokens:
                    bar.set_postfix_str(f"cp={cp} tokens={n}")
                    rows.append(measure(rig, n, spec, rooms))
                    bar.update(1)
            finally:
                rig.close()
                del rig
                gc.collect()
    return rows
