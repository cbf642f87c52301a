#!/usr/bin/env python
"""Who waits for whom in a staged chunk's cycle: figures read from ``scripts/staged_cycle.py --json``'s
per-chunk timestamps (one file, or the device script's ``cycle.json``: {name: that file's object}).

    landed trip, decode idle / busy   prefill's ChunkLanded -> decode read it, split by whether decode's
                                      loop logged any other cycle step between the send and the read
    decode loop gap after X -> Y      decode logged step X, and its next logged step was Y (X, Y in
                                      L landed-in, A ask-in, G grant-out, S scattered): how long one kind
                                      of event keeps decode's loop from the next (gaps over 50 ms dropped)
    first two asks of a rank          decode read a rank's SlotRequest for its chunk 1 this long after the
                                      one for chunk 0 (prefill sends both in one loop turn, chunk 1's
                                      Gather between them)
    decode slot held                  decode granted the slot -> the chunk's scatter completed
    chunk interval                    the staged room's p50 over its chunks (decode serves one per interval)

    python scripts/staged_cycle_detail.py cycle.json
"""

from __future__ import annotations

import json
import sys

import numpy as np


def detail(name: str, d: dict) -> None:
    c = d["chunks"]
    rooms = {x["room"] for x in c}
    ev = sorted([(x["landed_in"], "L") for x in c] + [(x["ask_in"], "A") for x in c]
                + [(x["grant_out"], "G") for x in c if x.get("grant_out") is not None]  # (none: granted with the request)
                + [(x["scattered"], "S") for x in c if x["scattered"]])
    times = np.array([t for t, _ in ev])
    idle, busy = [], []
    for x in c:
        between = ((times > x["landed_out"]) & (times < x["landed_in"])).sum()
        (busy if between else idle).append((x["landed_in"] - x["landed_out"]) * 1e3)
    gaps: dict[str, list[float]] = {}
    for (t0, a), (t1, b) in zip(ev, ev[1:]):
        if t1 - t0 <= 0.05:
            gaps.setdefault(a + b, []).append((t1 - t0) * 1e3)
    by = {(x["room"], x["cp"], x["chunk"]): x for x in c}
    first = [(by[(r, cp, 1)]["ask_in"] - x["ask_in"]) * 1e3 for (r, cp, ch), x in by.items()
             if ch == 0 and (r, cp, 1) in by]
    held = [(x["scattered"] - x["grant_out"]) * 1e3 for x in c if x["scattered"] and x.get("grant_out") is not None]
    row = d.get("row", {})

    def q(v: list[float]) -> str:
        return f"n={len(v)} p10 {np.percentile(v, 10):.2f} p50 {np.median(v):.2f} p90 {np.percentile(v, 90):.2f}" \
            if v else "n=0"

    print(f"== {name}: {len(c)} chunks of {len(rooms)} staged rooms; room p50 {row.get('staged_p50_ms')} ms, "
          f"{row.get('staged_gbps')} GB/s; chunk interval {row.get('staged_p50_ms', 0) / (len(c) / len(rooms)):.2f} ms")
    print(f"  landed trip, decode idle:  {q(idle)}")
    print(f"  landed trip, decode busy:  {q(busy)}")
    for k in sorted(gaps):
        if len(gaps[k]) > 5:
            print(f"  decode loop gap {k[0]} -> {k[1]}:    {q(gaps[k])}")
    print(f"  first two asks of a rank:  {q(first)}")
    print(f"  decode slot held:          {q(held)}")


def main() -> None:
    data = json.load(open(sys.argv[1]))
    for name, d in ({"run": data} if "chunks" in data else data).items():
        if d["chunks"]:  # (a run with the trace off has none: staged_cycle.py --split --untraced)
            detail(name, d)


if __name__ == "__main__":
    main()
