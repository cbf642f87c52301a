"""Engine results as events: the machine never sees a second event while the first one's
actions are being carried out, whatever order the engine's results come in.

- The prefill machine, driven by hand: two writes of one room, each of which may complete,
  fail at completion or be refused at submission (an engine failure during a post), and an
  abort from decode, in every order the events can come in. What the machine promises holds
  in each: one final report per target, none before the room is quiet, one ReleaseAux.
- Real endpoints over the local engine: a write refused inside ``submit_write`` and one whose
  completion callback fires inside ``submit_write`` (as a failing Mooncake batch's does), with
  the machine watched: no machine event is fed from inside ``submit_write`` or while another
  event's actions are still being carried out (the recursion the shell used to have, where a
  refused post fed ``post_failed`` from inside the loop over ``post``'s actions).
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from _cluster import wait_final
from kvbridge.errors import EngineError
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import TransferEngine, WriteState, WriteStatus
from kvbridge.transfer.engine.registry import entry_of
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.events import PostWrite, ReleaseAux
from kvbridge.transfer.prefill.machine import PrefillRooms
from kvbridge.transfer.shell import EndpointShell
from _machines import prefill_machine
from test_prefill_room import AUX, AUXF, D, HELLO, SPECS, _packed, bufs, peer, request

DONE = WriteStatus(WriteState.DONE)
FAILED = WriteStatus(WriteState.FAILED, "injected: queue full")
OUTCOMES = ("done", "failed", "refused")  # a write completes, fails at completion, or is refused at submission


def _machine() -> PrefillRooms:
    m = prefill_machine(PrefillConfig(instance="p", peer_timeout=5.0, target_timeout=60.0), SPECS, bufs(0), AUX, "x",
                     hello_of=lambda ident: HELLO.get(ident))
    m.peers.entries["r1"] = peer()
    m.admission.prove(D, "r1")
    return m


def _orders():
    """Every (outcome of write 0, outcome of write 1, order of the three events): the two
    writes' results and decode's abort, or no abort."""
    for a, b in itertools.product(OUTCOMES, OUTCOMES):
        for abort in (False, True):
            events = ["w0", "w1"] + (["abort"] if abort else [])
            for order in itertools.permutations(events):
                yield a, b, order


@pytest.mark.parametrize("outcome0,outcome1,order", list(_orders()))
def test_every_order_of_write_results_and_abort_ends_in_one_report_once_quiet(outcome0, outcome1, order):
    m = _machine()
    room = 40
    r = m.open(room, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.message(D, request(room, 7), 1.0)
    m.chunk(r, [0], np.array([5]), 4, False, None, None)
    m.chunk(r, [1], np.array([6]), None, True, _packed(room), None)
    actions = list(m.post(r, 1.1, AUXF))
    writes = [a for a in actions if isinstance(a, PostWrite)]
    assert len(writes) == 2
    outcome = {"w0": outcome0, "w1": outcome1}
    handles = {}
    sent: list = []
    in_flight = {"w0", "w1"}
    # the shell books what was submitted (a refused write is never booked)
    for name, w in zip(("w0", "w1"), writes):
        if outcome[name] != "refused":
            handles[name] = 100 + len(handles)
            sent += list(m.posted(w, handles[name], 1.2))
    now = 1.3
    for event in order:
        if event == "abort":
            out = m.message(D, wire.Abort(room=room, decode_rank="d/dp0/tp0", reason="decode gave up",
                                          decode_rank_id="r1"), now)
        elif outcome[event] == "refused":
            out = m.post_failed(writes[int(event[1])], "injected: engine refused the batch", now)
            in_flight.discard(event)
        else:
            out = m.write_final(handles[event], DONE if outcome[event] == "done" else FAILED, now)
            in_flight.discard(event)
        out = list(out)
        finals = [a.msg for a in out if isinstance(a, Send) and (
            isinstance(a.msg, wire.AbortAck) or (isinstance(a.msg, wire.PagesDone) and a.msg.status == "failed"))]
        assert not (finals and in_flight), f"{event}: a final report left while {sorted(in_flight)} in flight"
        sent += out
        now += 0.1
    reports = [a.msg for a in sent if isinstance(a, Send)]
    failed = [x for x in reports if isinstance(x, wire.PagesDone) and x.status == "failed"]
    acks = [x for x in reports if isinstance(x, wire.AbortAck)]
    oks = [x for x in reports if isinstance(x, wire.PagesDone) and x.status == "ok"]
    # one final report per target, and every abort answered once (at once when the target had ended)
    assert len(failed) <= 1 and len(acks) == ("abort" in order), reports
    assert len([a for a in sent if isinstance(a, ReleaseAux)]) == 1
    assert r.state.final
    bad = outcome0 != "done" or outcome1 != "done"
    aborted_first = "abort" in order and order.index("abort") < 2
    if not bad and "abort" not in order:
        assert r.state.state == KVPoll.Success and len(oks) == 2 and not failed and not acks
    elif bad or aborted_first:
        assert r.state.state == KVPoll.Failed and len(failed) + len(acks) >= 1
    if aborted_first and order.index("abort") == 0:
        assert not failed  # aborted before anything failed: the abort's ack is the target's report
    if bad and "abort" not in order:
        assert failed and "injected" in failed[0].reason and "injected" in r.state.reason


class _Injecting(TransferEngine):
    """The endpoint's engine with two faults: a write refused inside ``submit_write`` (raises),
    and one whose completion callback fires inside ``submit_write`` (final at once, failed).
    ``inside``: this thread is in ``submit_write`` now."""

    def __init__(self, inner: TransferEngine, plan: list[str]) -> None:
        self.inner, self.plan = inner, list(plan)
        self.max_slices_per_call = inner.max_slices_per_call
        self.direct_only = inner.direct_only
        self.local = threading.local()
        self.notify = None
        self.failed: set[int] = set()
        self.next_failed = -1

    @property
    def inside(self) -> bool:
        return getattr(self.local, "inside", False)

    @property
    def transport(self) -> str:
        return self.inner.transport

    def route(self, session: str) -> str:  # the registry name of the engine underneath (staging thresholds)
        return entry_of(self.inner).name

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, ptr, nbytes):
        self.inner.register(ptr, nbytes)

    def unregister(self, ptr):
        self.inner.unregister(ptr)

    def submit_write(self, session, src, dst, length, *, after=None):
        self.local.inside = True
        try:
            fault = self.plan.pop(0) if self.plan else "pass"
            if fault == "refuse":
                raise EngineError("injected: engine refused the batch")
            if fault == "fail":
                handle, self.next_failed = self.next_failed, self.next_failed - 1
                self.failed.add(handle)
                if self.notify is not None:
                    self.notify()  # final at once: the callback fires on this thread, inside submit_write
                return handle
            return self.inner.submit_write(session, src, dst, length, after=after)
        finally:
            self.local.inside = False

    def poll(self, handle):
        if handle in self.failed:
            return WriteStatus.failed("injected: batch failed")
        return self.inner.poll(handle)

    def wait(self, handle, timeout):
        self.inner.wait(handle, timeout)

    def probe_write(self, session, src, dst, length, timeout=5.0):
        self.inner.probe_write(session, src, dst, length, timeout)

    def set_notify(self, callback):
        self.notify = callback
        self.inner.set_notify(callback)

    def take_final(self):
        final = self.inner.take_final()
        return None if final is None else [*final, *sorted(self.failed)]

    def close(self):
        self.inner.close()


class _Watched:
    """The endpoint's machine, watched at its door: every ``feed`` hands its actions out through an
    iterator that marks them as being carried out; an event fed meanwhile, or from inside the
    engine's ``submit_write``, is recorded."""

    def __init__(self, machine, engine: _Injecting) -> None:
        self._machine, self._engine = machine, engine
        self.carrying = 0
        self.violations: list[str] = []
        self.calls = 0

    def __getattr__(self, name):
        value = getattr(self._machine, name)
        if name != "feed":  # the machine's one door; the rest are read-only queries
            return value

        def call(*args, **kw):
            if self.carrying:
                self.violations.append(f"{name} fed while another event's actions were carried out")
            if self._engine.inside:
                self.violations.append(f"{name} fed from inside submit_write")
            self.calls += 1
            out = value(*args, **kw)
            return self._tracked(out) if isinstance(out, (list, tuple)) else out

        return call

    def _tracked(self, actions):
        self.carrying += 1
        try:
            yield from actions
        finally:
            self.carrying -= 1


