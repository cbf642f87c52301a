"""Prefill's liveness under load, no I/O: a decode connection that sent nothing for
``peer_timeout`` fails its targets, but a prefill loop that itself did not run for half of that
(a starved process on a loaded host) blames no peer for the gap: what arrived meanwhile is read
first, and the silence counts again from then."""

from __future__ import annotations

from kvbridge.transfer.actions import Tick
from kvbridge.transfer.poll import KVPoll
from test_prefill_room import D, m, request  # noqa: F401  (m: the fixture)


def opened_and_asked(machine, room: int, now: float):
    r = machine.open(room, now)
    machine.engine_init(r, 7, None, now)
    machine.message(D, request(room, 7, deadline_ms=600_000), now)  # decode waits long: only silence fails it
    assert r.state.state == KVPoll.WaitingForInput
    return r


def ticks(machine, start: float, stop: float, step: float) -> None:
    t = start
    while t <= stop:
        machine.feed(Tick(t))
        t += step


def test_a_silent_decode_fails_its_target_after_peer_timeout(m):  # noqa: F811
    r = opened_and_asked(m, 31, now=1.0)
    ticks(m, 1.0, 5.9, 0.5)
    assert not r.state.final
    ticks(m, 6.5, 7.0, 0.5)  # silent 5.5 s > peer_timeout 5 s
    t = next(iter(r.targets.values()))
    assert t.failure is not None and "sent nothing" in t.failure


def test_a_frozen_prefill_loop_blames_no_peer_for_its_own_gap(m):  # noqa: F811
    r = opened_and_asked(m, 32, now=1.0)
    m.feed(Tick(1.0))
    m.feed(Tick(9.0))  # the loop did not run for 8 s: the decode's pings wait unread in the socket
    t = next(iter(r.targets.values()))
    assert t.failure is None and r.state.state != KVPoll.Failed
    ticks(m, 9.5, 13.5, 0.5)  # silent again, counted from 9.0: not yet
    assert t.failure is None
    ticks(m, 14.5, 15.0, 0.5)  # 5.5 s of real silence
    assert t.failure is not None and "sent nothing" in t.failure


def test_a_frozen_prefill_loop_does_not_fail_a_room_nobody_could_ask_for_meanwhile(m):  # noqa: F811
    """target_timeout (60 s here) counts again from the end of the loop's own gap: a CI run failed a
    room "no decode ranks asked for room 1 within 2.0s" after both endpoints' loops in one process
    had not run for 3.6 s, before decode's request could be sent."""
    r = m.open(41, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.feed(Tick(1.0))
    m.feed(Tick(50.0))  # the loop did not run for 49 s
    ticks(m, 50.5, 109.5, 0.5)  # 108.5 s after the room opened, 59.5 s after the gap
    assert r.state.state == KVPoll.Bootstrapping
    ticks(m, 110.5, 111.0, 0.5)
    assert r.state.state == KVPoll.Failed and "no decode ranks asked for room 41 within 60.0s" in r.state.reason

