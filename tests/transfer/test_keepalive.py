"""Keepalive, end to end in one process over real sockets and a real daemon: a prefill rank closes a
decode connection silent for its ``PrefillConfig.idle_timeout`` (120 s; 2 s here), and the next room then
connects and proves the decode rank's memory again (a read through the engine) on its own path.
Decode's keepalive pings keep that connection, and its proof, open between rooms."""

from __future__ import annotations

import time

import numpy as np
import pytest

from _cluster import wait_final
from kvbridge.errors import ConfigError
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.config import PrefillConfig

IDLE_S = 2.0  # the prefill rank's idle close here (120 s by default)


def _rooms_apart(cluster, keepalive: float) -> tuple[int, int, list]:
    """Two rooms, ``2.5 * IDLE_S`` apart with nothing else between them: (connections prefill closed
    as idle, memory proofs it read, the rooms' states)."""
    c = cluster(cp=1, keepalive=keepalive, keepalive_for=30.0, prefill_cfg={"idle_timeout": IDLE_S})
    engine = c.prefill[0].engine
    real, reads = engine.probe_read, []

    def counted(session, dst, src, length, timeout=5.0):  # noqa: ANN001, ANN202
        reads.append(session)
        return real(session, dst, src, length, timeout)

    engine.probe_read = counted
    states = []
    for room in (41, 42):
        pages = np.array([1, 2]) + room % 2 * 2
        r = c.decode.receiver(room, f"{c.name}-p")
        r.init(pages, 0, 8)
        senders = c.send(room, 8)
        wait_final([r, *senders], timeout=20)
        states.append((r.poll(), r.failure_reason, c.verified(room, 8, pages)))
        r.close()
        if room == 41:
            time.sleep(2.5 * IDLE_S)
    return c.prefill[0]._server.stats.timed_out, len(reads), states


def test_keepalive_pings_keep_the_connection_and_its_proof_between_rooms(cluster):
    closed, proofs, states = _rooms_apart(cluster, keepalive=IDLE_S / 8)
    assert states == [(KVPoll.Success, None, True)] * 2
    assert (closed, proofs) == (0, 1)  # one connection, proven once, for both rooms


def test_without_keepalive_the_idle_connection_closes_and_the_next_room_proves_again(cluster):
    closed, proofs, states = _rooms_apart(cluster, keepalive=0.0)
    assert states == [(KVPoll.Success, None, True)] * 2
    assert closed >= 1 and proofs == 2  # (what the keepalive spares a room)


def test_idle_timeout_zero_never_closes_and_a_negative_one_is_refused_by_name():
    assert PrefillConfig(instance="p", idle_timeout=0.0).idle_timeout == 0.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="idle_timeout .* must be >= 0 seconds"):
            PrefillConfig(instance="p", idle_timeout=bad)
