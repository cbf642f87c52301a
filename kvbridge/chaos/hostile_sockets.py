"""The raw sockets of ``kvbridge chaos --hostile``'s connection attacks (hostile.py): loopback
source addresses 127.0.0.2, ..., non-blocking connects, a valid Hello answering the server's
challenge (the attacker holds the secret), a byte-a-second dribble, and the keepers that hold
many connections open, re-opening those the server closes."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Any

from kvbridge.errors import ProtocolError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel.frames import HEADER, frame

__all__ = ["Holder", "Replayer", "RoomWatch", "authenticated", "closed", "connect", "dribble", "hello_for", "port_of",
           "try_send"]


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _source(i: int, addresses: int) -> str:
    n = i % addresses + 2
    return f"127.0.{n // 256}.{n % 256}"


def connect(port: int, i: int, addresses: int, source: str | None = None) -> socket.socket | None:
    """The ``i``-th attack connection (from the ``i % addresses``-th source address, or ``source``),
    non-blocking, or None when the connect failed."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=2.0,
                                        source_address=(source or _source(i, addresses), 0))
    except OSError:
        return None
    sock.setblocking(False)
    return sock


def try_send(sock: socket.socket, data: bytes) -> int:
    try:
        return sock.send(data)
    except OSError:  # the kernel buffer is full, or the server closed it: the attack goes on
        return 0


def closed(sock: socket.socket) -> bool:
    """The server closed (or reset) this non-blocking socket (what it sent before, such as its
    hello challenge, is read and dropped)."""
    try:
        for _ in range(16):
            if sock.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    return False


def hello_for(sock: socket.socket, secret: bytes, name: str) -> bytes:
    """Read the server's challenge on ``sock`` (blocking) and return the framed valid Hello that
    answers it: what a real rank sends, and what a capture of its connection would hold."""
    (size,) = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    nonce = wire.codec(secret).open_challenge(sock.recv(size, socket.MSG_WAITALL)).nonce
    return frame(wire.codec(secret).hello(name, nonce))


def authenticated(port: int, i: int, addresses: int, secret: bytes, name: str,
                  source: str | None = None) -> socket.socket | None:
    """A non-blocking connection that answered its challenge with a valid Hello, or None."""
    sock = connect(port, i, addresses, source)
    if sock is None:
        return None
    try:
        sock.settimeout(5.0)
        sock.sendall(hello_for(sock, secret, name))
        sock.setblocking(False)
    except (OSError, ProtocolError):
        sock.close()
        return None
    return sock


