"""Decode's rooms as a state machine, driven by events alone: no socket, no thread, no clock
(the time is passed in), no engine. Every abort/failure order we can name, and what the
machine asks its shell to do for each (Send, LookUp, Refresh, CheckLease, DropPeer, FreeRoom)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.bootstrap.schemas import LookupResponse, SenderRank
from kvbridge.bootstrap.topology import OwnerLanePlan, Topology
from kvbridge.errors import BootstrapUnavailable, ContractMismatch, InstanceIncomplete, LayoutError, RoomInUse
from kvbridge.layout import AuxSchema, deepseek_pools
from kvbridge.transfer.channel import wire
from kvbridge.transfer.actions import FreeRoom, Send
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.peers import CheckLease, DropPeer
from kvbridge.transfer.decode.events import LookUp, Refresh
from kvbridge.transfer.decode.machine import SCAN_S, DecodeRooms
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.rooms import Stage
from _machines import decode_machine

PAGE = 4
SCHEMA = AuxSchema.standard(hidden_size=8)
INSTANCE = "pre"


def topology(cp: int = 2, fingerprint: str = "fp") -> LookupResponse:
    ranks = [SenderRank(rank_id=f"rank{c}", dp_rank=0, cp_rank=c, tp_rank=0, pp_rank=0,
                        control_endpoint=f"tcp://p{c}", session_id=f"s{c}", pools=[]) for c in range(cp)]
    return LookupResponse(instance=INSTANCE, room=1, dp_rank=0, fingerprint=fingerprint, ranks=ranks,
                          topology=Topology(role="prefill", dp_size=1, cp_size=cp, tp_size=1, pp_size=1),
                          plan=OwnerLanePlan(cp_size=cp, rule="interleaved"))


class Memory:
    """The aux rows as they landed (what the shell's reader returns) and page digests."""

    def __init__(self) -> None:
        self.rows = np.zeros((8, SCHEMA.row_bytes), dtype=np.uint8)

    def land(self, slot: int, room: int) -> None:
        """A row that echoes ``room`` (every other region zero: a valid standard row)."""
        self.rows[slot] = 0
        at = SCHEMA.offsets["room"]
        self.rows[slot, at : at + 8] = np.frombuffer(np.uint64(room).tobytes(), np.uint8)

    def read(self, slot: int) -> tuple[np.ndarray, float]:
        return self.rows[slot].copy(), 0.0


@pytest.fixture
def m():
    mem = Memory()
    machine = decode_machine(DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, lease_quarantine=30.0,
                                       transfer_timeout=100.0),
                          deepseek_pools(num_layers=2, page_size=PAGE, index=False, draft_layers=0), SCHEMA,
                          read_aux_row=mem.read, page_digests=lambda *a: np.zeros(0, np.uint64),
                          rank_id=lambda: "dec-id")
    machine.memory = mem
    return machine


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def sends(actions, msg_type):
    return [(a.to, a.msg) for a in of(actions, Send) if isinstance(a.msg, msg_type)]


def done(room: int, cp: int, pages: list[int], aux: bool = False, num_tokens: int = 0) -> wire.PagesDone:
    return wire.PagesDone(room=room, cp_rank=cp, status="ok", reason="", pools=["target"] if pages else [],
                          logical_pages=np.asarray(pages, "<i4").tobytes(), digests=None, aux=aux,
                          num_tokens=num_tokens)


def failed(room: int, cp: int, reason: str = "write failed") -> wire.PagesDone:
    return wire.PagesDone(room=room, cp_rank=cp, status="failed", reason=reason, pools=[], logical_pages=b"",
                          digests=None)


def booted(m, room: int = 7, now: float = 1.0, cp: int = 2):
    """A room whose look-up was answered (topology known, WaitingForInput)."""
    r = m.open(room, INSTANCE, None, now)
    if r.state.state == KVPoll.Bootstrapping:  # (no cached answer)
        (ask,) = of(m.tick(now), LookUp)
        assert ask.room == room and r.lookup_pending
        m.looked_up(room, ask.key, topology(cp), None, now)
    assert r.state.state == KVPoll.WaitingForInput
    return r


def requested(m, room: int = 7, now: float = 1.0, num_tokens: int = 10, cp: int = 2):
    """A room that sent its TransferRequests (pages 0..2 of 10 tokens; cp0 owns 0, 2 and the aux row)."""
    r = booted(m, room, now, cp)
    acts = m.init(r, np.arange(3, dtype=np.int64) + 10, 1, num_tokens, 0, now)
    (to, req), = sends(acts, wire.TransferRequest)
    assert set(to) == {f"tcp://p{c}" for c in range(cp)} and req.decode_rank_id == "dec-id"
    assert r.state.state == KVPoll.Transferring
    return r


def test_a_room_commits_on_every_page_and_the_echoed_aux_row(m):
    r = requested(m)
    assert m.message("tcp://p1", done(7, 1, [1]), 2.0) == ()
    m.memory.land(1, 7)
    m.message("tcp://p0", done(7, 0, [0, 2], aux=True, num_tokens=10), 2.1)
    assert r.state.state == KVPoll.Success and r.aux.room == 7 and r.pages_releasable
    acts = m.close(r, 3.0)
    assert of(acts, FreeRoom) == [FreeRoom(7)] and 7 not in m.rooms and r.life.stage == Stage.CLOSED


def test_the_requests_go_out_at_the_tick_that_learns_the_topology(m):
    r = m.open(8, INSTANCE, None, 1.0)
    assert m.init(r, np.array([0, 1, 2]), 0, 10, 0, 1.0) == ()  # nothing known yet: nothing to send
    (ask,) = of(m.tick(1.0), LookUp)
    m.looked_up(8, ask.key, topology(), None, 1.01)
    assert len(sends(m.tick(1.02), wire.TransferRequest)) == 1 and r.state.state == KVPoll.Transferring


