"""The bench sweep: CP sizes x allocations x request lengths, every method on the same slices.

For each CP size one Rig (every rank its own process, pools sized for the longest
request); for each allocation and length: fill once, plan, then a checked warm-up
of each method and ``reps`` turns of kvbridge end to end, raw Mooncake, the engine
alone and (host memory) memcpy, and with ``staged`` the same kvbridge rooms through staging.
With ``rooms_in_flight`` K > 1 also ``kvbridge_load`` (and ``staged_load``): K such rooms at
once, each on its own decode pages, their bytes over the time to the last one's Success.
Throughput uses the median time; rows carry ratios (``staged_vs_contiguous``: against the
kvbridge row of the contiguous allocation of the same CP size and length, when swept).
"""

from __future__ import annotations

import gc
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.bench.rig import Rig, RigSpec
from kvbridge.errors import KVBridgeError
from kvbridge.layout.pools import preset_pools

QUICK_TOKENS = (1024, 8192, 32768, 131072)
FULL_TOKENS = (1024, 4096, 8192, 16384, 32768, 65536, 131072)
QUICK_LAYERS = 4
SLOW_ROOM_S = 2.0  # a warm-up slower than this: 2 timed turns instead of ``reps`` (TCP on GPU memory)
BUSY_THREADS = ("loop", "commands")  # kvbridge's host work; the pump's wait may spin (see load_busy)


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
    protocol: str = "tcp"
    verify: bool = True
    verify_every: bool = False  # check every kvbridge room, not only the first of each length
    quick: bool = False
    dst_order: str = "lane-major"
    allocs: Sequence[str] = ("contiguous",)
    raw_mooncake: bool = True
    device: str = "cpu"
    decode_device: str = "cpu"
    prefill_aux: str = "cpu"
    decode_aux: str = "cpu"
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str = ""
    poll_s: float = 0.0  # decode's wait: 0 blocks in KVReceiver.wait(); > 0 polls that often, like an engine's step
    staged: bool = True  # the staged method beside kvbridge direct
    staging_slot_bytes: int = 0  # both sides' staging slots (0: the configs' defaults)
    staging_slots: tuple[int, int] = (2, 8)  # prefill's gather slots, decode's staging slots
    staging_granted_slots: int = 0  # of decode's, kept for grants sent with a room's request (DecodeConfig)
    in_process: bool = False  # every rank a thread of this process (``RigSpec.in_process``)
    aux_inline: bool = True  # decode takes the aux row in the report (False: as a write; ``RigSpec.aux_inline``)
    ask_first: bool = False  # decode asks before prefill sends; timed from the sends (``RigSpec.ask_first``)
    send_early_ms: float = 0.0  # with ask_first: send() while the forward's last ms run (``RigSpec.send_early_ms``)
    send_early_host: bool = False  # that tail a host timer on a GPU too (``RigSpec.send_early_host``)
    rooms_in_flight: int = 1  # > 1: the load methods, that many rooms at once (``Rig.run_kvbridge_load``)


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


def load_busy(cpu: dict[str, dict[str, float]], seconds: float) -> tuple[dict[str, dict[str, float]] | None,
                                                                      str | None]:
    """What each rank's threads were busy with while rooms were in flight: CPU seconds over the load
    turns' seconds (from the sends' instant to the last Success), per rank and thread
    (``procs.RankBase.cpu``: loop, commands, pump; alone in its process also process and other).
    Also the busiest of the threads that run kvbridge's host work (``BUSY_THREADS``: the endpoint's
    loop, the thread that calls send()) as "<rank> <thread> <share>": near 1.0 it had no idle time,
    and that loop bounds the pair. The pump is not among them: it waits for the engine, and
    Mooncake's status call spins until a batch ends (as a CUDA event's synchronize may), so its
    share counts the transfer's time, not work. None: no turn timed, or no per-thread clock."""
    if seconds <= 0 or not cpu:
        return None, None
    busy = {rank: {t: round(s / seconds, 3) for t, s in sorted(threads.items())} for rank, threads in cpu.items()}
    named = [(share, rank, t) for rank, threads in busy.items() for t, share in threads.items() if t in BUSY_THREADS]
    if not named:
        return busy, None
    share, rank, thread = max(named)
    return busy, f"{rank} {thread} {share:.2f}"


