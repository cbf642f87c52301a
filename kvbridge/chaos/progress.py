"""Judging the legitimate rooms of a hostile attack by their progress, not by a fixed deadline.

An attack is defended when the victim's real rooms still succeed while it runs. A flood holds
the target while those rooms move, and on a loaded host (CI runs other suites beside this one)
a room may take longer than any fixed deadline and still be served in the end. So a room is
judged here as an operator would judge it:

- **failed** when a rank answers it with a failure (a wrong result; the wait goes on until its
  other ranks answered too, which follow a failure at once);
- **stalled** (failed) when nothing advanced for ``stall_s`` times the host's load factor
  (``load_factor``: the 1-minute load average per CPU, at least 1), read again at each look;
- **advancing** while anything that moves it does: a rank answered it, a prefill rank posted
  more bytes or slices (pages landing), ended a room, or refused or displaced a connection
  (the flood being refused) since the last look, or the daemon, where every room looks its
  ranks up, was at work (a fifth of a CPU or more: working through a flood's aftermath);
- and every wait ends by ``ceiling_s`` whatever it sees, so no loop of the harness is unbounded.

    ask rooms ─▶ look every LOOK_S: answers? prefill's posted bytes/slices, rooms, refusals?
                   ├─ every rank answered ────────────────────▶ ok, or failed (a wrong result)
                   ├─ something moved ─▶ the stall clock restarts
                   ├─ still for stall_s x load factor ────────▶ stalled (no progress)
                   └─ past ceiling_s ─────────────────────────▶ stalled (bounded)

``Waited`` records how long it waited, the window it used and the load it saw, so a verdict is
read with the conditions it was given under.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.worker import ops

__all__ = ["CEILING_S", "LOOK_S", "Progress", "Rooms", "Waited", "awake", "load_factor", "run_rooms"]

LOOK_S = 0.5  # how often the signs of progress are read
CEILING_S = 240.0  # no wait is longer, however the rooms advance
MAX_LOAD_FACTOR = 4.0  # a stall window (or a due time) is at most this many times its base


def load_factor() -> float:
    """The host's 1-minute load average per CPU, at least 1 (at most ``MAX_LOAD_FACTOR``)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(MAX_LOAD_FACTOR, max(1.0, load / (os.cpu_count() or 1)))


@dataclass
class Waited:
    """How a wait ended: ``done`` (every rank answered), ``seconds`` waited, ``stalled_s`` (the
    stillness that ended it, None when it did not stall), the ``window_s`` and ``load_factor``
    last used, and how many looks saw progress (``advances``)."""

    done: bool
    seconds: float
    stalled_s: float | None
    window_s: float
    load_factor: float
    advances: int
    daemon_busy_looks: int = 0  # looks at which the daemon was at work (counted among the advances)
    ceiling: bool = False

    def why(self) -> str:
        if self.done:
            return ""
        if self.ceiling:
            return f"still not answered after the {self.seconds:.0f}s ceiling (it kept advancing)"
        return (f"no progress for {self.stalled_s:.1f}s (window {self.window_s:.1f}s at load factor "
                f"{self.load_factor:.1f}; {self.advances} advances in {self.seconds:.1f}s)")

    def record(self) -> dict[str, Any]:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}