def test_rooms_of_one_group_wait_for_its_one_look_up_then_use_the_cache(m):
    a = m.open(1, INSTANCE, None, 1.0)
    b = m.open(2, INSTANCE, None, 1.0)
    asks = of(m.tick(1.0), LookUp)
    assert len(asks) == 1  # one look-up per DP group at a time
    m.looked_up(asks[0].room, asks[0].key, topology(), None, 1.0)
    m.tick(1.001)
    assert a.state.state == b.state.state == KVPoll.WaitingForInput
    c = m.open(3, INSTANCE, None, 1.1)  # served from the cache at once
    assert c.state.state == KVPoll.WaitingForInput


def test_a_used_topology_is_refreshed_ahead_of_expiry(m):
    booted(m, 1, now=1.0)
    m.open(2, INSTANCE, None, 1.5)  # uses the cache (ttl 2 s)
    acts = m.tick(2.1)  # half way to expiry
    (ref,) = of(acts, Refresh)
    assert of(m.tick(2.2), Refresh) == []  # one at a time
    m.refreshed(ref.key, topology(), 2.2)
    assert m.topologies.cached(ref.key, 4.0) is not None  # its clock restarted


def test_a_contract_mismatch_fails_the_room_with_its_diff_and_refuses_the_next_without_asking(m):
    r = m.open(1, INSTANCE, None, 1.0)
    (ask,) = of(m.tick(1.0), LookUp)
    m.looked_up(1, ask.key, None, ContractMismatch("differs", diff=["pools.target.dtype"]), 1.0)
    assert r.state.state == KVPoll.Failed and "contract mismatch" in r.state.reason and r.mismatch
    r2 = m.open(2, INSTANCE, None, 1.5)
    assert of(m.tick(1.5), LookUp) == [] and r2.state.state == KVPoll.Failed and r2.mismatch


def test_an_unreachable_daemon_uses_the_last_answer_or_asks_again(m):
    r = m.open(1, INSTANCE, None, 1.0)
    (ask,) = of(m.tick(1.0), LookUp)
    m.looked_up(1, ask.key, None, BootstrapUnavailable("daemon down"), 1.0)
    assert r.state.state == KVPoll.Bootstrapping and r.next_lookup == pytest.approx(1.25)
    assert of(m.tick(1.1), LookUp) == []
    (again,) = of(m.tick(1.3), LookUp)
    m.looked_up(1, again.key, None, InstanceIncomplete("cp1 missing"), 1.3)
    assert r.state.state == KVPoll.Bootstrapping and "cp1 missing" in r.lookup_problem
    m.running(1.3, 40.0, heard=False)  # past the bootstrap timeout: the last answer is in the reason
    assert r.state.state == KVPoll.Failed and "bootstrap timeout" in r.state.reason and "cp1 missing" in r.state.reason


def test_a_look_up_still_unanswered_at_the_bootstrap_timeout_names_the_daemon_and_its_age(m):
    # the client still retrying a daemon that does not answer (a loaded host: no attempt has failed yet)
    m.machine.daemon = "bootstrap daemon at http://127.0.0.1:9"
    r = m.open(1, INSTANCE, None, 1.0)
    (ask,) = of(m.tick(1.0), LookUp)
    m.running(1.0, 40.0, heard=False)  # the turn at 32.0 is past bootstrap_timeout (30)
    assert r.state.state == KVPoll.Failed and "bootstrap timeout" in r.state.reason
    assert "no answer yet from bootstrap daemon at http://127.0.0.1:9 to the look-up asked 31.0s ago" in r.state.reason
    # the answer that comes after the room ended changes nothing and frees the group's look-up
    m.looked_up(1, ask.key, None, BootstrapUnavailable("daemon down"), 40.5)
    assert r.state.state == KVPoll.Failed and ask.key not in m.topologies.in_flight


def test_a_second_look_up_unanswered_keeps_the_answer_before_it_in_the_reason(m):
    r = m.open(1, INSTANCE, None, 1.0)
    (ask,) = of(m.tick(1.0), LookUp)
    m.looked_up(1, ask.key, None, InstanceIncomplete("cp1 missing"), 1.0)
    (again,) = of(m.tick(1.2), LookUp)
    m.running(1.2, 40.0, heard=False)  # the turn at 31.2 is past bootstrap_timeout (30)
    assert "no answer yet from the bootstrap daemon to the look-up asked 30.0s ago" in r.state.reason
    assert "last answer before it: cp1 missing" in r.state.reason


def test_abort_before_the_request_tells_no_one_and_frees_at_once(m):
    r = booted(m)
    assert sends(m.abort(r, "engine gave up", 2.0), wire.Abort) == []
    assert r.state.state == KVPoll.Failed and r.pages_releasable
    assert of(m.close(r, 2.1), FreeRoom) == [FreeRoom(7)]


def test_abort_after_init_but_before_the_request_aborts_every_sender(m):
    """Pages assigned, no TransferRequest yet: another TP rank may have asked; every CP rank is
    told, and the pages wait for every ack (hard rule 6)."""
    r = m.open(7, INSTANCE, None, 1.0)
    (ask,) = of(m.tick(1.0), LookUp)
    r.page_ids, r.aux_slot = np.array([1, 2, 3]), 0  # init() happened; the loop has not asked yet
    m.looked_up(7, ask.key, topology(), None, 1.0)
    aborts = sends(m.abort(r, "gone", 1.1), wire.Abort)
    assert sorted(to for (to,), _ in aborts) == ["tcp://p0", "tcp://p1"] and not r.pages_releasable


def test_abort_mid_write_frees_pages_only_once_every_rank_acked(m):
    r = requested(m)
    m.message("tcp://p1", done(7, 1, [1]), 2.0)
    acts = m.abort(r, "engine gave up", 2.1)
    assert len(sends(acts, wire.Abort)) == 2 and r.state.reason == "engine gave up"
    m.close(r, 2.2)
    m.message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 2.3)
    assert not r.pages_releasable and 7 in m.rooms  # cp1 may still write
    m.message("tcp://p1", wire.AbortAck(room=7, cp_rank=1), 2.4)
    assert r.pages_releasable
    assert of(m.tick(2.5), FreeRoom) == [FreeRoom(7)] and 7 not in m.rooms


def test_unacked_aborts_are_sent_again(m):
    r = requested(m)
    m.abort(r, "x", 2.0)
    m.message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 2.1)
    again = sends(m.tick(3.1), wire.Abort)
    assert [to for to, _ in again] == [("tcp://p1",)]


