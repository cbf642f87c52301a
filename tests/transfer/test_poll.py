"""Room states: the transition table is enforced, Failed keeps the first reason; a handle's poll
reads a state short of final without the endpoint's lock."""

from __future__ import annotations

import threading

import pytest

from kvbridge.transfer.poll import IllegalTransition, KVPoll, RoomState
from kvbridge.transfer.rooms import RoomHandle


def test_values_match_the_pd_connectors_engines_know():
    assert [s.value for s in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput,
                              KVPoll.Transferring, KVPoll.Success)] == [0, 1, 2, 3, 4]


def test_forward_path_and_durations():
    st = RoomState()
    st.advance_to(KVPoll.Success)
    assert st.state == KVPoll.Success and st.final
    assert set(st.durations()) == {"Bootstrapping", "WaitingForInput", "Transferring"}


def test_illegal_transitions_are_refused():
    st = RoomState()
    with pytest.raises(IllegalTransition, match="Bootstrapping -> Success"):
        st.to(KVPoll.Success)
    st.to(KVPoll.Failed, "first reason")
    assert not st.to(KVPoll.Failed, "second reason") and st.reason == "first reason"
    with pytest.raises(IllegalTransition):
        st.to(KVPoll.Transferring)


def test_success_never_turns_into_failure():
    st = RoomState()
    st.advance_to(KVPoll.Success)
    assert not st.to(KVPoll.Failed, "late abort") and st.state == KVPoll.Success


class _Endpoint:
    """What a RoomHandle needs of an endpoint: its lock (``locked``), ``release``, ``close_room``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def locked(self, fn):
        with self.lock:
            return fn()

    def release(self, room) -> None:
        pass

    def close_room(self, room) -> None:
        pass


class _Room:
    def __init__(self) -> None:
        self.room = 7
        self.state = RoomState()


def _poll_in_thread(handle: RoomHandle) -> tuple[threading.Thread, list]:
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(handle.poll()), daemon=True)
    t.start()
    return t, seen


def test_a_poll_short_of_final_never_waits_for_the_loops_turn_and_a_final_one_does():
    """An engine's scheduler polls each request every step: a state short of final is read without the
    endpoint's lock, so a poll does not wait while the loop holds it. A final state waits for the turn
    that made it final to end, so what the engine does on Success finds the turn's work done."""
    ep, room = _Endpoint(), _Room()
    handle = RoomHandle(ep, room)
    with ep.lock:  # the loop's turn
        room.state.advance_to(KVPoll.Transferring)
        t, seen = _poll_in_thread(handle)
        t.join(10.0)
        assert seen == [KVPoll.Transferring]  # answered while the lock was held
        room.state.advance_to(KVPoll.Success)
        t, seen = _poll_in_thread(handle)
        t.join(0.2)
        assert t.is_alive() and seen == []  # Success is not answered mid-turn
    t.join(10.0)
    assert seen == [KVPoll.Success]
    handle.close()


def test_a_failed_state_has_its_reason_before_any_poll_can_see_it():
    """The reason is set before the state, so a lock-free reader that sees Failed finds its reason."""
    order = []

    class Spy(RoomState):
        __slots__ = ()

        def __setattr__(self, name, value):
            order.append(name)
            super().__setattr__(name, value)

    st = Spy()
    order.clear()
    st.to(KVPoll.Failed, "peer gone")
    assert order.index("reason") < order.index("state") and st.reason == "peer gone"