def measure(rig: Rig, alloc: str, num_tokens: int, spec: BenchSpec, rooms: random.Random) -> dict[str, Any]:
    seed = rooms.getrandbits(31)
    pages = rig.allocation(alloc, num_tokens)
    num_bytes, num_slices, plan_ms = rig.prepare(pages, num_tokens, seed)
    failures: list[str] = []
    problems: list[str] = []
    verified = rooms_verified = 0
    posted = {"kvbridge": 0, "staged": 0}  # slices posted per room (staged: wire pieces)

    room_ids: list[int] = []

    def kvbridge_room(check: bool, staging: str = "never") -> float:
        nonlocal verified, rooms_verified
        if check:
            rig.poison(pages)
        room_ids.append(rooms.getrandbits(63))
        seconds, posted["staged" if staging == "always" else "kvbridge"] = rig.run_kvbridge(
            room_ids[-1], pages, num_tokens, staging)
        if check:
            verified, errors = rig.check(pages, num_tokens, seed)
            rooms_verified += 1
            problems.extend(f"staged: {e}" if staging == "always" else e for e in errors)
        return seconds

    load = spec.rooms_in_flight
    load_each: dict[str, list[float]] = {"kvbridge_load": [], "staged_load": []}  # each room's seconds under load
    # per load method over its timed turns: each rank's threads' CPU seconds, and the turns' seconds (``load_busy``)
    load_cpu: dict[str, dict[str, dict[str, float]]] = {"kvbridge_load": {}, "staged_load": {}}
    load_s: dict[str, float] = {"kvbridge_load": 0.0, "staged_load": 0.0}

    def load_rooms(check: bool, staging: str) -> float:
        """``load`` rooms at once; every room's pages checked when ``check``."""
        nonlocal verified, rooms_verified
        if check:
            for k in range(load):
                rig.poison(rig.room_pages(pages, k))
        ids = [rooms.getrandbits(63) for _ in range(load)]
        seconds, each = rig.run_kvbridge_load(ids, pages, num_tokens, staging)
        load_each["staged_load" if staging == "always" else "kvbridge_load"].extend(each)
        if check:
            for k in range(load):
                n, errors = rig.check(rig.room_pages(pages, k), num_tokens, seed)
                verified = n  # (as a room one at a time: the bytes of one room checked)
                rooms_verified += 1
                problems.extend(f"{'staged ' if staging == 'always' else ''}load, room {k + 1} of {load}: {e}"
                                for e in errors)
        return seconds

    methods: dict[str, Callable[[], float]] = {"kvbridge": lambda: kvbridge_room(spec.verify_every)}
    if spec.staged:
        methods["staged"] = lambda: kvbridge_room(spec.verify_every, "always")
    if load > 1:
        methods["kvbridge_load"] = lambda: load_rooms(spec.verify_every, "never")
        if spec.staged:
            methods["staged_load"] = lambda: load_rooms(spec.verify_every, "always")
    if spec.raw_mooncake:
        methods["raw"] = rig.run_raw
    if spec.engine != "mooncake" or not spec.raw_mooncake:
        methods["engine"] = rig.run_engine
    if spec.device == "cpu":
        methods["memcpy"] = rig.run_memcpy
    times: dict[str, list[float]] = {name: [] for name in methods}
    warm: dict[str, float] = {}
    send_s: list[float] = []  # the slowest rank's send() of each timed kvbridge room
    forward_s: list[float] = []  # and the longest tail of its ranks' forwards (send_early_ms)
    for name, fn in methods.items():  # warm-up (connections, page faults); kvbridge's and raw's checked
        try:
            if name == "kvbridge":
                warm[name] = kvbridge_room(spec.verify)
            elif name == "staged":
                warm[name] = kvbridge_room(spec.verify, "always")
            elif name in load_each:
                # per room, as the others (SLOW_ROOM_S below is a room's time, not a turn of ``load`` rooms)
                warm[name] = load_rooms(spec.verify, "always" if name == "staged_load" else "never") / load
                load_each[name].clear()  # the warm-up's rooms are not timed
            elif name == "raw" and spec.verify:
                rig.poison(pages)
                warm[name] = fn()
                problems.extend(f"raw Mooncake: {e}" for e in rig.check(pages, num_tokens, seed)[1])
            else:
                warm[name] = fn()
        except KVBridgeError as exc:
            failures.append(f"{name} warm-up: {exc}")
    reps = spec.reps if max(warm.values(), default=0.0) < SLOW_ROOM_S else min(spec.reps, 2)
    for _ in range(reps):
        for name, fn in methods.items():
            try:
                times[name].append(fn())
                if name in load_cpu:
                    load_s[name] += times[name][-1]
                    for label, threads in rig.last_load_cpu.items():
                        per = load_cpu[name].setdefault(label, {})
                        for thread, used in threads.items():
                            per[thread] = per.get(thread, 0.0) + used
                if name == "kvbridge":
                    send_s.append(rig.last_send_s)
                    forward_s.append(rig.last_forward_s)
            except KVBridgeError as exc:  # counted and shown; the sweep goes on
                failures.append(f"{name}: {exc}")
    row: dict[str, Any] = {
        "cp": rig.spec.cp, "alloc": alloc, "engine": spec.engine, "tokens": num_tokens, "layers": spec.layers,
        "draft_layers": spec.draft_layers, "bytes": num_bytes, "slices": num_slices,
        "kvbridge_slices": posted["kvbridge"] or None, "staged_slices": posted["staged"] or None, "ideal_slices": rig.ideal_slices(pages), "plan_ms": round(plan_ms, 3),
        "reps": reps, "ask_first": spec.ask_first, "send_early_ms": spec.send_early_ms,
        "send_early_host": spec.send_early_host, "send_p50_ms": percentile_ms(send_s, 50) if send_s else None,
        "forward_p50_ms": percentile_ms(forward_s, 50) if spec.send_early_ms and forward_s else None,
    }
    for name in ("kvbridge", "staged", "raw", "engine", "memcpy"):
        t = times.get(name) or []
        row[f"{name}_gbps"] = round(num_bytes / float(np.median(t)) / 1e9, 4) if t else None
        row[f"{name}_p50_ms"] = percentile_ms(t, 50) if t else None
        if name in ("kvbridge", "staged", "raw"):
            row[f"{name}_p99_ms"] = percentile_ms(t, 99) if t else None
    for other in ("raw", "engine", "memcpy"):
        if row["kvbridge_gbps"] and row[f"{other}_gbps"]:
            row[f"ratio_vs_{other}"] = round(row["kvbridge_gbps"] / row[f"{other}_gbps"], 4)
    for other in ("raw", "kvbridge"):
        if row["staged_gbps"] and row[f"{other}_gbps"]:
            row[f"staged_vs_{other}"] = round(row["staged_gbps"] / row[f"{other}_gbps"], 4)
    if load > 1:  # K rooms' bytes over the time from their sends to the last Success; each room's own p50
        row["rooms_in_flight"] = load
        for name in load_each:
            t = times.get(name) or []
            row[f"{name}_gbps"] = round(load * num_bytes / float(np.median(t)) / 1e9, 4) if t else None
            row[f"{name}_room_p50_ms"] = percentile_ms(load_each[name], 50) if load_each[name] else None
            row[f"{name}_busy"], row[f"{name}_busiest"] = load_busy(load_cpu[name], load_s[name])
    if row["kvbridge_p50_ms"] is not None and row["raw_p50_ms"] is not None:
        row["fixed_cost_ms"] = round(row["kvbridge_p50_ms"] - row["raw_p50_ms"], 3)
    row.update(kvbridge_failures=failures[:3], bytes_verified=verified, rooms_verified=rooms_verified,
               verify_errors=problems[:3], room_ids=room_ids[1:])  # the timed rooms (trace breakdowns)
    return row