def test_a_write_failure_then_abort_counts_the_failed_rank_quiet(m):
    r = requested(m)
    m.message("tcp://p0", failed(7, 0, "queue full"), 2.0)
    assert r.state.state == KVPoll.Failed and "queue full" in r.state.reason
    assert (0, 0, 0) in r.quiet
    acts = m.abort(r, "too late", 2.1)  # already final: nothing changes, nothing sent
    assert acts == () and "queue full" in r.state.reason
    m.message("tcp://p1", wire.AbortAck(room=7, cp_rank=1), 2.2)
    assert r.pages_releasable


def test_a_report_after_the_room_failed_is_not_counted_but_a_late_failure_makes_it_quiet(m):
    r = requested(m)
    m.abort(r, "x", 2.0)
    m.message("tcp://p1", done(7, 1, [1]), 2.1)  # a late success report: ignored
    assert r.state.state == KVPoll.Failed and r.ledger.pages_by_rank == {}
    m.message("tcp://p1", failed(7, 1, "aborted"), 2.2)
    assert (1, 0, 0) in r.quiet  # (cp, tp, pp)


def test_a_forged_cp_rank_fails_the_room(m):
    r = requested(m)
    m.message("tcp://p1", done(7, 0, [0, 2]), 2.0)  # cp1's connection claims cp0
    assert r.state.state == KVPoll.Failed and "claims cp rank 0" in r.state.reason


def test_a_duplicate_report_fails_the_room_and_never_the_loop(m):
    r = requested(m)
    m.message("tcp://p1", done(7, 1, [1]), 2.0)
    m.message("tcp://p1", done(7, 1, [1]), 2.1)
    assert r.state.state == KVPoll.Failed and "page 1 of pool 'target' reported twice" in r.state.reason


def test_a_page_of_another_lane_fails_the_room(m):
    r = requested(m)
    m.message("tcp://p1", done(7, 1, [0]), 2.0)  # page 0 belongs to cp0
    assert r.state.state == KVPoll.Failed and "cp rank 0 owns it" in r.state.reason


def test_an_aux_row_echoing_another_room_fails_the_commit(m):
    r = requested(m)
    m.memory.land(1, 99)
    m.message("tcp://p1", done(7, 1, [1]), 2.0)
    m.message("tcp://p0", done(7, 0, [0, 2], aux=True), 2.1)
    assert r.state.state == KVPoll.Failed and "carries room 99, expected 7" in r.state.reason


def test_an_error_reply_to_the_request_fails_the_room_and_makes_that_rank_quiet(m):
    r = requested(m)
    m.message("tcp://p0", wire.ErrorReply(ref_type=wire.TransferRequest.TAG, room=7, reason="refused"), 2.0)
    assert r.state.state == KVPoll.Failed and "refused our" in r.state.reason and (0, 0, 0) in r.quiet


def test_a_request_refused_for_a_failed_memory_proof_is_asked_again_then_fails_the_room(m):
    """A prefill rank refuses a TransferRequest on a connection whose memory proof failed (CI: its
    read of our scratch region timed out while the host stood still). Nothing of the room reached
    it, so decode asks that rank again, after the admission's retry_s, up to PROOF_RETRIES times;
    a request answered meanwhile commits, and a third refusal fails the room, naming it."""
    from kvbridge.transfer.decode.machine import PROOF_RETRIES, PROOF_RETRY_S
    from kvbridge.transfer.ownership import PROOF_FAILED

    refused = wire.ErrorReply(ref_type=wire.TransferRequest.TAG, room=7,
                              reason=f"decode rank d (registration x) {PROOF_FAILED}: its memory proof could not be read")
    r = requested(m)
    now = 2.0
    for attempt in range(PROOF_RETRIES):
        acts = m.message("tcp://p0", refused, now)
        assert r.state.state == KVPoll.Transferring and not sends(acts, wire.Abort) and (0, 0, 0) not in r.quiet
        for t in np.arange(now + 0.5, now + PROOF_RETRY_S - 0.01, 0.5):  # a running loop: nothing before the retry
            m.message("tcp://p1", wire.Heartbeat(cp_rank=1, seq=1), t)  # (cp1 answered: alive)
            assert sends(m.tick(t), wire.TransferRequest) == []
        ((to, again),) = sends(m.tick(now + PROOF_RETRY_S), wire.TransferRequest)
        assert to == ("tcp://p0",) and again.room == 7 and again.pools == ["target"]  # that rank only, its pools
        assert sends(m.tick(now + PROOF_RETRY_S + 0.5), wire.TransferRequest) == []  # once
        now += PROOF_RETRY_S + 1.0
    m.message("tcp://p0", refused, now)  # the third refusal: the room fails on it
    assert r.state.state == KVPoll.Failed and PROOF_FAILED in r.state.reason and (0, 0, 0) in r.quiet



def test_a_request_asked_again_after_a_failed_memory_proof_commits_when_answered(m):
    from kvbridge.transfer.decode.machine import PROOF_RETRY_S
    from kvbridge.transfer.ownership import PROOF_FAILED

    r = requested(m)
    m.message("tcp://p0", wire.ErrorReply(ref_type=wire.TransferRequest.TAG, room=7, reason=f"x {PROOF_FAILED}: y"), 2.0)
    m.tick(2.0 + PROOF_RETRY_S / 2)
    assert len(sends(m.tick(2.0 + PROOF_RETRY_S), wire.TransferRequest)) == 1
    m.message("tcp://p1", done(7, 1, [1]), 4.1)
    m.memory.land(1, 7)
    m.message("tcp://p0", done(7, 0, [0, 2], aux=True, num_tokens=10), 4.2)
    assert r.state.state == KVPoll.Success


def keepalive_machine(keepalive: float, keepalive_for: float):
    mem = Memory()
    machine = decode_machine(DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, transfer_timeout=100.0,
                                          keepalive=keepalive, keepalive_for=keepalive_for),
                             deepseek_pools(num_layers=2, page_size=PAGE, index=False, draft_layers=0), SCHEMA,
                             read_aux_row=mem.read, page_digests=lambda *a: np.zeros(0, np.uint64),
                             rank_id=lambda: "dec-id")
    machine.memory = mem
    return machine


