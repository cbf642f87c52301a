"""Trace lines of a staged chunk's cycle (``KVBRIDGE_TRACE=1`` only), for ``scripts/staged_cycle.py``.

Both room machines call :func:`trace_cycle` with the event they were fed and the actions it gave:
every staged message read or sent (SlotRequest, SlotGrant, ChunkLanded), and decode's scatter
started and completed, one line each with the event's ``now`` (``time.monotonic()``, one clock
for every process of a host):

    trace room=R rank=L @T cycle <step> chunk=C slot=S cp=P

steps: ``ask-out`` / ``ask-in`` (SlotRequest), ``grant-out`` / ``grant-in`` (SlotGrant),
``landed-out`` / ``landed-in`` (ChunkLanded: prefill saw its write final / decode read it),
``scatter`` (decode started the slot's copy), ``scattered`` (it completed; the slot's credit goes
back). A ``landed-out`` of a chunk that landed (fed by the engine's completion of its write) ends
with ``write=H``, the engine's handle, which the engine's own trace lines and prefill's ``chunk ..
at`` line carry too (``staged_cycle.py`` splits prefill's post and write by it). The words avoid
what ``kvbridge.bench.trace`` matches, so its hop table is unchanged.
Sans-I/O: the lines are logged, nothing else.
"""

from __future__ import annotations

import logging
from typing import Any

from kvbridge.transfer.channel import wire

__all__ = ["trace_cycle"]

log = logging.getLogger(__name__)
_STEPS = {wire.SlotRequest: "ask", wire.SlotGrant: "grant", wire.ChunkLanded: "landed"}


def _line(rank: str, now: float, step: str, room: int, chunk: int, slot: int, cp: int, handle: Any = None) -> None:
    if handle is None:
        log.info("trace room=%d rank=%s @%.6f cycle %s chunk=%d slot=%d cp=%d", room, rank, now, step, chunk, slot, cp)
    else:
        log.info("trace room=%d rank=%s @%.6f cycle %s chunk=%d slot=%d cp=%d write=%d", room, rank, now, step, chunk,
                 slot, cp, handle)


def trace_cycle(rank: str, event: Any, actions: Any) -> None:
    """Log the staged cycle's steps in ``event`` (fed to a room machine on ``rank``) and ``actions``."""
    now = getattr(event, "now", None)
    if now is None:
        return
    msg = getattr(event, "msg", None)
    step = _STEPS.get(type(msg))
    if step is not None:
        _line(rank, now, f"{step}-in", msg.room, msg.chunk, getattr(msg, "slot", -1), getattr(msg, "cp_rank", -1))
    elif type(event).__name__ == "Scattered":
        _line(rank, now, "scattered", event.room, -1, event.slot, -1)
    for a in actions:
        msg = getattr(a, "msg", None)
        step = _STEPS.get(type(msg))
        if step is not None:
            # the write's handle on a chunk that landed: fed by that write's completion (a "failed" answer
            # to another chunk's grant, sent in the same feed, names no write)
            handle = getattr(event, "handle", None) if step == "landed" and msg.status == "ok" else None
            _line(rank, now, f"{step}-out", msg.room, msg.chunk, getattr(msg, "slot", -1), getattr(msg, "cp_rank", -1),
                  handle)
        elif type(a).__name__ == "Scatter":
            _line(rank, now, "scatter", a.room, -1, a.slot, -1)