def _against_contiguous(rows: list[dict[str, Any]]) -> None:
    """Each row's staged throughput against kvbridge on contiguous pages of the same CP size and
    length, once that row exists (allocations are swept in any order)."""
    base = {(r["cp"], r["tokens"]): r["kvbridge_gbps"] for r in rows
            if r["alloc"] == "contiguous" and r.get("kvbridge_gbps")}
    for row in rows:
        contiguous = base.get((row["cp"], row["tokens"]))
        if contiguous and row.get("staged_gbps"):
            row["staged_vs_contiguous"] = round(row["staged_gbps"] / contiguous, 4)


def run_sweep(spec: BenchSpec, bootstrap: str, token: str | None, show_progress: bool = True,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    rooms = random.Random()
    steps = len(spec.cps) * len(spec.allocs) * len(spec.tokens)
    with tqdm(total=steps, desc="bench", unit="cfg", file=sys.stderr, disable=not show_progress) as bar:
        for cp in spec.cps:
            rig = Rig(RigSpec(cp=cp, max_tokens=max(spec.tokens), bootstrap=bootstrap, token=token, preset=spec.preset,
                              layers=spec.layers, draft_layers=spec.draft_layers, page_size=spec.page_size,
                              engine=spec.engine, protocol=spec.protocol, raw_mooncake=spec.raw_mooncake,
                              device=spec.device, decode_device=spec.decode_device, prefill_aux=spec.prefill_aux,
                              decode_aux=spec.decode_aux, dst_order=spec.dst_order, env=dict(spec.env),
                              log_dir=spec.log_dir, poll_s=spec.poll_s, staged=spec.staged,
                              staging_slot_bytes=spec.staging_slot_bytes,
                              staging_slots=tuple(spec.staging_slots), in_process=spec.in_process,
                              staging_granted_slots=spec.staging_granted_slots,
                              aux_inline=spec.aux_inline, ask_first=spec.ask_first,
                              send_early_ms=spec.send_early_ms, send_early_host=spec.send_early_host,
                              rooms_in_flight=spec.rooms_in_flight))  # fmt: skip
            try:
                for alloc in spec.allocs:
                    for n in spec.tokens:
                        bar.set_postfix_str(f"cp={cp} {alloc} tokens={n}")
                        rows.append(measure(rig, alloc, n, spec, rooms))
                        _against_contiguous(rows)
                        if on_row is not None:
                            on_row(rows[-1])
                        bar.update(1)
            finally:
                rig.close()
                del rig
                gc.collect()
    return rows
