"""Decode's turn for a landed staged chunk, split: timers wrapped around the functions of that turn
in a bench decode rank's process, for ``scripts/staged_cycle.py --split`` (the library is untouched).

``scripts/split_hook/sitecustomize.py`` calls :func:`install` in every bench child started with
``KVBRIDGE_SPLIT_DIR`` set (``staged_cycle.py`` puts that folder first on the children's
``PYTHONPATH``); in a decode rank it wraps, with ``time.perf_counter``:

    turn         DecodeEndpoint._feed_event(Message(ChunkLanded)), the whole feed of one landing
    machine      DecodeRooms.feed            the machine's handling, less what is split below
    landed       DecodeStaging.landed        the landing's checks (the scatter list against the room's pages;
                                             from wire 16 the request's turn checks it, the landing takes it)
    trace_cycle  staging/cycle.py's lines    (their logging is "log")
    log          logging.Logger._log         every log line written in the turn (the trace's)
    carry        DecodeEndpoint._carry       other actions carried out (a Send: encode + socket)
    scatter      DecodeEndpoint._scatter     less the stager's parts
    ranges       CudaStager.copy             the device-range checks (less the launch)
    launch       CudaCopier.launch           torch's device/stream contexts, the pinned table fill
    plan         slicecopy.plan_pieces       the pieces' numpy
    table        CudaCopier._table           the wait for a piece table (event synchronise) / its growth
    upload       Cuda.memcpy_async           the table's copy to the device (and aux rows' copies)
    ev_record    Cuda.event_record           the table's event
    kernel       the Triton kernel's launch  (``_kernel()[grid](...)``)
    record       CudaCopier.record           the scatter's completion event
    host_copy    copy_slices                 the copy itself where the staging area is host memory (CPU)

Each part is exclusive (time in it less the wrapped parts inside it), so the parts sum to ``turn``.
Beside the turn, per landing: ``recv`` (the ``recv_ready`` call that returned the ChunkLanded: select,
socket reads and every frame's decoding, of which ``decode_L`` is the ChunkLanded frame's unseal +
decode), ``next`` (the ChunkLanded's ``now`` -> the ``now`` of the next Message or Scattered decode's loop fed:
round 12's "decode's next step", which counted the cycle's lines), ``after`` (the turn's end -> that
feed's start) and, within ``after``, ``between_recv`` (``recv_ready`` calls) and ``between_<Event>``
(the feeds of other events meanwhile: the loop's Tick every turn). Written at exit to
``$KVBRIDGE_SPLIT_DIR/decode-<pid>.json``: one dict per landing, seconds; and (wire 16, where the
scatter list is checked when the chunk asks) one per SlotRequest's whole feed, ``kind`` "ask".
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from split_timers import Timers  # noqa: E402 (beside this file, which is loaded by path)

P = time.perf_counter


class _Split(Timers):
    """The timers (``owner``: decode's loop thread, set by its ``_step``) and what one landing's turn records."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, Any] | None = None  # the last landing, waiting for its next feed
        self.recv: tuple[float, int] | None = None  # (duration, frames) of the last recv_ready
        self.decode_l: list[float] = []  # its ChunkLanded frames' decode times, in order (taken by their turns)


SPLIT = _Split()


def _entries(endpoint: Any, sender: str, msg: Any) -> int:
    """A landing's scatter entries: its ChunkLanded's list before wire 16, else the list its
    SlotRequest left with decode's staging book (0 where none is found)."""
    scatter = getattr(msg, "scatter", None)
    if scatter is not None:
        return len(scatter) // 24
    machine = endpoint.machine
    st, r = getattr(machine, "staging", None), machine.rooms.get(msg.room)
    key = r.by_endpoint.get(sender) if r is not None else None
    got = st.lists.get((msg.room, st.key(key, msg.chunk))) if st is not None and key is not None else None
    return int(got[2].size) if got else 0


def install() -> None:
    """Wrap the decode rank's functions (a no-op in a process that never imports them is fine: the
    wrapped modules are imported here)."""
    import logging

    from kvbridge.transfer.channel import wire
    from kvbridge.transfer.channel.transport import Channel
    from kvbridge.transfer.decode import endpoint as ep
    from kvbridge.transfer.decode import machine as mach
    from kvbridge.transfer.decode.staging import DecodeStaging

    s = SPLIT
    feed_event = ep.DecodeEndpoint._feed_event

    def _feed_event(self: Any, event: Any) -> None:
        if threading.get_ident() != s.owner and s.owner:
            return feed_event(self, event)
        start = P()
        last = s.last
        if last is not None:  # the landing before: its next step is the next message or scatter done
            if type(event) is ep.Message or type(event) is ep.Scattered:
                last["next"] = event.now - last["now"]
                last["after"] = start - last["end"]
                s.last = None
            else:  # a Tick (every turn), a look-up's answer, ...: timed as the loop's between
                try:
                    return feed_event(self, event)
                finally:
                    name = "between_" + type(event).__name__
                    last[name] = last.get(name, 0.0) + P() - start
        msg = getattr(event, "msg", None)
        if s.cur is None and type(event) is ep.Message and type(msg) is wire.SlotRequest:  # wire 16: the list's check
            try:
                return feed_event(self, event)
            finally:
                s.records.append({"kind": "ask", "room": msg.room, "chunk": msg.chunk, "now": event.now,
                                  "entries": len(getattr(msg, "scatter", b"")) // 24, "turn": P() - start})
        if s.cur is not None or type(event) is not ep.Message or type(msg) is not wire.ChunkLanded:
            return feed_event(self, event)
        rec: dict[str, Any] = {"room": msg.room, "chunk": msg.chunk, "cp": msg.cp_rank, "now": event.now,
                               "entries": _entries(self, event.endpoint, msg), "parts": {}}
        if s.recv is not None:
            rec["recv"], rec["frames"] = s.recv
        if s.decode_l:
            rec["decode_L"] = s.decode_l.pop(0)
        s.cur = rec
        frame = ["turn", start, 0.0]
        s.stack = [frame]
        try:
            feed_event(self, event)
        finally:
            end = P()
            rec["turn"] = end - start
            rec["parts"]["turn"] = rec["turn"] - frame[2]  # the shell's own (Registered check, queued events)
            rec["end"] = end
            s.cur, s.stack = None, []
            s.records.append(rec)
            s.last = rec

    ep.DecodeEndpoint._feed_event = _feed_event

    step = ep.DecodeEndpoint._step

    def _step(self: Any) -> None:
        s.owner = threading.get_ident()
        step(self)

    ep.DecodeEndpoint._step = _step

    recv_ready = Channel.recv_ready
    decode = Channel._decode

    def _decode(self: Any, body: Any, who: str) -> Any:
        t = P()
        out = decode(self, body, who)
        if type(out) is wire.ChunkLanded:
            s.decode_l.append(P() - t)
        return out

    def _recv_ready(self: Any, timeout_ms: int) -> Any:
        if threading.get_ident() != s.owner:
            return recv_ready(self, timeout_ms)
        s.decode_l = []
        t = P()
        out = recv_ready(self, timeout_ms)
        took = P() - t
        s.recv = (took, len(out))
        if s.last is not None:
            s.last["between_recv"] = s.last.get("between_recv", 0.0) + took
        return out

    Channel.recv_ready = _recv_ready
    Channel._decode = _decode

    mach.DecodeRooms.feed = s.timed("machine", mach.DecodeRooms.feed)
    mach.trace_cycle = s.timed("trace_cycle", mach.trace_cycle)
    DecodeStaging.landed = s.timed("landed", DecodeStaging.landed)
    logging.Logger._log = s.timed("log", logging.Logger._log)
    ep.DecodeEndpoint._carry = s.timed("carry", ep.DecodeEndpoint._carry)
    ep.DecodeEndpoint._scatter = s.timed("scatter", ep.DecodeEndpoint._scatter)
    ep.copy_slices = s.timed("host_copy", ep.copy_slices)
    if s.time_copier(launch="launch", memcpy="upload"):
        from kvbridge.transfer.staging.stagers import CudaStager

        CudaStager.copy = s.timed("ranges", CudaStager.copy)
    s.dump_at_exit("decode")
