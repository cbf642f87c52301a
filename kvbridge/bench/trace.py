"""Where a room's time goes, from the ``KVBRIDGE_TRACE=1`` lines of every rank's log.

Each trace line carries ``room=R`` and ``@T`` (``time.monotonic()``, one clock for
every process of a host). A room's path, hop by hop (the last CP rank decides
when a room completes, so each event is taken at its last occurrence):

    recv       decode: bench creates the receiver                       (bench line)
    requested  decode: bootstrap look-up done, request sent to the ranks (endpoint line)
    received   prefill: the request came out of the control channel      (per rank)
    target     prefill: request parsed and checked                       (per rank)
    posted     prefill: the room's writes handed to the engine           (per rank)
    written    prefill: the engine reported the writes final             (per rank)
    reported   decode: a rank's PagesDone came out of the control channel (per report)
    committed  decode: every page and the aux row accounted for
    final      decode: the bench's poll saw Success                      (bench line)

In the engine's order (the bench's ``ask_first``: decode's request, and at CP > 1 the room's
ticket, reach prefill before its sends) the room starts at the prefill ranks' ``send()``:

    send       prefill: the bench calls send(), every page at once        (bench line, per rank)
    posted ... final as above

The committed line also says how long reading the aux row took (``aux_read=``: for a row
in device memory, one copy to the host and its synchronisation; for a row its report carried,
``aux_inline``, writing it into the room's slot), shown as its own row; ``aux_ahead=`` when that
row was written before the commit, as its report came (0 at the commit then).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

EVENTS = ("recv", "requested", "received", "target", "posted", "written", "reported", "committed", "final")
HOPS = (
    ("recv", "requested", "look-up + request sent (decode)"),
    ("requested", "received", "request trip (decode -> the last prefill rank's loop)"),
    ("received", "target", "parse + checks (prefill)"),
    ("target", "posted", "plan + submit (prefill)"),
    ("posted", "written", "transfer + completion seen (prefill)"),
    ("written", "reported", "report trip (the last rank -> decode's loop)"),
    ("reported", "committed", "ledger + aux row read or write + commit (decode)"),
    ("committed", "final", "until the room's poll sees it"),
)
ENGINE_ORDER = ("send", "posted", "written", "reported", "committed", "final")
ENGINE_HOPS = (
    ("send", "posted", "send(): checks + plan + submit (prefill, the last rank)"),
    *HOPS[4:],
)
_ROOM = re.compile(r"trace room=(\d+)")
_AT = re.compile(r"@(\d+\.\d+)")
_AUX_READ = re.compile(r"aux_read=(\d+\.\d+)ms")
_SUBMIT = re.compile(r"submit=(\d+\.\d+)ms")
_KINDS = (("bench recv", "recv"), ("bench send", "send"), ("requested from (cp, tp, pp) ranks", "requested"),
          (" request from ", "received"),
          (" target ", "target"), (" -> ", "posted"), ("write of", "written"), (" report from ", "reported"),
          ("committed", "committed"), ("bench final", "final"))


def parse(lines: Iterable[str]) -> dict[int, dict[str, list[float]]]:
    """room -> event -> times (monotonic seconds) found in ``lines``."""
    rooms: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        room, at = _ROOM.search(line), _AT.search(line)
        if room is None or at is None:
            continue
        for needle, kind in _KINDS:
            if needle in line:
                rooms[int(room.group(1))][kind].append(float(at.group(1)))
                read = _AUX_READ.search(line) if kind == "committed" else None
                if read is not None:
                    rooms[int(room.group(1))]["aux_read_ms"].append(float(read.group(1)))
                submit = _SUBMIT.search(line) if kind == "posted" else None
                if submit is not None:  # (kept beside its post's time: the last post's is the room's)
                    rooms[int(room.group(1))]["submit_ms"].append(float(submit.group(1)))
                    rooms[int(room.group(1))]["submit_at"].append(float(at.group(1)))
                break
    return rooms


def asked_first(ev: dict[str, list[float]]) -> bool:
    """Decode's request reached every prefill rank before the bench's sends (the engine's order)."""
    return bool(ev.get("send")) and bool(ev.get("received")) and min(ev["send"]) > max(ev["received"])


def breakdown(rooms: dict[int, dict[str, list[float]]]) -> list[dict[str, object]]:
    """p50 and p90 of each hop (ms) over the rooms that have every event, then the total. Rooms
    in the engine's order (``asked_first``: all of them, else none is) run from the sends."""
    first = bool(rooms) and all(asked_first(ev) for ev in rooms.values())
    events, hops, start = (ENGINE_ORDER, ENGINE_HOPS, "send") if first else (EVENTS, HOPS, "recv")
    complete = [ev for ev in rooms.values() if all(ev.get(k) for k in events)]
    out: list[dict[str, object]] = []
    if not complete:
        return out
    for a, b, what in hops:
        ms = np.array([(max(ev[b]) - max(ev[a])) * 1e3 for ev in complete])
        out.append({"hop": f"{a} -> {b}", "what": what, "p50_ms": round(float(np.median(ms)), 3),
                    "p90_ms": round(float(np.percentile(ms, 90)), 3)})
    total = np.array([(max(ev["final"]) - min(ev[start])) * 1e3 for ev in complete])
    out.append({"hop": f"{start} -> final", "what": f"total ({len(complete)} rooms)",
                "p50_ms": round(float(np.median(total)), 3), "p90_ms": round(float(np.percentile(total, 90)), 3)})
    reads = np.array([ev["aux_read_ms"][-1] for ev in complete if ev.get("aux_read_ms")])
    if reads.size:
        out.append({"hop": "aux row read", "what": "inside 'reported -> committed' (decode)",
                    "p50_ms": round(float(np.median(reads)), 3), "p90_ms": round(float(np.percentile(reads, 90)), 3)})
    submits = np.array([ev["submit_ms"][int(np.argmax(ev["submit_at"]))] for ev in complete if ev.get("submit_ms")])
    if submits.size:
        inside = "send -> posted" if first else "target -> posted"
        out.append({"hop": "engine submit", "what": f"inside '{inside}' (the last post's submit_write)",
                    "p50_ms": round(float(np.median(submits)), 3),
                    "p90_ms": round(float(np.percentile(submits, 90)), 3)})
    if first:  # (the targets were built before the sends: no skew on the room's path)
        return out
    skew = np.array([(max(ev["target"]) - min(ev["target"])) * 1e3 for ev in complete])
    out.append({"hop": "target skew", "what": "first to last CP rank parsing the request",
                "p50_ms": round(float(np.median(skew)), 3), "p90_ms": round(float(np.percentile(skew, 90)), 3)})
    return out


def format_breakdown(hops: list[dict[str, object]], title: str) -> str:
    if not hops:
        return f"{title}: no complete room in the trace"
    lines = [title, f"{'hop':<24} {'p50 ms':>8} {'p90 ms':>8}  what"]
    lines += [f"{h['hop']:<24} {h['p50_ms']:>8.3f} {h['p90_ms']:>8.3f}  {h['what']}" for h in hops]
    return "\n".join(lines)
