"""Nothing unauthenticated costs memory or a slot for long (issue 20, findings 2 and 3), over
real sockets on loopback: a connection's first frame must be a small Hello (MAC'd with the
cluster secret); before it, at most one Hello's bytes are buffered; a connection that says
nothing, or says it a byte a second, is closed on a deadline; a flood of connections that
never authenticate cannot keep a real rank out."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from _raw_control import RawControl
from kvbridge.errors import ProtocolError
from kvbridge.transfer.channel import ControlServer, Limits, PeerSet, wire
from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES
from kvbridge.transfer.channel.frames import HEADER, frame
from kvbridge.transfer.channel.wire import Heartbeat, Ping

SECRET = b"preauth-secret"
FAST = Limits(hello_timeout=0.5, frame_timeout=0.5, max_pending=32, max_pending_per_address=8)


class Serving:
    """A server loop thread answering Ping with Heartbeat, as a prefill rank's loop does."""

    def __init__(self, server: ControlServer) -> None:
        self.server, self._stop = server, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self._stop.is_set():
            for peer, msg in self.server.recv_ready(50):
                if isinstance(msg, Ping):
                    self.server.send(peer, Heartbeat(cp_rank=0, seq=msg.seq))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture()
def served() -> Iterator[ControlServer]:
    server = ControlServer(secret=SECRET, limits=FAST)
    loop = Serving(server)
    yield server
    loop.stop()
    server.close()


def buffered(server: ControlServer) -> int:
    """Bytes the server holds for connections (its readers: what this test is about)."""
    return server.buffered_bytes


def wait_for(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def ping_once(endpoint: str, seq: int, timeout: float = 5.0) -> bool:
    peers = PeerSet(secret=SECRET, name="decode-0")
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


def test_a_partial_frame_is_not_buffered_before_the_hello(served: ControlServer) -> None:
    """A connection that announces a 4 MiB frame and sends 1 MiB of it, without a Hello first, is
    closed at its header (over the Hello limit); one that sends a Hello-sized partial frame holds
    at most that much, never more."""
    with RawControl(served.endpoint, hello=False) as raw:
        raw.send_bytes(HEADER.pack(4 << 20) + b"\0" * (1 << 16))
        assert raw.closed_by_peer(5)
    socks = []
    try:
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=5)
            sock.sendall(HEADER.pack(HELLO_MAX_BYTES) + b"\0" * (HELLO_MAX_BYTES - 1))  # one byte short
            socks.append(sock)
        assert wait_for(lambda: served.num_pending == 4)
        assert buffered(served) <= 4 * (HEADER.size + HELLO_MAX_BYTES)
    finally:
        for sock in socks:
            sock.close()
    assert served.stats.dropped == 1 and served.stats.received == 0


def test_a_connection_that_never_says_hello_is_closed(served: ControlServer) -> None:
    with RawControl(served.endpoint, hello=False) as raw:
        assert raw.closed_by_peer(5)
    assert served.stats.timed_out >= 1 and served.num_pending == 0


def test_a_connection_sending_a_byte_a_second_is_closed_before_and_after_its_hello(served: ControlServer) -> None:
    with RawControl(served.endpoint, hello=False) as raw:  # a slow Hello: the hello deadline
        hello = frame(wire.codec(SECRET).hello("slow", raw.challenge()))
        for byte in hello[:3]:
            raw.send_bytes(bytes([byte]))
            time.sleep(0.2)
        assert raw.closed_by_peer(5)
    with RawControl(served.endpoint, secret=SECRET) as raw:  # authenticated, then a frame a byte at a time
        data = frame(wire.encode(Ping(decode_rank="slow", seq=1), SECRET))
        closed = False
        for byte in data[:-1]:
            try:
                raw.send_bytes(bytes([byte]))
            except OSError:
                closed = True
                break
            if raw.closed_by_peer(0.1):
                closed = True
                break
        assert closed or raw.closed_by_peer(5)
    assert served.stats.timed_out >= 2 and served.stats.received == 0


