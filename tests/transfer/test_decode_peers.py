"""What a prefill rank knows of its decode ranks: their registered buffers, read from the
daemon once and off the loop; their liveness (issue 10 bug 3); requests that cannot be
served are refused at the boundary without ending a loop (issue 10 bug 1). And the
decode side's topology cache, which must expire under steady traffic (issue 10 bug 2)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np

from _cluster import wait_final, wait_until
from _local import ProvingPeers, replies, rogue_request
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel import PeerSet
from kvbridge.transfer.poll import KVPoll


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(m[2]) for m in re.finditer(rf"^{name}\{{(.*?)\}} (\S+)$", text, re.M)
               if all(w in m[1] for w in want))


def test_a_decode_ranks_buffers_are_read_from_the_daemon_once(cluster, daemon):
    c = cluster(cp=2)
    before = metric(daemon.url, "kvbridge_bootstrap_http_requests_total", route="/v1/ranks/{rank_id}", method="GET")
    for room in range(60, 65):
        r = c.decode.receiver(room, f"{c.name}-p")
        r.init(np.array([0, 1, 2]) + 3 * (room - 60), 0, 10)
        senders = c.send(room, 10)
        wait_final([r, *senders])
        assert r.poll() == KVPoll.Success, r.failure_reason
    after = metric(daemon.url, "kvbridge_bootstrap_http_requests_total", route="/v1/ranks/{rank_id}", method="GET")
    # one read of the decode rank's registration per prefill rank, and cp 1's one read of its room
    # decider's registration (the key its RoomTickets verify under: transfer/prefill/tickets.py); then cached
    assert after - before == 3


def test_a_request_from_an_unregistered_rank_is_refused_naming_it(cluster):
    c = cluster(cp=1)
    peers = PeerSet(name="feedfacecafebeef")
    try:
        peers.send(c.prefill[0].endpoint, rogue_request(c, 70, 8, rank_id="feedfacecafebeef"))
        (msg,) = replies(peers, 1)
        assert isinstance(msg, wire.ErrorReply) and msg.room == 70
        assert "decode rank rogue/dp0/tp0 (registration feedfacecafebeef) is not registered" in msg.reason
    finally:
        peers.close()


def test_reading_a_registration_never_blocks_the_loop(cluster):
    c = cluster(cp=1)
    ep = c.prefill[0]
    answered, slow = threading.Event(), ep.bootstrap.rank

    def held_rank(rank_id: str):
        answered.wait(10)  # the daemon is slow to answer
        return slow(rank_id)

    ep.bootstrap.rank = held_rank
    peers = ProvingPeers(c.decode)
    try:
        peers.send(ep.endpoint, rogue_request(c, 71, 8, rank_id=c.decode.rank_id))
        peers.send(ep.endpoint, wire.Ping(decode_rank="rogue/dp0/tp0", seq=1))
        (beat,) = replies(peers, 1)  # answered while the registration is still being read
        assert isinstance(beat, wire.Heartbeat) and beat.seq == 1
    finally:
        answered.set()
        peers.close()


def test_a_request_without_an_aux_slot_is_refused_and_the_rank_keeps_serving(cluster):
    """Issue 10 bug 1: an authenticated request that leaves the aux row nowhere to go crashed
    the worker when its aux row was posted. It is refused at the boundary; send() still works."""
    c = cluster(cp=1, prefill_secret=b"s3cret", decode_secret=b"s3cret")
    ep = c.prefill[0]
    peers = ProvingPeers(c.decode, secret=b"s3cret")
    try:
        peers.send(ep.endpoint, rogue_request(c, 72, 8, rank_id=c.decode.rank_id, aux_slot=-1))
        (msg,) = replies(peers, 1)
        assert msg.status == "failed" and "aux slot -1 outside the 8 rows" in msg.reason
        (s,) = c.send(72, 8)  # the owner of the last token posts its aux row: no exception
        wait_final([s])
        assert s.poll() == KVPoll.Failed and "aux slot -1" in s.failure_reason
    finally:
        peers.close()
    r = c.decode.receiver(73, f"{c.name}-p")  # the loop kept serving
    r.init(np.array([0, 1]), 0, 8)
    senders = c.send(73, 8)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success and c.verified(73, 8, np.array([0, 1]))


def test_a_silent_decode_rank_fails_its_prefill_targets_naming_it(cluster):
    """Issue 10 bug 3: a dead decode rank's rooms waited for the transfer timeout with a
    generic reason. Its pings stop; prefill fails its targets within peer_timeout."""
    c = cluster(cp=2, prefill_cfg={"peer_timeout": 1.0})
    r = c.decode.receiver(74, f"{c.name}-p")
    r.init(np.array([0, 1, 2]), 0, 10)
    senders = [ep.sender(74) for ep in c.prefill]  # the engine has not computed anything yet
    for s in senders:
        s.init(10)
    assert wait_until(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders), 10)
    c.decode.machine._liveness = lambda now: None  # the decode rank stops talking (as if it died)
    wait_final(senders, timeout=15)
    for s in senders:
        assert s.poll() == KVPoll.Failed
        assert f"decode rank {c.name}-d/dp0/tp0" in s.failure_reason and "sent nothing for" in s.failure_reason


def test_the_topology_cache_expires_under_steady_traffic(cluster, daemon):
    """Issue 10 bug 2: every cached hit re-stored the timestamp, so a steady flow of rooms kept
    a stale topology forever. A fresh look-up happens every topology_ttl whatever the traffic.

    The daemon's counter also counts the background refresh (every topology_ttl / 2 while the
    group is in use) and a loaded machine may take a second per room, so "rooms outnumber
    look-ups" is not a property; the rooms the cache served are counted on decode itself."""
    c = cluster(cp=1, topology_ttl=1.0)  # (long beside a room's set-up even on a loaded machine)
    before = metric(daemon.url, "kvbridge_bootstrap_lookups_total", outcome="ok")
    topologies, hits = c.decode.machine.topologies, []
    served = topologies.cached

    def counted(key, now):
        hit = served(key, now)
        if hit is not None:
            hits.append(now)
        return hit

    topologies.cached = counted
    receivers, room = [], 800

    def lookups() -> float:
        return metric(daemon.url, "kvbridge_bootstrap_lookups_total", outcome="ok") - before

    def steady() -> bool:  # a room every 50 ms, each served from the cache while it is fresh
        nonlocal room
        receivers.append(c.decode.receiver(room, f"{c.name}-p"))
        room += 1
        time.sleep(0.05)
        return lookups() >= 3 and bool(hits)

    try:
        assert wait_until(steady, 60, step=0), \
            f"the cached topology never expired while rooms kept coming ({lookups()} look-ups, {len(hits)} hits)"
    finally:
        for r in receivers:
            r.close()


def test_a_cache_hit_does_not_restart_the_topologys_clock(cluster):
    """The same rule on the cache itself, times passed in: hits within topology_ttl do not move
    the answer's time, so the answer expires topology_ttl after it was stored however often used."""
    from kvbridge.transfer.decode.topologies import Topologies

    c = cluster(cp=1)
    m = c.decode.machine
    r = c.decode.receiver(900, f"{c.name}-p")
    try:
        assert wait_until(lambda: bool(m.topologies.cache), 30), "no look-up answer was cached"
    finally:
        r.close()
    topo = next(iter(m.topologies.cache.values()))[1]
    t = Topologies(m.topologies.cfg, m.topologies.specs)
    ttl, key = t.cfg.topology_ttl, (topo.instance, topo.dp_rank)
    t.store(topo, 100.0)
    assert all(t.cached(key, float(now)) is topo for now in np.arange(100.0, 100.0 + ttl, ttl / 8))
    assert t.cache[key][0] == 100.0  # eight hits later, still the time it was stored
    assert t.cached(key, 100.0 + ttl) is None
