"""kvbridge's one transport: length-prefixed frames over stream sockets (TCP or Unix), a
server end (a peer is its connection) and a client end (one reconnecting client per
endpoint), both on ``selectors``, both carrying one codec's envelopes (``envelope.py``). This module
holds what both ends share (the ``Channel`` base, ``Limits``, ``Wakeup``, addresses); the
server end is ``server.py``, the client end ``clients.py``.

    frame = 4-byte big-endian length | envelope

    client (Clients)                                     server (Server)
    connect ────────────────────────────────────────────▶ accept: pending (reads <= one Hello)
            ◀──────────────────── HelloChallenge(nonce)   (first frame, fresh per connection)
    Hello(nonce, MAC) (first frame, <= 4 KiB) ──────────▶ a valid Hello carrying the nonce: peer
    messages (held until the Hello went) ───────────────▶ (full frames, within the budgets below)
             ◀───────────────── replies go back on the connection that asked

One loop thread receives (``recv_ready``); any thread may send. Every socket call goes
through one lock and the loop waits on file descriptors only (the wakeup pipe and the
sockets), never inside a socket call, so a send from an engine thread goes out at once;
what the kernel does not take waits (at most ``hwm`` frames; then PeerLost) for the loop.
Other threads hand the loop work through ``wakeup`` (``post`` anywhere, ``drain`` in the loop).

Bad input never raises out of ``recv_ready``: a message that does not decode comes back as
``(peer, ProtocolError)``, counted in ``stats.malformed``, and a server answers it with the
codec owner's refusal (``_refusal``). With a secret the MAC is checked before the size, so an
authentic message over ``max_bytes`` is answered like any other malformed one; anything that
does not authenticate is dropped unanswered (``stats.unauthenticated``). Clients never answer.

Nothing unauthenticated costs memory or a slot for long (``Limits``): a pending connection
buffers at most one Hello, must send it within ``hello_timeout``, and holds one of
``max_pending`` slots (``max_pending_per_address`` per source address; a newcomer evicts the
oldest pending connection of its address, or overall), apart from the ``max_connections``
slots of authenticated peers. A Hello opens only the connection whose challenge it carries
(``envelope.py``), so captured bytes open nothing.

What an authenticated peer costs is bounded too:
- slots: at most ``max_connections_per_address`` per source address (the peer's address, not
  the name its Hello claims: any holder of the secret can claim any name, and a cap per name
  would let it lock a named rank out; an address is what the network gives it). When every
  slot is taken, a newcomer from an address holding fewer connections than the busiest
  address displaces that address's oldest connection; otherwise it is refused;
- input: a reader buffers ``frame_allowance`` bytes on its own; beyond that it draws on one
  ``frame_budget`` shared by all connections (one frame at most). A connection that would
  exceed it is not read (TCP pushes back) until the budget frees, and its frame's clock stops
  meanwhile. So a server's buffered input is at most ``max_connections x frame_allowance +
  frame_budget``, whatever the peers send;
- time: a frame of n bytes must be complete ``frame_timeout + n / frame_rate`` seconds after it
  began, and a peer must send something every ``idle_timeout`` seconds (a deadline is checked
  after reading what the socket holds, so a busy loop never closes a peer that kept up);
- MAC failures: a connection whose frames fail their MAC ``max_bad_macs`` times is closed;
- output: what waits unsent for all peers together is at most ``max_queued_bytes`` plus one
  frame per peer (an empty queue always takes a frame): over it, the peer with the most unsent
  output (one that does not read) is closed. A malformed message is answered only while its
  peer's queue holds fewer than ``REFUSALS_QUEUED`` frames.
A frame over ``auth_limit(max_bytes)`` closes its connection at once.

A client connects on first use and again, every RECONNECT_S doubling to RECONNECT_MAX_S,
while the peer is unreachable (a connect nobody answers is given CONNECT_TIMEOUT_S); frames
sent meanwhile wait (up to ``hwm``) and go out once connected, after the Hello that answers
the connection's challenge (a first frame that is not one is logged and counted, and the
connection is dropped and tried again). A send on a connection whose challenge has not come
yet waits for it (GREET_WAIT_S off the loop thread, GREET_WAIT_LOOP_S on it) and answers it
itself, so what it sent goes out even when nobody turns this side's loop meanwhile. A frame
only partly sent when its connection broke is sent again whole: the server drops a partial
frame with its connection, so a frame arrives once or not at all. A server that cannot accept
(out of file descriptors) stops listening for ACCEPT_PAUSE_S instead of spinning. A connection
that ends delivers every complete frame it carried first. Closing drops what waits (linger 0).
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

from kvbridge.errors import ConfigError, KVBridgeError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer.channel.envelope import Codec, auth_limit
from kvbridge.transfer.channel.frames import FrameError, QueueFull, Stream, frame

log = logging.getLogger("kvbridge.transfer.channel")

DEFAULT_HWM = 1000
MAX_BATCH = 256  # frames per connection per recv_ready
MAX_PEERS = 1024
MAX_WAKEUP_ITEMS = 10_000
RECONNECT_S = 0.05
RECONNECT_MAX_S = 1.0
CONNECT_TIMEOUT_S = 5.0
GREET_WAIT_S = 1.0  # how long a send on a new connection waits for the server's challenge (off the loop)
GREET_WAIT_LOOP_S = 0.01  # (on the loop thread, which must not stall; its next turn reads it anyway)
ACCEPT_PAUSE_S = 0.1
SCAN_S = 0.05  # deadlines are checked this often (at most) while a Hello or a frame is due
IDLE_SCAN_S = 1.0  # and this often when only idle deadlines are
REFUSALS_QUEUED = 8  # a malformed message is answered only while fewer frames wait for its peer
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE

PeerT = TypeVar("PeerT", bound=Hashable)
Received = tuple[PeerT, Union[Any, ProtocolError]]  # (peer, message) or (peer, why it was refused)


@dataclass(frozen=True)
class Limits:
    """How long and how much a server gives a connection (seconds, counts, bytes); see the
    module docstring for what each bounds. ``docs/security.md`` states the defaults and the
    worst case they give."""

    hello_timeout: float = 2.0  # a new connection's Hello must have arrived by then
    frame_timeout: float = 3.0  # a frame of n bytes must be complete frame_timeout + n / frame_rate after it began
    frame_rate: float = float(2 << 20)  # bytes per second
    idle_timeout: float | None = 120.0  # an authenticated peer silent this long is closed (None: never)
    max_connections: int = 4096  # authenticated peers
    max_connections_per_address: int | None = 64  # of them from one source address (None: no cap)
    max_pending: int = 128  # connections that have not sent their Hello yet
    max_pending_per_address: int = 16
    max_bad_macs: int = 3  # frames failing their MAC after the Hello before the connection is closed
    frame_allowance: int = 8 << 10  # bytes a connection's reader holds without drawing on the shared budget
    frame_budget: int = 16 << 20  # bytes beyond their allowances that all connections' readers share
    max_queued_bytes: int = 32 << 20  # unsent output of all peers together (plus one frame each)

    def frame_deadline(self, size: int) -> float:
        """Seconds a frame of ``size`` bytes may take from its first byte to its last."""
        return self.frame_timeout + size / self.frame_rate


@dataclass
class ChannelStats:
    received: int = 0
    malformed: int = 0
    unauthenticated: int = 0  # messages or hellos that did not authenticate (dropped)
    sent: int = 0
    error_replies: int = 0
    dropped: int = 0  # connections closed for an oversized frame (unanswered)
    timed_out: int = 0  # connections closed for a missed hello, frame or idle deadline
    evicted: int = 0  # pending connections closed to make room for newer ones
    refused: int = 0  # authenticated connections over max_connections or max_connections_per_address
    displaced: int = 0  # authenticated connections closed for a newcomer from a less busy address
    bad_mac_closed: int = 0  # connections closed after max_bad_macs frames failed their MAC
    throttled: int = 0  # times a connection's reading waited for the shared frame budget
    output_closed: int = 0  # connections closed holding the most unsent output, over max_queued_bytes

    def counts(self) -> dict[str, int]:
        """The message counts (what metrics publish)."""
        return {"received": self.received, "sent": self.sent, "malformed": self.malformed,
                "unauthenticated": self.unauthenticated, "error_replies": self.error_replies}


class Wakeup:
    """Thread-safe hand-off to a loop thread: ``post`` from anywhere, ``drain`` in the loop."""

    def __init__(self, max_items: int = MAX_WAKEUP_ITEMS) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._items: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._max_items = max_items
        self._closed = False

    def post(self, item: Any = None) -> bool:
        """Queue ``item`` (None: just wake the loop); False once closed."""
        with self._lock:
            if self._closed:
                return False
            if item is not None:
                if len(self._items) >= self._max_items:
                    raise TransferError(f"wakeup queue full ({self._max_items} items): the loop thread is not draining")
                self._items.append(item)
            try:
                os.write(self._write_fd, b"\x00")
            except BlockingIOError:  # pipe full: the loop is already due to wake
                pass
        return True

    def drain(self) -> list[Any]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def fileno(self) -> int:
        return self._read_fd

    def clear_signal(self) -> None:
        try:
            os.read(self._read_fd, 65536)
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read_fd)
                os.close(self._write_fd)


class Channel(Generic[PeerT]):
    """What both ends share: the selector, the io lock, receiving and decoding, sending."""

    def __init__(self, codec: Codec[Any], *, hwm: int) -> None:
        self.codec = codec
        self.secret = codec.secret
        self.max_bytes = codec.max_bytes
        self.hwm = hwm
        self.stats = ChannelStats()
        self.wakeup = Wakeup()
        self._max_frame = auth_limit(codec.max_bytes)
        self._io = threading.RLock()  # every socket call (any thread); reentrant: a receive may answer
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.wakeup.fileno(), READ, None)
        self._by_fd: dict[int, Stream] = {}
        self._backlog: set[Stream] = set()  # streams whose reader holds complete frames (over MAX_BATCH)
        self._loop: int | None = None
        self._closed = False

    # what the two ends differ in (io lock held)
    def _receive(self, stream: Stream, body: bytes) -> Received[PeerT] | None:
        raise NotImplementedError

    def _lost(self, stream: Stream, why: str) -> None:
        raise NotImplementedError

    def _other_event(self, key: selectors.SelectorKey, out: list[Received[PeerT]]) -> None:
        """A file object of the subclass's own fired (the server's listener)."""

    def _broken(self, stream: Stream, why: str) -> None:
        self._lost(stream, why)

    def _due(self) -> float | None:
        """Monotonic time of the next housekeeping, or None."""
        return None

    def _housekeeping(self, out: list[Received[PeerT]]) -> None:
        """After every wait, io lock held (never raises); may read (into ``out``)."""

    def _taken(self, stream: Stream) -> None:
        """Frames were taken out of ``stream``'s reader (or it grew)."""

    def _readable(self, stream: Stream) -> bool:
        return stream.read()

    def _writable(self, stream: Stream) -> None:
        stream.flush()

    # -- receiving (the loop thread) -----------------------------------------------------------
    def recv_ready(self, timeout_ms: int) -> list[Received[PeerT]]:
        """Wait up to ``timeout_ms`` for input; return what arrived (possibly nothing: a wakeup)."""
        if self._closed:
            raise TransferError("channel is closed")
        self._loop = threading.get_ident()
        with self._io:
            timeout = 0.0 if self._backlog else max(0, int(timeout_ms)) / 1000
            due = self._due()
            if due is not None:
                timeout = max(0.0, min(timeout, due - time.monotonic()))
        try:
            events = self._sel.select(timeout)
        except (OSError, ValueError):  # (closed by another thread meanwhile)
            events = []
        out: list[Received[PeerT]] = []
        with self._io:
            if self._closed:
                return out
            self._housekeeping(out)
            for key, ev in events:
                stream = key.data
                if not isinstance(stream, Stream):
                    if key.fd == self.wakeup.fileno():
                        self.wakeup.clear_signal()
                    else:
                        self._other_event(key, out)
                    continue
                if self._by_fd.get(key.fd) is not stream:  # (lost earlier in this turn)
                    continue
                self._service(stream, ev, out)
            for stream in list(self._backlog):
                self._backlog.discard(stream)
                if stream.sock is not None:
                    self._frames(stream, out)
        return out

    def _service(self, stream: Stream, ev: int, out: list[Received[PeerT]]) -> None:
        try:
            if ev & WRITE:
                self._writable(stream)
            # frames already waiting are handled first: no more bytes are taken from the socket
            # meanwhile (the reader stays bounded and the sender feels TCP's push-back)
            ready = stream.sock is not None and not stream.reader.ready
            alive = self._readable(stream) if ev & READ and ready else True
        except (OSError, KVBridgeError) as exc:
            alive, why = False, str(exc)
        else:
            why = "closed by the peer"
        if stream.sock is None:
            return
        self._frames(stream, out, limit=MAX_BATCH if alive else None)  # what came before the end counts
        if stream.sock is None:
            return
        if alive:
            self._interest(stream)
        else:
            self._lost(stream, why)

    def _frames(self, stream: Stream, out: list[Received[PeerT]], limit: int | None = MAX_BATCH) -> None:
        if self._greeting(stream):  # the Hello alone, under the pre-auth limit; the rest under the full one
            self._frames_of(stream, out, 1)
            if stream.sock is None or self._greeting(stream):
                return
        self._frames_of(stream, out, limit)

    def _greeting(self, stream: Stream) -> bool:
        """``stream`` waits for its Hello (server side)."""
        return False

    def _frames_of(self, stream: Stream, out: list[Received[PeerT]], limit: int | None) -> None:
        try:
            bodies = stream.reader.frames(limit if limit is not None else 1 << 62)
        except FrameError as exc:
            self.stats.dropped += 1
            if power_of_two(self.stats.dropped):
                log.warning("%s channel: closed %d connection(s) that announced an oversized frame; latest: %s",
                            self.codec.name, self.stats.dropped, exc)
            self._lost(stream, str(exc))
            return
        if not stream.reader.buffered:
            stream.partial_since = 0.0
        elif bodies or not stream.partial_since:  # a frame began in this read: its clock starts now
            stream.partial_since = time.monotonic()
        self._taken(stream)
        for body in bodies:
            item = self._receive(stream, body)
            if item is not None:
                out.append(item)
            if stream.sock is None:  # (a Hello that failed, or the last bad MAC, closed it)
                return
        if stream.reader.ready:
            self._backlog.add(stream)

    def _decode(self, body: bytes, who: str) -> Any:
        """The message, a ProtocolError, or None when dropped as unauthenticated."""
        self.stats.received += 1
        try:
            body = self.codec.unseal(body)
        except ProtocolError as err:
            if self.secret is not None and err.field == "mac":  # ("size", "v": authentic, refused)
                self.stats.unauthenticated += 1
                if power_of_two(self.stats.unauthenticated):
                    log.warning("dropped %d unauthenticated %s message(s); latest from %s: %s",
                                self.stats.unauthenticated, self.codec.name, who, err)
                return None
            return self._malformed(err, who)
        try:
            return self.codec.decode_body(body)
        except ProtocolError as err:
            err.body = body  # type: ignore[attr-defined]  (for the server's refusal: its tag and room)
            return self._malformed(err, who)

    def _malformed(self, err: ProtocolError, who: str) -> ProtocolError:
        self.stats.malformed += 1
        if power_of_two(self.stats.malformed):
            log.warning("%d malformed %s message(s); latest from %s: %s", self.stats.malformed, self.codec.name, who, err)
        return err

    # -- sending (any thread) ------------------------------------------------------------------
    def _send(self, stream: Stream, data: bytes, who: str) -> None:
        if self._closed:
            raise TransferError(f"{self.codec.name} channel to {who} is closed")
        try:
            stream.queue(frame(data))
        except QueueFull:
            raise PeerLost(f"{self.codec.name} channel to {who}: send queue full ({self.hwm} messages); peer gone "
                           "or stalled") from None
        except OSError as exc:
            self.stats.sent += 1
            self._broken(stream, str(exc))
            return
        self.stats.sent += 1
        if stream.wants_write and stream.sock is not None:
            self._interest(stream)

    def _interest(self, stream: Stream) -> None:
        """Watch ``stream`` for input (unless throttled), and for output while frames wait or it
        connects."""
        events = (0 if stream.throttled else READ) | (WRITE if stream.wants_write or not stream.connected else 0)
        if events != stream.events:
            if not events:
                self._sel.unregister(stream.sock)
            elif stream.events:
                self._sel.modify(stream.sock, events, stream)
            else:
                self._sel.register(stream.sock, events, stream)
            stream.events = events
            self._wake_loop()

    def _watch(self, stream: Stream) -> None:
        self._by_fd[stream.fd] = stream
        self._interest(stream)
        self._wake_loop()

    def _unwatch(self, stream: Stream) -> None:
        if stream.sock is not None and self._by_fd.get(stream.fd) is stream:
            del self._by_fd[stream.fd]
            if stream.events:
                try:
                    self._sel.unregister(stream.sock)
                except (KeyError, ValueError):
                    pass
        stream.events = 0
        self._backlog.discard(stream)

    def _wake_loop(self) -> None:
        if self._loop is not None and threading.get_ident() != self._loop:
            self.wakeup.post()

    def _close(self, streams: list[Stream], others: list[socket.socket] = ()) -> None:
        self._closed = True
        for stream in streams:
            self._unwatch(stream)
            stream.close()
        for sock in others:
            sock.close()
        self._sel.close()
        self.wakeup.close()


