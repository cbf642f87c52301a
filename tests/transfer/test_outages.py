"""Outages that must not fail healthy rooms (found by ``kvbridge chaos``): a bootstrap
daemon that is down while rooms keep coming, and a decode loop that was itself frozen."""

from __future__ import annotations

import threading

import numpy as np

from _cluster import wait_final, wait_until
from _local import Cluster
from kvbridge.transfer.poll import KVPoll


def test_rooms_keep_flowing_on_the_last_topology_while_the_daemon_is_down(start_daemon):
    daemon = start_daemon("--lease-ttl", "30")
    # prefill waits for room 2's request while decode's refresh of its stale topology fails against the
    # stopped daemon before it falls back to the last one: more than the test clusters' 2 s on a loaded
    # host (CI: "no decode ranks asked for room 2 within 2.0s"), so prefill waits longer here, and decode's
    # bootstrap timeout leaves room 2's failing look-up the time to fall back. Room 3's reason names the
    # daemon whether its look-up's attempts have failed by then or are still waiting for an answer
    c = Cluster(daemon.url, "daemon-down", cp=2, topology_ttl=0.2, bootstrap_timeout=10.0,
                prefill_cfg={"target_timeout": 15.0})
    try:
        r = c.decode.receiver(1, "daemon-down-p")
        r.init(np.array([1, 2, 3]), 0, 10)
        wait_final([r, *c.send(1, 10)])
        assert r.poll() == KVPoll.Success
        daemon.stop()  # the cached topology is past its TTL long before the next room
        threading.Event().wait(0.5)
        r2 = c.decode.receiver(2, "daemon-down-p")
        r2.init(np.array([4, 5, 6]), 1, 10)
        wait_final([r2, *c.send(2, 10)])
        assert r2.poll() == KVPoll.Success, r2.failure_reason
        assert c.verified(2, 10, np.array([4, 5, 6]))
        # a DP group never looked up has nothing to fall back on: the timeout names the daemon
        r3 = c.decode.receiver(3, "never-seen-p")
        assert wait_until(lambda: r3.poll() == KVPoll.Failed, 20)
        assert f"bootstrap daemon at {daemon.url.rstrip('/')}" in r3.failure_reason, r3.failure_reason
        assert "unreachable" in r3.failure_reason
    finally:
        c.close()


def test_a_frozen_decode_loop_blames_no_prefill_rank(cluster):
    c = cluster(cp=1, peer_timeout=1.0, ping_interval=0.1)
    gate = threading.Event()
    c.prefill[0].engine.faults.gate = gate  # the room stays in flight across the freeze
    r = c.decode.receiver(7, f"{c.name}-p")
    r.init(np.array([1, 2]), 0, 7)
    senders = c.send(7, 7)
    ep = c.prefill[0]
    # in flight: decode transferring, and prefill holding the target (its connection proven, the write gated)
    asked = lambda: ep.locked(lambda: 7 in ep.machine.rooms and bool(ep.machine.rooms[7].targets))  # noqa: E731
    assert wait_until(lambda: r.poll() == KVPoll.Transferring and asked(), 10)
    with c.decode._lock:  # the decode loop cannot run: no pings go out, so no heartbeat comes back
        threading.Event().wait(2.0)
    assert not wait_until(lambda: r.poll() == KVPoll.Failed, 0.5), r.failure_reason
    gate.set()
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success
