"""Prefill's turns for a staged chunk, split: timers wrapped around the functions of those turns in a
bench prefill rank's process, for ``scripts/staged_cycle.py --split`` (the library is untouched), the
counterpart of ``scripts/decode_split.py``.

Why: on one GPU a staged chunk's IPC post holds prefill's loop 0.5-0.8 ms between the SlotGrant's
``now`` (taken once the endpoint's lock is held) and the engine's post trace line; these timers say
where. ``scripts/split_hook/sitecustomize.py`` calls :func:`install` in a prefill rank (``python -m
kvbridge.bench.procs prefill ...``) started with ``KVBRIDGE_SPLIT_DIR`` set. A *turn* is one feed
through ``PrefillEndpoint._feed_event`` (its actions carried out, and the events they queued fed),
recorded for these kinds:

    request a Message holding a wire.TransferRequest  decode's request read and checked
    post    a Post (``send()``'s, the KV whole)     what the room's targets can take now, posted
    tick    a Tick (``resolved``: a Resolved)       the rooms marked since the last tick posted: where a staged
                                                    write starts (its plan, staged plan, first SlotRequests and
                                                    Gathers; with slots granted with the request, PostChunks);
                                                    kept only where it gathered or posted a chunk (the room: its
                                                    first Gather's)
    grant   a Message holding a wire.SlotGrant      the PostChunk: wire pieces, submit_write, the post
    final   a WriteFinal of a staged write's chunk  ChunkLanded sent, gather slot freed, the next Gather
            (``final_direct``: a direct write's)    (fed on the loop, or on the engine's thread when the
                                                    lock was free: ``EndpointShell._engine_final``)

and split, with ``time.perf_counter``, into exclusive parts (time in a function less the wrapped parts
inside it), which sum to the turn:

    machine        PrefillRooms.feed             the room machine's handling (every feed of the turn)
    trace_cycle    staging/cycle.py's lines      (their logging is "log")
    log            logging.Logger._log           every log line of the turn (the trace's, the engine's)
    reply          PrefillEndpoint._reply        a Send: encode + seal + socket
    plan_chunk     targets.plan_chunk / plan_target   a chunk's slices planned (its pages, the aux row), checked
    stage_plan     layout.staging.stage_plan     those slices packed into slot-sized chunks
    scatter_list   StagedPlan.scatter, wire.pack_scatter   a chunk's scatter list (in the machine: a final's turn
                                                           before wire 16, the SlotRequest's from 16)
    wire           StagedPlan.wire               the chunk's wire pieces (slot -> slot)
    post_chunk     PrefillEndpoint._post_chunk   less wire and submit (slot address, the answer queued)
    submit         <engine>.submit_write         less what is below (the endpoint's engine's class,
                                                 found at start: IPC, Mooncake, local, auto alike)
    check          check_slices / check_write    the slices' checks (the IPC engine's / Mooncake's)
    translate      IpcEngine._translate          dst -> this process's addresses, under the lock
    post           IpcEngine._post               less launch (the batch queued for the pump); Mooncake:
                   MooncakeEngine._post          batch_transfer_async_write from the caller (small writes)
    launch         IpcEngine._launch             less what is below
    wait_for       CudaCopier.wait_for           the stream's waits for the source's events
    copier_launch  CudaCopier.launch             less its parts (torch's contexts, the table fill)
    plan           slicecopy.plan_pieces         the pieces' numpy
    table          CudaCopier._table             the wait for a piece table / its growth
    memcpy         Cuda.memcpy_async             the table's upload, plain copies
    ev_record      Cuda.event_record             the table's event
    kernel         the Triton kernel's launch    (``_kernel()[grid](...)``)
    record         CudaCopier.record             the copy's completion event
    gather         PrefillEndpoint._gather       less the stager's parts
    gather_list    StagedPlan.gather             the chunk's gather list
    stager_gather  CudaStager / HostStager.gather   less their parts
    hold           AddressRanges.hold            the gather list's device-range checks
    host_copy      stagers.copy_slices           the gather itself where the gather slot is host memory
    turn           the shell's own               _feed's loop, _carry's dispatch, queued events' records

Beside the turn: ``thread`` ("loop", or "other": a completion collected on the engine's thread),
``gathers`` (Gathers carried in it); ``grant``: ``wait`` (seconds from ``recv_ready`` returning the
batch that held the grant to the feed's start: the lock's wait and the batch's earlier messages) and
``frames`` (messages that batch held); ``final``: ``wait`` (seconds from the engine's last batch of
that write counted final, ``JobTable.batch_finished``, just after the engine's own done trace line, to
the feed's start), where the endpoint's engine keeps a JobTable. Written at exit to
``$KVBRIDGE_SPLIT_DIR/prefill-<pid>.json``: one dict per turn (``kind``, ``room``, ``chunk`` the wire
chunk where known else -1, ``now``, ``turn``, ``parts``), seconds. Every wrapper is a pass-through on a
thread other than the one feeding the recorded turn, and outside one.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from split_timers import Timers  # noqa: E402 (beside this file, which is loaded by path)

P = time.perf_counter
KINDS = ("request", "post", "tick", "resolved", "grant", "final", "final_direct")
QUIET = ("tick", "resolved")  # kept only where they gathered or posted a chunk


class _Split(Timers):
    """The timers (``owner``: the thread feeding the turn) and what prefill's turns record."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = 0  # the endpoint's loop thread (its ``_step``)
        self.recv: tuple[float, int] | None = None  # (when, frames) of the loop's last recv_ready
        self.final_at: dict[int, float] = {}  # engine handle -> when its write was counted final
        self.jobs: Any = None  # the endpoint's engine's JobTable
        # the event types a turn is recorded for (set by install; a test may set its own)
        self.message: Any = None
        self.grant: Any = None
        self.request: Any = None
        self.post: Any = None
        self.quiet: dict[Any, str] = {}  # event type -> kind, for QUIET's
        self.write_final: Any = None

    def turn(self, rec: dict[str, Any], fn: Any, *args: Any) -> Any:
        """``fn(*args)`` as the recorded turn ``rec``, kept in ``records`` once done."""
        me = threading.get_ident()
        rec["thread"] = "loop" if me == self.loop else "other"
        rec.setdefault("gathers", 0)
        rec["parts"] = {}
        self.owner = me
        self.cur = rec
        start = P()
        if "since" in rec:  # (a perf_counter moment before the feed: its wait)
            rec["wait"] = start - rec.pop("since")
        frame = ["turn", start, 0.0]
        self.stack = [frame]
        try:
            return fn(*args)
        finally:
            rec["turn"] = P() - start
            rec["parts"]["turn"] = rec["turn"] - frame[2]  # the shell's own remainder
            self.cur, self.stack, self.owner = None, [], 0
            if rec["kind"] not in QUIET or rec["gathers"] or "post_chunk" in rec["parts"]:
                self.records.append(rec)

    def feed_wrapper(self, feed_event: Any) -> Any:
        """``PrefillEndpoint._feed_event``, each feed of a grant or a write's completion a turn."""
        s = self

        def _feed_event(endpoint: Any, event: Any) -> Any:
            if s.cur is not None:  # (inside a recorded turn: part of it)
                return feed_event(endpoint, event)
            rec = s.classify(endpoint, event)
            if rec is None:
                return feed_event(endpoint, event)
            return s.turn(rec, feed_event, endpoint, event)

        _feed_event.__wrapped__ = feed_event
        return _feed_event

    def classify(self, endpoint: Any, event: Any) -> dict[str, Any] | None:
        """The record of ``event``'s turn (before its feed: the machine's books still name its
        chunk), or None: not a kind recorded."""
        kind = type(event)
        if kind is self.message:
            msg = event.msg
            if type(msg) is self.request:
                rec: dict[str, Any] = {"kind": "request", "room": msg.room, "chunk": -1, "now": event.now}
            elif type(msg) is self.grant:
                rec = {"kind": "grant", "room": msg.room, "chunk": msg.chunk, "now": event.now}
            else:
                return None
            if self.recv is not None and threading.get_ident() == self.loop:
                rec["since"], rec["frames"] = self.recv
            return rec
        if kind in self.quiet:
            return {"kind": self.quiet[kind], "room": -1, "chunk": -1, "now": getattr(event, "now", 0.0)}
        if kind is self.post:
            return {"kind": "post", "room": event.room.room, "chunk": -1, "now": event.now}
        if kind is not self.write_final:
            return None
        room, chunk, staged = _chunk_of(endpoint, event.handle)
        rec = {"kind": "final" if staged else "final_direct", "room": room, "chunk": chunk, "now": event.now}
        since = self.final_at.pop(event.handle, None)
        if since is not None:
            rec["since"] = since
        return rec

    def note_gather(self, gather: Any) -> Any:
        """``PrefillEndpoint._gather``, timed, each call counted in the turn (``gathers``: a
        completion's feed gathers the chunk that takes the gather slot it freed)."""
        timed = self.timed("gather", gather)
        s = self

        def _gather(endpoint: Any, a: Any, *args: Any, **kwargs: Any) -> Any:
            cur = s.cur
            if cur is not None and threading.get_ident() == s.owner:
                cur["gathers"] = cur.get("gathers", 0) + 1
                if cur["room"] == -1:
                    cur["room"] = a.room
            return timed(endpoint, a, *args, **kwargs)

        _gather.__wrapped__ = gather
        return _gather


