"""Endpoints in one process over the local engine (fault injection), against a
real bootstrap daemon: held, failed and corrupted writes, misuse of the engine
API, timeouts, authentication. The same behaviour over real Mooncake between
processes is in test_rooms.py and test_rooms_faults.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from _cluster import wait_final, wait_until
from _local import PAGE, Cluster, HostEvent
from kvbridge.bootstrap.client import LeaseKeeper
from kvbridge.errors import LayoutError, PageRangeError, UnknownInstance
from kvbridge.transfer.engine import tensor_region
from kvbridge.transfer.decode.events import LookUp
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, fill_pages, make_aux
from kvbridge.transfer.actions import Tick


@pytest.mark.parametrize("engine", ["local", "ipc"])
def test_abort_waits_for_writes_still_in_flight(cluster, engine):
    """Hard rule 6: pages are not released while a posted write may still land."""
    c = cluster(engine=engine)
    gate = threading.Event()
    for ep in c.prefill:
        ep.engine.faults.gate = gate  # every write is held in flight until the gate opens
    pages = np.array([5, 6, 7])
    r = c.decode.receiver(1, f"{c.name}-p")
    r.init(pages, 0, 10)
    senders = c.send(1, 10)
    assert wait_until(lambda: all(s.poll() == KVPoll.Transferring for s in senders), 10)
    r.abort("user cancelled")
    assert r.poll() == KVPoll.Failed
    assert not wait_until(lambda: r.pages_releasable, 0.5), "released while writes were in flight"
    assert all(s.poll() == KVPoll.Transferring for s in senders)  # the prefill side waits for its writes too
    gate.set()
    assert wait_until(lambda: r.pages_releasable, 10)
    wait_final(senders)
    assert all(s.poll() == KVPoll.Failed and "user cancelled" in s.failure_reason for s in senders)


@pytest.mark.parametrize("engine", ["local", "ipc"])
def test_failed_write_fails_the_room_with_the_engine_reason(cluster, engine):
    c = cluster(engine=engine)
    c.prefill[1].engine.faults.fail_batches = {0}
    pages = np.array([1, 2, 3, 4])
    r = c.decode.receiver(2, f"{c.name}-p")
    r.init(pages, 0, 14)
    senders = c.send(2, 14)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Failed
    assert "prefill cp rank 1" in r.failure_reason and "injected failure of batch 0" in r.failure_reason
    assert wait_until(lambda: r.pages_releasable, 10)
    assert senders[1].poll() == KVPoll.Failed


def asked_and_filled(c, room: int, n: int):
    """Room ``room`` of ``n`` tokens at CP 1: decode asked (pages 0 and 1, aux slot 3), prefill's
    local pages 10 and 11 hold them, its sender is initialised; (receiver, sender)."""
    ep = c.prefill[0]
    r = c.decode.receiver(room, f"{c.name}-p")
    r.init(np.array([0, 1]), 3, n)
    for (pool, layer), buf in ep.buffers.tensors.items():
        fill_pages(c.specs[pool], buf, room, layer, np.array([0, 1]), np.array([10, 11]), n)
    s = ep.sender(room)
    s.init(n)
    return r, s


def pages_sent_not_last(c, room: int, n: int):
    """``asked_and_filled``, then prefill sent every page in a send that is not the last and the
    room is Transferring; (receiver, sender)."""
    r, s = asked_and_filled(c, room, n)
    s.send(np.array([0, 1]), np.array([10, 11]), num_tokens_ready=n)  # every page, not yet the last chunk
    assert wait_until(lambda: s.poll() == KVPoll.Transferring, 30)
    return r, s


def test_corrupted_aux_row_is_caught_by_the_room_echo(cluster):
    """Hard rule 4: an aux row that carries another room's id never commits (a decode rank that
    takes the row as a write; one that takes it in the report: test_aux_inline.py)."""
    c = cluster(cp=1, aux_inline=False)
    c.prefill[0].engine.faults.corrupt_batches = {1}  # batch 0: the pages, batch 1: the aux row alone
    room, n = 0x1234, 8
    r, s = pages_sent_not_last(c, room, n)
    s.send(np.array([], np.int64), np.array([], np.int64), is_last=True, aux=make_aux(c.aux_schema, room, n))
    wait_final([r])
    assert r.poll() == KVPoll.Failed
    assert "aux row in slot 3 carries room" in r.failure_reason and str(room) in r.failure_reason


@pytest.mark.parametrize("engine", ["local", "ipc"])
def test_corrupted_page_fails_only_with_the_digest_check(cluster, engine):
    plain, checked = cluster(cp=1, engine=engine), cluster(cp=1, verify_digest=True, engine=engine)
    results = []
    for c in (plain, checked):
        c.prefill[0].engine.faults.corrupt_batches = {0}
        r = c.decode.receiver(3, f"{c.name}-p")
        r.init(np.array([8, 9]), 0, 7)
        senders = c.send(3, 7)  # noqa: F841  (dropping a sender would close its room)
        wait_final([r])
        results.append(r)
    assert results[0].poll() == KVPoll.Success and not plain.verified(3, 7, np.array([8, 9]))
    assert results[1].poll() == KVPoll.Failed and "digest mismatch" in results[1].failure_reason


def test_sender_misuse_is_refused_with_the_reason(cluster):
    c = cluster()
    ep0, ep1 = c.prefill
    s = ep0.sender(4)
    with pytest.raises(LayoutError, match="before init"):
        s.send(np.array([0]), np.array([0]))
    s.init(10)  # 3 pages: cp0 owns 0 and 2, cp1 owns 1; the last token (9) is on page 2 -> cp0
    with pytest.raises(LayoutError, match="must say how many tokens of the request are ready"):
        s.send(np.array([0]), np.array([0]))
    with pytest.raises(LayoutError, match="logical page 1 is owned by cp rank 1"):
        s.send(np.array([1]), np.array([0]), num_tokens_ready=8)
    with pytest.raises(LayoutError, match="local pages must lie in"):
        s.send(np.array([0]), np.array([64]), num_tokens_ready=8)
    # page ids that are not integers would name other pages once cast: refused by name
    for logical, local, field in (([0.5], [0], "logical_pages"), ([0], [1.7], "local_pages"),
                                  (np.array([True]), [0], "logical_pages")):
        with pytest.raises(LayoutError, match=f"{field} must be integers, got dtype (float64|bool)") as info:
            s.send(logical, local, num_tokens_ready=8)
        assert info.value.field == field and "room=4" in str(info.value)
    assert not ep0.locked(lambda: ep0.machine.rooms[4].given.any())  # nothing was queued
    with pytest.raises(LayoutError, match=r"num_tokens_ready 11 must lie in \[0, 10\]"):
        s.send(np.array([0]), np.array([0]), num_tokens_ready=11)
    with pytest.raises(LayoutError, match=r"the last chunk leaves tokens \[8, 10\) not ready"):
        s.send(np.array([0, 2]), np.array([0, 1]), num_tokens_ready=8, is_last=True, aux=make_aux(c.aux_schema, 4, 10))
    with pytest.raises(LayoutError, match="must carry the aux row"):
        s.send(np.array([0, 2]), np.array([0, 1]), is_last=True)
    with pytest.raises(LayoutError, match="leaves 1 owned pages unsent"):
        s.send(np.array([0]), np.array([0]), is_last=True, aux=make_aux(c.aux_schema, 4, 10))
    with pytest.raises(LayoutError, match="carries room 5"):
        s.send(np.array([0, 2]), np.array([0, 1]), is_last=True, aux=make_aux(c.aux_schema, 5, 10))
    s1 = ep1.sender(4)
    s1.init(10)
    with pytest.raises(LayoutError, match="hard rule 4"):
        s1.send(np.array([1]), np.array([0]), is_last=True, aux=make_aux(c.aux_schema, 4, 10))
    with pytest.raises(LayoutError, match="says 11 tokens"):
        s1.init(11)
    s.abort("test over")
    s1.abort("test over")


def test_receiver_misuse_is_refused_with_the_reason(cluster):
    c = cluster()
    r = c.decode.receiver(6, f"{c.name}-p")
    with pytest.raises(LayoutError, match=r"3 pages for logical pages \[0, 4\) of 13 tokens"):
        r.init(np.array([0, 1, 2]), 0, 13)
    with pytest.raises(PageRangeError, match="registered capacity"):
        r.init(np.array([0, 1, 64]), 0, 12)
    with pytest.raises(PageRangeError, match="aux slot 8"):
        r.init(np.array([0, 1, 2]), 8, 12)
    with pytest.raises(LayoutError, match="integers"):
        r.init(np.array([0.0, 1.0, 2.0]), 0, 12)
    r.init(np.array([0, 1, 2]), 0, 12)
    with pytest.raises(LayoutError, match="init\\(\\) called twice"):
        r.init(np.array([0, 1, 2]), 0, 12)
    r.abort("test over")
    assert c.decode.machine.rooms[6].state.state == KVPoll.Failed


def test_timeouts_name_the_state_that_overran(cluster, daemon):
    # the bootstrap timeout leaves the daemon's look-up of the instance that exists time on a loaded
    # host (at 0.5 s a CI run under load saw never_init fail in bootstrap instead of in waiting)
    c = cluster(bootstrap_timeout=5.0, waiting_timeout=0.5)
    lost = c.decode.receiver(7, "no-such-instance")
    never_init = c.decode.receiver(8, f"{c.name}-p")
    orphan = c.prefill[0].sender(9)  # no decode rank ever asks for room 9
    orphan.init(5)
    wait_final([lost, never_init, orphan], timeout=30)
    assert "no-such-instance" in lost.failure_reason
    assert "waiting timeout" in never_init.failure_reason
    assert "no decode ranks asked for room 9" in orphan.failure_reason
    assert lost.pages_releasable and never_init.pages_releasable


def test_unauthenticated_control_messages_are_dropped(cluster):
    """A decode rank with the wrong cluster secret gets nothing: its rooms fail on liveness."""
    good = cluster(cp=1, prefill_secret=b"s3cret", decode_secret=b"s3cret")
    r = good.decode.receiver(10, f"{good.name}-p")
    r.init(np.array([0, 1]), 0, 8)
    senders = good.send(10, 8)  # noqa: F841
    wait_final([r])
    assert r.poll() == KVPoll.Success and good.verified(10, 8, np.array([0, 1]))
    bad = cluster(cp=1, prefill_secret=b"s3cret", decode_secret=b"guess")
    r = bad.decode.receiver(11, f"{bad.name}-p")
    r.init(np.array([0, 1]), 0, 8)
    wait_final([r], timeout=10)
    assert r.poll() == KVPoll.Failed and "sent nothing" in r.failure_reason
    # the prefill rank's challenge does not authenticate with the decode rank's secret: the decode
    # rank sends no Hello (it counts the refusal) and the prefill rank reads nothing from it
    assert bad.decode._peers.stats.unauthenticated > 0
    assert bad.prefill[0]._server.stats.received == 0 and bad.prefill[0]._server.num_peers == 0
    assert as_bytes(bad.dbufs[("target", 0)])[[0, 1]].min() == SENTINEL_BYTE  # nothing written


def test_release_from_a_finalizer_never_takes_the_lock(cluster):
    """Receivers and senders are released from GC finalizers, which may run on a
    thread that already holds the endpoint lock: that must not deadlock."""
    c = cluster(cp=1)
    done = threading.Event()
    receiver, sender = c.decode.receiver(12, f"{c.name}-p"), c.prefill[0].sender(12)

    def drop_under_lock() -> None:
        with c.decode._lock, c.prefill[0]._lock:
            c.decode.release(receiver._room)
            c.prefill[0].release(sender._room)
        done.set()

    t = threading.Thread(target=drop_under_lock, daemon=True)
    t.start()
    assert done.wait(5), "releasing a room under the endpoint lock deadlocked"


def test_a_lookup_answered_before_its_callback_is_attached_does_not_deadlock(cluster):
    """``Future.add_done_callback`` runs the callback inline when the future is already
    done, i.e. on the loop thread that holds the lock: the answer must be queued, not applied."""
    c = cluster(cp=1)

    def done_submit(fn, *args):
        fut: Future = Future()
        fut.set_exception(UnknownInstance("no such instance (answered at once)"))
        return fut

    # before the receiver opens: its own look-up must not reach the real daemon first (a 404 of
    # its own would decide the room before the look-up below is fed)
    c.decode._pool.submit = done_submit
    r = c.decode.receiver(13, "instance-that-answers-at-once")
    finished = threading.Event()

    def lookup_under_lock() -> None:
        with c.decode._lock:
            key = ("instance-that-answers-at-once", None)
            c.decode._feed([LookUp(13, key[0], None, key)])
        finished.set()

    threading.Thread(target=lookup_under_lock, daemon=True).start()
    assert finished.wait(5), "applying a look-up answer under the loop's lock deadlocked"
    wait_final([r], timeout=10)
    assert "answered at once" in r.failure_reason


def test_trace_mode_logs_who_sent_which_pages_and_the_commit(cluster, caplog, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_TRACE", "1")  # read when an endpoint is built
    c = cluster(cp=2)
    r = c.decode.receiver(14, f"{c.name}-p")
    r.init(np.array([0, 1, 2]), 0, 10)
    with caplog.at_level("INFO", logger="kvbridge.transfer"):
        senders = c.send(14, 10)  # noqa: F841
        wait_final([r])
        assert wait_until(lambda: "committed" in caplog.text, 30)
    assert r.poll() == KVPoll.Success
    text = caplog.text
    assert "trace room=14" in text and "pages=[0, 2]" in text and "pages=[1]" in text
    assert "committed pages_by_rank={0: 2, 1: 1}" in text and "aux_read=" in text
    # the hops' other ends: each prefill rank saw the request, decode saw each rank's report
    assert text.count("request from") == 2 and "report from cp0" in text and "report from cp1" in text


def test_rooms_keep_working_after_the_bootstrap_daemon_restarts(start_daemon):
    """Ranks re-register on their next heartbeat; new rooms find them again."""
    daemon = start_daemon("--lease-ttl", "30")
    c = Cluster(daemon.url, "restart", cp=2)
    try:
        r = c.decode.receiver(20, "restart-p")
        r.init(np.array([0, 1, 2]), 0, 10)
        senders = c.send(20, 10)  # noqa: F841
        wait_final([r])
        assert r.poll() == KVPoll.Success
        daemon.restart()  # same port, empty state
        c.decode.machine.topologies.clear()  # no cached topology: the next room must look the instance up again

        def reregistered() -> bool:
            # every rank, decode's too (a room whose request leaves just before its decode rank re-registers:
            # test_a_room_asked_just_before_its_decode_rank_re_registers_completes)
            try:
                return (len(c.clients[0].instance("restart-p").ranks) == 2
                        and [rk.rank_id for rk in c.clients[0].instance("restart-d").ranks] == [c.decode.rank_id])
            except UnknownInstance:
                return False

        assert wait_until(reregistered, 10)
        r = c.decode.receiver(21, "restart-p")
        r.init(np.array([3, 4, 5]), 1, 10)
        senders = c.send(21, 10)  # noqa: F841
        wait_final([r], timeout=20)
        assert r.poll() == KVPoll.Success and c.verified(21, 10, np.array([3, 4, 5]))
    finally:
        c.close()


def test_a_room_asked_just_before_its_decode_rank_re_registers_completes(start_daemon):
    """A room's TransferRequests left on decode's connections named by its registration R; then the
    daemon restarts and decode registers again as R'. The room's prefill ranks hold its targets on
    those connections (a prefill rank answers a room only on the connection that asked), so decode
    keeps them open, pinged under R, while the room needs them, and opens new ones under R' for
    what it asks from now on: the room completes long before its transfer timeout, and the old
    connections close once it is done. The re-registration is the test's own, at the moment it picks
    (decode's lease keeper is stopped first): the request has left and been taken, nothing answered."""
    daemon = start_daemon("--lease-ttl", "30")
    # prefill's peer timeout short: the wait below outlasts it, so the old connections must be heard from
    c = Cluster(daemon.url, "rereg", cp=2, transfer_timeout=60.0, prefill_cfg={"peer_timeout": 2.0})
    try:
        old = c.decode.rank_id
        c.decode._lease.stop()
        r = c.decode.receiver(30, "rereg-p")
        pages = np.array([0, 1, 2])
        r.init(pages, 0, 10)

        def asked() -> bool:  # every prefill rank holds the room's target (cp1's after the decider's ticket)
            return all(ep.locked(lambda ep=ep: bool(getattr(ep.machine.rooms.get(30), "targets", None)))
                       for ep in c.prefill)

        assert wait_until(asked, 20)
        daemon.restart()  # same port, empty state
        reg = c.decode._lease.registration
        c.decode.bootstrap.heartbeat(reg)  # the daemon forgot decode: it registers again, under a new id
        assert reg.rank_id != old
        c.decode._lease = LeaseKeeper(c.decode.bootstrap, reg).start()
        assert wait_until(lambda: c.decode._peers.name == reg.rank_id, 10)  # its connections renamed
        assert {name for _, name in c.decode._peers.retired()} == {old}  # but the room's kept open
        time.sleep(3.0)  # past prefill's peer timeout: the room's targets live on their connection's pings
        senders = c.send(30, 10)  # noqa: F841  (only now does prefill write and report)
        wait_final([r], timeout=30)
        assert r.poll() == KVPoll.Success, r.failure_reason
        assert c.verified(30, 10, pages)
        assert wait_until(lambda: not c.decode._peers.retired(), 10)  # the old connections closed with the room
        r2 = c.decode.receiver(31, "rereg-p")  # and a room asked under the new registration is served
        r2.init(np.array([3, 4, 5]), 1, 10)
        senders = c.send(31, 10)  # noqa: F841
        wait_final([r2], timeout=30)
        assert r2.poll() == KVPoll.Success, r2.failure_reason
        assert c.verified(31, 10, np.array([3, 4, 5]))
    finally:
        c.close()


def test_a_dead_decode_peer_fails_the_prefill_room_with_the_reason(cluster):
    """The decode rank vanishes while writes are in flight: the prefill room fails once
    its writes have failed (nothing is left in flight), naming the decode rank."""
    c = cluster()
    gate = threading.Event()
    for ep in c.prefill:
        ep.engine.faults.gate = gate
    r = c.decode.receiver(22, f"{c.name}-p")
    r.init(np.array([0, 1, 2]), 0, 10)
    senders = c.send(22, 10)
    assert wait_until(lambda: all(s.poll() == KVPoll.Transferring for s in senders), 30)
    c.fabric.detach(c.decode.engine.session_id)  # the decode rank's memory is gone
    gate.set()
    wait_final(senders, timeout=10)
    for s in senders:
        assert s.poll() == KVPoll.Failed
        assert f"write to decode rank {c.name}-d/dp0/tp0" in s.failure_reason and "failed" in s.failure_reason


@pytest.mark.parametrize("lane_rule", ["contiguous", "replicated"])
def test_other_lane_rules_deliver_every_page_once(cluster, lane_rule):
    """Contiguous ranges, and replicated KV where rank 0 sends and the other ranks send nothing."""
    c = cluster(cp=3, lane_rule=lane_rule)
    pages = np.array([9, 3, 4, 5, 6, 7, 8])
    r = c.decode.receiver(23, f"{c.name}-p")
    r.init(pages, 0, 27)
    senders = c.send(23, 27)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success, r.failure_reason
    assert all(s.poll() == KVPoll.Success for s in senders)
    assert c.verified(23, 27, pages)
    expected = {0: 7} if lane_rule == "replicated" else {0: 3, 1: 3, 2: 1}
    assert r.stats["pages_by_rank"] == expected


def test_a_peer_idle_longer_than_the_peer_timeout_is_not_declared_dead(cluster):
    """Liveness only runs while a peer has rooms: a quiet spell between rooms is no death."""
    c = cluster(cp=1, peer_timeout=0.5)
    for room, pages in ((24, [0, 1]), (25, [2, 3])):
        r = c.decode.receiver(room, f"{c.name}-p")
        r.init(np.array(pages), 0, 8)
        senders = c.send(room, 8)  # noqa: F841
        wait_final([r])
        assert r.poll() == KVPoll.Success, r.failure_reason
        time.sleep(1.5)  # three peer timeouts without a room toward this prefill rank


def _lookups(url: str) -> dict[str, float]:
    import re

    import httpx

    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return {m[1]: float(m[2]) for m in re.finditer(r'kvbridge_bootstrap_lookups_total\{outcome="(\w+)"\} (\S+)', text)}


def test_a_burst_of_rooms_asks_the_daemon_once(cluster, daemon):
    """Rooms of one DP group wait for the group's one look-up instead of each asking."""
    c = cluster(cp=1)
    before = _lookups(daemon.url).get("ok", 0)
    receivers = [c.decode.receiver(300 + i, f"{c.name}-p") for i in range(200)]
    assert wait_until(lambda: all(r.poll() == KVPoll.WaitingForInput for r in receivers), 10)
    assert _lookups(daemon.url).get("ok", 0) - before == 1
    for r in receivers:
        r.abort("test over")


def test_a_burst_toward_a_mismatched_instance_is_refused_after_one_look_up(cluster, daemon):
    c = cluster(cp=1)
    other = c.contract.model_copy(update={"kernel": c.contract.kernel.model_copy(update={"abi": "another-abi"})})
    c.decode.contract = other  # this decode rank now speaks a different contract
    before = _lookups(daemon.url).get("mismatch", 0)
    receivers = [c.decode.receiver(600 + i, f"{c.name}-p") for i in range(100)]
    wait_final(receivers, timeout=10)
    assert all(r.poll() == KVPoll.Failed and "kernel.abi" in r.failure_reason for r in receivers)
    assert all(any(getattr(d, "path", "") == "kernel.abi" for d in r.mismatch) for r in receivers)
    assert _lookups(daemon.url).get("mismatch", 0) - before == 1


def test_a_loop_step_touches_only_the_rooms_an_event_concerns(cluster, monkeypatch):
    c = cluster(cp=1)
    ep = c.prefill[0]
    senders = [ep.sender(900 + i) for i in range(100)]
    for s in senders:
        s.init(8)
    touched = []
    orig = type(ep.machine)._post_room
    monkeypatch.setattr(type(ep.machine), "_post_room", lambda self, r, now: (touched.append(r.room), orig(self, r, now)))
    with ep._lock:
        ep._feed_event(Tick(time.monotonic()))  # whatever the init() calls left to do
        touched.clear()
        ep.machine.dirty.add(950)
        ep._feed_event(Tick(time.monotonic()))
    assert touched == [950]
    for s in senders:
        s.abort("test over")


def test_closing_an_endpoint_withdraws_its_memory_from_the_engine(daemon):
    """The engine may outlive an endpoint: after close() no peer can write into its buffers."""
    c = Cluster(daemon.url, "withdraw", cp=1)
    engines = [c.decode.engine, c.prefill[0].engine]
    regions = [c.decode.buffers, c.prefill[0].buffers]
    c.close(engines=False)
    try:
        for engine, bufs in zip(engines, regions):
            for t in bufs.tensors.values():  # registering again would be refused as overlapping if still there
                ptr, nbytes = tensor_region(t)
                engine.register(ptr, nbytes)
                engine.unregister(ptr)
        engines[0].register(*tensor_region(c.aux))  # the decode aux rows too
    finally:
        for engine in c.engines:
            engine.close()


@pytest.mark.parametrize("engine", ["local", "ipc"])
def test_send_with_a_ready_event_reads_no_page_before_it_completes(cluster, engine):
    """The copy waits for the producer (pages written by GPU work still queued): send() returns
    at once, the decode pages stay untouched until the event completes, then the room lands."""
    c = cluster(cp=1, engine=engine)
    ep = c.prefill[0]
    room, n, logical, local, dst = 0x77, 8, np.array([0, 1]), np.array([10, 11]), np.array([4, 5])
    r = c.decode.receiver(room, f"{c.name}-p")
    r.init(dst, 1, n)
    for (pool, layer), buf in ep.buffers.tensors.items():
        fill_pages(c.specs[pool], buf, room, layer, logical, local, n)
    ready = HostEvent()
    s = ep.sender(room)
    s.init(n)
    s.send(logical, local, is_last=True, aux=make_aux(c.aux_schema, room, n), ready_event=ready)
    assert wait_until(lambda: s.poll() == KVPoll.Transferring, 30)
    time.sleep(0.3)
    assert r.poll() == KVPoll.Transferring
    assert all((as_bytes(b)[dst] == SENTINEL_BYTE).all() for b in c.dbufs.values()), "read before the event"
    ready.set()
    wait_final([r, s])
    assert r.poll() == KVPoll.Success and s.poll() == KVPoll.Success and c.verified(room, n, dst)


def test_a_topology_in_use_is_refreshed_before_it_expires(cluster):
    """Rooms of a DP group further apart than topology_ttl find its topology cached (refreshed in
    the background): no room waits for a bootstrap look-up (a few ms) on its way to the request."""
    # a TTL of 1 s: its refresh (due at half of it) has 0.5 s to come back from the daemon, which a
    # loaded 2-core host may need (at 0.3 s, a refresh slower than 0.15 s left the cache expired)
    c = cluster(cp=1, topology_ttl=1.0)
    for i, room in enumerate((31, 32, 33)):
        if i:
            time.sleep(3.0)  # three TTLs: without the refresh the cached answer would be gone
        r = c.decode.receiver(room, f"{c.name}-p")
        if i:
            assert r.poll() == KVPoll.WaitingForInput, "the room had to look its topology up"
        r.init(np.array([1, 2]), 0, 6)
        wait_final([r, *c.send(room, 6)])
        assert r.poll() == KVPoll.Success
        r.close()


def test_wait_blocks_until_the_room_is_final_and_times_out_with_the_state(cluster):
    """KVReceiver.wait / KVSender.wait: the poll state when the room turns final, without a
    polling loop; a timeout returns the state it is still in."""
    c = cluster(engine="local")
    gate = threading.Event()
    for ep in c.prefill:
        ep.engine.faults.gate = gate  # writes held in flight
    pages = np.array([3, 4, 5])
    r = c.decode.receiver(0x58, f"{c.name}-p")
    r.init(pages, 0, 12)
    senders = c.send(0x58, 12)
    assert wait_until(lambda: all(s.poll() == KVPoll.Transferring for s in senders), 10)
    started = time.monotonic()
    assert r.wait(0.3) == KVPoll.Transferring and senders[0].wait(0.01) == KVPoll.Transferring
    assert time.monotonic() - started >= 0.3  # it waited the whole timeout
    seen: list[KVPoll] = []
    waiter = threading.Thread(target=lambda: seen.append(r.wait(20)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not seen  # still blocked while the writes are held
    gate.set()
    waiter.join(20)
    assert seen == [KVPoll.Success] and all(s.wait(20) == KVPoll.Success for s in senders)
    assert c.verified(0x58, 12, pages)
    failed = c.decode.receiver(0x59, f"{c.name}-p")
    failed.abort("given up")
    assert failed.wait(5) == KVPoll.Failed and failed.failure_reason == "given up"


@pytest.mark.parametrize("forged", ["aux from the wrong cp rank", "pages of the other cp rank", "aux twice"])
def test_a_forged_report_fails_the_room_naming_the_rank_and_nothing_commits(cluster, forged):
    """A prefill rank's report (wire v3: pages and the aux row in one PagesDone) is checked against
    the owner lanes before anything is recorded: a report the ledger cannot take fails the room,
    names the rank, and the room never commits."""
    from kvbridge.transfer.channel import wire

    c = cluster(cp=2)
    room, n = 77, 4 * PAGE - 3  # 4 pages: cp0 owns 0 and 2, cp1 owns 1 and 3 (and the last token)
    r = c.decode.receiver(room, f"{c.name}-p")
    r.init(np.array([20, 21, 22, 23]), 1, n)
    ep = c.prefill[0]
    assert wait_until(lambda: room in ep.machine.rooms and ep.machine.rooms[room].targets, 10)
    ident = next(iter(ep.machine.rooms[room].targets.values())).ident
    report = dict(room=room, cp_rank=0, status="ok", reason="", pools=sorted(c.specs), digests=None)
    if forged == "aux from the wrong cp rank":
        msgs = [wire.PagesDone(**report, logical_pages=b"", aux=True, num_tokens=n)]
        expect = "aux row reported by cp rank 0, but cp rank 1 owns the last valid token"
    elif forged == "pages of the other cp rank":
        msgs = [wire.PagesDone(**report, logical_pages=wire.pack_pages(np.array([1])))]
        expect = "logical page 1 reported by cp rank 0, but cp rank 1 owns it"
    else:
        srv1 = c.prefill[1]
        assert wait_until(lambda: room in srv1.machine.rooms and srv1.machine.rooms[room].targets, 10)
        ident = next(iter(srv1.machine.rooms[room].targets.values())).ident
        ep = srv1
        msgs = [wire.PagesDone(**{**report, "cp_rank": 1}, logical_pages=b"", aux=True, num_tokens=n)] * 2
        expect = "aux row reported twice"
    for msg in msgs:
        ep._server.send(ident, msg)
    wait_final([r])
    assert r.poll() == KVPoll.Failed and expect in r.failure_reason, r.failure_reason
    assert r.aux is None  # never committed


def test_an_aux_row_that_would_not_unpack_fails_the_room_at_commit_and_a_good_one_decodes_when_read(cluster):
    """The commit checks what decoding the aux row would refuse (a standard row's top-k count),
    so a room never reaches Success with a row its reader cannot decode; the decoding itself
    waits for the first reader and gives the row that landed."""
    c = cluster(cp=1)
    n = 8
    bad = np.array(make_aux(c.aux_schema, 0x51, n), copy=True)
    bad["topk"] = c.aux_schema.region("topk_ids").count + 1
    for room, aux in ((0x51, bad), (0x52, make_aux(c.aux_schema, 0x52, n))):
        r = c.decode.receiver(room, f"{c.name}-p")
        r.init(np.array([0, 1]), 2, n)
        senders = c.send(room, n, aux=aux)  # noqa: F841
        wait_final([r])
        if room == 0x51:
            assert r.poll() == KVPoll.Failed and "corrupt aux row: topk count" in r.failure_reason
            assert r.aux is None and r.aux_regions is None
        else:
            sent = c.aux_schema.unpack(aux)
            assert r.poll() == KVPoll.Success and r.aux.room == room and r.aux.first_token == sent.first_token
            assert np.array_equal(r.aux.hidden, sent.hidden) and np.array_equal(r.aux.topk_ids, sent.topk_ids)
            assert int(r.aux_regions["room"].reshape(-1)[0]) == room
        r.close()


def test_the_cp_ranks_of_one_tp_source_get_one_encoding_of_the_request(cluster, monkeypatch):
    """Decode encodes a room's TransferRequest once per distinct request (here: one for both
    CP ranks) and sends the same bytes to each rank; both act on it."""
    from kvbridge.transfer import channel
    from kvbridge.transfer.channel import wire

    c = cluster(cp=2)
    encoded = []
    real = wire.encode

    def counting(msg, *a, **k):
        if isinstance(msg, wire.TransferRequest):
            encoded.append(msg.room)
        return real(msg, *a, **k)

    monkeypatch.setattr(channel.wire, "encode", counting)
    r = c.decode.receiver(31, f"{c.name}-p")
    r.init(np.array([0, 1, 2]), 0, 10)
    senders = c.send(31, 10)  # noqa: F841
    wait_final([r])
    assert r.poll() == KVPoll.Success and c.verified(31, 10, np.array([0, 1, 2]))
    assert encoded == [31]


def test_a_row_asked_ahead_is_reported_after_the_pages_post_and_written_into_the_slot_before_they_land(cluster):
    """``DecodeConfig(aux_ahead=True)`` on host rows (the default only where they are device
    memory): the aux owner reports the row on its own right after it posts the pages' write;
    decode writes it into the room's slot then, and the commit writes nothing more. The pages'
    write is held until the row is in the slot, so the order is the one asserted."""
    c = cluster(cp=1, aux_ahead=True)
    assert c.decode.aux_inline and c.decode.aux_ahead
    room, n = 0x4322, 8
    gate = c.prefill[0].engine.faults.gate = threading.Event()  # the pages' write waits at the gate
    r, s = asked_and_filled(c, room, n)
    s.send(np.array([0, 1]), np.array([10, 11]), is_last=True, aux=make_aux(c.aux_schema, room, n))
    slot_room = lambda: c.aux_schema.room_of(as_bytes(c.aux[3]))  # noqa: E731
    try:
        assert wait_until(lambda: slot_room() == room, 30)  # the row is in its slot: the pages are not
        assert r.poll() == KVPoll.Transferring
    finally:
        gate.set()
    wait_final([r, s])
    assert r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, r.failure_reason
    assert r.aux.room == room and c.verified(room, n, np.array([0, 1]))


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "written"])
def test_the_last_send_after_the_pages_is_a_report_and_no_write_when_decode_takes_the_row_inline(cluster, inline):
    """Issue 33: a decode rank whose aux rows kvbridge writes takes the row in the report. A
    room's last send after its pages (a layer-wise room's shape) then posts no write: batch 1,
    which would be the row's own write, is set to fail and never runs; the row lands in the
    room's slot all the same. Taking the row as a write, that same batch fails the room."""
    c = cluster(cp=1, aux_inline=inline)
    c.prefill[0].engine.faults.fail_batches = {1}  # batch 0: the pages
    room, n = 0x4321, 8
    r, s = pages_sent_not_last(c, room, n)
    aux = make_aux(c.aux_schema, room, n)
    s.send(np.array([], np.int64), np.array([], np.int64), is_last=True, aux=aux)
    wait_final([r, s])
    if not inline:
        assert r.poll() == KVPoll.Failed and "injected failure of batch 1" in r.failure_reason
        return
    sent = c.aux_schema.unpack(aux)
    assert r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, r.failure_reason
    assert r.aux.room == room and r.aux.first_token == sent.first_token and np.array_equal(r.aux.hidden, sent.hidden)
    assert int(r.aux_regions["room"].reshape(-1)[0]) == room  # written into the room's slot (3)
    landed = c.aux_schema.unpack(as_bytes(c.aux[3]))  # the slot itself holds the row
    assert landed.room == room and landed.first_token == sent.first_token and np.array_equal(landed.hidden, sent.hidden)
    assert np.array_equal(landed.topk_ids, sent.topk_ids) and np.array_equal(landed.topk_probs, sent.topk_probs)
