#!/usr/bin/env python
"""Where a staged chunk's cycle goes, step by step: the bench's staged rooms with KVBRIDGE_TRACE=1,
every rank its own process (CPU: Mooncake TCP on 127.0.0.1; ``--device cuda:0``: Mooncake NVLink),
then the ``cycle`` trace lines (``kvbridge/transfer/staging/cycle.py``) of the timed staged rooms
joined per chunk:

    ask trip        prefill took a gather slot and sent SlotRequest -> decode read it
    grant wait      decode read it -> decode granted a slot (0 unless its area was full)
    grant trip      decode's SlotGrant -> prefill read it
    post + write    prefill read the grant -> the chunk's write final on prefill (gather on a GPU,
                    post, transfer, completion seen by prefill's loop) and ChunkLanded sent; a chunk
                    whose slot came with the room's request (``--granted-slots``: no SlotGrant, no
                    grant steps) from its SlotRequest sent, which its gather and post follow
    landed trip     prefill's ChunkLanded -> decode read it (and started the scatter)
    scatter         decode started the slot's copy -> it completed (the slot is free)
    credit back     the slot free -> decode granted it again (only where a chunk waited)
    gather slot     prefill sent SlotRequest -> ChunkLanded (how long a gather slot is held)

p50 / p90 ms over every chunk of the timed rooms, and the rooms' p50. Prints the bench row too.

Then prefill's "post + write" split by the chunk's write (its engine handle: prefill's ``chunk .. at``
line, the engine's own trace lines and the ``landed-out`` line carry it):

    grant -> submitted     prefill read the grant -> ``submit_write`` returned on its loop
    grant -> engine post   -> the engine's post of the write (IPC: its copy launched, inside
                           ``submit_write``; Mooncake: the pump's ``batch_transfer_async_write`` returned,
                           after the gather's event; on NVLink the copy is inside that call)
    engine post -> done    -> the engine saw the write complete (IPC: the pump's event synchronise)
    done -> landed out     -> prefill's machine fed the completion and sent ChunkLanded

and each staged room's own steps on decode's clock, from decode's request (p50 over the rooms):
the request at the first prefill rank, the first SlotRequest sent, the last chunk read landed, the
last scatter complete, the commit.

``--split``: decode's turn for each landed chunk of those rooms split into its parts (the frame's read,
the machine's checks, the scatter's launch and its CUDA calls, the trace lines), timed in the decode
rank by ``scripts/decode_split.py`` (wrapped in through ``scripts/split_hook/sitecustomize.py``; the
library is untouched); then prefill's turns of those rooms split the same way, timed in each prefill
rank by ``scripts/prefill_split.py``: per kind of turn (``grant``: the SlotGrant's feed, its chunk's
wire pieces and post; ``final``: a staged write's completion, ChunkLanded sent and the next chunk's
SlotRequest and Gather), the count and on which
thread, the wait before the feed and each part's p50 and mean. ``--untraced``: the same without
``KVBRIDGE_TRACE`` (no cycle table).

    PYTHONPATH=$PWD .venv/bin/python scripts/staged_cycle.py [--tokens 8192] [--layers 61] [--slot-kib 8192]
        [--gather-slots 2] [--decode-slots 4] [--reps 3] [--cp 2] [--device cuda:0] [--engine ipc] [--json out.json]
        [--split [--untraced]]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.bench.trace import parse

_LINE = re.compile(r"trace room=(\d+) rank=(\S+) @(\d+\.\d+) cycle (\S+) chunk=(-?\d+) slot=(-?\d+) cp=(-?\d+)")
_CP = re.compile(r"/cp(\d+)/")
SPLIT_PARTS = ("turn", "machine", "landed", "trace_cycle", "log", "carry", "scatter", "ranges", "launch", "plan",
               "table", "upload", "ev_record", "kernel", "record", "host_copy")
# scripts/prefill_split.py's turns
PREFILL_KINDS = ("request", "post", "tick", "resolved", "grant", "final", "final_direct")
PREFILL_PARTS = ("turn", "machine", "trace_cycle", "log", "reply", "plan_chunk", "stage_plan", "scatter_list", "wire",
                 "post_chunk", "submit", "check", "translate", "post", "launch", "wait_for", "copier_launch", "plan",
                 "table", "memcpy", "ev_record", "kernel", "record", "gather", "gather_list", "stager_gather", "hold",
                 "host_copy")
STEPS = ("ask trip", "grant wait", "grant trip", "post + write", "landed trip", "scatter", "credit back",
         "gather slot")


def cycle_steps(lines: list[str], rooms: set[int], chunks: list[dict] | None = None) -> dict[str, list[float]]:
    """Step -> durations (ms) over every chunk of ``rooms`` found in the ``cycle`` lines; ``chunks``
    (when given) gets each chunk's timestamps (monotonic seconds, one clock for the host's processes)."""
    pre: dict[tuple[int, int, int, str], float] = {}  # (room, cp, chunk, step) on prefill
    ask_in: dict[tuple[int, int, int], float] = {}
    grants: dict[tuple[int, int, int], list[float]] = defaultdict(list)  # decode's grant-out (room, chunk, slot)
    landed: list[tuple[int, int, int, int, float]] = []  # decode's landed-in (room, cp, chunk, slot, t)
    scatters: dict[tuple[int, int], list[tuple[str, float]]] = defaultdict(list)  # (room, slot)
    slot_grants: dict[int, list[float]] = defaultdict(list)  # slot -> decode's grant times (any room)
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            continue
        room, rank, at, step = int(m[1]), m[2], float(m[3]), m[4]
        chunk, slot, cp = int(m[5]), int(m[6]), int(m[7])
        if step == "grant-out":
            slot_grants[slot].append(at)
        if room not in rooms:
            continue
        found = _CP.search(rank)
        if found is None:  # a decode rank's label has no CP rank (dp/tp); a prefill rank's has
            if step == "ask-in":
                ask_in[(room, cp, chunk)] = at
            elif step == "grant-out":
                grants[(room, chunk, slot)].append(at)
            elif step == "landed-in":
                landed.append((room, cp, chunk, slot, at))
            elif step in ("scatter", "scattered"):
                scatters[(room, slot)].append((step, at))
        else:
            pre[(room, int(found[1]), chunk, step)] = at
    out: dict[str, list[float]] = {s: [] for s in STEPS}
    for room, cp, chunk, slot, t_in in landed:
        ask_out = pre.get((room, cp, chunk, "ask-out"))
        g_in = pre.get((room, cp, chunk, "grant-in"))
        l_out = pre.get((room, cp, chunk, "landed-out"))
        a_in = ask_in.get((room, cp, chunk))
        g_out = max((t for t in grants.get((room, chunk, slot), []) if t <= t_in), default=None)
        if None in (ask_out, l_out, a_in) or (g_in is None) != (g_out is None):
            continue
        if g_in is None:  # its slot came with the room's request (no SlotGrant): post + write from its ask
            g_in = ask_out
        done = min((t for s, t in scatters[(room, slot)] if s == "scattered" and t >= t_in), default=None)
        regrant = min((t for t in slot_grants[slot] if done is not None and t >= done), default=None)
        if chunks is not None:
            chunks.append(dict(room=room, cp=cp, chunk=chunk, slot=slot, ask_out=ask_out, ask_in=a_in, grant_out=g_out,
                               grant_in=g_in, landed_out=l_out, landed_in=t_in, scattered=done, regrant=regrant,
                               with_request=g_out is None))
        for name, a, b in (("ask trip", ask_out, a_in), ("grant wait", a_in, g_out), ("grant trip", g_out, g_in),
                           ("post + write", g_in, l_out), ("landed trip", l_out, t_in), ("scatter", t_in, done),
                           ("credit back", done, regrant), ("gather slot", ask_out, l_out)):
            if a is not None and b is not None:
                out[name].append((b - a) * 1e3)
    return out


_CHUNK_AT = re.compile(r"trace room=(\d+) rank=\S+ \+[\d.]+ms @(\d+\.\d+) -> \S+ chunk \d+ at \S+ .*write=(\d+)")
_ENGINE = re.compile(r"trace engine=(?:ipc|mooncake) write=(\d+) batch=\d+ (->|done|failed) .*@(\d+\.\d+)")
_WRITE = re.compile(r" write=(\d+)\s*$")  # the write's handle, ending a landed-out cycle line (staging/cycle.py)
POST_STEPS = ("grant -> submitted", "grant -> engine post", "engine post -> done", "done -> landed out")
ROOM_STEPS = ("request at prefill", "first SlotRequest", "last landing read", "last scatter done", "committed")


def post_split(logs: dict[str, list[str]], rooms: set[int]) -> dict[str, list[float]]:
    """Prefill's "post + write" of each chunk of ``rooms``, split (ms): ``logs`` maps each prefill
    process's log to its lines (engine handles are per process). A chunk counts once all of its
    lines are found (its write's ``landed-out``, grant, ``chunk .. at`` line and engine lines). A
    grant that came ahead of its chunk's gather slot (credits beyond one per gather slot) counts
    from its arrival: ``grant -> submitted`` then holds the wait for the gather slot too."""
    out: dict[str, list[float]] = {s: [] for s in POST_STEPS}
    for lines in logs.values():
        grant: dict[tuple[int, int], float] = {}  # (room, chunk): one process is one CP rank (a grant names none)
        submitted: dict[int, float] = {}
        posted: dict[int, float] = {}
        done: dict[int, float] = {}
        landed: list[tuple[int, int, int, float]] = []  # (room, chunk, write, when)
        for line in lines:
            if (m := _ENGINE.search(line)) is not None:
                h, t = int(m[1]), float(m[3])
                if m[2] == "->":
                    posted.setdefault(h, t)  # its first batch
                else:
                    done[h] = max(done.get(h, t), t)  # its last
            elif (m := _LINE.search(line)) is not None:  # (room, rank, at, step, chunk, slot, cp)
                if m[4] == "grant-in":
                    grant[(int(m[1]), int(m[5]))] = float(m[3])
                elif m[4] == "ask-out":  # a chunk granted with the request counts from its ask (its gather and post)
                    grant.setdefault((int(m[1]), int(m[5])), float(m[3]))
                elif m[4] == "landed-out" and (w := _WRITE.search(line)) is not None:
                    landed.append((int(m[1]), int(m[5]), int(w[1]), float(m[3])))
            elif (m := _CHUNK_AT.search(line)) is not None:
                submitted[int(m[3])] = float(m[2])
        for room, chunk, h, t_out in landed:
            t_grant = grant.get((room, chunk))
            if room not in rooms or None in (t_grant, submitted.get(h), posted.get(h), done.get(h)):
                continue
            for name, a, b in (("grant -> submitted", t_grant, submitted[h]), ("grant -> engine post", t_grant, posted[h]),
                               ("engine post -> done", posted[h], done[h]), ("done -> landed out", done[h], t_out)):
                out[name].append((b - a) * 1e3)
    return out


def room_steps(lines: list[str], rooms: set[int]) -> dict[str, list[float]]:
    """Each room of ``rooms``: ms from decode's request to the request's arrival at the first prefill
    rank, the first SlotRequest sent, the last ChunkLanded read, the last scatter complete and the commit."""
    events = parse(lines)  # decode's request, each rank's request read, the commit (kvbridge.bench.trace)
    cycle: dict[tuple[int, str], list[float]] = defaultdict(list)  # (room, cycle step) -> times
    for line in lines:
        m = _LINE.search(line)
        if m is not None and int(m[1]) in rooms:
            cycle[(int(m[1]), m[4])].append(float(m[3]))
    out: dict[str, list[float]] = {s: [] for s in ROOM_STEPS}
    for room in rooms:
        ev = events.get(room, {})
        if not ev.get("requested"):
            continue
        t0 = min(ev["requested"])
        for name, times, pick in (("request at prefill", ev.get("received"), min),
                                  ("first SlotRequest", cycle.get((room, "ask-out")), min),
                                  ("last landing read", cycle.get((room, "landed-in")), max),
                                  ("last scatter done", cycle.get((room, "scattered")), max),
                                  ("committed", ev.get("committed"), max)):
            if times:
                out[name].append((pick(times) - t0) * 1e3)
    return out


def print_steps(title: str, names: tuple[str, ...], steps: dict[str, list[float]], unit: str = "chunks") -> None:
    print(title)
    print(f"{'step':<22} {unit:>6} {'p50 ms':>8} {'p90 ms':>8}")
    for name in names:
        ms = np.array(steps[name])
        if ms.size:
            print(f"{name:<22} {ms.size:>6} {np.median(ms):>8.3f} {np.percentile(ms, 90):>8.3f}")
        else:
            print(f"{name:<22} {0:>6} {'-':>8} {'-':>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slot-kib", type=int, default=8192, help="both sides' staging slots (KiB)")
    ap.add_argument("--gather-slots", type=int, default=2)
    ap.add_argument("--decode-slots", type=int, default=4)
    ap.add_argument("--granted-slots", type=int, default=0,
                    help="of the decode slots, kept for grants sent with a room's request (DecodeConfig."
                         "staging_granted_slots: each rank's first chunk written without a SlotGrant)")
    ap.add_argument("--device", default="cpu", help="cpu (Mooncake TCP) or cuda:N (Mooncake NVLink)")
    ap.add_argument("--engine", default="mooncake", choices=["mooncake", "ipc"],
                    help="ipc: the IPC engine writes the slots (cuda:N only; no raw Mooncake row)")
    ap.add_argument("--split", action="store_true",
                    help="time the parts of decode's turn for each landed chunk, and of prefill's turns for each "
                         "grant and staged write's completion")
    ap.add_argument("--untraced", action="store_true",
                    help="with --split: the trace off (no cycle table; the turn as it runs without the trace's lines)")
    ap.add_argument("--json", default="", help="write the row, the steps and every chunk's timestamps here (with "
                    "--split: decode's records, \"split\", and prefill's, \"prefill_split\")")
    args = ap.parse_args()

    from kvbridge.bench.sweep import BenchSpec, run_sweep
    from kvbridge.worker.cluster import start_bootstrap

    folder = tempfile.mkdtemp(prefix="staged-cycle-")
    gpu = args.device.startswith("cuda")
    if args.untraced and not args.split:
        ap.error("--untraced needs --split (the staged rooms are then those decode's timers saw a chunk land in)")
    env = {} if args.untraced else {"KVBRIDGE_TRACE": "1"}
    if gpu:
        env.update(MC_INTRANODE_NVLINK="true", PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    if args.engine == "ipc":
        env.pop("MC_INTRANODE_NVLINK", None)
    split_dir = Path(folder) / "split"
    if args.split:
        split_dir.mkdir()
        hook = Path(__file__).resolve().parent / "split_hook"
        env.update(KVBRIDGE_SPLIT_DIR=str(split_dir),
                   PYTHONPATH=os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p))
    spec = BenchSpec(tokens=[args.tokens], cps=[args.cp], layers=args.layers, reps=args.reps, allocs=["random"],
                     engine=args.engine, raw_mooncake=args.engine == "mooncake",
                     protocol="rdma" if gpu and args.engine == "mooncake" else "tcp", device=args.device, decode_device=args.device,
                     prefill_aux=args.device, decode_aux=args.device, env=env, log_dir=folder, verify=True,
                     verify_every=True, staged=True, staging_slot_bytes=args.slot_kib << 10,
                     staging_slots=(args.gather_slots, args.decode_slots), staging_granted_slots=args.granted_slots)
    with start_bootstrap() as (url, token):
        row = run_sweep(spec, url, token, show_progress=False)[0]
    logs = {p.name: p.read_text(errors="replace").splitlines() for p in sorted(Path(folder).glob("*.log"))}
    lines = [ln for name in sorted(logs) for ln in logs[name]]
    # the timed rooms alternate kvbridge (direct) and staged; the staged ones are those with cycle lines
    rooms = {int(m[1]) for ln in lines if (m := _LINE.search(ln))} & set(row["room_ids"])
    if args.untraced:  # no cycle lines: the staged rooms are those a chunk landed in
        rooms = {r["room"] for p in split_dir.glob("decode-*.json") for r in json.loads(p.read_text())} & set(
            row["room_ids"])
    chunks: list[dict] = []
    steps = cycle_steps(lines, rooms, chunks)
    print(f"{args.tokens} tokens, {args.layers} layers, CP {args.cp}, random, {args.device}, slots "
          f"{args.slot_kib} KiB x ({args.gather_slots} gather per rank, {args.decode_slots} decode, "
          f"{args.granted_slots} of them granted with requests): staged "
          f"{row['staged_gbps']} GB/s p50 {row['staged_p50_ms']} ms ({row['staged_slices']} pieces), direct "
          f"{row['kvbridge_gbps']} GB/s, raw {row['raw_gbps']} GB/s, engine {row['engine_gbps']} GB/s; verified {row['rooms_verified']} rooms, "
          f"errors {row['verify_errors'] + row['kvbridge_failures']}; {len(rooms)} staged rooms traced")
    print_steps("a chunk's cycle:", STEPS, steps)
    posts = post_split({k: v for k, v in logs.items() if k.startswith("prefill")}, rooms)
    print_steps("prefill's post + write, split by the chunk's write:", POST_STEPS, posts)
    room = room_steps(lines, rooms)
    print_steps("each staged room, ms after decode's request:", ROOM_STEPS, room, "rooms")
    split = split_table(split_dir, rooms) if args.split else []
    prefill_split = prefill_table(split_dir, rooms) if args.split else []
    print(f"trace logs: {folder}")
    if args.json:
        keep = {k: v for k, v in row.items() if isinstance(v, (int, float, str, type(None)))}
        Path(args.json).write_text(json.dumps({"args": vars(args), "row": keep, "steps": steps, "chunks": chunks,
                                               "post": posts, "room": room, "split": split,
                                               "prefill_split": prefill_split}) + "\n")


def split_table(folder: Path, rooms: set[int]) -> list[dict]:
    """Print decode's per-landing turn, split (``scripts/decode_split.py``'s records of ``rooms``);
    returns the records."""
    recs = [r for p in sorted(folder.glob("decode-*.json")) for r in json.loads(p.read_text()) if r["room"] in rooms]
    asks = [r for r in recs if r.get("kind") == "ask"]
    recs = [r for r in recs if r.get("kind") != "ask"]
    if asks:  # wire 16: each SlotRequest's feed checks the chunk's scatter list
        turn = np.array([r["turn"] for r in asks]) * 1e3
        print(f"decode's SlotRequest turn (the scatter list checked there): {len(asks)} requests, entries p50 "
              f"{int(np.median([r['entries'] for r in asks]))}, p50 {np.median(turn):.3f} ms, p90 "
              f"{np.percentile(turn, 90):.3f}, mean {turn.mean():.3f}")
    if not recs:
        print("split: no landing recorded")
        return recs

    def row(name: str, vals: list[float], note: str = "") -> None:
        ms = np.array(vals) * 1e3
        print(f"{name:<22} {np.median(ms):>8.3f} {np.percentile(ms, 90):>8.3f} {ms.mean():>8.3f}  {note}")

    print(f"decode's turn per landed chunk, split: {len(recs)} landings, scatter entries p50 "
          f"{int(np.median([r['entries'] for r in recs]))}")
    print(f"{'part (exclusive)':<22} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}")
    for name in SPLIT_PARTS:
        vals = [r["parts"].get(name, 0.0) for r in recs]
        if any(vals):
            row(name, vals)
    row("= turn (whole feed)", [r["turn"] for r in recs])
    with_recv = [r for r in recs if "recv" in r]
    if with_recv:
        row("recv_ready (with L)", [r["recv"] for r in with_recv], "select + reads + every frame's decode")
    with_dec = [r for r in recs if "decode_L" in r]
    if with_dec:
        row("  L frame decode", [r["decode_L"] for r in with_dec], "unseal (MAC) + decode of the ChunkLanded")
    if with_recv:
        print(f"{'  frames per recv':<22} {np.median([r['frames'] for r in with_recv]):>8.0f}")
    nxt = [r for r in recs if "next" in r]
    if nxt:
        row("L now -> next event", [r["next"] for r in nxt], "round 12's 'decode's next step after L'")
        row("turn end -> next feed", [r["after"] for r in nxt], "the loop between, of which:")
        for name in sorted({k for r in nxt for k in r if k.startswith("between_")}):
            row(f"  {name[8:]}", [r.get(name, 0.0) for r in nxt], "recv_ready calls" if name == "between_recv" else
                "feeds of this event")
    return recs


def prefill_table(folder: Path, rooms: set[int]) -> list[dict]:
    """Print prefill's turns, split (``scripts/prefill_split.py``'s records of ``rooms``, every
    prefill rank's), one column pair per kind of turn: p50 and mean ms of each part, of the whole
    turn and of the wait before it; returns the records."""
    recs = [r for p in sorted(folder.glob("prefill-*.json")) for r in json.loads(p.read_text()) if r["room"] in rooms]
    if not recs:
        print("prefill's turns, split: no turn recorded")
        return recs
    by_kind = {k: [r for r in recs if r["kind"] == k] for k in PREFILL_KINDS}
    kinds = [k for k in PREFILL_KINDS if by_kind[k]]

    def threads(rs: list[dict]) -> str:
        return ", ".join(f"{t} {n}" for t in ("loop", "other") if (n := sum(r["thread"] == t for r in rs)))

    print("prefill's turns, split: " + "; ".join(
        f"{k} {len(by_kind[k])} ({threads(by_kind[k])}, gathers p50 "
        f"{np.median([r.get('gathers', 0) for r in by_kind[k]]):.0f})" for k in kinds))
    print(f"{'part (exclusive)':<22} " + " ".join(f"{k + ' p50':>13} {'mean':>8}" for k in kinds))

    def row(name: str, get: Any) -> None:
        cells = []
        for k in kinds:
            ms = np.array([v for r in by_kind[k] if (v := get(r)) is not None], dtype=float) * 1e3
            cells.append(f"{np.median(ms):>13.3f} {ms.mean():>8.3f}" if ms.size else f"{'-':>13} {'-':>8}")
        print(f"{name:<22} " + " ".join(cells))

    for name in PREFILL_PARTS:
        if any(r["parts"].get(name) for r in recs):
            row(name, lambda r, name=name: r["parts"].get(name, 0.0))
    row("= turn (whole feed)", lambda r: r["turn"])
    if any("wait" in r for r in recs):
        row("wait before the feed", lambda r: r.get("wait"))
        print("  (grant: recv_ready returned its batch -> the feed; final: the engine counted the write final -> "
              "the feed)")
    grants = [r["frames"] for r in by_kind["grant"] if "frames" in r]
    if grants:
        print(f"{'  frames per recv':<22} {np.median(grants):>13.0f}  (the grant's batch)")
    return recs


if __name__ == "__main__":
    main()
