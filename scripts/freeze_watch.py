"""Watch for the whole host standing still: a process of its own that wakes every ``--every``
seconds and, when a wake-up comes more than ``--gap`` seconds after the one before, prints one
line saying when and how long, with what the kernel counted over that gap:

    gap 28.61 s ending 2026-12-06T23:02:44.120 steal 0.00 iowait 0.31 psi-some cpu 27.9 memory 0.0 io 0.4 ...

(seconds: CPU time stolen by the hypervisor and waiting for I/O, summed over CPUs, from
``/proc/stat``; the pressure stall totals of ``/proc/pressure/*``, "some" and "full").

Why a process of its own: a worker that stood still for ~30 s failed vLLM tests three times on
CI's 2-core host (docs/performance.md, round 24) and no stack showed why. If this watcher, which
holds no lock and shares no interpreter with anyone, stood still too, the host did (the hypervisor,
memory reclaim, a stalled disk); if it did not, the stall was the worker's own. The vLLM suite's
conftest runs it for the session and puts the lines of a failed test's span in its report.

It ends when its stdin closes (its parent went away or closed it) or after ``--max-s``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import select
import sys
import time
from pathlib import Path

PSI = ("cpu", "memory", "io")


def counters() -> dict[str, float]:
    """Seconds the kernel counted so far: steal and iowait summed over CPUs, PSI totals."""
    out: dict[str, float] = {}
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        tick = os.sysconf("SC_CLK_TCK")
        out["steal"] = int(fields[8]) / tick if len(fields) > 8 else 0.0
        out["iowait"] = int(fields[5]) / tick
    except (OSError, ValueError, IndexError):
        pass
    for name in PSI:
        try:
            for line in Path(f"/proc/pressure/{name}").read_text().splitlines():
                kind, *kv = line.split()
                total = dict(x.split("=", 1) for x in kv).get("total")
                if total is not None:
                    out[f"{kind} {name}"] = int(total) / 1e6
        except (OSError, ValueError):
            pass
    return out


def describe(gap: float, ended: float, before: dict[str, float], after: dict[str, float]) -> str:
    stamp = dt.datetime.fromtimestamp(ended).isoformat(timespec="milliseconds")
    parts = [f"gap {gap:.2f} s ending {stamp}"]
    for key in ("steal", "iowait"):
        if key in after and key in before:
            parts.append(f"{key} {after[key] - before[key]:.2f}")
    for kind in ("some", "full"):
        psi = [f"{name} {after[f'{kind} {name}'] - before[f'{kind} {name}']:.1f}" for name in PSI
               if f"{kind} {name}" in after and f"{kind} {name}" in before]
        if psi:
            parts.append(f"psi-{kind} " + " ".join(psi))
    return " ".join(parts)


def gaps(log: Path, start: float = float("-inf"), stop: float = float("inf")) -> list[str]:
    """The gap lines of a watcher's ``--out`` file whose gap overlaps ``[start, stop]`` (epoch
    seconds; every gap line by default); [] where the file is missing."""
    try:
        text = Path(log).read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] != ["gap"] or len(words) < 5 or words[3] != "ending":
            continue
        try:
            gap, ended = float(words[1]), dt.datetime.fromisoformat(words[4]).timestamp()
        except ValueError:
            continue
        if ended >= start and ended - gap <= stop:
            out.append(line)
    return out


def watch(every: float, gap: float, max_s: float, out) -> int:
    """Sample until stdin closes or ``max_s`` passes; returns how many gaps were printed."""
    start = last = time.monotonic()
    seen = counters()
    found = 0
    print(f"freeze_watch: pid {os.getpid()}, waking every {every:g} s, reporting gaps over {gap:g} s", file=out,
          flush=True)
    while time.monotonic() - start < max_s:
        ready, _, _ = select.select([sys.stdin], [], [], every)
        if ready and not sys.stdin.buffer.read1(4096):  # EOF: the parent is gone or done
            break
        now, now_counters = time.monotonic(), counters()
        if now - last > gap:
            print(describe(now - last, time.time(), seen, now_counters), file=out, flush=True)
            found += 1
        last, seen = now, now_counters
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--every", type=float, default=0.25, help="seconds between wake-ups (default 0.25)")
    ap.add_argument("--gap", type=float, default=3.0, help="report a wake-up later than this many seconds (default 3)")
    ap.add_argument("--max-s", type=float, default=6 * 3600, help="stop after this many seconds (default 6 h)")
    ap.add_argument("--out", default="-", help="file to append the lines to (default stdout)")
    args = ap.parse_args(argv)
    if args.every <= 0 or args.gap <= args.every:
        ap.error("--every must be > 0 and --gap larger than --every")
    if args.out == "-":
        watch(args.every, args.gap, args.max_s, sys.stdout)
    else:
        with open(args.out, "a", encoding="utf-8") as out:
            watch(args.every, args.gap, args.max_s, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