def test_a_hello_with_a_wrong_mac_or_for_another_channel_is_refused(served: ControlServer) -> None:
    with RawControl(served.endpoint, secret=b"not-the-secret") as raw:
        assert raw.closed_by_peer(5)
    other = wire.codec(SECRET)
    other.name = "ops"
    with RawControl(served.endpoint, hello=False) as raw:
        raw.send(other.hello("x", raw.challenge()))
        assert raw.closed_by_peer(5)
    assert served.stats.unauthenticated == 2 and served.num_peers == 0


def test_a_flood_of_unauthenticated_connections_does_not_lock_out_a_real_rank() -> None:
    """Ten times more idle connections than the server has slots for peers (and more than its
    pending slots), held well inside the hello deadline: the real rank still gets in at once.
    The flood holds pending slots only, never a peer's, and the oldest give way to newcomers."""
    limits = Limits(max_connections=4, max_pending=8, max_pending_per_address=4, hello_timeout=30)
    server = ControlServer(secret=SECRET, limits=limits)
    loop = Serving(server)
    socks = []
    try:
        for _ in range(40):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        assert wait_for(lambda: server.stats.evicted >= 40 - limits.max_pending_per_address)
        assert server.num_pending <= limits.max_pending_per_address and server.stats.timed_out == 0
        assert ping_once(server.endpoint, 7)
        assert server.stats.refused == 0
    finally:
        for sock in socks:
            sock.close()
        loop.stop()
        server.close()


def test_authenticated_slots_are_bounded_and_refusals_are_counted() -> None:
    """Three Hellos for two slots: exactly one connection is refused and counted, whichever the
    server read last (the three race: no order is promised), and the two it kept are the ones
    still open."""
    server = ControlServer(secret=SECRET, limits=Limits(max_connections=2))
    loop = Serving(server)
    try:
        raws = [RawControl(server.endpoint, secret=SECRET, name=f"r{i}") for i in range(3)]
        try:
            assert wait_for(lambda: server.stats.refused == 1)
            closed = [i for i, raw in enumerate(raws) if raw.closed_by_peer(1)]
            assert len(closed) == 1 and server.num_peers == 2 and server.stats.refused == 1
            names = {server.hello_of(p).peer for p in server.peers}
            assert names == {f"r{i}" for i in range(3)} - {f"r{closed[0]}"}
        finally:
            for raw in raws:
                raw.close()
    finally:
        loop.stop()
        server.close()


def test_a_peer_set_names_itself_in_its_hello(served: ControlServer) -> None:
    got: list[str] = []
    peers = PeerSet(secret=SECRET, name="decode-rank-42")
    try:
        peers.send(served.endpoint, Ping(decode_rank="d0", seq=1))
        assert wait_for(lambda: served.num_peers == 1)
        got = [served.hello_of(p).peer for p in served.peers]
    finally:
        peers.close()
    assert got == ["decode-rank-42"]


def test_an_idle_authenticated_peer_is_closed_when_an_idle_timeout_is_set() -> None:
    server = ControlServer(secret=SECRET, limits=Limits(idle_timeout=0.3))
    loop = Serving(server)
    try:
        with RawControl(server.endpoint, secret=SECRET) as raw:
            assert wait_for(lambda: server.num_peers == 1)
            assert raw.closed_by_peer(5)
        assert server.stats.timed_out == 1
    finally:
        loop.stop()
        server.close()


def test_hello_decoding_errors_are_protocol_errors() -> None:
    codec = wire.codec(SECRET)
    nonce, challenge = codec.challenge()
    assert codec.open_challenge(challenge).nonce == nonce and len(nonce) == 16
    with pytest.raises(ProtocolError, match="not a hello"):
        codec.open_hello(wire.encode(Ping(decode_rank="d", seq=1), SECRET), nonce)
    with pytest.raises(ProtocolError, match="bad MAC"):
        codec.open_hello(wire.codec(b"other").hello("x", nonce), nonce)
    with pytest.raises(ProtocolError, match="another connection's challenge") as info:
        codec.open_hello(codec.hello("me", codec.challenge()[0]), nonce)
    assert info.value.field == "challenge"
    with pytest.raises(ProtocolError, match="not a hello challenge"):
        codec.open_challenge(codec.hello("me", nonce))
    with pytest.raises(ProtocolError, match="bad MAC"):
        wire.codec(b"other").open_challenge(challenge)
    assert codec.open_hello(codec.hello("me", nonce), nonce).peer == "me"
