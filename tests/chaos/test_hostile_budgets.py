"""The budget attacks of ``kvbridge chaos --hostile`` (``kvbridge/chaos/hostile_budgets.py``),
driven with the attack's own code against a real ``ControlServer`` on loopback (its loop on a
thread answering Pings as a prefill rank's does): one identity's paced flood of the largest
frames and another identity's frame that needs the shared budget; thousands of addresses
against a TP 2 host's proven connections. The held-bytes caps are driven through the admission
machine in ``tests/transfer/test_admission.py`` and the daemon restart with its claims file in
``tests/bootstrap/test_bootstrap_lapses.py``; all four run end to end in ``test_hostile.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvbridge.chaos.hostile import ATTACKS, NOT_APPLICABLE, NOT_APPLICABLE_ON, Outcome, format_hostile
from kvbridge.chaos.hostile_budgets import STARVE_PACE, AuthFlood, Starver, probe_frame, starve_due
from kvbridge.chaos.hostile_sockets import port_of
from kvbridge.errors import PeerLost
from kvbridge.transfer.channel import ControlServer, Limits, PeerSet
from kvbridge.transfer.channel.wire import Heartbeat, Ping

SECRET = b"budgets-secret"


class Serving:
    """The server's loop on a thread, answering Ping with Heartbeat."""

    def __init__(self, server: ControlServer) -> None:
        self.server, self._stop = server, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self._stop.is_set():
            for peer, msg in self.server.recv_ready(50):
                if isinstance(msg, Ping):
                    try:
                        self.server.send(peer, Heartbeat(cp_rank=0, seq=msg.seq))
                    except PeerLost:
                        pass

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def served(limits: Limits, **kw: object) -> Iterator[ControlServer]:
    server = ControlServer(secret=SECRET, limits=limits, **kw)
    loop = Serving(server)
    try:
        yield server
    finally:
        loop.stop()
        server.close()


@pytest.fixture()
def default_server() -> Iterator[ControlServer]:
    yield from served(Limits())


def test_one_identitys_paced_flood_leaves_another_identity_its_turn(default_server: ControlServer) -> None:
    """40 connections of one identity (one name, 127.0.0.2) push 4 MiB frames, each paced at
    0.6 x frame_rate once read, so every share of the budget they win is held for seconds; a 1 MiB
    frame from a second identity (127.0.0.3) is answered within one turn. Served in arrival order
    (before issue 32; checked by hand with that order restored) it waited behind the whole flood
    and got no answer in 30 s."""
    server, limits = default_server, Limits()
    port = port_of(server.endpoint)
    flood = Starver(port, SECRET, 40, "127.0.0.2", STARVE_PACE * limits.frame_rate)
    try:
        assert len(flood.socks) == 40
        flood.run_for(0.5)
        assert server.stats.throttled >= 30  # the flood waits for the budget before the probe comes
        result: list[float | None] = []
        probe = threading.Thread(target=lambda: result.append(probe_frame(port, "127.0.0.3", SECRET, 1 << 20, 30.0)))
        probe.start()
        deadline = time.monotonic() + 40
        while probe.is_alive() and time.monotonic() < deadline:
            flood.pump()
            time.sleep(0.02)
        probe.join(1)
        assert result and result[0] is not None, "the second identity's frame was never answered"
        assert result[0] <= starve_due(flood.frame_bytes, 1 << 20), result
        assert server.peers_from("127.0.0.2") == 40  # the flood was still there
    finally:
        flood.close()


def test_an_address_flood_takes_every_free_slot_and_no_proven_one() -> None:
    """A TP 2 host's two proven connections (127.0.0.1) on a server of 64 slots; the attack's
    AuthFlood opens 62 + 40 authenticated connections from 102 addresses: it holds the 62 free
    slots, the other 40 are refused (nothing is fairer to displace than proven ranks), nothing is
    displaced, and both ranks still ping on their connections."""
    proven: set[bytes] = set()
    limits = Limits(max_connections=64)
    for server in served(limits, protected=lambda ident: ident in proven):
        ranks = [PeerSet(secret=SECRET, name=f"tp{i}") for i in range(2)]
        flood = AuthFlood(port_of(server.endpoint), SECRET, "hostile-address")
        try:
            assert all(_pinged(server.endpoint, rank, i) for i, rank in enumerate(ranks))
            proven.update(server.peers)
            assert len(proven) == 2
            flood.open(62, 30.0)
            assert len(flood.held) == 62 and server.num_peers == 64
            flood.open(40, 30.0)
            assert flood.refused == 40 and len(flood.held) == 62, (flood.refused, len(flood.held), flood.failed)
            flood.sweep()
            assert flood.lost == 0 and server.stats.displaced == 0 and server.stats.refused == 40
            assert all(_pinged(server.endpoint, rank, 10 + i) for i, rank in enumerate(ranks))
            assert set(server.peers) >= proven  # the very connections they proved on
        finally:
            flood.close()
            for rank in ranks:
                rank.close()


def _pinged(endpoint: str, peers: PeerSet, seq: int) -> bool:
    peers.send(endpoint, Ping(decode_rank="tp", seq=seq))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(isinstance(m, Heartbeat) and m.seq == seq for _, m in peers.recv_ready(50)):
            return True
    return False


def test_an_attack_that_cannot_apply_to_an_engine_is_reported_so_never_defended() -> None:
    for engine, table in NOT_APPLICABLE_ON.items():
        assert set(table) <= set(ATTACKS), engine
        assert all(len(why) > 40 for why in table.values()), table  # each says why
    out = Outcome("mooncake_reader", NOT_APPLICABLE, "-", details={"engine": "nixl", "reason": "no Mooncake"})
    report = {"attacks": [vars(out)], "defended": [], "not_applicable": ["mooncake_reader"], "engine": "nixl",
              "seconds": 1.0, "problems": []}
    text = format_hostile(report)
    assert "0/0 attacks defended (1 not applicable on nixl)" in text and "n/a mooncake_reader: no Mooncake" in text