def _chunk_of(endpoint: Any, handle: int) -> tuple[int, int, bool]:
    """(room, wire chunk, staged) of the write the engine's ``handle`` posted, from the machine's
    books (-1 where they do not say)."""
    try:
        m = endpoint.machine
        w = m.writes.handles.get(handle)
        sw = m.stage.writes.get(w) if w is not None else None
        if sw is not None and handle in sw.posted:
            return sw.room, sw.first_chunk + sw.posted[handle], True
        if w is not None and w in m.writes.by_write:
            return m.writes.by_write[w][0].room, -1, False
    except (AttributeError, KeyError, TypeError):  # (books of another shape: still a turn)
        pass
    return -1, -1, False


SPLIT = _Split()


def install() -> None:
    """Wrap the prefill rank's functions (the wrapped modules are imported here; the CUDA ones only
    where they import)."""
    import logging

    from kvbridge.layout.staging import StagedPlan
    from kvbridge.transfer.channel import wire
    from kvbridge.transfer.channel.transport import Channel
    from kvbridge.transfer.engine import jobs
    from kvbridge.transfer.prefill import endpoint as ep
    from kvbridge.transfer.prefill import machine as mach
    from kvbridge.transfer.staging import stagers

    s = SPLIT
    s.message, s.grant, s.request, s.write_final = ep.Message, wire.SlotGrant, wire.TransferRequest, ep.WriteFinal
    s.post = ep.Post
    s.quiet = {ep.Tick: "tick", ep.Resolved: "resolved"}
    E = ep.PrefillEndpoint
    E._feed_event = s.feed_wrapper(E._feed_event)

    step = E._step

    def _step(self: Any) -> None:
        s.loop = threading.get_ident()
        step(self)

    E._step = _step

    recv_ready = Channel.recv_ready

    def _recv_ready(self: Any, timeout_ms: int) -> Any:
        out = recv_ready(self, timeout_ms)
        if threading.get_ident() == s.loop:
            s.recv = (P(), len(out))
        return out

    Channel.recv_ready = _recv_ready

    batch_finished = jobs.JobTable.batch_finished

    def _batch_finished(self: Any, job: Any, reason: str = "") -> None:
        # before the call: it reports the write final to the endpoint, which may feed it right there
        if self is s.jobs and job.finished + 1 >= job.num_batches:
            s.final_at[job.handle] = P()
        return batch_finished(self, job, reason)

    jobs.JobTable.batch_finished = _batch_finished

    wrapped: set[type] = set()
    start = E.start

    def _start(self: Any) -> None:
        """The endpoint's engine: its class's submit_write timed ("submit"), its JobTable watched."""
        cls = type(self.engine)
        if cls not in wrapped and hasattr(cls, "submit_write"):
            wrapped.add(cls)
            cls.submit_write = s.timed("submit", cls.submit_write)
        s.jobs = getattr(self.engine, "_jobs", None)
        start(self)

    E.start = _start

    mach.PrefillRooms.feed = s.timed("machine", mach.PrefillRooms.feed)
    mach.trace_cycle = s.timed("trace_cycle", mach.trace_cycle)
    logging.Logger._log = s.timed("log", logging.Logger._log)
    E._reply = s.timed("reply", E._reply)
    E._post_chunk = s.timed("post_chunk", E._post_chunk)
    E._gather = s.note_gather(E._gather)
    from kvbridge.transfer.prefill import staged as stg
    from kvbridge.transfer.prefill import writes as wr

    wr.plan_chunk = s.timed("plan_chunk", wr.plan_chunk)
    wr.plan_target = s.timed("plan_chunk", wr.plan_target)
    stg.stage_plan = s.timed("stage_plan", stg.stage_plan)
    StagedPlan.wire = s.timed("wire", StagedPlan.wire)
    StagedPlan.gather = s.timed("gather_list", StagedPlan.gather)
    StagedPlan.scatter = s.timed("scatter_list", StagedPlan.scatter)
    wire.pack_scatter = s.timed("scatter_list", wire.pack_scatter)
    stagers.copy_slices = s.timed("host_copy", stagers.copy_slices)
    stagers.HostStager.gather = s.timed("stager_gather", stagers.HostStager.gather)
    stagers.CudaStager.gather = s.timed("stager_gather", stagers.CudaStager.gather)
    stagers.AddressRanges.hold = s.timed("hold", stagers.AddressRanges.hold)
    engines = {  # the engines' steps (each module where it imports): name in the module -> part
        "kvbridge.transfer.engine.ipc.engine": {"check_slices": "check", "IpcEngine._translate": "translate",
                                                "IpcEngine._post": "post", "IpcEngine._launch": "launch"},
        "kvbridge.transfer.engine.mooncake": {"check_write": "check", "MooncakeEngine._post": "post"},
    }
    for module, parts in engines.items():
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        for dotted, part in parts.items():
            owner, _, attr = dotted.rpartition(".")
            holder = getattr(found, owner) if owner else found
            setattr(holder, attr, s.timed(part, getattr(holder, attr)))
    if s.time_copier(launch="copier_launch", memcpy="memcpy"):
        from kvbridge.transfer.engine import slicecopy

        slicecopy.CudaCopier.wait_for = s.timed("wait_for", slicecopy.CudaCopier.wait_for)
    s.dump_at_exit("prefill")