@pytest.mark.parametrize("keepalive", [10.0, 0.0])
def test_a_prefill_rank_with_no_room_here_is_pinged_to_keep_its_connection_then_left_alone(keepalive):
    """Keepalive: once a room toward them ended, its prefill ranks are pinged every ``keepalive``
    seconds, so their connections (and the proofs they carry) stay open past prefill's idle close,
    until ``keepalive_for`` seconds after their last room; no answer declares no one dead (no room
    waits on it). ``keepalive=0`` pings no rank without a room."""
    m = keepalive_machine(keepalive, 35.0)
    r = requested(m, now=1.0)
    m.message("tcp://p1", done(7, 1, [1]), 2.0)
    m.memory.land(1, 7)
    m.message("tcp://p0", done(7, 0, [0, 2], aux=True, num_tokens=10), 2.1)
    assert r.state.state == KVPoll.Success
    m.close(r, 2.2)
    pinged = []
    for step in range(1, 60):  # a tick every second for a minute: nothing heard from either rank
        now = 2.2 + step
        pinged += [(now, to) for to, _ in sends(m.tick(now), wire.Ping)]
    assert all(p.dead is None for p in m.peers.values())  # an unanswered keepalive blames no one
    if keepalive == 0:
        assert pinged == []
        return
    times = sorted({t for t, _ in pinged})
    assert {to for _, to in pinged} == {("tcp://p0",), ("tcp://p1",)} and len(pinged) == 2 * len(times)
    assert times[0] - 2.2 <= 10.0 + 1 and all(b - a == pytest.approx(10.0) for a, b in zip(times, times[1:]))
    assert times[-1] - 2.2 <= 35.0 + 1 and 2.2 + 60 - times[-1] > 10.0  # none after keepalive_for


def test_keepalive_settings_below_zero_are_refused_by_name():
    from kvbridge.errors import ConfigError

    for name in ("keepalive", "keepalive_for"):
        with pytest.raises(ConfigError, match=f"{name} must be a number of seconds >= 0") as info:
            DecodeConfig(instance="dec", **{name: -1.0})
        assert info.value.field == name


def test_peer_silence_fails_its_rooms_and_a_late_report_changes_nothing(m):
    r = requested(m, now=1.0)
    acts = m.tick(1.0 + SCAN_S)
    assert len(sends(acts, wire.Ping)) == 2  # both ranks pinged
    m.message("tcp://p1", wire.Heartbeat(cp_rank=1, seq=1), 3.0)
    now = 1.0 + SCAN_S
    for step in range(1, 25):  # loop turns every 0.25 s: cp0 never answers
        now = 1.0 + step * 0.25
        if step < 20:
            m.message("tcp://p1", wire.Heartbeat(cp_rank=1, seq=step), now)
        acts = m.tick(now)
        if r.state.final:
            break
    assert r.state.state == KVPoll.Failed and "prefill rank pre/cp0" in r.state.reason
    assert "sent nothing" in r.state.reason
    assert of(acts, CheckLease) == [CheckLease("tcp://p0", INSTANCE, "rank0")]
    m.message("tcp://p0", done(7, 0, [0, 2], aux=True), now + 0.1)  # it was only slow
    assert r.state.state == KVPoll.Failed and not r.pages_releasable  # still not quiet: hard rule 6
    m.message("tcp://p1", wire.AbortAck(room=7, cp_rank=1), now + 0.2)
    # its lease is gone: quiet only after the quarantine (a frozen process still holds writes)
    m.lease_checked("tcp://p0", "rank0", True, now + 0.3)
    m.tick(now + 1.0)
    assert not r.pages_releasable
    m.tick(now + 31.0)
    assert r.pages_releasable


def test_a_frozen_loop_blames_no_peer(m):
    r = requested(m, now=1.0)
    m.tick(1.0 + SCAN_S)
    m.tick(100.0)  # the loop itself did not run for 99 s
    assert r.state.state == KVPoll.Transferring


def test_a_dead_peer_gone_for_good_is_dropped(m):
    r = requested(m, now=1.0, cp=1)
    m.abort(r, "x", 1.0)
    m.close(r, 1.0)
    now, checks = 1.0, []
    while now < 7.0:  # the loop turns; the rank says nothing
        now += 0.5
        checks += of(m.tick(now), CheckLease)
    assert checks == [CheckLease("tcp://p0", INSTANCE, "rank0")]
    m.lease_checked("tcp://p0", "rank0", True, now)
    drops = []
    while now < 40.0:  # quarantine over: quiet, room forgotten, then the connection
        now += 1.0
        drops += of(m.tick(now), DropPeer)
    assert r.pages_releasable and 7 not in m.rooms
    assert drops == [DropPeer("tcp://p0")] and "tcp://p0" not in m.peers


def test_close_during_drain_and_reopen_refused_until_quiet(m):
    r = requested(m)
    m.close(r, 2.0)  # the engine let go before the end: fails, aborts, drains
    assert r.state.state == KVPoll.Failed and "closed room 7's receiver" in r.state.reason
    with pytest.raises(RoomInUse, match="draining: a prefill rank may still write its pages") as err:
        m.open(7, INSTANCE, None, 2.1)
    assert err.value.draining
    for cp in (0, 1):
        m.message(f"tcp://p{cp}", wire.AbortAck(room=7, cp_rank=cp), 2.2)
    m.tick(2.3)
    assert m.open(7, INSTANCE, None, 2.4) is not r  # a fresh room


def test_an_open_room_is_refused_and_init_twice_is_an_error(m):
    r = booted(m)
    with pytest.raises(RoomInUse, match="open: a KVReceiver still holds it") as err:
        m.open(7, INSTANCE, None, 1.1)
    assert not err.value.draining
    m.init(r, np.array([0, 1, 2]), 0, 10, 0, 1.2)
    with pytest.raises(LayoutError, match="init\\(\\) called twice"):
        m.init(r, np.array([0, 1, 2]), 0, 10, 0, 1.3)