BUSY_SHARE = 0.2  # a daemon using this share of a CPU between two looks is working (leases alone: ~1%)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Progress:
    """The signs that the cluster's rooms move: each prefill rank's posted bytes and slices, its
    rooms ended, and its control channel's refused and displaced connections (worker Stats); and
    the daemon at work (``BUSY_SHARE`` of a CPU since the last look: every room looks its ranks up
    there, and a flood's aftermath there, such as ``metadata_flood``'s, delays them)."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self._daemon_cpu: tuple[float, float | None] | None = None  # (when, its CPU seconds)
        self.busy_looks = 0

    def daemon_busy(self) -> bool:
        daemon = getattr(self.h.c, "daemon", None)
        now, cpu = time.monotonic(), cpu_seconds(daemon.pid if daemon is not None and daemon.alive else None)
        last, self._daemon_cpu = self._daemon_cpu, (now, cpu)
        if last is None or cpu is None or last[1] is None or now <= last[0]:
            return False
        busy = (cpu - last[1]) / (now - last[0]) >= BUSY_SHARE
        self.busy_looks += busy
        return busy

    def sign(self) -> tuple:
        out = []
        for m in self.h.c.prefill:
            try:
                st = self.h.c.stats(m, timeout=5.0)
            except KVBridgeError:  # (no answer in time: no sign of anything this look)
                st = {}
            posted = st.get("posted", {})
            conns = st.get("control_connections", {})
            out.append((posted.get("bytes"), posted.get("slices"), st.get("rooms_ok"), st.get("rooms_failed"),
                        conns.get("refused"), conns.get("displaced")))
        return tuple(out)

    def wait(self, done: Callable[[], bool], step: Callable[[float], int], stall_s: float,
             ceiling_s: float = CEILING_S) -> Waited:
        """Call ``step(seconds)`` (it collects answers and returns how many came) until ``done()``
        (every rank answered: a failure is an answer, the room's other ranks follow it at once),
        the rooms stop advancing for ``stall_s`` x the load factor, or ``ceiling_s`` passes."""
        t0 = last_move = time.monotonic()
        sign, advances, factor = self.sign(), 0, load_factor()
        self.daemon_busy()
        next_look = t0 + LOOK_S
        while True:
            answered = step(0.05)
            now = time.monotonic()
            if answered:
                last_move, advances = now, advances + 1
            if done():
                return Waited(True, now - t0, None, stall_s * factor, factor, advances, self.busy_looks)
            if now >= next_look:
                seen = self.sign()
                now = time.monotonic()
                if self.daemon_busy() or seen != sign:
                    sign, last_move, advances = seen, now, advances + 1
                factor = load_factor()
                next_look = now + LOOK_S
            still = now - last_move
            if still > stall_s * factor or now - t0 > ceiling_s:
                return Waited(False, now - t0, still, stall_s * factor, factor, advances, self.busy_looks,
                              ceiling=now - t0 > ceiling_s)


@dataclass
class Rooms:
    """``run_rooms``' result: (member, answer) per room and rank asked, and how the wait ended."""

    answers: dict[tuple[int, str], Any]
    waited: Waited

    @property
    def ok(self) -> bool:
        return self.waited.done and all(isinstance(r, ops.RoomResult) and r.ok for r in self.answers.values())

    def why(self) -> str:
        failed = [f"{name}: {_reason(r)}" for (_, name), r in self.answers.items()
                  if not (isinstance(r, ops.RoomResult) and r.ok)]
        return "; ".join([*failed, self.waited.why()] if not self.waited.done else failed)[:600]


def run_rooms(h: Any, n: int, decode: Sequence[Any] | None = None, stall_s: float | None = None,
              ceiling_s: float = CEILING_S) -> Rooms:
    """``n`` rooms at once through every prefill rank and the ``decode`` ranks (the cluster's by
    default), judged by their progress (``Progress.wait``; ``stall_s``: the spec's room timeout)."""
    members = [*h.c.prefill, *(h.c.decode if decode is None else decode)]
    for m in members:
        awake(m)
    asked: dict[tuple[int, str], tuple[Any, int]] = {}
    for _ in range(n):
        room = h.next_room()
        for m in members:
            op = (ops.Prefill(room, h.spec.tokens, 0) if m.role == "prefill"
                  else ops.Decode(room, h.spec.tokens, h.c.prefill_instance))
            asked[(room, m.name)] = (m, h.submit(m, op))
    answers: dict[tuple[int, str], Any] = {}

    def step(seconds: float) -> int:
        got = 0
        for m in members:
            if m.client is not None:
                m.client.poll(seconds / len(members))
        for key, (m, request_id) in list(asked.items()):
            reply = None if m.client is None else m.client.take(request_id)
            if reply is not None:
                answers[key] = reply
                del asked[key]
                got += 1
        return got

    waited = Progress(h).wait(lambda: not asked, step, h.spec.room_timeout if stall_s is None else stall_s,
                              ceiling_s)
    return Rooms(answers, waited)


def awake(m: Any, tries: int = 4, timeout: float = 5.0) -> bool:
    """Make sure the harness's ops connection to worker ``m`` carries an op now: a worker closes
    a connection idle for its ``idle_timeout`` (120 s), and an attack that runs longer without
    an op (``metadata_flood`` on a loaded host) would otherwise send its room into a connection
    the worker already closed, where the op is lost and never answered. A Stats call answered
    proves the connection (the client reconnects once it sees the close); at most ``tries``."""
    if m.client is None or not m.alive:
        return False
    for _ in range(tries):
        try:
            m.client.poll(0.0)  # (a close the worker sent is seen here: the client reconnects)
            if isinstance(m.client.call(ops.Stats(), timeout), ops.StatsReply):
                return True
        except KVBridgeError:
            continue
    return False


def _reason(reply: Any) -> str:
    if isinstance(reply, ops.RoomResult):
        return "ok" if reply.ok else f"failed: {reply.reason[:200]}"
    return "no answer" if reply is None else type(reply).__name__
