"""Control channel over real TCP sockets on loopback: a server loop thread serving two
clients, bad input answered or dropped without stopping the loop, broken framing closing
only its own connection, reconnects, wakeups, close."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from _cluster import wait_until
from _raw_control import RawControl
from kvbridge.errors import ConfigError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel import ControlServer, Limits, PeerSet, Wakeup
from kvbridge.transfer.channel.frames import frame as streams_frame
from kvbridge.transfer.engine import Faults, LocalFabric, create_engine, tensor_region
from kvbridge.transfer.channel.wire import AbortAck, ErrorReply, Heartbeat, Ping

SECRET = b"s3cret"
PLAIN = wire.codec()


class EchoLoop:
    """A server loop thread: answers Ping with Heartbeat(seq) and stops when posted "stop"."""

    def __init__(self, server: ControlServer) -> None:
        self.server = server
        self.errors: list[ProtocolError] = []
        self.work_done: list[object] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            for peer, msg in self.server.recv_ready(timeout_ms=1000):
                if isinstance(msg, ProtocolError):
                    self.errors.append(msg)
                elif isinstance(msg, Ping):
                    try:
                        self.server.send(peer, Heartbeat(cp_rank=0, seq=msg.seq))
                    except PeerLost:  # it closed meanwhile (as a prefill rank's _reply, go on)
                        pass
            for work in self.server.wakeup.drain():
                if work == "stop":
                    return
                self.work_done.append(work)

    def stop(self) -> None:
        self.server.wakeup.post("stop")
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture()
def served() -> Iterator[tuple[ControlServer, EchoLoop]]:
    server = ControlServer()
    loop = EchoLoop(server)
    yield server, loop
    loop.stop()
    server.close()


def replies(peers: PeerSet, count: int, timeout: float = 5.0) -> list[tuple[str, object]]:
    got: list[tuple[str, object]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += peers.recv_ready(timeout_ms=50)
    return got


def test_server_loop_serves_two_clients(served: tuple[ControlServer, EchoLoop]) -> None:
    server, _ = served
    assert server.endpoint.startswith("tcp://127.0.0.1:") and server.port > 0
    d0, d1 = PeerSet(), PeerSet()
    try:
        for seq in range(20):
            d0.send(server.endpoint, Ping(decode_rank="d0", seq=seq))
            d1.send(server.endpoint, Ping(decode_rank="d1", seq=100 + seq))
        got0, got1 = replies(d0, 20), replies(d1, 20)
        assert [m.seq for _, m in got0] == list(range(20))
        assert [m.seq for _, m in got1] == list(range(100, 120))
        assert {ep for ep, _ in got0 + got1} == {server.endpoint}
        assert d0.get(server.endpoint) is d0.get(server.endpoint)  # one client per peer
    finally:
        d0.close()
        d1.close()


def test_a_rename_keeps_open_the_connections_of_the_names_it_is_told_to_keep(
        served: tuple[ControlServer, EchoLoop]) -> None:
    """A decode rank that registered again (decode/machine.py, "Re-registration"): connections
    opened from now on say the new name; the ones of an earlier name it keeps stay open, retired:
    what the server sends on them still arrives, with their name, and a sender picks them by name,
    until ``drop_name`` closes them."""
    server, _ = served
    peers = PeerSet(name="R")

    def named(count: int) -> list[tuple[str, str, object]]:
        got: list[tuple[str, str, object]] = []
        deadline = time.monotonic() + 5
        while len(got) < count and time.monotonic() < deadline:
            got += peers.recv_named(timeout_ms=50)
        return got

    def hellos() -> list[str]:
        return sorted(server.hello_of(p).peer for p in server.peers)

    try:
        peers.send(server.endpoint, Ping(decode_rank="d", seq=1))
        assert [(name, m.seq) for _, name, m in named(1)] == [("R", 1)]
        (old,) = server.peers
        peers.rename("R2", keep={"R"})
        assert peers.name == "R2" and peers.retired() == [(server.endpoint, "R")]
        peers.send(server.endpoint, Ping(decode_rank="d", seq=2))  # a new connection, saying R2
        peers.send_frame(server.endpoint, peers.encode(Ping(decode_rank="d", seq=3)), "R")  # the kept one
        assert sorted((name, m.seq) for _, name, m in named(2)) == [("R", 3), ("R2", 2)]
        assert hellos() == ["R", "R2"] and old in server.peers  # the same connection as before the rename
        server.send(old, Heartbeat(cp_rank=0, seq=9))  # the server answers on the connection that asked
        assert [(ep, name, m.seq) for ep, name, m in named(1)] == [(server.endpoint, "R", 9)]
        peers.drop_name("R")
        assert peers.retired() == []
        assert wait_until(lambda: hellos() == ["R2"], 5)
        peers.rename("R3")  # nothing kept: every connection closes, and opens again under R3 when used
        assert wait_until(lambda: not server.peers, 5) and peers.endpoints() == []
        peers.send(server.endpoint, Ping(decode_rank="d", seq=4))
        assert [(name, m.seq) for _, name, m in named(1)] == [("R3", 4)] and hellos() == ["R3"]
    finally:
        peers.close()


@pytest.mark.parametrize(
    ("body", "reason", "ref_type", "room"),
    [
        (PLAIN.seal(b"\xc1garbage"), "not msgpack", "", None),
        (b"", "shorter than the 3-byte envelope header", "", None),
        (PLAIN.seal(msgpack.packb({"t": "launch", "room": 5})), "unknown message type 'launch'", "launch", 5),
        (PLAIN.seal(msgpack.packb({"t": "abort", "room": 9})), "missing field 'decode_rank' in abort", "abort", 9),
        (wire.codec().with_version(wire.WIRE_VERSION + 1).seal(msgpack.packb({"t": "ping"})),
         f"unsupported wire version {wire.WIRE_VERSION + 1}", "", None),
        (wire.encode(Ping(decode_rank="x", seq=1), SECRET), "a MAC but no secret", "", None),
    ],
)
def test_bad_messages_get_an_error_reply_and_the_loop_keeps_serving(
    served: tuple[ControlServer, EchoLoop], body: bytes, reason: str, ref_type: str, room: int | None
) -> None:
    server, loop = served
    peers = PeerSet()
    try:
        peers.get(server.endpoint).send_frame(body)
        ((_, reply),) = replies(peers, 1)
        assert isinstance(reply, ErrorReply)
        assert reason in reply.reason and (reply.ref_type, reply.room) == (ref_type, room)
        peers.send(server.endpoint, Ping(decode_rank="d0", seq=7))  # still serving
        ((_, beat),) = replies(peers, 1)
        assert beat == Heartbeat(cp_rank=0, seq=7)
        assert server.stats.malformed == 1 and server.stats.error_replies == 1
        assert len(loop.errors) == 1 and reason in str(loop.errors[0])
    finally:
        peers.close()


def test_oversized_message_gets_an_error_reply() -> None:
    server = ControlServer(max_bytes=256)
    loop = EchoLoop(server)
    peers = PeerSet()
    try:
        peers.get(server.endpoint).send_frame(b"\x00" * 300)
        ((_, reply),) = replies(peers, 1)
        assert isinstance(reply, ErrorReply) and "300 bytes is over the 256-byte limit" in reply.reason
    finally:
        peers.close()
        loop.stop()
        server.close()


def test_unauthenticated_messages_are_dropped_and_counted() -> None:
    server = ControlServer(secret=SECRET)
    loop = EchoLoop(server)
    good, wrong, plain = PeerSet(secret=SECRET), PeerSet(secret=b"other"), PeerSet()
    try:
        wrong.send(server.endpoint, Ping(decode_rank="intruder", seq=1))
        plain.send(server.endpoint, Ping(decode_rank="intruder", seq=2))
        plain.get(server.endpoint).send_frame(b"\xc1junk")
        good.send(server.endpoint, Ping(decode_rank="d0", seq=3))
        ((_, beat),) = replies(good, 1)
        assert beat == Heartbeat(cp_rank=0, seq=3)  # signed with the secret, verified by the client
        # the server's challenge does not authenticate with their secret (or none): each counts it,
        # sends no Hello and nothing else, and its caller hears nothing (the server said nothing);
        # a wrong Hello at the server: test_channel_preauth
        assert replies(wrong, 1, timeout=0.3) == [] and replies(plain, 1, timeout=0.3) == []
        assert wrong.stats.unauthenticated >= 1 and plain.stats.unauthenticated >= 1
        assert server.stats.received == 1 and server.stats.error_replies == 0 and server.num_peers == 1
        assert loop.errors == []
    finally:
        for p in (good, wrong, plain):
            p.close()
        loop.stop()
        server.close()


def test_client_counts_bad_replies_and_never_answers_them() -> None:
    server = ControlServer()
    peers = PeerSet()
    try:
        peers.send(server.endpoint, Ping(decode_rank="d0", seq=1))
        ((ident, _),) = replies_from_server(server, 1, pump=peers)
        server.send_frame(ident, PLAIN.seal(b"\xc1"))  # a broken server
        ((endpoint, err),) = replies(peers, 1)
        assert endpoint == server.endpoint and isinstance(err, ProtocolError) and "not msgpack" in str(err)
        assert peers.stats.malformed == 1 and peers.stats.sent == 1
        assert replies_from_server(server, 1, timeout=0.3) == []
    finally:
        peers.close()
        server.close()


def replies_from_server(server: ControlServer, count: int, timeout: float = 5.0, pump: PeerSet | None = None) -> list:
    """What ``server`` receives; ``pump``: a client whose loop must turn too (to answer the
    server's challenge with its Hello: until then it sends nothing)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += server.recv_ready(timeout_ms=50)
        if pump is not None:
            assert pump.recv_ready(timeout_ms=0) == []
    return got


def test_wakeup_from_another_thread_ends_the_wait_at_once() -> None:
    server = ControlServer()
    try:
        threading.Timer(0.1, server.wakeup.post, args=("work",)).start()
        start = time.monotonic()
        assert server.recv_ready(timeout_ms=5000) == []
        assert time.monotonic() - start < 2
        assert server.wakeup.drain() == ["work"] and server.wakeup.drain() == []
    finally:
        server.close()


def test_write_completion_wakes_the_loop_through_the_engine_notify() -> None:
    fabric = LocalFabric()
    a, b = create_engine("local", fabric=fabric), create_engine("local", fabric=fabric)
    server = ControlServer()
    try:
        gate = threading.Event()
        a.faults = Faults(gate=gate)
        a.set_notify(server.wakeup.post)
        src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        handle = a.submit_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [64])
        assert server.recv_ready(timeout_ms=100) == [] and a.poll(handle).state.value == "pending"
        threading.Timer(0.1, gate.set).start()
        start = time.monotonic()
        server.recv_ready(timeout_ms=5000)
        assert time.monotonic() - start < 2 and a.poll(handle).state.value == "done" and dst.all()
    finally:
        a.close()
        b.close()
        server.close()


