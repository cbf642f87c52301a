"""The staged cycle's trace lines (``transfer/staging/cycle.py``) and their per-chunk join in
``scripts/staged_cycle.py``: each step a chunk goes through is logged with its event's time, the
hop table's parser ignores them, and the join gives each step's duration (sans-I/O)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np

from kvbridge.bench.trace import parse
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode.events import Message, Scattered
from kvbridge.transfer.decode.staging import Scatter
from kvbridge.transfer.staging.cycle import trace_cycle

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "staged_cycle.py"
PRE, DEC = "p/dp0/cp1/tp0/pp0", "d/dp0/tp0"


def _script():
    spec = importlib.util.spec_from_file_location("staged_cycle", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_staged_message_and_scatter_is_one_trace_line_with_its_event_time(caplog):
    ask = wire.SlotRequest(room=7, cp_rank=1, chunk=3, num_bytes=100, scatter=b"")
    grant = wire.SlotGrant(room=7, decode_rank=DEC, chunk=3, slot=2)
    empty = np.zeros(0, np.uint64)
    with caplog.at_level(logging.INFO, logger="kvbridge.transfer.staging.cycle"):
        trace_cycle(DEC, Message("ep", ask, 10.5), [Send(("ep",), grant), Scatter(7, 2, empty, empty, empty)])
        trace_cycle(DEC, Scattered(7, 2, 11.0), [])
        trace_cycle(DEC, object(), [Send(("ep",), grant)])  # an event without a time: nothing logged
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"trace room=7 rank={DEC} @10.500000 cycle ask-in chunk=3 slot=-1 cp=1",
                     f"trace room=7 rank={DEC} @10.500000 cycle grant-out chunk=3 slot=2 cp=-1",
                     f"trace room=7 rank={DEC} @10.500000 cycle scatter chunk=-1 slot=2 cp=-1",
                     f"trace room=7 rank={DEC} @11.000000 cycle scattered chunk=-1 slot=2 cp=-1"]
    assert not parse(lines)  # the bench's hop table does not mistake them for its hops


def test_the_join_gives_each_step_of_a_chunk_and_the_credit_back_of_its_slot():
    def line(rank: str, at: float, step: str, chunk: int = -1, slot: int = -1, cp: int = -1, room: int = 7) -> str:
        return f"x trace room={room} rank={rank} @{at:.6f} cycle {step} chunk={chunk} slot={slot} cp={cp}"

    lines = [line(PRE, 1.000, "ask-out", 3, cp=1), line(DEC, 1.001, "ask-in", 3, cp=1),
             line(DEC, 1.003, "grant-out", 3, 2), line(PRE, 1.004, "grant-in", 3, 2),
             line(PRE, 1.010, "landed-out", 3, 2, 1), line(DEC, 1.012, "landed-in", 3, 2, 1),
             line(DEC, 1.012, "scatter", slot=2), line(DEC, 1.0125, "scattered", slot=2),
             line(DEC, 1.0135, "grant-out", 9, 2, room=8)]  # the slot's next grant (another room)
    steps = _script().cycle_steps(lines, {7})
    got = {k: round(v[0], 3) for k, v in steps.items() if v}
    assert got == {"ask trip": 1.0, "grant wait": 2.0, "grant trip": 1.0, "post + write": 6.0, "landed trip": 2.0,
                   "scatter": 0.5, "credit back": 1.0, "gather slot": 10.0}
    chunks: list[dict] = []  # --json: each chunk's timestamps, for scripts/staged_cycle_detail.py
    _script().cycle_steps(lines, {7}, chunks)
    assert chunks == [dict(room=7, cp=1, chunk=3, slot=2, ask_out=1.0, ask_in=1.001, grant_out=1.003, grant_in=1.004,
                           landed_out=1.01, landed_in=1.012, scattered=1.0125, regrant=1.0135, with_request=False)]
    # a chunk whose slot came with the room's request: no grant lines; post + write from its ask
    lines = [line(PRE, 2.000, "ask-out", 0, cp=1, room=9), line(DEC, 2.001, "ask-in", 0, cp=1, room=9),
             line(PRE, 2.006, "landed-out", 0, 3, 1, room=9), line(DEC, 2.007, "landed-in", 0, 3, 1, room=9),
             line(DEC, 2.007, "scatter", slot=3, room=9), line(DEC, 2.008, "scattered", slot=3, room=9)]
    chunks = []
    steps = _script().cycle_steps(lines, {9}, chunks)
    assert {k: round(v[0], 3) for k, v in steps.items() if v} == {"ask trip": 1.0, "post + write": 6.0,
                                                                  "landed trip": 1.0, "scatter": 1.0,
                                                                  "gather slot": 6.0}
    assert chunks[0]["with_request"] and chunks[0]["grant_out"] is None


def test_the_split_timers_are_exclusive_and_count_only_inside_a_landing_on_the_loop(tmp_path, capsys):
    import threading
    import time

    spec = importlib.util.spec_from_file_location("decode_split", SCRIPT.parent / "decode_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    s = mod._Split()
    inner = s.timed("inner", lambda: time.sleep(0.002))
    outer = s.timed("outer", lambda: (time.sleep(0.003), inner()))
    outer()  # no landing being fed: nothing counted
    s.owner, s.cur = threading.get_ident(), {"parts": {}}
    s.stack = [["turn", time.perf_counter(), 0.0]]
    outer()
    parts = s.cur["parts"]
    assert set(parts) == {"inner", "outer"} and 0.002 <= parts["inner"] < 0.05 and 0.003 <= parts["outer"] < 0.05
    assert s.stack[0][2] >= parts["inner"] + parts["outer"]  # the turn's inner time: both, once
    rec = {"room": 7, "chunk": 0, "cp": 0, "now": 1.0, "entries": 48, "parts": {"turn": 0.0001, **parts},
           "turn": 0.0051, "recv": 0.001, "frames": 2, "decode_L": 0.0002, "next": 0.006, "after": 0.0009,
           "between_recv": 0.0008}
    ask = {"kind": "ask", "room": 7, "chunk": 1, "now": 0.9, "entries": 48, "turn": 0.0004}  # wire 16: its list's check
    (tmp_path / "decode-1.json").write_text(__import__("json").dumps([ask, rec, {**rec, "room": 8}]))
    assert len(_script().split_table(tmp_path, {7})) == 1
    out = capsys.readouterr().out
    assert "1 landings" in out and "L now -> next event" in out and "  recv" in out
    assert "SlotRequest turn (the scatter list checked there): 1 requests, entries p50 48, p50 0.400 ms" in out


def test_a_landed_out_fed_by_a_writes_completion_names_the_write(caplog):
    from kvbridge.transfer.prefill.events import WriteFinal

    landed = wire.ChunkLanded(room=7, cp_rank=1, chunk=3, slot=2, status="ok", reason="")
    given_back = wire.ChunkLanded(room=7, cp_rank=1, chunk=5, slot=0, status="failed", reason="x")
    with caplog.at_level(logging.INFO, logger="kvbridge.transfer.staging.cycle"):
        # the write's completion lands chunk 3; a slot granted ahead to chunk 5 is given back in the same feed
        trace_cycle(PRE, WriteFinal(41, None, 2.5), [Send(("ep",), landed), Send(("ep",), given_back)])
        trace_cycle(PRE, Message("ep", wire.SlotGrant(room=7, decode_rank=DEC, chunk=4, slot=1), 2.6),
                    [Send(("ep",), landed)])  # a "failed" answer to a grant: no write, no handle
    assert [r.getMessage() for r in caplog.records] == [
        f"trace room=7 rank={PRE} @2.500000 cycle landed-out chunk=3 slot=2 cp=1 write=41",
        f"trace room=7 rank={PRE} @2.500000 cycle landed-out chunk=5 slot=0 cp=1",
        f"trace room=7 rank={PRE} @2.600000 cycle grant-in chunk=4 slot=1 cp=-1",
        f"trace room=7 rank={PRE} @2.600000 cycle landed-out chunk=3 slot=2 cp=1"]


def test_prefills_post_and_write_split_by_the_chunks_write_in_each_process():
    """Handles are per process: the same write number in two prefill logs is two writes."""
    def log(cp: int, off: float) -> list[str]:
        rank = f"p/dp0/cp{cp}/tp0/pp0"
        return [f"x trace room=7 rank={rank} @{1.000 + off:.6f} cycle grant-in chunk=3 slot=2 cp=-1",
                f"x trace engine=ipc write=5 batch=0 -> s slices=1 bytes=9 @{1.0002 + off:.6f}",
                f"x trace room=7 rank={rank} +1.00ms @{1.0003 + off:.6f} -> d chunk 0 at 0x10 slices=1 bytes=9 write=5",
                f"x trace engine=ipc write=5 batch=0 done +1.00ms @{1.0022 + off:.6f}",
                f"x trace room=7 rank={rank} @{1.0025 + off:.6f} cycle landed-out chunk=3 slot=2 cp={cp} write=5",
                f"x trace room=8 rank={rank} @{1.0030 + off:.6f} cycle landed-out chunk=3 slot=2 cp={cp} write=6"]

    steps = _script().post_split({"prefill-cp0.log": log(0, 0.0), "prefill-cp1.log": log(1, 0.5)}, {7, 8})
    got = {k: [round(x, 3) for x in v] for k, v in steps.items()}
    assert got == {"grant -> submitted": [0.3, 0.3], "grant -> engine post": [0.2, 0.2],
                   "engine post -> done": [2.0, 2.0], "done -> landed out": [0.3, 0.3]}  # room 8's write: no lines


def test_each_staged_rooms_steps_run_from_decodes_request():
    lines = [f"x trace room=7 rank={DEC} +0.00ms @2.000000 requested from (cp, tp, pp) ranks [(0, 0, 0), (1, 0, 0)]",
             f"x trace room=7 rank={PRE} @2.000400 request from {DEC} pages=4",
             f"x trace room=7 rank={PRE} @2.001000 cycle ask-out chunk=0 slot=-1 cp=1",
             f"x trace room=7 rank={PRE} @2.001500 cycle ask-out chunk=1 slot=-1 cp=1",
             f"x trace room=7 rank={DEC} @2.004000 cycle landed-in chunk=0 slot=1 cp=1",
             f"x trace room=7 rank={DEC} @2.005000 cycle landed-in chunk=1 slot=2 cp=1",
             f"x trace room=7 rank={DEC} @2.006000 cycle scattered chunk=-1 slot=2 cp=-1",
             f"x trace room=7 rank={DEC} +7.00ms @2.007000 committed pages_by_rank={{1: 4}} aux_owner=cp1",
             f"x trace room=9 rank={DEC} +0.00ms @3.000000 requested from (cp, tp, pp) ranks [(0, 0, 0)]"]
    steps = _script().room_steps(lines, {7})
    assert {k: [round(x, 3) for x in v] for k, v in steps.items()} == {
        "request at prefill": [0.4], "first SlotRequest": [1.0], "last landing read": [5.0],
        "last scatter done": [6.0], "committed": [7.0]}


def _prefill_split():
    spec = importlib.util.spec_from_file_location("prefill_split", SCRIPT.parent / "prefill_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prefills_turns_are_split_into_exclusive_parts_counted_only_inside_a_turn_on_its_thread():
    """scripts/prefill_split.py's wrappers around fakes: a grant's feed and a staged write's
    completion are turns (room and wire chunk from the machine's books, the waits before them), a
    direct write's completion is marked, other messages are not turns; the parts are exclusive and sum
    to the turn; a timer on another thread, or outside a turn, counts nothing."""
    import threading
    import time
    from types import SimpleNamespace

    from kvbridge.transfer.prefill.events import Message as Msg, WriteFinal

    mod = _prefill_split()
    s = mod._Split()
    s.message, s.grant, s.write_final = Msg, wire.SlotGrant, WriteFinal
    s.loop = threading.get_ident()
    s.jobs = object()
    wire_t = s.timed("wire", lambda: time.sleep(0.002))
    submit = s.timed("submit", lambda: (time.sleep(0.003), wire_t()))
    reply = s.timed("reply", lambda: time.sleep(0.001))
    submit()  # no turn: nothing counted, nothing recorded
    assert s.records == [] and s.cur is None

    def feed(endpoint, event):
        if type(getattr(event, "msg", None)) is wire.SlotRequest:  # (not a turn; fed inside one: part of it)
            submit()
            return
        submit()
        other = threading.Thread(target=reply)  # another thread meanwhile: not this turn's
        other.start()
        other.join()
        wrapped(endpoint, Msg(b"x", wire.SlotRequest(room=7, cp_rank=1, chunk=3, num_bytes=9, scatter=b""), None, 0.0))  # nested

    wrapped = s.feed_wrapper(feed)
    staged = SimpleNamespace(room=7, first_chunk=10, posted={41: 2})
    by_write = {6: (SimpleNamespace(room=8), None)}  # write id -> (its room, its target)
    books = SimpleNamespace(writes=SimpleNamespace(handles={41: 5, 42: 6}, by_write=by_write),
                            stage=SimpleNamespace(writes={5: staged}))
    ep = SimpleNamespace(machine=books)
    s.recv = (time.perf_counter(), 3)
    wrapped(ep, Msg(b"x", wire.SlotGrant(room=7, decode_rank=DEC, chunk=12, slot=1), None, 1.0))
    wrapped(ep, Msg(b"x", wire.SlotRequest(room=7, cp_rank=1, chunk=3, num_bytes=9, scatter=b""), None, 1.1))  # not a turn
    s.final_at[41] = time.perf_counter()
    done = threading.Thread(target=wrapped, args=(ep, WriteFinal(41, None, 2.0)))  # collected on the engine's thread
    done.start()
    done.join()
    wrapped(ep, WriteFinal(42, None, 3.0))  # a direct write's completion, on the loop
    assert [(r["kind"], r["room"], r["chunk"], r["thread"], r["now"]) for r in s.records] == [
        ("grant", 7, 12, "loop", 1.0), ("final", 7, 12, "other", 2.0), ("final_direct", 8, -1, "loop", 3.0)]
    grant, final, direct = s.records
    assert grant["frames"] == 3 and grant["wait"] >= 0 and final["wait"] >= 0 and "wait" not in direct
    assert not s.final_at  # (taken by its turn)
    for r in s.records:
        assert set(r["parts"]) == {"submit", "wire", "turn"}  # the other thread's "reply" is in none
        assert r["parts"]["wire"] >= 0.002 and r["parts"]["submit"] >= 0.003  # exclusive: wire's sleep is not submit's
        assert abs(sum(r["parts"].values()) - r["turn"]) < 1e-9
        assert r["turn"] >= r["parts"]["submit"] + r["parts"]["wire"]
    assert s.cur is None and s.stack == []


def test_request_post_and_the_tick_that_starts_a_staged_write_are_turns_and_idle_ticks_are_not_kept():
    """Round 28's kinds: decode's request and send()'s Post are turns; a Tick (or a Resolved) is one
    only where it gathered or posted a chunk (a staged write started there), named by its first
    Gather's room; the chunk's plan and staged plan are parts of it."""
    import threading
    import time
    from types import SimpleNamespace

    from kvbridge.transfer.actions import Tick
    from kvbridge.transfer.prefill.events import Message as Msg, Post, Resolved, WriteFinal

    mod = _prefill_split()
    s = mod._Split()
    request = SimpleNamespace(room=9)  # (a stand-in for decode's TransferRequest: only its type and room are read)
    s.message, s.grant, s.request, s.write_final, s.post = Msg, wire.SlotGrant, SimpleNamespace, WriteFinal, Post
    s.quiet = {Tick: "tick", Resolved: "resolved"}
    s.loop = threading.get_ident()
    plan = s.timed("plan_chunk", lambda: time.sleep(0.001))
    stage = s.timed("stage_plan", lambda: time.sleep(0.001))
    gather = s.note_gather(lambda endpoint, a: None)

    def feed(endpoint, event):
        if type(event) is Tick and event.now == 2.0:  # the tick that starts room 9's staged write
            plan()
            stage()
            gather(endpoint, SimpleNamespace(room=9))

    wrapped = s.feed_wrapper(feed)
    wrapped(None, Msg(b"x", request, None, 0.5))
    wrapped(None, Post(SimpleNamespace(room=9), 1.0))
    wrapped(None, Tick(1.5))  # an idle tick: not kept
    wrapped(None, Tick(2.0))
    assert [(r["kind"], r["room"], r["now"], r["gathers"]) for r in s.records] == [
        ("request", 9, 0.5, 0), ("post", 9, 1.0, 0), ("tick", 9, 2.0, 1)]
    tick = s.records[-1]
    assert tick["parts"]["plan_chunk"] >= 0.001 and tick["parts"]["stage_plan"] >= 0.001
    assert abs(sum(tick["parts"].values()) - tick["turn"]) < 1e-9


def test_install_wraps_a_prefill_rank_and_writes_its_turns_at_exit(tmp_path):
    """install() in a fresh interpreter wraps the prefill rank's functions; a turn recorded there is
    written at exit to prefill-<pid>.json."""
    import os
    import subprocess
    import sys

    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("prefill_split", {str(SCRIPT.parent / "prefill_split.py")!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
from kvbridge.transfer.prefill.endpoint import PrefillEndpoint as E
mod.install()
from kvbridge.layout.staging import StagedPlan
from kvbridge.transfer.prefill import machine, staged, writes
for fn in (E._feed_event, E._reply, E._post_chunk, E._gather, StagedPlan.wire, machine.PrefillRooms.feed,
           writes.plan_chunk, writes.plan_target, staged.stage_plan):
    assert hasattr(fn, "__wrapped__"), fn
mod.SPLIT.turn({{"kind": "grant", "room": 7, "chunk": 0, "now": 1.0}}, lambda: None)
"""
    env = {**os.environ, "KVBRIDGE_SPLIT_DIR": str(tmp_path), "PYTHONPATH": str(SCRIPT.parents[1])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (dump,) = tmp_path.glob("prefill-*.json")
    assert [r["kind"] for r in __import__("json").loads(dump.read_text())] == ["grant"]


def test_the_prefill_table_shows_each_kind_of_turn_of_the_rooms_asked(tmp_path, capsys):
    def rec(kind, room, thread="loop", **extra):
        return {"kind": kind, "room": room, "chunk": 0, "now": 1.0, "thread": thread, "gathers": 0, "turn": 0.0005,
                "parts": {"turn": 0.0001, "machine": 0.0002, "submit": 0.0002}, **extra}

    recs = [rec("grant", 7, wait=0.0001, frames=2), rec("final", 7, "other", wait=0.0002), rec("final_direct", 7),
            rec("grant", 8, wait=0.0001, frames=2)]
    (tmp_path / "prefill-1.json").write_text(__import__("json").dumps(recs))
    (tmp_path / "decode-1.json").write_text("[]")  # decode's records: not read here
    got = _script().prefill_table(tmp_path, {7})
    assert [(r["kind"], r["room"]) for r in got] == [("grant", 7), ("final", 7), ("final_direct", 7)]
    out = capsys.readouterr().out
    assert "grant 1 (loop 1" in out and "final 1 (other 1" in out and "final_direct 1 (loop 1" in out
    assert "machine" in out and "wait before the feed" in out and "frames per recv" in out
    assert _script().prefill_table(tmp_path, {9}) == [] and "no turn recorded" in capsys.readouterr().out
