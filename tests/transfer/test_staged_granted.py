"""Decode slots granted with a room's TransferRequest (``DecodeConfig.staging_granted_slots``,
wire 18): each sender's first chunk of the room holds a slot from the request on, so it is
written as soon as it is gathered, its SlotRequest (the scatter list decode checks) sent first and
no SlotGrant coming for it. Real endpoints in one process over the local engine against a real
daemon (the rooms byte for byte, back-pressure with the kept slots, a grant no chunk used, an
abort, forged grants); the sans-I/O book of decode's staging for a misbehaving sender; the same
room between processes over Mooncake TCP is in test_staged_rooms.py."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest

from _cluster import wait_final, wait_until
from _local import ProvingPeers, replies, rogue_request
from kvbridge.errors import LedgerError
from kvbridge.layout import BufferDesc
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode.staging import DecodeStaging, Scatter
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.staging.area import SlotState, StagingArea
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, make_aux
from test_staged_local import GATHER, SLOT, land_many, land_room, send_random

KEPT = dict(staging="always", staging_bytes=4 * SLOT, staging_slot_bytes=SLOT, staging_granted_slots=2)


def kept_cluster(cluster, cp: int = 2, **kw):
    return cluster(cp=cp, prefill_cfg=kw.pop("prefill_cfg", GATHER), **{**KEPT, **kw})


def reserved_free(c) -> int:
    return c.decode.locked(lambda: c.decode.staging.area.num_free_reserved)


@pytest.mark.parametrize("cp", [1, 2])
def test_first_chunks_granted_with_the_request_are_written_without_waiting_for_a_grant(cluster, cp):
    """Each prefill rank's first chunk of the room writes into the slot its request granted: its
    SlotRequest goes before its write, no SlotGrant comes for it (a second grant of a chunk fails
    its target by name), the later chunks ask as before; the room lands byte for byte and the kept
    slots are free again."""
    c = kept_cluster(cluster, cp=cp)
    seen: list[tuple[int, str, int]] = []  # (rank, what, wire chunk or -1), in order
    for rank, ep in enumerate(c.prefill):
        reply, submit = ep._reply, ep.engine.submit_write
        lo, hi = ep.gather.base, ep.gather.base + ep.gather.nbytes

        def sent(ident, msg, _rank=rank, _reply=reply):
            if type(msg) is wire.SlotRequest:
                seen.append((_rank, "ask", msg.chunk))
            _reply(ident, msg)

        def post(session, src, dst, length, *, after=None, _rank=rank, _submit=submit, _lo=lo, _hi=hi):
            if len(src) and _lo <= int(np.min(src)) < _hi:
                seen.append((_rank, "post", -1))
            return _submit(session, src, dst, length, after=after)

        ep._reply, ep.engine.submit_write = sent, post
    senders = land_room(c, 11, 64, 3 + cp)  # 16 pages: several chunks per rank through 4 KiB slots
    book = c.decode.machine.staging.counters
    assert book["granted_with_request"] == book["granted_with_request_used"] == cp, book
    for rank, (ep, s) in enumerate(zip(c.prefill, senders)):
        assert s.stats["chunks"] > 2 and set(s.stats["paths"].values()) == {"staged"}
        assert ep.machine.stage.counters["grants_with_request_used"] == 1, ep.machine.stage.counters
        order = [(what, chunk) for who, what, chunk in seen if who == rank]
        assert order[0] == ("ask", 0), order  # chunk 0's list goes before anything of it is written
    # every other chunk asked and was granted: requests = chunks, grants = requests less the first chunks
    assert book["slot_requests"] == sum(s.stats["chunks"] for s in senders)
    assert book["granted_at_once"] + book["slot_waits"] == book["slot_requests"] - cp
    assert wait_until(lambda: reserved_free(c) == 2, 10)
    assert c.decode.locked(lambda: c.decode.staging.area.num_free) == 2


def test_many_rooms_with_kept_slots_none_fails_and_every_slot_comes_back(cluster):
    """Back-pressure with kept slots: five rooms of two CP ranks at once, one kept slot and two for
    the chunks that ask; rooms that found the kept slot taken ask as before. None fails, every
    room lands byte for byte, nothing is left held."""
    c = kept_cluster(cluster, staging_bytes=3 * SLOT, staging_granted_slots=1)
    land_many(c, range(200, 205), 48, 8)
    area = c.decode.staging.area
    assert area.counters["reserved"] >= 1 and area.counters["reserve_refused"] >= 1, area.counters
    assert wait_until(lambda: reserved_free(c) == 1, 10)
    assert c.decode.locked(lambda: (area.num_free, area.num_waiting)) == (2, 0)


def test_a_kept_slot_no_chunk_used_is_free_when_the_room_commits(cluster):
    """Decode offers its area (auto) and grants a kept slot to each rank's first chunk; prefill
    stages nothing (staging never) and writes the pages directly. The room commits, and the slots
    granted with its request, never written, are free at once."""
    c = kept_cluster(cluster, cp=2, staging="auto", prefill_cfg=dict(staging="never"))
    senders = land_room(c, 12, 40, 12)
    assert all(set(s.stats["paths"].values()) == {"direct"} for s in senders)
    book = c.decode.machine.staging.counters
    assert book["granted_with_request"] == book["granted_with_request_unused"] == 2, book
    assert book["slot_requests"] == 0
    assert reserved_free(c) == 2  # freed in the commit's own turn


def test_an_aborted_room_quarantines_its_granted_slot_until_prefill_acknowledges(cluster):
    """The first chunk's write into its granted slot is held in flight; the room is aborted: the
    slot (a write may still land in it) is QUARANTINED, not freed, until the prefill rank
    acknowledges the abort; nothing reaches the pages."""
    c = kept_cluster(cluster, cp=1)
    gate = threading.Event()
    c.prefill[0].engine.faults.gate = gate
    n, pages = 40, np.arange(20, 30)
    r = c.decode.receiver(3, f"{c.name}-p")
    r.init(pages, 0, n)
    senders = send_random(c, 3, n, np.random.default_rng(4))
    area = c.decode.staging.area
    first_kept = area.num_slots - area.reserved  # the kept slots are the area's last; the first goes first
    assert wait_until(lambda: c.prefill[0].machine.stage.counters["grants_with_request_used"] == 1, 10)
    r.abort("user cancelled")
    assert r.poll() == KVPoll.Failed
    assert c.decode.locked(lambda: area.state(first_kept)) is SlotState.QUARANTINED
    gate.set()
    wait_final(senders)
    assert wait_until(lambda: reserved_free(c) == 2, 10), "freed once prefill acknowledged the abort"
    for buf in c.dbufs.values():
        assert (as_bytes(buf).reshape(64, -1)[pages] == SENTINEL_BYTE).all(), "a write reached the pages"


@pytest.mark.parametrize("granted, offered, why", [
    ([4], True, "granted slots [4] with its request: each must be one of its 4 staging slots"),
    ([1, 1], True, "granted slots [1, 1] with its request: each must be one of its 4 staging slots, none twice"),
    ([0], False, "granted staging slots [0] with a request that offers no staging area"),
])
def test_a_forged_grant_in_a_request_is_refused_by_name_and_nothing_is_written(cluster, granted, offered, why):
    """A request (authenticated, its connection proven) granting a slot outside the registered area,
    the same slot twice, or a slot with no area offered: the room's decider refuses it naming
    ``staging_granted``; not a byte is written anywhere."""
    c = kept_cluster(cluster, cp=1)
    area = c.decode.staging.descriptor
    staging = dict(staging_slots=area.num_slots, staging_slot_bytes=area.slot_bytes, staging_base=area.base,
                   staging_only=True) if offered else {}
    request = msgspec.structs.replace(rogue_request(c, 97, 8, rank_id=c.decode.rank_id), staging_granted=granted,
                                      **staging)
    peers = ProvingPeers(c.decode)
    ep = c.prefill[0]
    try:
        s = ep.sender(97)
        s.init(8)
        peers.send(ep.endpoint, request)
        got = replies(peers, 1)
        s.send(np.arange(2), np.arange(2) + 10, is_last=True, aux=make_aux(c.aux_schema, 97, 8))
    finally:
        peers.close()
    failed = [m for m in got if isinstance(m, wire.PagesDone)]
    assert len(failed) == 1 and failed[0].status == "failed", got
    assert why in failed[0].reason and "field=staging_granted" in failed[0].reason, failed[0].reason
    wait_final([s])
    assert s.poll() == KVPoll.Failed and ep.counters["bytes"] == 0
    assert all((as_bytes(b) == SENTINEL_BYTE).all() for b in c.dbufs.values())


# ---- decode's book, sans-I/O -------------------------------------------------------------------

DESCS = [BufferDesc("kv", 0, 1 << 20, 64, 256)]
SENDER = (0, 0, 0)


def book(reserved: int = 1) -> DecodeStaging:
    return DecodeStaging(StagingArea(3, 1 << 12, rank="d", reserved=reserved), 1 << 40, DESCS, "d")


def ask(room: int, chunk: int, pages=(3,)) -> wire.SlotRequest:
    dst = np.array([(1 << 20) + p * 256 for p in pages], dtype=np.uint64)
    off = np.arange(len(pages), dtype=np.uint64) * np.uint64(256)
    return wire.SlotRequest(room=room, cp_rank=0, chunk=chunk, num_bytes=256 * len(pages),
                            scatter=wire.pack_scatter(off, dst, np.full(len(pages), 256, dtype=np.uint64)))


def test_decodes_book_answers_a_granted_chunks_request_with_no_grant_and_checks_its_list():
    ds, out = book(), []
    assert ds.grant_with_request(5, SENDER) == [2]
    assert ds.grant_with_request(5, SENDER, again=True) == [2]  # the request sent again: the same slot
    assert ds.grant_with_request(6, SENDER) == []  # the one kept slot is taken: room 6's first chunk asks
    ds.request(5, SENDER, "p0", ask(5, 0), np.array([3]), -1, out)
    assert out == [] and ds.counters["granted_with_request_used"] == 1  # no SlotGrant for it
    ds.request(5, SENDER, "p0", ask(5, 1), np.array([3]), -1, out)
    assert [type(a.msg) for a in out] == [wire.SlotGrant] and out[0].msg.slot == 0  # a later chunk asks
    out.clear()
    ds.landed(5, SENDER, wire.ChunkLanded(room=5, cp_rank=0, chunk=0, slot=2, status="ok", reason=""), out)
    assert [type(a) for a in out] == [Scatter] and out[0].slot == 2
    ds.scattered(5, 2, out)
    assert ds.area.num_free_reserved == 1
    # a list into a page the room does not hold fails the room before anything lands
    assert ds.grant_with_request(7, SENDER) == [2]
    with pytest.raises(LedgerError, match="writes into pages this room does not hold"):
        ds.request(7, SENDER, "p0", ask(7, 0, pages=(9,)), np.array([3]), -1, [])


def test_a_granted_chunk_that_reports_a_landing_before_its_list_fails_the_room():
    """A sender that writes into its granted slot and reports it landed without having sent the
    chunk's scatter list: nothing is scattered (LedgerError names the missing list), the slot is free."""
    ds, out = book(), []
    assert ds.grant_with_request(5, SENDER) == [2]
    with pytest.raises(LedgerError, match="chunk 0 landed with no checked scatter list"):
        ds.landed(5, SENDER, wire.ChunkLanded(room=5, cp_rank=0, chunk=0, slot=2, status="ok", reason=""), out)
    assert not any(isinstance(a, Scatter) for a in out) and ds.area.num_free_reserved == 1
    assert ds.with_request == {}