def test_wakeup_queue_is_bounded() -> None:
    w = Wakeup(max_items=3)
    for i in range(3):
        w.post(i)
    with pytest.raises(TransferError, match="wakeup queue full"):
        w.post(3)
    for _ in range(100_000):  # plain wakeups never fill anything
        w.post()
    assert w.drain() == [0, 1, 2]
    w.close()
    assert w.post("late") is False


def test_sending_to_a_peer_that_is_gone_is_peer_lost(served: tuple[ControlServer, EchoLoop]) -> None:
    server, _ = served
    with pytest.raises(PeerLost, match="not connected"):
        server.send(b"\x00nobody", AbortAck(room=1, cp_rank=0))


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="secret"):
        ControlServer(secret=b"")
    with pytest.raises(ConfigError, match="cannot bind"):
        ControlServer(host="203.0.113.1")
    peers = PeerSet(max_peers=1)
    try:
        with pytest.raises(ConfigError, match="tcp://host:port"):
            peers.get("127.0.0.1:5000")
        peers.get("tcp://127.0.0.1:1")
        with pytest.raises(TransferError, match="more than 1 control peers"):
            peers.get("tcp://127.0.0.1:2")
        peers.drop("tcp://127.0.0.1:1")
        peers.get("tcp://127.0.0.1:2")
    finally:
        peers.close()