@pytest.mark.parametrize("staging", ["never", "always"])
def test_the_shell_never_feeds_the_machine_from_inside_a_post(cluster, staging):
    c = cluster(cp=1, prefill_cfg={"staging": staging}, staging=staging)
    ep = c.prefill[0]
    engine = _Injecting(ep.engine, ["refuse", "fail"])
    with ep._lock:
        ep.engine = engine
        engine.set_notify(ep._wake)
        watched = ep.machine = _Watched(ep.machine, engine)
    pages = {room: np.arange(2) + 4 * i for i, room in enumerate((61, 62, 63))}
    recv = {room: c.decode.receiver(room, f"{c.name}-p") for room in pages}
    for room, p in pages.items():
        recv[room].init(p, room - 61, 8)
    senders = {}
    for room in pages:  # one after the other: every room's source pages are the same local pages
        senders[room] = c.send(room, 8)[0]
        wait_final([senders[room], recv[room]])
    failed = [room for room, s in senders.items() if s.poll() == KVPoll.Failed]
    assert len(failed) == 2, [(s.poll(), s.failure_reason) for s in senders.values()]
    assert all("injected" in senders[room].failure_reason for room in failed)
    (ok,) = set(pages) - set(failed)
    assert senders[ok].poll() == KVPoll.Success and recv[ok].poll() == KVPoll.Success
    assert c.verified(ok, 8, pages[ok])
    assert all(recv[room].poll() == KVPoll.Failed for room in failed)
    assert watched.calls and watched.violations == []