def test_a_granted_slot_of_another_chunk_is_refused_and_an_unused_one_freed_only_at_the_commit():
    ds, out = book(), []
    assert ds.grant_with_request(5, SENDER) == [2]
    with pytest.raises(LedgerError, match="chunk 1 reported in slot 2, which it was not granted"):
        ds.landed(5, SENDER, wire.ChunkLanded(room=5, cp_rank=0, chunk=1, slot=2, status="ok", reason=""), out)
    assert ds.area.state(2) is SlotState.ASSIGNED  # still chunk 0's
    ds.room_done(5, out)
    assert ds.area.state(2) is SlotState.FREE and ds.counters["granted_with_request_unused"] == 1
    # a failed room's granted slot is quarantined (a write may still land), not freed
    assert ds.grant_with_request(6, SENDER) == [2]
    ds.fail_room(6, 100.0, out)
    ds.room_done(6, out)  # (nothing: the room failed)
    assert ds.area.state(2) is SlotState.QUARANTINED
    ds.sender_quiet(6, SENDER, out)
    assert ds.area.state(2) is SlotState.FREE
    assert not any(isinstance(a, Send) for a in out)


def test_kept_slots_must_leave_one_for_the_asks_and_be_a_count():
    """A decode rank that would keep every slot of its area for grants sent with requests (none
    left for a chunk that asks) or a negative count is refused at start-up, naming the setting."""
    from kvbridge.errors import ConfigError
    from kvbridge.transfer.decode import DecodeConfig
    from kvbridge.transfer.staging.buffer import StagingBuffer

    assert StagingBuffer(4 * SLOT, SLOT, rank="d", reserved=3).area.num_free == 1
    with pytest.raises(ConfigError, match="would keep every one of the staging area's 4 slots") as err:
        StagingBuffer(4 * SLOT, SLOT, rank="d", reserved=4)
    assert err.value.field == "staging_granted_slots"
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="staging_granted_slots must be an integer >= 0") as err:
            DecodeConfig(instance="d", staging_granted_slots=bad)
        assert err.value.field == "staging_granted_slots"