def test_close_leaves_nothing_listening() -> None:
    server = ControlServer()
    port = server.port
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    server.close()
    server.close()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(TransferError, match="closed"):
        server.recv_ready(0)


def test_a_frame_over_the_limit_closes_only_its_connection(served: tuple[ControlServer, EchoLoop]) -> None:
    """A length over wire.auth_limit(max_bytes) is refused as soon as its header arrives: that
    connection is closed unanswered (nothing of the frame is buffered), every other goes on."""
    server, _ = served
    peers = PeerSet()
    try:
        with RawControl(server.endpoint) as raw:
            raw.send_bytes((wire.auth_limit(server.max_bytes) + 1).to_bytes(4, "big") + b"x" * 100)
            assert raw.closed_by_peer(5)
        assert server.stats.dropped == 1 and server.stats.error_replies == 0
        peers.send(server.endpoint, Ping(decode_rank="d0", seq=5))
        ((_, beat),) = replies(peers, 1)
        assert beat == Heartbeat(cp_rank=0, seq=5)
    finally:
        peers.close()


def test_frames_split_and_batched_across_reads_all_arrive(served: tuple[ControlServer, EchoLoop]) -> None:
    """TCP delivers bytes, not messages: frames cut at any byte, and many in one segment."""
    server, _ = served
    with RawControl(server.endpoint) as raw:
        data = b"".join(streams_frame(wire.encode(Ping(decode_rank="d0", seq=i))) for i in range(50))
        raw.send_bytes(data[:3])
        time.sleep(0.05)
        for cut in range(3, len(data), 97):
            raw.send_bytes(data[cut : cut + 97])
        seqs = []
        while len(seqs) < 50 and (body := raw.recv(5)) is not None:
            seqs.append(wire.decode(body).seq)
        assert seqs == list(range(50))
    assert server.stats.malformed == 0


