"""Rooms end to end: prefill CP ranks in real processes write through real
Mooncake TCP (and real NIXL over UCX) on loopback into decode ranks in this process;
every byte checked.

Pools are poisoned (SENTINEL_BYTE) before a transfer: padding rows and the tail
of a partial last page must keep the poison, pages outside a room must stay
untouched, and the aux row must be the owner-of-last-token's row for this room.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final, wait_until
from _local import ProvingPeers
from kvbridge.bootstrap.contract import fingerprint
from kvbridge.errors import PageRangeError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll

from _engines import needs_mooncake, needs_nixl

PAGE = 4


def scattered_pages(rng: np.random.Generator, num_pages: int, capacity: int, taken: set[int]) -> np.ndarray:
    free = np.array(sorted(set(range(capacity)) - taken))
    pages = rng.choice(free, size=num_pages, replace=False)
    taken.update(pages.tolist())
    return pages


# every CP size over Mooncake; CP 1 and 2 over NIXL (the same tests, the other engine)
@pytest.fixture(scope="module", params=[pytest.param((cp, "mooncake"), id=f"cp{cp}", marks=needs_mooncake)
                                        for cp in (1, 2, 4)]
                + [pytest.param((cp, "nixl"), id=f"nixl-cp{cp}", marks=needs_nixl) for cp in (1, 2)])
def prefill(request, daemon):
    cp, engine = request.param
    procs = []
    try:
        for rank in range(cp):
            procs.append(PrefillProc(daemon.url, rank, cp, instance=f"prefill-{engine}-cp{cp}", engine=engine))
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("num_decode", [1, 2])
def test_batch_of_rooms_arrives_byte_exact(prefill, daemon, num_decode):
    """bs > 1: rooms of random lengths (partial last pages), chunked sends, target +
    index + draft pools, into one or two decode ranks; every byte compared."""
    cp = len(prefill)
    rng = np.random.default_rng(cp * 10 + num_decode)
    decodes = [DecodeRank(daemon.url, tp_rank=t, tp_size=num_decode, engine=prefill[0].engine,
                          instance=f"decode-{prefill[0].engine}") for t in range(num_decode)]
    try:
        taken = [set() for _ in decodes]
        rooms = []
        for i in range(5):
            room = 1000 * cp + 100 * num_decode + i
            n = int(rng.integers(1, 120))
            cuts = sorted(set(rng.integers(1, n + 1, size=int(rng.integers(0, 3))).tolist()) | {n})
            receivers = []
            for d, tk in zip(decodes, taken):
                pages = scattered_pages(rng, -(-n // PAGE), d.pages, tk)
                receivers.append(d.receive(room, n, pages, prefill=prefill[0].instance))
            for p in prefill:
                p.send(room, n, chunks=cuts)
            rooms.append((room, receivers))
        wait_final([r for _, rs in rooms for r in rs])
        for room, receivers in rooms:
            for d, r in zip(decodes, receivers):
                assert r.poll() == KVPoll.Success, r.failure_reason
                assert d.verify(r) == []
                assert r.aux.room == room
            for p in prefill:
                assert p.result(room)["state"] == "Success"
        for d, tk in zip(decodes, taken):
            assert d.untouched_except(np.array(sorted(tk)))
    finally:
        for d in decodes:
            d.close()


def test_out_of_range_destination_is_refused_before_any_write(prefill, daemon):
    cp = len(prefill)
    d = DecodeRank(daemon.url, pages=64, engine=prefill[0].engine, instance=f"decode-{prefill[0].engine}")
    peers = ProvingPeers(d.ep)
    try:
        # the decode side refuses its own bad page ids at once
        r = d.ep.receiver(7001, prefill[0].instance)
        with pytest.raises(PageRangeError, match="registered capacity"):
            r.init(np.array([0, 64]), 0, 2 * PAGE)
        r.abort("test")
        # a request that slips a bad page past decode is refused by the room's decider (cp 0), nothing
        # written; the other CP ranks hold the claim for the decider's RoomTicket (tickets.py), which
        # never comes: the decode rank's Abort, as a refused decode sends it, withdraws it there
        room, n = 7002, 3 * PAGE + 1
        for p in prefill:
            p.send(room, n)
            peers.send(p.endpoint, wire.TransferRequest(
                room=room, decode_rank="rogue/dp0/tp0", decode_rank_id=d.ep.rank_id,
                page_ids=wire.pack_pages(np.array([1, 2, 3, 64])), first_page=0, pools=sorted(d.specs), aux_slot=0,
                num_tokens=n, deadline_ms=10_000, want_digest=False, fingerprint=fingerprint(d.ep.contract),
                num_decode_ranks=1))
        replies = []
        assert wait_until(lambda: replies.extend(peers.recv_ready(50)) or len(replies) >= 1, 20)
        (endpoint, msg), = replies
        assert endpoint == prefill[0].endpoint, (endpoint, msg)
        assert isinstance(msg, wire.PagesDone) and msg.status == "failed", msg
        assert "destination page 64 outside" in msg.reason and "nothing written" in msg.reason
        assert prefill[0].result(room)["state"] == "Failed"
        for p in prefill[1:]:
            peers.send(p.endpoint, wire.Abort(room=room, decode_rank="rogue/dp0/tp0", reason="refused by the decider",
                                              decode_rank_id=d.ep.rank_id))
        more = []
        assert wait_until(lambda: more.extend(peers.recv_ready(50)) or len(more) >= cp - 1, 20), more
        for _, msg in more:  # acked; never a success
            assert isinstance(msg, wire.AbortAck) or (isinstance(msg, wire.PagesDone) and msg.status == "failed"), msg
        for p in prefill[1:]:  # acked once quiet: a wrongly written room has succeeded by now; the engine ends
            p.command(op="abort", room=room, reason="ended by the test")  # the rest (else it waits target_timeout)
            assert p.result(room)["state"] != "Success"
        assert d.untouched_except(np.array([], dtype=np.int64))
        assert not d.aux.any(), "no aux row may be written either"
    finally:
        peers.close()
        d.close()


def test_abort_during_transfer_waits_for_acks(prefill, daemon):
    cp = len(prefill)
    d = DecodeRank(daemon.url, engine=prefill[0].engine, instance=f"decode-{prefill[0].engine}")
    try:
        room, n = 8001, 16 * PAGE
        recv = d.receive(room, n, np.arange(100, 116), prefill=prefill[0].instance)
        for p in prefill:  # first half now, the rest after a long pause
            p.send(room, n, chunks=[n // 2, n], pause=30)
        assert wait_until(lambda: recv.stats.get("pages_by_rank"), 30)
        recv.abort("client went away")
        assert recv.poll() == KVPoll.Failed and "client went away" in recv.failure_reason
        assert wait_until(lambda: recv.pages_releasable, 10), "every prefill rank must ack the abort"
        for p in prefill:
            res = p.result(room)
            assert res["state"] == "Failed" and "aborted" in res["reason"]
        # a room after the abort still works on the same ranks
        ok = d.receive(8002, 5, np.array([200, 201]), prefill=prefill[0].instance)
        for p in prefill:
            p.send(8002, 5)
        wait_final([ok])
        assert ok.poll() == KVPoll.Success and d.verify(ok) == []
    finally:
        d.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")
def test_thousand_rooms_in_flight_use_bounded_threads(daemon):
    p = PrefillProc(daemon.url, 0, 1, "--pages", "2048", instance="prefill-burst")
    d = DecodeRank(daemon.url, pages=2048, aux_rows=1024, instance="decode-burst")
    try:
        rooms = list(range(50_000, 51_000))
        threads_before = threading.active_count()
        receivers = [d.receive(room, PAGE, np.array([i]), prefill="prefill-burst") for i, room in enumerate(rooms)]
        threads_in_flight = threading.active_count() - threads_before
        p.command(op="burst", rooms=rooms, num_tokens=PAGE)
        wait_final(receivers, timeout=120)
        # at most the look-up pool's 4 threads appear, however many rooms are in flight
        assert threads_in_flight <= 4, f"{threads_in_flight} new threads for 1,000 rooms"
        failed = [(r.room, r.failure_reason) for r in receivers if r.poll() != KVPoll.Success]
        assert not failed, failed[:3]
        assert all(not d.verify(r) for r in receivers[::97])
    finally:
        d.close()
        p.stop()