def test_init_after_a_failure_asks_nothing(m):
    r = booted(m)
    m.abort(r, "gone", 1.1)
    assert m.init(r, np.array([0, 1, 2]), 0, 10, 0, 1.2) == ()




def test_timeouts_fail_rooms_in_each_state(m):
    waiting = booted(m, 1, now=1.0)
    moving = requested(m, 2, now=1.0)
    m.running(1.0, 62.0)  # waiting_timeout 60
    assert "waiting timeout" in waiting.state.reason and moving.state.state == KVPoll.Transferring
    m.running(62.0, 102.0)  # transfer_timeout 100
    assert "transfer timeout" in moving.state.reason and "missing" in moving.state.reason


def test_a_frozen_loop_counts_its_gap_toward_no_rooms_deadline(m):
    """A loop that did not run for a while (a starved process) spares each room the gap: its
    state's deadline counts only the seconds the loop ran, however many gaps (each state its own)."""
    waiting = booted(m, 1, now=1.0)
    moving = requested(m, 2, now=1.0)
    m.running(1.0, 40.0)
    m.tick(70.0)  # 30 s not run: both rooms spared them
    assert waiting.state.state == KVPoll.WaitingForInput and moving.state.state == KVPoll.Transferring
    m.running(70.0, 85.0)  # waiting: 39 + 15 s run, within waiting_timeout 60
    assert waiting.state.state == KVPoll.WaitingForInput
    m.running(85.0, 92.0)  # 61 s run: it failed
    assert waiting.state.state == KVPoll.Failed and "waiting timeout" in waiting.state.reason
    m.tick(120.0)  # another gap, 28 s: the transferring room has run 61 s of its 100
    m.running(120.0, 158.0)  # 99 s run
    assert moving.state.state == KVPoll.Transferring
    m.running(158.0, 160.0)
    assert moving.state.state == KVPoll.Failed and "transfer timeout" in moving.state.reason


def test_the_token_count_can_come_with_the_aux_row(m):
    r = booted(m)
    m.init(r, np.array([0, 1, 2]), 1, None, 0, 1.0)  # pages only
    m.memory.land(1, 7)
    m.message("tcp://p1", done(7, 1, [1]), 2.0)
    m.message("tcp://p0", done(7, 0, [0, 2], aux=True, num_tokens=13), 2.1)  # 13 tokens > 3 pages of 4
    assert r.state.state == KVPoll.Failed and "13 tokens" in r.state.reason


def test_a_challenge_is_answered_with_what_lies_in_the_scratch_region_on_that_connection():
    """Prefill proves a decode rank holds its registered memory: it writes a nonce into the
    rank's scratch region and sends Challenge(offset); the rank echoes what it reads there."""
    scratch = bytes(range(64)) * 2
    specs = deepseek_pools(num_layers=2, page_size=PAGE, index=False, draft_layers=0)
    m = decode_machine(DecodeConfig(instance="d"), specs, SCHEMA, read_aux_row=lambda slot: (None, 0.0),
                    page_digests=lambda *a: None, rank_id=lambda: "r1",
                    read_scratch=lambda offset: scratch[offset:offset + wire.NONCE_BYTES])
    (send,) = m.message("tcp://p:1", wire.Challenge(offset=32), 1.0)
    assert send.to == ("tcp://p:1",) and send.msg == wire.ChallengeEcho(nonce=scratch[32:64])
    silent = decode_machine(DecodeConfig(instance="d"), specs, SCHEMA, read_aux_row=lambda slot: (None, 0.0),
                         page_digests=lambda *a: None, rank_id=lambda: "r1")
    assert not silent.message("tcp://p:1", wire.Challenge(offset=0), 1.0)  # no scratch region: no echo


def test_a_memory_challenge_is_answered_by_writing_our_proof_into_our_own_scratch():
    """Proof by read (issue 32): a Challenge with a nonce asks us to write our proof key's
    signature over it (our registration, the prefill endpoint as dialled, the nonce, the offset)
    into our own scratch region at the offset, for that prefill rank to read back. The machine
    signs and hands the shell a ``WriteProof`` (the memory touch is the shell's, which then echoes
    the SHA-256 of what it wrote); without a key, a registration or a scratch region: no answer."""
    from kvbridge.transfer.decode import events as ev
    from kvbridge.transfer.ownership import ProofKey, verify_memory

    key = ProofKey()
    specs = deepseek_pools(num_layers=2, page_size=PAGE, index=False, draft_layers=0)
    m = DecodeRooms(DecodeConfig(instance="d"), specs, SCHEMA, proof_key=key)
    nonce = bytes(range(32))
    assert not of(m.feed(ev.Message("tcp://localhost:01", wire.Challenge(offset=128, nonce=nonce), 1.0)),
                  ev.WriteProof)  # no registration yet: nothing to sign for
    m.feed(ev.Registered("r1"))
    (w,) = of(m.feed(ev.Message("tcp://localhost:01", wire.Challenge(offset=128, nonce=nonce), 1.0)), ev.WriteProof)
    assert (w.endpoint, w.offset) == ("tcp://localhost:01", 128)
    assert verify_memory(key.public_hex, "r1", "tcp://127.0.0.1:1", nonce, 128, w.proof)
    assert not verify_memory(key.public_hex, "r1", "tcp://127.0.0.1:1", nonce, 64, w.proof)  # another offset
    keyless = DecodeRooms(DecodeConfig(instance="d"), specs, SCHEMA)
    keyless.feed(ev.Registered("r1"))
    assert not keyless.feed(ev.Message("tcp://p:1", wire.Challenge(offset=0, nonce=nonce), 1.0))
    no_scratch = DecodeRooms(DecodeConfig(instance="d"), specs, SCHEMA, proof_key=key, scratch=False)
    no_scratch.feed(ev.Registered("r1"))
    assert not no_scratch.feed(ev.Message("tcp://p:1", wire.Challenge(offset=0, nonce=nonce), 1.0))


