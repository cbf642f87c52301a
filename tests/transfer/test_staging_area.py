"""The staging area's slot table: every allowed transition, the refusal of every other one,
FIFO back-pressure and quarantine (hard rule 6 for staging slots)."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.errors import ConfigError, TransferError
from kvbridge.transfer.staging.area import EVENTS, TRANSITIONS, Grant, SlotState, StagingArea, StagingSlotError

S = SlotState


def area_in(state: SlotState) -> StagingArea:
    """A one-slot area whose slot 0 is in ``state`` (room 7, chunk 0), reached by legal events."""
    area = StagingArea(1, 64, rank="d0")
    if state is S.FREE:
        return area
    assert area.acquire(7, 0) == Grant(7, 0, 0)
    if state is S.QUARANTINED:
        area.quarantine(0, free_at=10.0)
    elif state in (S.LANDED, S.SCATTERING, S.SCATTERED):
        area.landed(0, 7, 0)
        if state is not S.LANDED:
            area.scatter(0)
        if state is S.SCATTERED:
            area.scattered(0)
    assert area.state(0) is state
    return area


def event(area: StagingArea, name: str) -> None:
    {
        "acquire": lambda: area._move(0, "acquire"),
        "landed": lambda: area.landed(0, 7, 0),
        "scatter": lambda: area.scatter(0),
        "scattered": lambda: area.scattered(0),
        "release": lambda: area.release(0),
        "quarantine": lambda: area.quarantine(0, 1.0),
        "acknowledged": lambda: area.acknowledged(0),
        "unused": lambda: area.unused(0),
        # expire() sweeps the area; in other states the move itself is what is refused
        "expire": lambda: area.expire(100.0) if area.state(0) is S.QUARANTINED else area._move(0, "expire"),
    }[name]()


def test_the_table_is_the_documented_cycle() -> None:
    assert TRANSITIONS == {
        S.FREE: {"acquire": S.ASSIGNED},
        S.ASSIGNED: {"landed": S.LANDED, "quarantine": S.QUARANTINED, "unused": S.FREE},
        S.LANDED: {"scatter": S.SCATTERING, "release": S.FREE},
        S.SCATTERING: {"scattered": S.SCATTERED},
        S.SCATTERED: {"release": S.FREE},
        S.QUARANTINED: {"acknowledged": S.FREE, "expire": S.FREE},
    }
    assert {e for moves in TRANSITIONS.values() for e in moves} == set(EVENTS)


@pytest.mark.parametrize(("state", "name"), list(itertools.product(list(SlotState), EVENTS)),
                         ids=lambda v: v.name if isinstance(v, SlotState) else v)
def test_every_event_in_every_state(state: SlotState, name: str) -> None:
    area = area_in(state)
    if name in TRANSITIONS[state]:
        event(area, name)
        assert area.state(0) is TRANSITIONS[state][name]
        if area.state(0) is S.FREE:
            assert area.owner(0) == (None, None) and area.num_free == 1
    else:
        with pytest.raises(StagingSlotError, match=f"slot 0: {name} not allowed in state {state.name}") as err:
            event(area, name)
        assert isinstance(err.value, TransferError) and err.value.rank == "d0" and err.value.field == "slot"
        assert area.state(0) is state  # refused: nothing changed


def test_a_quarantined_slot_is_never_released_by_a_plain_release() -> None:
    # hard rule 6: QUARANTINED -> FREE only by acknowledgement or expiry
    area = area_in(S.QUARANTINED)
    with pytest.raises(StagingSlotError, match="release not allowed in state QUARANTINED"):
        area.release(0)
    assert area.expire(9.0) == [] and area.state(0) is S.QUARANTINED
    area.acknowledged(0)
    assert area.state(0) is S.FREE


def test_landed_names_the_wrong_chunk() -> None:
    area = area_in(S.ASSIGNED)
    with pytest.raises(StagingSlotError, match="slot 0 holds room 7 chunk 0, not chunk 3") as err:
        area.landed(0, 7, 3)
    assert err.value.room == 7
    with pytest.raises(StagingSlotError, match="slot 5 outside the area's 1 slots"):
        area.scattered(5)


def test_back_pressure_is_fifo_and_never_grows() -> None:
    area = StagingArea(2, 1024)
    assert area.acquire(1, 0).slot == 0 and area.acquire(1, 1).slot == 1
    assert area.acquire(2, 0) is None and area.acquire(3, 0) is None and area.acquire(2, 1) is None
    assert area.num_waiting == 3 and area.counters["waits"] == 3 and area.counters["max_waiting"] == 3
    with pytest.raises(StagingSlotError, match="chunk 0 already holds or awaits"):
        area.acquire(2, 0)
    area.landed(1, 1, 1)
    area.scatter(1)
    area.scattered(1)
    assert area.release(1) == [Grant(2, 0, 1, waited=True)]  # the oldest waiter, on the slot just freed
    area.landed(0, 1, 0)
    assert area.release(0) == [Grant(3, 0, 0, waited=True)]  # LANDED -> FREE (a failed room's chunk)
    assert area.num_free == 0 and area.num_waiting == 1
    assert area.acquire(4, 0) is None  # a newcomer never jumps the queue
    assert area.num_slots == 2 and area.nbytes == 2048 and area.offset(1) == 1024


def test_a_failed_room_quarantines_what_may_still_land_and_frees_the_rest() -> None:
    area = StagingArea(4, 64)
    for chunk in range(4):
        area.acquire(9, chunk)
    area.acquire(5, 0)  # waits
    area.acquire(9, 4)  # waits too; leaves the queue with its room
    area.landed(1, 9, 1)
    area.landed(2, 9, 2)
    area.scatter(2)
    area.scattered(2)
    grants = area.fail_room(9, free_at=100.0)
    assert grants == [Grant(5, 0, 1, waited=True)]  # the LANDED slot went to the next room at once
    assert area.num_waiting == 0 and area.num_free == 1  # SCATTERED slot 2 freed, nobody waiting
    assert [area.state(i) for i in (0, 3)] == [S.QUARANTINED, S.QUARANTINED]
    assert area.acquire(6, 0).slot == 2
    assert area.acquire(6, 1) is None
    assert area.expire(99.9) == []  # the lease plus quarantine has not passed: still quarantined
    assert area.expire(100.0) == [Grant(6, 1, 0, waited=True)]
    assert area.state(3) is S.FREE and area.counters["expired"] == 2 and area.counters["quarantined"] == 2


def test_an_acknowledged_abort_frees_its_quarantined_slots() -> None:
    area = StagingArea(2, 64)
    area.acquire(1, 0)
    area.acquire(1, 1)
    assert area.acquire(2, 0) is None
    area.fail_room(1, free_at=1e9)
    assert area.room_acknowledged(1) == [Grant(2, 0, 0, waited=True)]
    assert area.state(1) is S.FREE and area.counters["acknowledged"] == 2


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="num_slots must be a positive integer"):
        StagingArea(0, 64)
    with pytest.raises(ConfigError, match="slot_bytes"):
        StagingArea(1, 0)


def test_reserved_slots_are_granted_with_a_request_and_never_to_a_waiter() -> None:
    """The area's last ``reserved`` slots: ``reserve`` takes one or returns None (nothing queues), a
    chunk that asks never gets one, and one that turns FREE goes back to the reserved ones even
    with chunks waiting; ``unused`` frees one that nothing wrote."""
    area = StagingArea(3, 64, rank="d0", reserved=2)
    assert area.num_free == 1 and area.num_free_reserved == 2
    assert area.reserve(1, 0) == Grant(1, 0, 1) and area.reserve(2, 0) == Grant(2, 0, 2)
    assert area.reserve(3, 0) is None and area.counters["reserve_refused"] == 1
    assert area.acquire(4, 0) == Grant(4, 0, 0)
    assert area.acquire(5, 0) is None  # the reserved slots are not the asks': it waits
    with pytest.raises(StagingSlotError, match="chunk 0 already holds or awaits"):
        area.reserve(5, 0)
    with pytest.raises(StagingSlotError, match="chunk 0 already holds or awaits"):
        area.reserve(1, 0)
    # slot 1 lands and is scattered: back to the reserved ones, not to room 5, which waits on
    area.landed(1, 1, 0)
    area.scatter(1)
    area.scattered(1)
    assert area.release(1) == [] and area.num_free_reserved == 1 and area.num_waiting == 1
    # slot 2 was never written: its room committed
    assert area.unused(2) == [] and area.num_free_reserved == 2 and area.counters["unused"] == 1
    assert area.owner(2) == (None, None)
    # slot 0, an asked one, goes to the waiter
    area.landed(0, 4, 0)
    assert area.release(0) == [Grant(5, 0, 0, waited=True)]
    # a reserved slot of a failed room is quarantined like any other
    assert area.reserve(6, 0) == Grant(6, 0, 1)
    assert area.fail_room(6, free_at=5.0) == [] and area.state(1) is S.QUARANTINED
    assert area.expire(6.0) == [] and area.num_free_reserved == 2


@pytest.mark.parametrize("reserved", [-1, 3, 1.5, True])
def test_reserved_slots_leave_one_for_asks(reserved) -> None:
    with pytest.raises(ConfigError, match="staging reserved slots must be an integer from 0 to 2"):
        StagingArea(3, 64, rank="d0", reserved=reserved)
