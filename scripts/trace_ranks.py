"""A traced room, rank by rank: when each prefill CP rank took decode's request, held it for the
room's decision (planning it ahead), had the decision, made its target, posted its write and saw
it final, and when decode had each rank's report and committed; p50 over the rooms, in ms after
decode sent its request. Reads the ``KVBRIDGE_TRACE=1`` logs of a bench run (``gpu_bench.py
--trace-out DIR`` writes one per group; ``kvbridge bench --trace`` keeps one per rank in the folder
it names at the end, read here as one).

    python3 scripts/trace_ranks.py DIR/trace-mooncake-nvlink-contiguous-8192.log [more logs or folders ...]

One column per log or folder; the first ``--skip`` rooms of each (warm-up) are left out."""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

_ROOM, _AT = re.compile(r"trace room=(\d+)"), re.compile(r"@(\d+\.\d+)")
_CP, _REPORT = re.compile(r"/cp(\d+)/"), re.compile(r"report from cp(\d+)")
_PREFILL = ((" request from ", "request"), (" held ", "held, planned ahead"), (" decided for ", "decision"),
            (" target ", "target"), (" -> ", "write posted"), ("write of", "write final"))


def _lines(path: str) -> list[str]:
    """A log's lines; a folder's ``*.log`` (one per rank: ``kvbridge bench --trace``), by time."""
    p = Path(path)
    if not p.is_dir():
        return p.read_text(errors="replace").splitlines()
    lines = [line for f in sorted(p.glob("*.log")) for line in f.read_text(errors="replace").splitlines()]
    return sorted(lines, key=lambda line: float(m.group(1)) if (m := _AT.search(line)) else 0.0)


def events(path: str) -> list[dict[str, float]]:
    """Per room (in the log's order), event -> its first time after decode's request (ms)."""
    rooms: dict[str, dict[str, float]] = defaultdict(dict)
    order: list[str] = []
    for line in _lines(path):
        room, at = _ROOM.search(line), _AT.search(line)
        if room is None or at is None:
            continue
        ev, t = rooms[room.group(1)], float(at.group(1))
        if room.group(1) not in order:
            order.append(room.group(1))
        if "requested from" in line:
            name = "decode: request sent"
        elif (m := _REPORT.search(line)) is not None:
            name = f"decode: cp{m.group(1)}'s report"
        elif "committed" in line:
            name = "decode: committed"
        elif "bench final" in line:
            name = "bench: Success seen"
        elif "bench send" in line:  # (--ask-first: every rank's send() at one instant, after the request)
            name = "bench: send()"
        else:
            cp = _CP.search(line)
            name = next((f"cp{cp.group(1)}: {what}" for needle, what in _PREFILL if needle in line), None) \
                if cp is not None else None
        if name is not None:
            ev.setdefault(name, t)
    out = []
    for room in order:
        ev = rooms[room]
        t0 = ev.get("decode: request sent")
        if t0 is not None and "decode: committed" in ev:
            out.append({k: (v - t0) * 1e3 for k, v in ev.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--skip", type=int, default=2, help="warm-up rooms left out of each log")
    a = ap.parse_args()
    cols = [events(p)[a.skip:] for p in a.logs]
    names: list[str] = []
    for rooms in cols:
        for ev in rooms:
            names += [k for k in ev if k not in names]
    first = {n: min((statistics.median([ev[n] for ev in rooms if n in ev]) for rooms in cols
                     if any(n in ev for ev in rooms)), default=0.0) for n in names}
    names.sort(key=lambda n: (first[n], n))
    print("| event (p50 ms after decode's request) | " + " | ".join(f"{p.rsplit('/', 1)[-1]} ({len(c)} rooms)"
                                                                  for p, c in zip(a.logs, cols)) + " |")
    print("| --- |" + " --- |" * len(cols))
    for n in names:
        cells = []
        for rooms in cols:
            vals = [ev[n] for ev in rooms if n in ev]
            cells.append(f"{statistics.median(vals):.2f}" if vals else "-")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