class _Echo:
    """A machine that answers every event but a queued one with one action (carried out by
    ``_Shell._carry``, which queues a ``"result"`` event, as a posted write does)."""

    def __init__(self) -> None:
        self.seen: list = []

    def feed(self, event):
        self.seen.append(event)
        return () if event == "result" else ("act",)


class _Shell(EndpointShell):
    config = PrefillConfig(instance="p")

    def __init__(self) -> None:
        super().__init__()
        self.machine = _Echo()
        self.wakes = 0

    def _carry(self, action) -> None:
        self._queue("result")

    def _wake(self) -> None:
        self.wakes += 1


class _Room:
    def __init__(self, final: bool) -> None:
        self.state = type("S", (), {"final": final})()


def test_an_event_queued_by_the_feed_in_progress_is_fed_by_it_without_waking_the_loop():
    """A result queued by an action (a write posted) is fed before the feed returns: no wake;
    one queued from another thread (an engine's, a pool's) wakes the loop; closing a finished
    room leaves the loop nothing to do, closing an unfinished one wakes it."""
    shell = _Shell()
    with shell._lock:
        shell._feed_event("init")
    assert shell.machine.seen == ["init", "result"] and shell.wakes == 0 and not shell._events
    other = threading.Thread(target=shell._queue, args=("late",))
    other.start()
    other.join()
    assert shell.wakes == 1 and list(shell._events) == ["late"]
    shell._events.clear()
    shell.close_room(_Room(final=True))
    assert shell.wakes == 1 and shell.machine.seen[-1] == "result"
    shell.close_room(_Room(final=False))
    assert shell.wakes == 2