def test_a_key_challenge_is_signed_with_our_proof_key_for_our_registration_and_that_prefill_rank():
    """The key half of the proof (transfer/ownership.py): the signature is over our registration
    id, the prefill endpoint as we dialled it (canonical) and its nonce, with the key whose public
    half is in our registration; without a key or a registration, no answer."""
    from kvbridge.transfer.ownership import ProofKey, verify_proof

    key = ProofKey()
    specs = deepseek_pools(num_layers=2, page_size=PAGE, index=False, draft_layers=0)
    m = decode_machine(DecodeConfig(instance="d"), specs, SCHEMA, read_aux_row=lambda slot: (None, 0.0),
                    page_digests=lambda *a: None, rank_id=lambda: "r1", proof_key=key)
    nonce = bytes(range(32))
    (send,) = m.message("tcp://localhost:01", wire.KeyChallenge(nonce=nonce), 1.0)
    assert send.to == ("tcp://localhost:01",) and isinstance(send.msg, wire.KeyProof)
    assert verify_proof(key.public_hex, "r1", "tcp://127.0.0.1:1", nonce, send.msg.signature)
    assert not verify_proof(key.public_hex, "r1", "tcp://127.0.0.1:2", nonce, send.msg.signature)
    assert not verify_proof(key.public_hex, "r2", "tcp://127.0.0.1:1", nonce, send.msg.signature)
    assert not verify_proof(ProofKey().public_hex, "r1", "tcp://127.0.0.1:1", nonce, send.msg.signature)
    keyless = decode_machine(DecodeConfig(instance="d"), specs, SCHEMA, read_aux_row=lambda slot: (None, 0.0),
                          page_digests=lambda *a: None, rank_id=lambda: "r1")
    assert not keyless.message("tcp://p:1", wire.KeyChallenge(nonce=nonce), 1.0)
# ---- staged transfers (decode/staging.py) ------------------------------------------------------
SLOT = 4096
AREA_BASE = 1 << 44
PAGES_BASE = 1 << 40


@pytest.fixture
def ms():
    """A machine whose staging area has 2 slots; staged only (an aborted room's pages free at once)."""
    from kvbridge.layout import BufferDesc
    from kvbridge.transfer.decode.staging import DecodeStaging
    from kvbridge.transfer.staging.area import StagingArea

    mem = Memory()
    specs = deepseek_pools(num_layers=2, page_size=PAGE, index=False, draft_layers=0)
    (pool, spec), = specs.items()
    bufs = [BufferDesc(pool, layer, PAGES_BASE + layer * (1 << 30), 64, spec.bytes_per_page) for layer in spec.layer_ids]
    cfg = DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, lease_ttl=2.0, lease_quarantine=3.0,
                       transfer_timeout=100.0, staging="always", staging_bytes=2 * SLOT, staging_slot_bytes=SLOT)
    machine = decode_machine(cfg, specs, SCHEMA, read_aux_row=mem.read, page_digests=lambda *a: np.zeros(0, np.uint64),
                          rank_id=lambda: "dec-id",
                          staging=DecodeStaging(StagingArea(2, SLOT), AREA_BASE, bufs, "dec/dp0/tp0"))
    machine.memory, machine.page_bytes = mem, spec.bytes_per_page
    return machine


def ask(m, room: int, cp: int, chunk: int, page: int) -> wire.SlotRequest:
    """Chunk ``chunk`` asks for a slot: 64 bytes for physical page ``page`` of layer 0."""
    scatter = wire.pack_scatter(np.array([0]), np.array([PAGES_BASE + page * m.page_bytes]), np.array([64]))
    return wire.SlotRequest(room=room, cp_rank=cp, chunk=chunk, num_bytes=SLOT, scatter=scatter)


def landed(room: int, cp: int, chunk: int, slot: int, status: str = "ok") -> wire.ChunkLanded:
    return wire.ChunkLanded(room=room, cp_rank=cp, chunk=chunk, slot=slot, status=status, reason="")


def test_the_request_describes_the_staging_area(ms):
    r = booted(ms)
    (_, req), = sends(ms.init(r, np.array([10, 11, 12]), 1, 10, 0, 1.0), wire.TransferRequest)
    assert (req.staging_slots, req.staging_slot_bytes, req.staging_base, req.staging_only) == (2, SLOT, AREA_BASE, True)


def test_slots_are_granted_fifo_scattered_on_landing_and_the_room_commits_after_the_scatter(ms):
    from kvbridge.transfer.decode.staging import Scatter

    r = requested(ms)
    grants = [sends(ms.message(f"tcp://p{c}", ask(ms, 7, c, k, 10 + c + 2 * k), 2.0), wire.SlotGrant) for c, k in ((0, 0), (1, 0), (0, 1))]
    assert [g[0][1].slot for g in grants[:2]] == [0, 1] and grants[2] == []  # full: the third waits
    assert ms.staging.area.num_waiting == 1
    acts = ms.message("tcp://p0", landed(7, 0, 0, 0), 2.1)
    (sc,) = of(acts, Scatter)
    assert sc.slot == 0 and int(sc.src[0]) == AREA_BASE and int(sc.dst[0]) == PAGES_BASE + 10 * ms.page_bytes
    assert sends(acts, wire.SlotGrant) == []  # the slot is busy until the shell scattered it
    acts = ms.scattered(7, 0, 2.2)
    (to, g), = sends(acts, wire.SlotGrant)
    assert to == ("tcp://p0",) and (g.chunk, g.slot) == (1, 0)  # the waiter gets the freed slot
    ms.message("tcp://p1", landed(7, 1, 0, 1), 2.3)  # landed, not yet scattered
    ms.message("tcp://p1", done(7, 1, [1]), 2.4)
    ms.memory.land(1, 7)
    ms.message("tcp://p0", done(7, 0, [0, 2], aux=True, num_tokens=10), 2.5)
    assert r.state.state == KVPoll.Transferring  # every page reported, but one chunk is not scattered
    ms.scattered(7, 1, 2.6)
    assert r.state.state == KVPoll.Success


def test_a_scatter_list_outside_the_rooms_pages_fails_the_room_when_asked_and_no_slot_is_granted(ms):
    r = requested(ms)
    acts = ms.message("tcp://p0", ask(ms, 7, 0, 0, 40), 2.0)  # page 40 is not the room's
    assert r.state.state == KVPoll.Failed and "chunk 0's scatter list writes into pages this room does not hold" \
        in r.state.reason
    assert sends(acts, wire.SlotGrant) == [] and len(sends(acts, wire.Abort)) == 2
    assert ms.staging.area.num_free == 2 and not ms.staging.lists and not ms.staging.list_bytes


