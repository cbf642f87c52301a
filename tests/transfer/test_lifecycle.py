"""A room's lifecycle on both sides (issue 8 bugs 1, 2, 6): handles hold their room,
close()/with/dropping end it, an open or draining id is refused with RoomInUse,
closed rooms are forgotten once quiet and a late request for one is refused."""

from __future__ import annotations

import gc
import logging
import re
import threading
import time

import numpy as np
import pytest

from _cluster import wait_final, wait_until
from _local import ProvingPeers, replies, rogue_request
from kvbridge.errors import RoomInUse
from kvbridge.transfer.rooms import Stage, Tombstones
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.actions import Tick
from kvbridge.transfer.prefill.events import Gc


def test_a_reused_room_id_is_refused_until_the_old_room_is_closed(cluster):
    """Bug 1: sender(room) reattached to the finished room and reported its Success at once."""
    c = cluster(cp=1)
    ep = c.prefill[0]
    r = c.decode.receiver(30, f"{c.name}-p")
    r.init(np.array([0, 1]), 0, 8)
    senders = c.send(30, 8)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success and senders[0].poll() == KVPoll.Success
    with pytest.raises(RoomInUse, match=r"room 30 is open: a KVSender still holds it \(Success\)") as err:
        ep.sender(30)
    assert (err.value.room, err.value.field) == (30, "room") and ": None" not in str(err.value)  # bug 6
    with pytest.raises(RoomInUse, match="room 30 is open: a KVReceiver still holds it"):
        c.decode.receiver(30, f"{c.name}-p")
    r.close()
    senders[0].close()
    assert wait_until(lambda: 30 not in ep.machine.rooms and 30 not in c.decode.machine.rooms, 30)
    senders = c.send(30, 8)  # a fresh room (opened on prefill before decode asks, see the lifecycle doc) ...
    again = c.decode.receiver(30, f"{c.name}-p")
    again.init(np.array([2, 3]), 1, 8)
    wait_final([again, *senders])  # ... that really moves bytes again
    assert again.poll() == KVPoll.Success and c.verified(30, 8, np.array([2, 3]))


def test_a_draining_room_keeps_its_id_until_no_write_can_land(cluster):
    c = cluster(cp=1)
    ep = c.prefill[0]
    gate = threading.Event()
    ep.engine.faults.gate = gate  # writes stay in flight
    r = c.decode.receiver(31, f"{c.name}-p")
    r.init(np.array([4, 5]), 0, 8)
    (s,) = c.send(31, 8)
    assert wait_until(lambda: s.poll() == KVPoll.Transferring, 30)
    s.close()
    r.close()
    assert s.poll() == KVPoll.Transferring and "closed" in (r.failure_reason or "")  # failing, writes drain first
    with pytest.raises(RoomInUse, match=r"room 31 is draining: 1 write\(s\) of the previous room still in flight"):
        ep.sender(31)
    with pytest.raises(RoomInUse, match="room 31 is draining: a prefill rank may still write its pages"):
        c.decode.receiver(31, f"{c.name}-p")
    peers = ProvingPeers(c.decode)  # another decode rank asking now gets no new target on a closed room ...
    try:
        peers.send(ep.endpoint, rogue_request(c, 31, 8, rank_id=c.decode.rank_id))
        # ... and its refusal waits until no write of the room is in flight to anyone: a decode
        # instance's ranks free pages together, so a refusal must mean nothing can land (hard rule 6)
        assert replies(peers, 1, timeout=0.5) == []
        gate.set()
        (msg,) = replies(peers, 1)
        assert msg.status == "failed" and "room 31 is failing" in msg.reason
    finally:
        gate.set()
        peers.close()
    wait_final([s])
    assert s.poll() == KVPoll.Failed and "closed" in s.failure_reason
    assert wait_until(lambda: 31 not in ep.machine.rooms and 31 not in c.decode.machine.rooms, 30)
    ep.sender(31).close()  # the id is free again


def test_a_final_state_stays_readable_while_the_handle_lives(cluster, caplog):
    """Bug 2: a held handle read Failed / 'room unknown' / no aux row once the room was
    forgotten after the retention time."""
    c = cluster(cp=1)
    r = c.decode.receiver(32, f"{c.name}-p")
    r.init(np.array([6, 7]), 2, 8)
    senders = c.send(32, 8)
    wait_final([r, *senders])
    later = time.monotonic() + 3600  # an hour of housekeeping later
    with c.decode._lock:
        c.decode.machine.next_scan = 0.0
        c.decode._feed_event(Tick(later))
    with c.prefill[0]._lock:
        c.prefill[0]._feed_event(Gc(later))
    assert r.poll() == KVPoll.Success and r.failure_reason is None and r.aux.room == 32
    assert r.stats["state"] == "Success" and senders[0].poll() == KVPoll.Success
    # send() on the ended room queues nothing and says so (it was ignored silently), naming the room and
    # state; never an exception on the engine's thread (it may not have polled since the room ended)
    with caplog.at_level(logging.WARNING, logger="kvbridge.transfer.prefill.endpoint"):
        senders[0].send(np.array([0]), np.array([0]), num_tokens_ready=8)
    (line,) = [rec.getMessage() for rec in caplog.records if "already ended" in rec.getMessage()]
    assert "room 32, which already ended (Success)" in line and "field=send" in line, line
    assert senders[0].poll() == KVPoll.Success


