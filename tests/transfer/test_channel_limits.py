"""What an authenticated connection, or bytes captured from one, can cost a server (issue 26),
over real sockets on loopback: a Hello opens only the connection whose challenge it answers;
slots are capped per source address (and, when full, a newcomer from a less busy address
displaces the busiest address's oldest connection); frames that fail their MAC close their
connection after ``max_bad_macs``; partial frames stay within a per-connection allowance plus
one shared budget, and a frame's deadline grows with its size; unsent output is bounded for all
peers together. Every server is stopped; every loop is bounded."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from _raw_control import RawControl
from kvbridge.errors import ConfigError, PeerLost
from kvbridge.transfer.channel import ControlServer, Limits, PeerSet, wire
from kvbridge.transfer.channel.frames import HEADER, frame
from kvbridge.transfer.channel.wire import Heartbeat, Ping

SECRET = b"limits-secret"


class Serving:
    """A server loop thread answering Ping with Heartbeat, as a prefill rank's loop does."""

    def __init__(self, server: ControlServer) -> None:
        self.server, self._stop = server, threading.Event()
        self.received: list[object] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self._stop.is_set():
            for peer, msg in self.server.recv_ready(50):
                self.received.append(msg)
                if isinstance(msg, Ping):
                    try:
                        self.server.send(peer, Heartbeat(cp_rank=0, seq=msg.seq))
                    except PeerLost:
                        pass

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def serve(limits: Limits, **kw: object) -> Iterator[tuple[ControlServer, Serving]]:
    server = ControlServer(secret=SECRET, limits=limits, **kw)
    loop = Serving(server)
    try:
        yield server, loop
    finally:
        loop.stop()
        server.close()