def test_a_chunks_checked_list_is_kept_until_it_lands_and_dropped_with_a_failed_room(ms, monkeypatch):
    """Wire 16: the list a SlotRequest carries is kept (and counted per asking endpoint) until its
    chunk lands; a room that fails drops its lists; a chunk that asks again before it landed, or
    an endpoint whose lists of chunks not landed would pass the cap, fails the room by name,
    before any slot is granted to that request."""
    from kvbridge.transfer.decode import staging as decode_staging

    st = ms.staging
    requested(ms)
    ms.message("tcp://p0", ask(ms, 7, 0, 0, 10), 2.0)
    ms.message("tcp://p0", ask(ms, 7, 0, 1, 11), 2.0)
    assert len(st.lists) == 2 and st.list_bytes == {"tcp://p0": 48}
    ms.message("tcp://p0", landed(7, 0, 0, 0), 2.1)
    assert len(st.lists) == 1 and st.list_bytes == {"tcp://p0": 24}  # chunk 0's taken by its landing
    r = ms.rooms[7]
    acts = ms.message("tcp://p0", ask(ms, 7, 0, 1, 12), 2.2)  # chunk 1 again, before it landed
    assert r.state.state == KVPoll.Failed and "chunk 1 asked for a slot again before it landed" in r.state.reason
    assert sends(acts, wire.SlotGrant) == [] and not st.lists and not st.list_bytes  # the failed room's lists dropped

    monkeypatch.setattr(decode_staging, "LISTS_CAP_BYTES", 40)  # room for one list of one entry from an endpoint
    ms.close(r, 2.3)
    r = requested(ms, 8, now=2.3)
    ms.message("tcp://p1", ask(ms, 8, 1, 0, 10), 2.4)
    acts = ms.message("tcp://p1", ask(ms, 8, 1, 1, 11), 2.4)
    assert r.state.state == KVPoll.Failed and "lists of chunks not landed 48 B, over 40 B" in r.state.reason
    assert sends(acts, wire.SlotGrant) == [] and not st.lists and not st.list_bytes


def test_a_failed_staged_room_frees_pages_at_once_and_quarantines_its_slot_until_the_ack(ms):
    from kvbridge.transfer.staging.area import SlotState

    r = requested(ms)
    ms.message("tcp://p0", ask(ms, 7, 0, 0, 10), 2.0)
    ms.message("tcp://p1", ask(ms, 7, 1, 0, 11), 2.0)
    acts = ms.message("tcp://p1", landed(7, 1, 0, 1), 2.0)  # landed: its scatter starts
    (scatter,) = [a for a in acts if type(a).__name__ == "Scatter"]
    ms.abort(r, "user cancelled", 2.1)
    area = ms.staging.area
    assert area.state(0) is SlotState.QUARANTINED  # cp0's chunk may still land in slot 0
    assert area.state(1) is SlotState.SCATTERING and not r.pages_releasable  # the copy still writes the pages
    ms.scattered(7, scatter.slot, 2.15)
    assert r.pages_releasable  # staged only: no remote write lands in the pages
    assert area.state(1) is SlotState.FREE  # cp1's landed chunk: nothing more lands there
    ms.message("tcp://p1", wire.AbortAck(room=7, cp_rank=1), 2.2)
    assert area.state(0) is SlotState.QUARANTINED  # another sender's ack frees nothing of cp0's
    ms.close(r, 2.3)
    assert 7 not in ms.rooms  # forgotten at once; a late ack still frees the slot
    ms.message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 2.4)
    assert area.num_free == 2


def test_a_quarantined_slot_of_a_silent_sender_frees_after_lease_and_quarantine(ms):
    r = requested(ms)
    ms.message("tcp://p0", ask(ms, 7, 0, 0, 10), 2.0)
    ms.abort(r, "user cancelled", 2.1)
    ms.tick(2.1 + 4.9)
    assert ms.staging.area.num_free == 1
    ms.tick(2.1 + 5.1)  # lease_ttl 2 + lease_quarantine 3
    assert ms.staging.area.num_free == 2 and ms.staging.area.counters["expired"] == 1


def test_a_chunk_reported_in_a_slot_it_was_not_granted_fails_the_room(ms):
    r = requested(ms)
    ms.message("tcp://p0", ask(ms, 7, 0, 0, 10), 2.0)
    ms.message("tcp://p1", landed(7, 1, 0, 0), 2.1)  # slot 0 is cp0's
    assert r.state.state == KVPoll.Failed and "which it was not granted" in r.state.reason


def test_a_staged_only_room_refuses_a_write_that_came_through_no_slot(ms):
    r = requested(ms)
    ms.message("tcp://p0", ask(ms, 7, 0, 0, 10), 2.0)
    ms.message("tcp://p0", landed(7, 0, 0, 0), 2.1)
    ms.scattered(7, 0, 2.2)
    ms.message("tcp://p0", done(7, 0, [0]), 2.3)  # came through slot 0: counted
    assert r.state.state == KVPoll.Transferring
    ms.message("tcp://p1", done(7, 1, [1]), 2.4)  # cp1 landed nothing in staging
    assert r.state.state == KVPoll.Failed and "came through no staging slot" in r.state.reason