def test_a_client_waits_for_a_server_that_is_not_up_yet_and_reconnects_after_a_restart() -> None:
    """As a ZMQ DEALER did: messages sent before the server listens, or once it restarted on the
    same port, wait in the client (up to its hwm) and go out when it connects. The client's loop
    runs meanwhile, as a decode rank's does: it notices the closed connection and reconnects."""
    import queue

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    peers, got, stop = PeerSet(), queue.Queue(), threading.Event()

    def client_loop() -> None:
        while not stop.is_set():
            for _, msg in peers.recv_ready(timeout_ms=100):
                got.put(msg.seq)

    thread = threading.Thread(target=client_loop, daemon=True)
    thread.start()
    server = loop = None
    try:
        peers.send(endpoint, Ping(decode_rank="d0", seq=1))  # nobody listens yet: it waits
        time.sleep(0.3)
        assert got.empty()
        server = ControlServer(port=port)
        loop = EchoLoop(server)
        assert got.get(timeout=10) == 1
        loop.stop()
        server.close()
        time.sleep(0.2)  # the client sees its connection close
        server = ControlServer(port=port)  # restarted, same port
        loop = EchoLoop(server)
        peers.send(endpoint, Ping(decode_rank="d0", seq=2))
        assert got.get(timeout=10) == 2
    finally:
        stop.set()
        thread.join(5)
        if loop is not None:
            loop.stop()
        if server is not None:
            server.close()
        peers.close()


def test_a_client_queue_is_bounded_while_its_peer_is_unreachable() -> None:
    peers = PeerSet(hwm=5)
    try:
        for seq in range(5):
            peers.send("tcp://127.0.0.1:1", Ping(decode_rank="d0", seq=seq))
        with pytest.raises(PeerLost, match="send queue full"):
            peers.send("tcp://127.0.0.1:1", Ping(decode_rank="d0", seq=5))
        peers.drop("tcp://127.0.0.1:1")
        peers.send("tcp://127.0.0.1:1", Ping(decode_rank="d0", seq=6))  # a fresh client after drop()
    finally:
        peers.close()