def wait_for(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def ping_once(endpoint: str, seq: int, name: str = "decode-0", timeout: float = 10.0) -> bool:
    peers = PeerSet(secret=SECRET, name=name)
    try:
        peers.send(endpoint, Ping(decode_rank="d0", seq=seq))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, msg in peers.recv_ready(50):
                if isinstance(msg, Heartbeat) and msg.seq == seq:
                    return True
        return False
    finally:
        peers.close()


def raw_from(endpoint: str, source: str, **kw: object) -> RawControl:
    """A RawControl whose connection comes from loopback address ``source``."""
    port = int(endpoint.rsplit(":", 1)[1])
    real = socket.create_connection
    try:
        socket.create_connection = lambda addr, timeout=None: real(addr, timeout, source_address=(source, 0))
        return RawControl(f"tcp://127.0.0.1:{port}", **kw)
    finally:
        socket.create_connection = real


@pytest.fixture()
def default_served() -> Iterator[tuple[ControlServer, Serving]]:
    yield from serve(Limits())


# ---- the Hello ---------------------------------------------------------------------------------
def test_a_replayed_hello_opens_nothing_and_a_real_rank_still_gets_in(default_served) -> None:
    """A valid Hello captured off one connection, replayed on 60 more: every replay is closed
    unauthenticated (it carries another connection's nonce), no slot is taken, a real rank pings."""
    server, _ = default_served
    with RawControl(server.endpoint, hello=False) as first:
        captured = frame(wire.codec(SECRET).hello("decode-victim", first.challenge()))
        first.send_bytes(captured)
        assert wait_for(lambda: server.num_peers == 1)
        replays = []
        try:
            for _ in range(60):
                raw = RawControl(server.endpoint, hello=False)
                replays.append(raw)
                raw.send_bytes(captured)
            assert all(raw.closed_by_peer(5) for raw in replays)
        finally:
            for raw in replays:
                raw.close()
        # each closed: refused for its nonce, or evicted unread by newer pending connections of its
        # address (max_pending_per_address); none authenticated
        assert server.num_peers == 1 and server.stats.unauthenticated + server.stats.evicted == 60
        assert server.stats.unauthenticated > 0
        assert ping_once(server.endpoint, 1)


def test_the_secret_never_travels(default_served) -> None:
    """Neither the challenge nor the Hello carries the secret (only MACs): the bytes of both
    directions of a real handshake hold no copy of it."""
    server, _ = default_served
    with RawControl(server.endpoint, hello=False) as raw:
        nonce = raw.challenge()
        hello = wire.codec(SECRET).hello("decode-0", nonce)
        assert SECRET not in hello and nonce in hello
        challenge = wire.codec(SECRET).challenge()[1]
        assert SECRET not in challenge


# ---- slots --------------------------------------------------------------------------------------
def test_one_address_cannot_hold_every_slot() -> None:
    """Slots are capped per source address (the address, not the name a Hello claims): a fourth
    connection from 127.0.0.2 is refused, whichever of the four the server read last, while one
    from 127.0.0.3 gets in."""
    for server, _ in serve(Limits(max_connections=8, max_connections_per_address=3)):
        raws = [raw_from(server.endpoint, "127.0.0.2", secret=SECRET, name=f"a{i}") for i in range(4)]
        try:
            assert wait_for(lambda: server.stats.refused == 1)
            assert sum(raw.closed_by_peer(1) for raw in raws) == 1
            assert server.peers_from("127.0.0.2") == 3
            with raw_from(server.endpoint, "127.0.0.3", secret=SECRET, name="b") as other:
                assert wait_for(lambda: server.peers_from("127.0.0.3") == 1) and not other.closed_by_peer(0.3)
            assert server.stats.refused == 1
        finally:
            for raw in raws:
                raw.close()


def test_when_every_slot_is_taken_a_newcomer_displaces_the_busiest_address() -> None:
    for server, _ in serve(Limits(max_connections=4, max_connections_per_address=None)):
        raws = [raw_from(server.endpoint, "127.0.0.2", secret=SECRET, name=f"a{i}") for i in range(4)]
        try:
            assert wait_for(lambda: server.num_peers == 4)
            with raw_from(server.endpoint, "127.0.0.3", secret=SECRET, name="b"):
                # the displacement is counted before the newcomer's connection is: wait for both
                assert wait_for(lambda: server.stats.displaced == 1 and server.peers_from("127.0.0.3") == 1)
                assert server.num_peers == 4
                assert server.peers_from("127.0.0.2") == 3
                assert sum(raw.closed_by_peer(1) for raw in raws) == 1
                # the busiest address no longer holds more than one more than the newcomer's, so
                # another connection from it is refused rather than displacing
                with raw_from(server.endpoint, "127.0.0.2", secret=SECRET, name="a4") as late:
                    assert late.closed_by_peer(5)
                assert server.stats.refused == 1 and server.stats.displaced == 1
        finally:
            for raw in raws:
                raw.close()


def test_the_idle_timeout_is_on_by_default() -> None:
    assert Limits().idle_timeout == 120.0
    for server, _ in serve(Limits(idle_timeout=0.3)):
        with RawControl(server.endpoint, secret=SECRET) as raw:
            assert wait_for(lambda: server.num_peers == 1)
            assert raw.closed_by_peer(10)
        assert server.stats.timed_out == 1


# ---- MAC failures ----------------------------------------------------------------------------------
def test_frames_failing_their_mac_close_the_connection_after_max_bad_macs(default_served) -> None:
    server, loop = default_served
    bad = Limits().max_bad_macs
    with RawControl(server.endpoint, secret=SECRET) as raw:
        for _ in range(bad - 1):
            raw.send(b"")  # (an empty frame: no envelope, no MAC)
        raw.send(wire.encode(Ping(decode_rank="d0", seq=5), SECRET))
        assert wait_for(lambda: any(isinstance(m, Ping) for m in loop.received))
        assert not raw.closed_by_peer(0.2)  # fewer than max_bad_macs: still served
        raw.send(wire.encode(Ping(decode_rank="d0", seq=6), b"not-the-secret"))
        assert raw.closed_by_peer(5)
    assert server.stats.bad_mac_closed == 1 and server.stats.unauthenticated == bad


def test_a_mac_failing_flood_costs_a_bounded_number_of_frames(default_served) -> None:
    """100,000 frames that fail their MAC, pushed as fast as the socket takes them: the server
    reads max_bad_macs of them (and whatever shared the last read), then closes the connection."""
    server, _ = default_served
    with RawControl(server.endpoint, secret=SECRET, timeout=2.0) as raw:
        try:
            raw.send_bytes(frame(b"\x00" * 40) * 100_000)
        except OSError:  # closed under it: what the defence is
            pass
        assert raw.closed_by_peer(5)
    assert server.stats.bad_mac_closed == 1
    assert server.stats.unauthenticated <= Limits().frame_allowance // len(frame(b"\x00" * 40)) + 1
    assert ping_once(server.endpoint, 2)


# ---- the frame budget -----------------------------------------------------------------------------
SMALL = 64 << 10  # max_bytes of the servers below: frames up to auth_limit(SMALL) = 132 KiB


def budget_limits(**kw: object) -> Limits:
    return Limits(**({"frame_allowance": 1024, "frame_budget": HEADER.size + wire.auth_limit(SMALL)} | kw))


def test_a_frame_budget_must_hold_the_largest_frame() -> None:
    with pytest.raises(ConfigError, match="frame_budget") as info:
        ControlServer(secret=SECRET, max_bytes=SMALL, limits=Limits(frame_budget=1 << 16))
    assert info.value.field == "frame_budget"


def test_partial_frames_stay_within_the_allowances_and_the_shared_budget() -> None:
    """Ten connections announce the largest frame and send all of it but one byte: the server
    holds at most 10 x frame_allowance + frame_budget (two of them read, eight waiting), a real
    rank's Ping goes through meanwhile, and once the ten finish their frames every one arrives
    (whoever holds a reservation can finish: no reader waits on another in a circle)."""
    limits = budget_limits()
    for server, loop in serve(limits, max_bytes=SMALL):
        bodies = [wire.encode(Ping(decode_rank="x" * (SMALL - 300 - i), seq=100 + i), SECRET, max_bytes=SMALL)
                  for i in range(10)]  # (two fit the shared budget at once)
        raws = [RawControl(server.endpoint, secret=SECRET, name=f"big{i}") for i in range(10)]
        try:
            for raw, body in zip(raws, bodies):
                raw.sock.settimeout(5.0)
                raw.send_bytes(frame(body)[:-1])
            bound = 10 * limits.frame_allowance + limits.frame_budget
            assert wait_for(lambda: server.stats.throttled >= 8)
            assert server.buffered_bytes <= bound
            assert ping_once(server.endpoint, 7)
            assert server.buffered_bytes <= bound
            for raw, body in zip(raws, bodies):
                raw.send_bytes(frame(body)[-1:])
            assert wait_for(lambda: sum(isinstance(m, Ping) and m.seq >= 100 for m in loop.received) == 10, 30)
            assert server.stats.unauthenticated == 0 and server.stats.timed_out == 0 and server.buffered_bytes == 0
        finally:
            for raw in raws:
                raw.close()


def test_bytes_read_with_the_hello_stay_within_the_allowance() -> None:
    """A connection whose Hello and the start of a large frame arrive together while the shared
    budget is taken: before, the pending read took up to one Hello's worth (4 KiB) at once, the
    Hello and what followed it, and after authentication the reader kept the frame's first ~4 KB
    with no reservation, beyond its allowance (the cause of this file's budget test failing 2.4 KB
    over under load, when the loop reached the connection only after both had arrived). Now a
    pending connection reads no byte past its Hello's frame."""
    limits = budget_limits()
    server = ControlServer(secret=SECRET, limits=limits, max_bytes=SMALL)
    loop = Serving(server)
    largest = b"\x00" * wire.auth_limit(SMALL)
    try:
        with RawControl(server.endpoint, secret=SECRET, name="hog") as hog:  # takes the whole budget
            hog.sock.settimeout(5.0)
            hog.send_bytes(frame(largest)[:-1])
            assert wait_for(lambda: server.buffered_bytes >= len(largest) - 1)
            loop.stop()  # the loop is busy elsewhere while the next connection's bytes arrive
            with RawControl(server.endpoint, hello=False) as late:
                deadline = time.monotonic() + 5
                while not late.nonce and time.monotonic() < deadline:
                    server.recv_ready(20)
                    late.challenge(0.05)
                hello = frame(wire.codec(SECRET).hello("late", late.nonce))
                late.send_bytes(hello + frame(largest)[:4000])  # one send: they arrive together
                time.sleep(0.2)
                while server.num_peers < 2 and time.monotonic() < deadline:
                    server.recv_ready(20)
                for _ in range(3):
                    server.recv_ready(20)
                assert server.num_peers == 2
                assert server.buffered_bytes <= 2 * limits.frame_allowance + limits.frame_budget, server.buffered_bytes
    finally:
        server.close()


def test_a_frame_deadline_grows_with_its_size() -> None:
    """A stalled 100-byte frame is closed at about frame_timeout; a stalled frame announcing
    1 MiB at 1 MiB/s is still open a second after the small one was due (its deadline is
    frame_timeout + 1 s), then closed too."""
    limits = Limits(frame_timeout=0.3, frame_rate=float(1 << 20))
    assert limits.frame_deadline(1 << 20) == pytest.approx(1.3) and limits.frame_deadline(0) == 0.3
    for server, _ in serve(limits):
        with RawControl(server.endpoint, secret=SECRET) as small, RawControl(server.endpoint, secret=SECRET) as big:
            small.send_bytes(HEADER.pack(100) + b"\0" * 10)
            big.send_bytes(HEADER.pack(1 << 20) + b"\0" * 10)
            assert small.closed_by_peer(10)
            assert not big.closed_by_peer(0.05)  # (it cannot be due before 1.3 s from its first byte)
            assert big.closed_by_peer(10)
        assert server.stats.timed_out == 2


def test_a_busy_loop_never_closes_a_frame_that_arrived_in_time() -> None:
    """The loop does not turn for longer than the frame deadline while the rest of a frame
    arrives: the next turn reads it before judging, so the message is received, not expired."""
    server = ControlServer(secret=SECRET, limits=Limits(frame_timeout=0.2, frame_rate=float(1 << 30)))
    try:
        with RawControl(server.endpoint, hello=False) as raw:
            got = []
            deadline = time.monotonic() + 5
            while not raw.nonce and time.monotonic() < deadline:
                got += server.recv_ready(20)
                raw.challenge(0.05)
            raw.send_bytes(frame(wire.codec(SECRET).hello("busy", raw.nonce)))
            data = frame(wire.encode(Ping(decode_rank="busy", seq=1), SECRET))
            raw.send_bytes(data[:10])
            while server.num_peers == 0 or not server.buffered_bytes:
                assert time.monotonic() < deadline
                got += server.recv_ready(20)
            raw.send_bytes(data[10:])
            time.sleep(0.6)  # the loop is busy elsewhere, past the frame's deadline
            got += server.recv_ready(0)
            assert [m for _, m in got] == [Ping(decode_rank="busy", seq=1)]
            assert server.stats.timed_out == 0 and server.num_peers == 1
    finally:
        server.close()


# ---- output -------------------------------------------------------------------------------------
def test_unsent_output_is_bounded_and_the_peer_that_does_not_read_is_closed() -> None:
    limits = Limits(max_queued_bytes=1 << 20)
    server = ControlServer(secret=SECRET, limits=limits)
    try:
        with RawControl(server.endpoint, hello=False) as stalled:
            deadline = time.monotonic() + 5
            while not stalled.nonce and time.monotonic() < deadline:
                server.recv_ready(20)
                stalled.challenge(0.05)
            stalled.send_bytes(frame(wire.codec(SECRET).hello("stalled", stalled.nonce)))
            while server.num_peers == 0:
                assert time.monotonic() < deadline
                server.recv_ready(20)
            (peer,) = server.peers
            blob = wire.encode(Ping(decode_rank="y" * (256 << 10), seq=1), SECRET)
            with pytest.raises(PeerLost, match="unsent output"):
                for _ in range(4096):  # (the kernel's buffers take some megabytes first)
                    server.send_frame(peer, blob)
            assert server.stats.output_closed == 1 and server.num_peers == 0
            assert server.queued_bytes == 0
    finally:
        server.close()


def test_every_limit_and_its_default_is_stated_in_security_md() -> None:
    """docs/security.md's table names every limit with the control channel's default."""
    from dataclasses import fields
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    shown = {"hello_timeout": "2 s", "frame_timeout": "3 s + n / 2 MiB/s", "frame_rate": "3 s + n / 2 MiB/s",
             "idle_timeout": "120 s", "max_connections": "4,096", "max_connections_per_address": "64",
             "max_pending": "128 / 16", "max_pending_per_address": "128 / 16", "max_bad_macs": "3",
             "frame_allowance": "8 KiB", "frame_budget": "16 MiB", "max_queued_bytes": "32 MiB"}
    assert set(shown) == {f.name for f in fields(Limits)}  # a new limit needs its row
    defaults = Limits()
    assert (defaults.hello_timeout, defaults.frame_timeout, defaults.frame_rate, defaults.idle_timeout) == \
        (2.0, 3.0, float(2 << 20), 120.0)
    assert (defaults.max_connections, defaults.max_connections_per_address, defaults.max_pending,
            defaults.max_pending_per_address, defaults.max_bad_macs) == (4096, 64, 128, 16, 3)
    assert (defaults.frame_allowance, defaults.frame_budget, defaults.max_queued_bytes) == (8 << 10, 16 << 20, 32 << 20)
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    for name, value in shown.items():
        assert any(f"`{name}`" in row and value in row for row in rows), name


# ---- fairness (issue 32) -----------------------------------------------------------------------------
def test_one_addresss_flood_of_large_frames_cannot_starve_another_address() -> None:
    """The budget fits two largest frames. Six connections from 127.0.0.2 announce the largest
    frame and stall one byte short; a frame from 127.0.0.3 arriving after them is read at once
    (no address holds more than its share, and waiting addresses take turns): before, readers were
    served in arrival order and it waited behind the stalled ones until their deadlines."""
    one = HEADER.size + wire.auth_limit(SMALL)
    limits = budget_limits(frame_budget=2 * one)
    for server, loop in serve(limits, max_bytes=SMALL):
        body = b"\x00" * wire.auth_limit(SMALL)  # the largest frame read (its MAC would fail: it never ends)
        flood = [raw_from(server.endpoint, "127.0.0.2", secret=SECRET, name=f"f{i}") for i in range(6)]
        try:
            for raw in flood:
                raw.sock.settimeout(5.0)
                raw.send_bytes(frame(body)[:-1])
            assert wait_for(lambda: server.stats.throttled >= 5)
            assert server._budget_by_address["127.0.0.2"] <= server._address_share
            other = wire.encode(Ping(decode_rank="y" * (SMALL - 300), seq=2), SECRET, max_bytes=SMALL)
            with raw_from(server.endpoint, "127.0.0.3", secret=SECRET, name="real") as real:
                real.sock.settimeout(5.0)
                start = time.monotonic()
                real.send_bytes(frame(other))
                assert wait_for(lambda: any(isinstance(m, Ping) and m.seq == 2 for m in loop.received), 10)
                waited = time.monotonic() - start
            # the flood's stalled frames are still open (their deadlines, about 3 s, not reached)
            assert waited < limits.frame_deadline(len(body)), waited
            assert server.stats.timed_out == 0
        finally:
            for raw in flood:
                raw.close()


def test_proven_connections_are_never_displaced_and_a_known_rank_gets_back_in() -> None:
    """Every slot taken by one connection per address (an address flood): a newcomer from yet
    another address would displace the busiest address's oldest connection, a host with two
    ranks; connections the owner vouches for (a proven rank) stay. A newcomer whose Hello names a
    known rank displaces an unproven one instead of being refused."""
    proven: set[bytes] = set()
    for server, _ in serve(Limits(max_connections=4, max_connections_per_address=None),
                           protected=lambda ident: ident in proven, vouch=lambda hello: hello.peer == "known"):
        ranks = [raw_from(server.endpoint, "127.0.0.2", secret=SECRET, name=f"rank{i}") for i in range(2)]
        flood = []
        try:
            assert wait_for(lambda: server.num_peers == 2)
            proven.update(server.peers)
            flood = [raw_from(server.endpoint, f"127.0.1.{i}", secret=SECRET, name="f") for i in range(2)]
            assert wait_for(lambda: server.num_peers == 4)
            with raw_from(server.endpoint, "127.0.2.1", secret=SECRET, name="f") as late:
                assert late.closed_by_peer(5)  # refused: nothing fairer to displace but proven ranks
            assert server.stats.displaced == 0 and server.peers_from("127.0.0.2") == 2
            assert not any(raw.closed_by_peer(0.2) for raw in ranks)
            with raw_from(server.endpoint, "127.0.2.2", secret=SECRET, name="known") as back:
                assert wait_for(lambda: server.stats.displaced == 1)
                assert not back.closed_by_peer(0.3) and server.peers_from("127.0.2.2") == 1
            assert server.peers_from("127.0.0.2") == 2 and sum(raw.closed_by_peer(1) for raw in flood) == 1
        finally:
            for raw in ranks + flood:
                raw.close()