def test_a_slot_still_scattering_is_never_granted_or_reported_into_and_every_free_slot_is_granted_at_once(ms):
    """Credits on decode: every free slot is granted the turn it is asked for; a slot whose scatter
    has not completed is neither granted again nor accepted as a landing (refused by name)."""
    from kvbridge.transfer.decode.staging import Scatter
    from kvbridge.transfer.staging.area import SlotState

    r = requested(ms)
    granted = [g.slot for c, k in ((0, 0), (0, 1)) for _, g in sends(ms.message("tcp://p0", ask(ms, 7, c, k, 10 + k), 2.0),
                                                                     wire.SlotGrant)]
    assert granted == [0, 1]  # two asks, two free slots: both granted at once
    assert sends(ms.message("tcp://p1", ask(ms, 7, 1, 0, 11), 2.0), wire.SlotGrant) == []  # none free: it waits
    (sc,) = of(ms.message("tcp://p0", landed(7, 0, 0, 0), 2.1), Scatter)
    assert ms.staging.area.state(0) is SlotState.SCATTERING and ms.staging.area.num_waiting == 1
    ms.tick(2.15)
    assert ms.staging.area.state(0) is SlotState.SCATTERING  # no grant of a slot whose copy still runs
    acts = ms.message("tcp://p0", landed(7, 0, 0, 0), 2.2)  # a second landing into it
    assert r.state.state == KVPoll.Failed and "landed not allowed in state SCATTERING" in r.state.reason
    assert ms.staging.area.state(0) is SlotState.SCATTERING and not r.pages_releasable  # its copy still writes
    acts = ms.scattered(7, sc.slot, 2.3)
    assert ms.staging.area.state(0) is not SlotState.SCATTERING and r.pages_releasable


def test_a_grant_past_the_area_is_refused_by_the_slot_table():
    from kvbridge.errors import StagingSlotError
    from kvbridge.transfer.staging.area import StagingArea

    area = StagingArea(2, 64, rank="d0")
    for call in (lambda: area.landed(2, 1, 0), lambda: area.scatter(5), lambda: area.release(-1)):
        with pytest.raises(StagingSlotError, match="outside the area's 2 slots") as err:
            call()
        assert err.value.rank == "d0" and err.value.field == "slot"


# ---- the door: every event type the machine takes, fed through feed() -------------------------------

def test_every_event_type_of_the_decode_machine_is_fed_through_its_one_door(ms):
    """``decode.events.EVENTS`` lists what DecodeRooms.feed takes; rooms walk through every type
    (a new event type without a case here fails). The machine reads no memory: a commit asks the
    shell for the aux row (ReadForCommit) and a Challenge for an echo (EchoScratch); anything
    that is not an event is refused."""
    from kvbridge.transfer.actions import AbortRoom, CloseRoom, Shutdown, Tick
    from kvbridge.transfer.decode import events as ev
    from kvbridge.transfer.decode.staging import Scatter

    dm = ms.machine
    fed: set[type] = set()

    def feed(event):
        fed.add(type(event))
        return dm.feed(event)

    feed(ev.Registered("dec-id"))
    feed(ev.SetStaging("always"))
    r = dm.open(7, INSTANCE, None, 1.0)
    (look,) = of(feed(Tick(1.0)), ev.LookUp)
    feed(ev.LookedUp(7, look.key, topology(1), None, 1.0))
    (_, req), = sends(feed(ev.Init(r, np.array([10, 11, 12]), 1, 10, 0, 1.0)), wire.TransferRequest)
    assert req.decode_rank_id == "dec-id"
    # one page through a staging slot: grant, land, scatter (done, and another that failed)
    (_, grant), = sends(feed(ev.Message("tcp://p0", ask(ms, 7, 0, 0, 10), 1.1)), wire.SlotGrant)
    (sc,) = of(feed(ev.Message("tcp://p0", landed(7, 0, 0, grant.slot), 1.2)), Scatter)
    feed(ev.Scattered(7, sc.slot, 1.2))
    acts = feed(ev.Message("tcp://p0", wire.PagesDone(room=7, cp_rank=0, status="ok", reason="", pools=["target"],
                                                      logical_pages=np.asarray([0, 1, 2], "<i4").tobytes(),
                                                      digests=None, aux=True, num_tokens=10), 1.3))
    (read,) = of(acts, ev.ReadForCommit)  # every page written: the shell reads the row, the machine checks it
    assert read == ev.ReadForCommit(7, 1, ()) and r.state.state == KVPoll.Transferring
    ms.memory.land(1, 7)
    row, read_s = ms.memory.read(read.aux_slot)
    feed(ev.CommitRead(7, row, read_s, (), None, 1.4))
    assert r.state.state == KVPoll.Success
    feed(ev.AuxRowWritten(7, 1e-4, None, 1.45))  # (an answer for a room that ended: nothing happens)
    assert r.state.state == KVPoll.Success
    feed(CloseRoom(r, 1.5))
    r2 = dm.open(8, INSTANCE, None, 2.0)
    feed(Tick(2.0))
    feed(ev.Init(r2, np.array([20, 21, 22]), 2, 10, 0, 2.0))
    (_, grant), = sends(feed(ev.Message("tcp://p0", ask(ms, 8, 0, 0, 20), 2.1)), wire.SlotGrant)
    (sc,) = of(feed(ev.Message("tcp://p0", landed(8, 0, 0, grant.slot), 2.2)), Scatter)
    feed(ev.ScatterFailed(8, sc.slot, "copy refused", 2.2))
    assert r2.state.state == KVPoll.Failed and "copy refused" in r2.state.reason
    feed(AbortRoom(r2, "again", 2.3))  # (already failed: nothing more)
    r3 = dm.open(9, INSTANCE, None, 2.3)  # topology cached: the release goes out at once, and the room is done
    (_, rel), = sends(feed(ev.Release(r3, "prefix hit", 2.3)), wire.Release)
    assert rel.room == 9 and rel.decode_rank_id == "dec-id" and r3.state.state == KVPoll.Success
    # the answers of the shell's pool threads, a prefill rank's Challenge, the clock, the end
    feed(ev.Refreshed(("pre", 0), None, 2.4))
    feed(ev.LeaseChecked("tcp://p0", "rank0", False, 2.4))
    dm.scratch = True  # (a rank that registered a scratch region)
    (echo,) = of(dm.feed(ev.Message("tcp://p0", wire.Challenge(offset=32), 2.5)), ev.EchoScratch)
    assert echo == ev.EchoScratch("tcp://p0", 32)  # read and sent by the shell
    feed(ev.InitKinds(r2, {}))  # the engine's kind units (a paged model has none: nothing claimed)
    feed(Shutdown("the endpoint closes", 3.0))
    assert fed == set(ev.EVENTS), set(ev.EVENTS) - fed
    with pytest.raises(TypeError, match="does not take"):
        dm.feed(wire.Ping(decode_rank="x", seq=1))