def test_any_thread_may_send_while_the_loops_wait() -> None:
    """Decode ranks send requests from engine threads and prefill ranks report completions from
    engine threads, while each loop thread waits on its sockets' file descriptors: every message
    arrives."""
    import queue

    server, peers = ControlServer(), PeerSet()
    pings: queue.Queue = queue.Queue()
    stop = threading.Event()

    def server_loop() -> None:  # receives; a worker thread answers
        while not stop.is_set():
            for peer, msg in server.recv_ready(timeout_ms=1000):
                pings.put((peer, msg.seq))

    def answer() -> None:
        while (item := pings.get()) is not None:
            server.send(item[0], Heartbeat(cp_rank=0, seq=item[1]))

    got: list[int] = []

    def client_loop() -> None:  # receives what the worker sent
        while not stop.is_set():
            got.extend(m.seq for _, m in peers.recv_ready(timeout_ms=1000))

    threads = [threading.Thread(target=f, daemon=True) for f in (server_loop, answer, client_loop)]
    for t in threads:
        t.start()
    try:
        def send(base: int) -> None:
            for i in range(200):
                peers.send(server.endpoint, Ping(decode_rank="d", seq=base + i))

        senders = [threading.Thread(target=send, args=(1000 * k,)) for k in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        deadline = time.monotonic() + 30
        while len(got) < 800 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(got) == sorted(1000 * k + i for k in range(4) for i in range(200))
    finally:
        stop.set()
        pings.put(None)
        server.wakeup.post()
        peers.wakeup.post()
        for t in threads:
            t.join(5)
        peers.close()
        server.close()


def test_a_connection_that_ends_delivers_every_frame_it_carried(served: tuple[ControlServer, EchoLoop]) -> None:
    """Thousands of frames, then the peer closes: all of them are handled, not the first batches only."""
    server, _ = served
    with RawControl(server.endpoint) as raw:
        raw.send_bytes(b"".join(streams_frame(wire.encode(Ping(decode_rank="d0", seq=i))) for i in range(3000)))
        # an orderly end (FIN): closing with the server's answers unread would reset the connection
        # (RST), and TCP then drops whatever this socket had not yet sent, which no server can read
        raw.sock.shutdown(socket.SHUT_WR)
        assert raw.closed_by_peer(60)  # the server closes its end once it has read everything
    deadline = time.monotonic() + 20
    while server.stats.received < 3000 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats.received == 3000 and server.stats.malformed == 0


def test_a_flood_is_read_no_faster_than_it_is_handled() -> None:
    """While complete frames wait, no more bytes are taken from that socket: the reader's buffer
    stays within the connection's frame allowance (small frames never draw on the shared budget)
    and the sender meets TCP's push-back (here: 40 MiB of signed Pings, each received)."""
    server = ControlServer(secret=SECRET)
    peak, stop = [0], threading.Event()

    def slow_loop() -> None:  # a loop that handles one batch every 10 ms: slower than any sender
        while not stop.is_set():
            server.recv_ready(timeout_ms=50)
            peak[0] = max(peak[0], server.buffered_bytes)  # (one connection: its reader)
            time.sleep(0.01)

    loop = threading.Thread(target=slow_loop, daemon=True)
    loop.start()
    try:
        with RawControl(server.endpoint, timeout=0.5, secret=SECRET) as raw:
            ping = streams_frame(wire.encode(Ping(decode_rank="flood", seq=1), SECRET))
            with pytest.raises(TimeoutError):  # push-back: the server takes the bytes as it handles them
                for _ in range(10):
                    raw.send_bytes(ping * ((4 << 20) // len(ping)))
        assert 0 < peak[0] <= Limits().frame_allowance
        assert server.stats.received > 0 and server.stats.unauthenticated == 0 and server.stats.error_replies == 0
    finally:
        stop.set()
        server.wakeup.post()
        loop.join(5)
        server.close()


def test_sockets_past_fd_1024_connect_and_send() -> None:
    """A busy engine holds thousands of file descriptors: the channel never uses select() (which
    refuses fds of 1024 and more) on its sockets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    pad = []
    try:
        while len(pad) < 1100:
            try:
                pad.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:  # (a lower limit than 1,100 descriptors: the sockets below stay under 1024)
                break
        server = ControlServer()
        loop = EchoLoop(server)
        peers = PeerSet()
        try:
            peers.send(server.endpoint, Ping(decode_rank="d0", seq=9))
            ((_, beat),) = replies(peers, 1)
            assert beat == Heartbeat(cp_rank=0, seq=9)
            assert len(pad) < 1100 or server._listener.fileno() >= 1024
        finally:
            peers.close()
            loop.stop()
            server.close()
    finally:
        for fd in pad:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


ACCEPT_EMFILE = r"""
import logging, resource, socket, sys, threading, time
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel import ControlServer
warnings = []
class Count(logging.Handler):
    def emit(self, record): warnings.append(record.getMessage())
logging.getLogger("kvbridge.transfer.channel").addHandler(Count())
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from kvbridge.transfer.channel import Limits
# pending slots (and the hello deadline) wide enough that accepts, not evictions, run out first
limits = Limits(max_pending=1000, max_pending_per_address=1000, hello_timeout=60)
server, stop, turns = ControlServer(limits=limits), threading.Event(), [0]
def loop():
    while not stop.is_set():
        for peer, msg in server.recv_ready(50):
            server.send(peer, wire.Heartbeat(cp_rank=0, seq=msg.seq))
        turns[0] += 1
threading.Thread(target=loop, daemon=True).start()
print(server.port, flush=True)
sys.stdin.readline()  # the test has opened connections until accepts failed
print(sum("accept failed" in w for w in warnings), turns[0], flush=True)
sys.stdin.readline()
stop.set(); server.wakeup.post(); time.sleep(0.2); server.close()
"""


def test_a_server_out_of_file_descriptors_pauses_accepts_instead_of_spinning() -> None:
    """accept() failing (EMFILE) leaves the listener readable: the server stops polling it for a
    moment, logs rarely, and serves again once descriptors are free."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", ACCEPT_EMFILE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    clients: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(200):  # more than its 64 descriptors
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.0)
        proc.stdin.write("\n")
        proc.stdin.flush()
        failures, turns = map(int, proc.stdout.readline().split())
        assert 1 <= failures <= 12, failures  # logged at powers of two, not per loop turn
        assert turns < 2000, turns  # paused for 0.1 s at a time: no spinning on the readable listener
        for c in clients:
            c.close()
        clients.clear()
        peers = PeerSet()
        try:
            peers.send(f"tcp://127.0.0.1:{port}", Ping(decode_rank="d0", seq=4))
            ((_, beat),) = replies(peers, 1, timeout=10)
            assert beat == Heartbeat(cp_rank=0, seq=4)  # accepting again
        finally:
            peers.close()
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.flush()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_a_unix_abstract_address_carries_the_same_channel() -> None:
    """The transport's other address family (the IPC side channel's): a server on an abstract Unix
    socket, a client naming it ``unix:@...``, the same Hello, codec and replies."""
    import uuid

    from kvbridge.transfer.channel import Clients, Server

    endpoint = f"unix:@kvbridge-test/{uuid.uuid4().hex}"
    server = Server(wire.codec(SECRET), endpoint)
    loop = EchoLoop(server)
    clients = Clients(wire.codec(SECRET), name="unix-client")
    try:
        assert server.endpoint == endpoint and server.port == 0
        clients.send(endpoint, Ping(decode_rank="u", seq=11))
        ((got_endpoint, beat),) = replies(clients, 1)
        assert got_endpoint == endpoint and beat == Heartbeat(cp_rank=0, seq=11)
        assert [server.hello_of(p).peer for p in server.peers] == ["unix-client"]
        with pytest.raises(ConfigError, match="cannot bind"):
            Server(wire.codec(SECRET), endpoint)  # the name is taken
    finally:
        clients.close()
        loop.stop()
        server.close()