def dribble(port: int, first: bytes, slow: bytes, wait_s: float, hello_secret: bytes | None = None) -> float | None:
    """Send ``first`` (after a valid Hello when ``hello_secret`` is given), then ``slow`` one
    byte a second (then keep the frame open); seconds until the server closed the connection,
    or None if it had not after ``wait_s``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
    t0 = time.monotonic()
    try:
        if hello_secret is not None:
            sock.sendall(hello_for(sock, hello_secret, "hostile-slow"))
            t0 = time.monotonic()
        sock.sendall(first)
        sock.setblocking(False)
        i = 0
        while time.monotonic() - t0 < wait_s:
            if i < len(slow):
                if try_send(sock, slow[i:i + 1]) == 0 and closed(sock):
                    return round(time.monotonic() - t0, 2)
                i += 1
            else:
                try_send(sock, b"\0")  # the frame's body, still one byte a second
            with selectors.DefaultSelector() as sel:
                sel.register(sock, selectors.EVENT_READ)
                if sel.select(1.0) and closed(sock):
                    return round(time.monotonic() - t0, 2)
        return None
    finally:
        sock.close()


class _Keeper:
    """Keeps ``n`` connections open from a thread, sweeping every ``SWEEP_S``: the ones the
    server closed are counted and dropped, and up to ``REOPEN_PER_SWEEP`` re-opened (``n`` on
    the first sweep), until stopped. ``opened(sock)`` is what a subclass does with a new one."""

    SWEEP_S = 0.25
    REOPEN_PER_SWEEP = 400  # bounds the connect storm on a small host

    def __init__(self, port: int, n: int, addresses: int, name: str) -> None:
        self.port, self.n, self.addresses = port, n, addresses
        self.socks: dict[socket.socket, float] = {}  # socket -> when it was opened
        self.connects = self.failures = self.closed_by_server = self.peak_open = 0
        self._stop = threading.Event()
        self._filled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_filled(self, timeout: float) -> None:
        self._filled.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)
        for sock in self.socks:
            sock.close()
        self.socks.clear()

    def opened(self, sock: socket.socket) -> None:
        """A new connection, just opened (the default sends nothing)."""

    def swept(self, now: float) -> None:
        """After a sweep dropped the closed connections, before it re-opens."""

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            for sock in [s for s in self.socks if closed(s)]:
                self.closed_by_server += 1
                del self.socks[sock]
                sock.close()
            self.swept(time.monotonic())
            budget = self.n if first else self.REOPEN_PER_SWEEP
            while len(self.socks) < self.n and budget > 0 and not self._stop.is_set():
                sock = connect(self.port, self.connects, self.addresses)
                self.connects += 1
                budget -= 1
                if sock is None:
                    self.failures += 1
                    continue
                self.opened(sock)
                self.socks[sock] = time.monotonic()
            self.peak_open = max(self.peak_open, len(self.socks))
            first = False
            self._filled.set()
            self._stop.wait(self.SWEEP_S)


class Holder(_Keeper):
    """Keeps ``n`` idle connections open (re-opening those the server closes) until stopped."""

    def __init__(self, port: int, n: int, addresses: int) -> None:
        super().__init__(port, n, addresses, "hostile-holder")


class Replayer(_Keeper):
    """Keeps ``n`` connections open that each sent ``captured`` (one real connection's Hello)
    first, re-opening those the server closes, until stopped; ``held_peak``: the most that
    were open ``held_after`` seconds after they sent it (a replay the server took as a peer)."""

    REOPEN_PER_SWEEP = 200

    def __init__(self, port: int, n: int, addresses: int, captured: bytes, held_after: float) -> None:
        super().__init__(port, n, addresses, "hostile-replayer")
        self.captured, self.held_after = captured, held_after
        self.held_peak = 0

    def opened(self, sock: socket.socket) -> None:
        try_send(sock, self.captured)

    def swept(self, now: float) -> None:
        self.held_peak = max(self.held_peak, sum(1 for t in self.socks.values() if now - t > self.held_after))


class RoomWatch:
    """What an attacker's forged TransferRequest brought back: prefill's refusals (by endpoint),
    the PagesDone reports of ``room`` (by CP rank) and the prefill members' own room results."""

    def __init__(self, room: int, pending: list[tuple[Any, int]]) -> None:
        self.room, self.pending = room, pending
        self.refusals: dict[str, str] = {}
        self.reports: dict[int, list[str]] = {}
        self.replies: dict[str, Any] = {}

    def open(self) -> bool:
        """Neither every member answered nor every one refused."""
        return len(self.replies) < len(self.pending) and len(self.refusals) < len(self.pending)

    def note(self, where: str, msg: Any) -> None:
        """Keep a refusal or a report of the room (other messages are the caller's)."""
        if isinstance(msg, wire.ErrorReply):
            self.refusals[where] = msg.reason[:300]
        elif isinstance(msg, wire.PagesDone) and msg.room == self.room:
            self.reports.setdefault(msg.cp_rank, []).append(msg.status if msg.status == "ok"
                                                            else f"failed: {msg.reason[:200]}")

    def take_replies(self) -> None:
        for m, request_id in self.pending:
            m.client.poll(0.0)
            reply = m.client.take(request_id)
            if reply is not None:
                self.replies[m.name] = reply