def test_send_on_an_aborted_room_names_why_it_ended(cluster, caplog):
    c = cluster(cp=1)
    with c.prefill[0].sender(35) as s:
        s.init(8)
        s.abort("the engine gave up")
        with caplog.at_level(logging.WARNING, logger="kvbridge.transfer.prefill.endpoint"):
            s.send(np.array([0]), np.array([0]), num_tokens_ready=8, is_last=True)
        assert any(re.search(r"room 35, which already ended \(Failed: .*the engine gave up", rec.getMessage())
                   for rec in caplog.records), [rec.getMessage() for rec in caplog.records]
        assert s.poll() == KVPoll.Failed


def test_close_and_with_end_a_room_that_has_not_finished(cluster):
    c = cluster(cp=1)
    with c.prefill[0].sender(33) as s:
        s.init(8)
    with c.decode.receiver(34, f"{c.name}-p") as r:
        pass
    assert s.poll() == KVPoll.Failed and "closed room 33's sender" in s.failure_reason
    assert r.poll() == KVPoll.Failed and "closed room 34's receiver" in r.failure_reason
    s.close()  # idempotent
    assert wait_until(lambda: not c.prefill[0].machine.rooms and not c.decode.machine.rooms, 30)


def test_dropping_a_handle_closes_its_room(cluster):
    c = cluster(cp=1)
    ep = c.prefill[0]
    s = ep.sender(35)
    s.init(8)
    room = s._room
    del s
    gc.collect()
    assert wait_until(lambda: 35 not in ep.machine.rooms, 30)
    assert room.state.state == KVPoll.Failed and room.life.stage == Stage.CLOSED


def test_a_dropped_handle_holds_its_room_no_more_and_wait_waits_for_the_drain(cluster):
    """Issue 20 finding 7: right after a handle is dropped, sender(id)/receiver(id) said a handle
    still held the room (until the next housekeeping, ~0.5 s), and wait=5 did not wait. Now the
    dropped handle's room is closed first: free at once when quiet, else draining (wait= waits)."""
    c = cluster(cp=1)
    ep = c.prefill[0]
    ep.sender(36).init(8)  # dropped at once
    ep.sender(36).close()  # quiet: the id is free again immediately
    r = c.decode.receiver(37, f"{c.name}-p")
    del r
    c.decode.receiver(37, f"{c.name}-p").close()
    gate = threading.Event()
    ep.engine.faults.gate = gate  # writes stay in flight: a dropped sender's room drains
    try:
        rcv = c.decode.receiver(38, f"{c.name}-p")
        rcv.init(np.array([4, 5]), 0, 8)
        (s,) = c.send(38, 8)
        assert wait_until(lambda: s.poll() == KVPoll.Transferring, 30)
        del s
        with pytest.raises(RoomInUse, match="draining") as info:
            ep.sender(38)
        assert info.value.draining and "still holds it" not in str(info.value)
        threading.Timer(0.3, gate.set).start()
        ep.sender(38, wait=5).close()  # waits for the drain, then opens
    finally:
        gate.set()
    rcv.close()


def test_a_late_request_for_a_closed_room_is_refused_with_its_outcome(cluster):
    """Tombstones: a decode rank asking after prefill closed the room learns why, at once."""
    c = cluster(cp=1)
    ep = c.prefill[0]
    s = ep.sender(36)
    s.init(8)
    s.close()
    assert wait_until(lambda: 36 not in ep.machine.rooms, 30)
    r = c.decode.receiver(36, f"{c.name}-p")
    r.init(np.array([0, 1]), 0, 8)
    wait_final([r], timeout=10)
    assert "room 36 was already closed on prefill rank" in r.failure_reason
    assert "Failed: the engine closed room 36's sender" in r.failure_reason


def test_rooms_are_forgotten_once_closed_and_quiet(cluster):
    """No unbounded growth: closed rooms leave both books; tombstones are bounded."""
    c = cluster(cp=2)
    for room in range(40, 60):
        with c.decode.receiver(room, f"{c.name}-p") as r:
            r.init(np.array([0, 1, 2]), 0, 10)
            senders = c.send(room, 10)
            wait_final([r, *senders])
            assert r.poll() == KVPoll.Success, r.failure_reason
            for s in senders:
                s.close()
    books = [c.decode.machine, *(ep.machine for ep in c.prefill)]
    assert wait_until(lambda: not any(b.rooms for b in books), 30)
    assert all(len(ep.machine.rooms.tombstones) == 20 for ep in c.prefill)
    stones = Tombstones(ttl_s=60, max_entries=3)
    for room in range(10):
        stones.add(room, "Success")
    assert len(stones) == 3 and stones.get(9) == "Success" and stones.get(0) is None
    stones.prune(time.monotonic() + 61)
    assert len(stones) == 0