# ---- the server end ---------------------------------------------------------------------------------
# ---- addresses --------------------------------------------------------------------------------------
def parse_address(endpoint: str, *, listen: bool = False) -> tuple[int, Any, str]:
    """``tcp://host:port`` or ``unix:@abstract`` / ``unix:/path`` as (family, sockaddr, label)."""
    if isinstance(endpoint, str) and endpoint.startswith("unix:") and len(endpoint) > 5:
        name = endpoint[5:]
        return socket.AF_UNIX, ("\0" + name[1:]) if name.startswith("@") else name, endpoint
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ConfigError(f"endpoint must look like tcp://host:port or unix:@name, got {endpoint!r}", field="endpoint")
    host, _, port = endpoint[6:].rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        number = int(port)
        if not (0 if listen else 1) <= number < 65536:
            raise ValueError(port)
        if listen:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return family, (host, number), f"{host}:{number}"
        family, _, _, _, sockaddr = socket.getaddrinfo(host, number, type=socket.SOCK_STREAM)[0]
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot connect to endpoint {endpoint!r}: {exc}", field="endpoint") from None
    return family, sockaddr, endpoint


def listen_socket(family: int, sockaddr: Any) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart on the same port past TIME_WAIT
        sock.bind(sockaddr)
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def set_nodelay(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family != socket.AF_UNIX:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small message, one segment, now
        except OSError:
            pass


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
