"""Room states: the transition table is enforced, Failed keeps the first reason."""

from __future__ import annotations

import pytest

from kvbridge.transfer.poll import IllegalTransition, KVPoll, RoomState


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
