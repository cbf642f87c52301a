"""kvbridge's one transport: length-prefixed frames over stream sockets (TCP or Unix), a
server end (a peer is its connection) and a client end (one reconnecting client per
endpoint), both on ``selectors``, both carrying one codec's envelopes (``envelope.py``).

    frame = 4-byte big-endian length | envelope

    client (Clients)                                     server (Server)
    connect, then Hello (first frame, <= 4 KiB) ───────▶ accept: pending (reads <= one Hello)
    messages ──────────────────────────────────────────▶ after a valid Hello: peer (full frames)
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
slots of authenticated peers; an authenticated peer must finish a frame it started within
``frame_timeout`` (a byte-a-second sender is closed) and, when ``idle_timeout`` is set, send
something that often. A frame over ``auth_limit(max_bytes)`` closes its connection at once.

A client connects on first use and again, every RECONNECT_S doubling to RECONNECT_MAX_S,
while the peer is unreachable (a connect nobody answers is given CONNECT_TIMEOUT_S); frames
sent meanwhile wait (up to ``hwm``) and go out, after a fresh Hello, once connected. A frame
only partly sent when its connection broke is sent again whole: the server drops a partial
frame with its connection, so a frame arrives once or not at all. A server that cannot accept
(out of file descriptors) stops listening for ACCEPT_PAUSE_S instead of spinning. A connection
that ends delivers every complete frame it carried first. Closing drops what waits (linger 0).
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

from kvbridge.errors import ConfigError, KVBridgeError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES, Codec, Hello, auth_limit
from kvbridge.transfer.channel.frames import HEADER, READ_PER_CALL, FrameError, QueueFull, Stream, frame

log = logging.getLogger("kvbridge.transfer.channel")

DEFAULT_HWM = 1000
MAX_BATCH = 256  # frames per connection per recv_ready
MAX_PEERS = 1024
MAX_WAKEUP_ITEMS = 10_000
RECONNECT_S = 0.05
RECONNECT_MAX_S = 1.0
CONNECT_TIMEOUT_S = 5.0
ACCEPT_PAUSE_S = 0.1
SCAN_S = 0.05  # deadlines are checked this often (at most)
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE

PeerT = TypeVar("PeerT", bound=Hashable)
Received = tuple[PeerT, Union[Any, ProtocolError]]  # (peer, message) or (peer, why it was refused)


@dataclass(frozen=True)
class Limits:
    """How long and how much a server gives a connection (seconds, counts)."""

    hello_timeout: float = 2.0  # a new connection's Hello must have arrived by then
    frame_timeout: float = 10.0  # a frame an authenticated peer started must be complete by then
    idle_timeout: float | None = None  # an authenticated peer silent this long is closed (None: never)
    max_connections: int = 4096  # authenticated peers
    max_pending: int = 128  # connections that have not sent their Hello yet
    max_pending_per_address: int = 16


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
    refused: int = 0  # authenticated connections over max_connections

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


class _Channel(Generic[PeerT]):
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
        self._sel.register(self.wakeup.fileno(), _R, None)
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

    def _housekeeping(self) -> None:
        """After every wait, io lock held (never raises)."""

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
            self._housekeeping()
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
            if ev & _W:
                self._writable(stream)
            # frames already waiting are handled first: no more bytes are taken from the socket
            # meanwhile (the reader stays bounded and the sender feels TCP's push-back)
            ready = stream.sock is not None and not stream.reader.ready
            alive = self._readable(stream) if ev & _R and ready else True
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
            if _power_of_two(self.stats.dropped):
                log.warning("%s channel: closed %d connection(s) that announced an oversized frame; latest: %s",
                            self.codec.name, self.stats.dropped, exc)
            self._lost(stream, str(exc))
            return
        if not stream.reader.buffered:
            stream.partial_since = 0.0
        elif bodies or not stream.partial_since:  # a frame began in this read: its clock starts now
            stream.partial_since = time.monotonic()
        for body in bodies:
            item = self._receive(stream, body)
            if stream.sock is None:  # (a Hello that failed closed it)
                return
            if item is not None:
                out.append(item)
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
                if _power_of_two(self.stats.unauthenticated):
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
        if _power_of_two(self.stats.malformed):
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
        """Watch ``stream`` for input, and for output while frames wait or it connects."""
        events = _R | (_W if stream.wants_write or not stream.connected else 0)
        if events != stream.events:
            if stream.events:
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
class Server(_Channel[bytes]):
    """Listens on ``address`` (``tcp://host:port``, port 0: a free one; ``unix:@name`` abstract,
    ``unix:/path``); a peer is its connection's id (bytes). ``admit(sock)`` may refuse a new
    connection by raising (its result is kept as the stream's ``info``)."""

    def __init__(self, codec: Codec[Any], address: str, *, hwm: int = DEFAULT_HWM, limits: Limits | None = None,
                 admit: Callable[[socket.socket], Any] | None = None,
                 on_lost: Callable[[bytes], None] | None = None) -> None:
        super().__init__(codec, hwm=hwm)
        self.limits = limits or Limits()
        self._admit = admit
        self._on_lost = on_lost
        family, sockaddr, label = parse_address(address, listen=True)
        try:
            self._listener = _listen(family, sockaddr)
        except OSError as exc:
            self._sel.close()
            self.wakeup.close()
            raise ConfigError(f"cannot bind the {codec.name} channel to {label}: {exc.strerror or exc}",
                              field="port") from exc
        if family == socket.AF_UNIX:
            self.port = 0
            self.endpoint = address
        else:
            self.port = int(self._listener.getsockname()[1])
            host = sockaddr[0]
            self.endpoint = f"tcp://{f'[{host}]' if ':' in host else host}:{self.port}"
        self._peers: dict[bytes, Stream] = {}
        self._pending: dict[Stream, None] = {}  # accepted, no Hello yet (oldest first)
        self._pending_by_address: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count(1)
        self._accept_failures = 0
        self._listen_paused = 0.0
        self._next_scan = 0.0
        self._sel.register(self._listener, _R, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def hello_of(self, peer: bytes) -> Hello | None:
        """What a connected peer said it is (its Hello), or None once it is gone."""
        stream = self._peers.get(peer)
        return None if stream is None else stream.hello

    def info_of(self, peer: bytes) -> Any:
        stream = self._peers.get(peer)
        return None if stream is None else stream.info

    def send(self, peer: bytes, msg: Any) -> None:
        """Send to a connected peer (any thread); PeerLost when it is gone or its queue is full."""
        self.send_frame(peer, self.codec.encode(msg))

    def send_frame(self, peer: bytes, data: bytes) -> None:
        """Send one encoded message (or, in tests, any bytes) to ``peer`` (any thread)."""
        who = f"peer {peer.hex()}"
        with self._io:
            stream = self._peers.get(peer)
            if stream is None or stream.sock is None or stream.broken:
                raise PeerLost(f"{self.codec.name} channel to {who}: peer not connected")
            self._send(stream, data, who)
            if stream.sock is None or stream.broken:
                raise PeerLost(f"{self.codec.name} channel to {who}: connection closed")

    def _refusal(self, err: ProtocolError, body: bytes) -> Any:
        """The answer to a malformed message (None: no answer)."""
        return None

    def _receive(self, stream: Stream, body: bytes) -> Received[bytes] | None:
        if stream.hello is None:
            self._authenticate(stream, body)
            return None
        stream.last_rx = time.monotonic()
        result = self._decode(body, f"peer {stream.ident.hex()}")
        if isinstance(result, ProtocolError):
            reply = self._refusal(result, getattr(result, "body", b""))
            if reply is not None:
                try:
                    self.send(stream.ident, reply)
                    self.stats.error_replies += 1
                except TransferError as exc:
                    log.debug("could not answer a malformed message: %s", exc)
        return None if result is None else (stream.ident, result)

    def _authenticate(self, stream: Stream, body: bytes) -> None:
        """A pending connection's first frame: its Hello, or the connection is closed."""
        try:
            hello = self.codec.open_hello(body)
        except ProtocolError as err:
            self.stats.unauthenticated += 1
            if _power_of_two(self.stats.unauthenticated):
                log.warning("%s channel %s: closed %d connection(s) without a valid hello; latest from %s: %s",
                            self.codec.name, self.endpoint, self.stats.unauthenticated, stream.address, err)
            self._lost(stream, f"no valid hello: {err}")
            return
        self._unpend(stream)
        if len(self._peers) >= self.limits.max_connections:
            self.stats.refused += 1
            if _power_of_two(self.stats.refused):
                log.warning("%s channel %s: %d peers connected; refusing another", self.codec.name, self.endpoint,
                            len(self._peers))
            self._lost(stream, "too many peers")
            return
        stream.hello = hello
        stream.last_rx = time.monotonic()
        stream.reader.max_frame = self._max_frame
        self._peers[stream.ident] = stream

    def _greeting(self, stream: Stream) -> bool:
        return stream.hello is None

    def _readable(self, stream: Stream) -> bool:
        if stream.hello is not None:
            return stream.read()
        # pending: never more than one Hello's frame is buffered
        return stream.read(max(0, HEADER.size + HELLO_MAX_BYTES - stream.reader.buffered))

    def _broken(self, stream: Stream, why: str) -> None:
        """The peer stopped reading: nothing more is sent, but what it sent is still read."""
        stream.broken = True
        stream.drop_output()
        self._interest(stream)

    def _writable(self, stream: Stream) -> None:
        try:
            stream.flush()
        except OSError as exc:
            self._broken(stream, str(exc))

    def _other_event(self, key: selectors.SelectorKey, out: list[Received[bytes]]) -> None:
        if key.fileobj is not self._listener or self._listen_paused:
            return
        for _ in range(64):  # connections accepted per wake-up: the rest wait for the next
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: stop listening for a moment (the
                # listener stays readable, so watching it now would spin), then again
                self._accept_failures += 1
                if _power_of_two(self._accept_failures):
                    log.warning("%s channel %s: accept failed (%d times): %s; pausing accepts %.1fs",
                                self.codec.name, self.endpoint, self._accept_failures, exc, ACCEPT_PAUSE_S)
                self._sel.unregister(self._listener)
                self._listen_paused = time.monotonic() + ACCEPT_PAUSE_S
                return
            self._accepted(sock, addr[0] if isinstance(addr, tuple) else "unix", out)

    def _accepted(self, sock: socket.socket, address: str, out: list[Received[bytes]]) -> None:
        info = None
        if self._admit is not None:
            try:
                info = self._admit(sock)
            except (OSError, KVBridgeError) as exc:
                log.warning("%s channel %s: refused a connection: %s", self.codec.name, self.endpoint, exc)
                sock.close()
                return
        _nodelay(sock)
        limits = self.limits
        if self._pending_by_address[address] >= limits.max_pending_per_address:
            self._evict(next(s for s in self._pending if s.address == address))
        elif len(self._pending) >= limits.max_pending:
            self._evict(next(iter(self._pending)))
        stream = Stream(sock, HELLO_MAX_BYTES, self.hwm)
        stream.ident = b"\x00" + next(self._ids).to_bytes(4, "big")
        stream.address = address
        stream.info = info
        stream.hello_by = time.monotonic() + limits.hello_timeout
        self._pending[stream] = None
        self._pending_by_address[address] += 1
        self._watch(stream)
        self._service(stream, _R, out)  # its Hello is usually here already: authenticate it now

    def _evict(self, stream: Stream) -> None:
        self.stats.evicted += 1
        if _power_of_two(self.stats.evicted):
            log.warning("%s channel %s: evicted %d connection(s) that sent no hello (latest from %s)",
                        self.codec.name, self.endpoint, self.stats.evicted, stream.address)
        self._lost(stream, "evicted: no hello while newer connections waited")

    def _unpend(self, stream: Stream) -> None:
        if self._pending.pop(stream, 0) is None:
            self._pending_by_address[stream.address] -= 1
            if self._pending_by_address[stream.address] <= 0:
                del self._pending_by_address[stream.address]

    def _due(self) -> float | None:
        due = self._listen_paused or None
        if self._pending or self.limits.idle_timeout is not None or any(
                s.partial_since for s in self._peers.values()):
            due = min(due or self._next_scan, self._next_scan)
        return due

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self._listen_paused and now >= self._listen_paused:
            self._listen_paused = 0.0
            self._sel.register(self._listener, _R, None)
        if now < self._next_scan:
            return
        self._next_scan = now + SCAN_S
        for stream in [s for s in self._pending if s.hello_by <= now]:
            self._expire(stream, f"no hello within {self.limits.hello_timeout:g}s")
        limits = self.limits
        for stream in list(self._peers.values()):
            if stream.partial_since and now - stream.partial_since > limits.frame_timeout:
                self._expire(stream, f"a frame not completed within {limits.frame_timeout:g}s")
            elif limits.idle_timeout is not None and now - stream.last_rx > limits.idle_timeout:
                self._expire(stream, f"idle for {limits.idle_timeout:g}s")

    def _expire(self, stream: Stream, why: str) -> None:
        self.stats.timed_out += 1
        if _power_of_two(self.stats.timed_out):
            log.warning("%s channel %s: closed %d connection(s) on a deadline; latest from %s: %s",
                        self.codec.name, self.endpoint, self.stats.timed_out, stream.address, why)
        self._lost(stream, why)

    def _lost(self, stream: Stream, why: str) -> None:
        self._unwatch(stream)
        self._unpend(stream)
        stream.close()
        known = self._peers.pop(stream.ident, None) is not None
        log.debug("%s channel %s: connection %s closed (%s)", self.codec.name, self.endpoint, stream.ident.hex(), why)
        if known and self._on_lost is not None:
            self._on_lost(stream.ident)

    def close(self) -> None:
        with self._io:
            if self._closed:
                return
            streams = list(self._peers.values()) + list(self._pending)
            self._peers.clear()
            self._pending.clear()
            if not self._listen_paused:
                self._sel.unregister(self._listener)
            self._close(streams, [self._listener])


# ---- the client end ---------------------------------------------------------------------------------
class Client:
    """The connection to one server; created and owned by a ``Clients``."""

    def __init__(self, owner: Clients, endpoint: str, address: tuple[int, Any], max_frame: int, hwm: int,
                 hello: bytes) -> None:
        self._owner = owner
        self.endpoint = endpoint
        self.address = address  # (socket family, sockaddr)
        self.stream = Stream(None, max_frame, hwm)
        self.stream.client = self
        self.stream.preamble = frame(hello)
        self.connecting = False
        self.connect_by = 0.0
        self.retry_at = 0.0
        self.backoff = RECONNECT_S
        self.dropped = False

    def send(self, msg: Any) -> None:
        self.send_frame(self._owner.encode(msg))

    def send_frame(self, data: bytes) -> None:
        """Send one encoded message (or, in tests, any bytes) (any thread)."""
        self._owner._send_client(self, data)


class Clients(_Channel[str]):
    """One reconnecting ``Client`` per server endpoint; replies come back as ``(endpoint, message)``.
    ``name``: who this side is, said in the Hello of every connection."""

    def __init__(self, codec: Codec[Any], *, name: str = "", hwm: int = DEFAULT_HWM, max_peers: int = MAX_PEERS,
                 admit: Callable[[socket.socket], Any] | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        super().__init__(codec, hwm=hwm)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.max_peers = max_peers
        self._admit = admit
        self._on_lost = on_lost
        self._clients: dict[str, Client] = {}
        self._retry: set[Client] = set()
        self._connecting: set[Client] = set()

    def get(self, endpoint: str) -> Client:
        """The client of ``endpoint``, connected on first use (any thread)."""
        client = self._clients.get(endpoint)
        if client is not None:
            return client
        family, sockaddr, _ = parse_address(endpoint)
        with self._io:
            client = self._clients.get(endpoint)
            if client is not None:
                return client
            if self._closed:
                raise TransferError(f"{self.codec.name} channel is closed")
            if len(self._clients) >= self.max_peers:
                raise TransferError(f"more than {self.max_peers} {self.codec.name} peers; drop() the ones that are gone")
            client = self._clients[endpoint] = Client(self, endpoint, (family, sockaddr), self._max_frame, self.hwm,
                                                      self.codec.hello(self.name))
            self._connect(client)
        return client

    def send(self, endpoint: str, msg: Any) -> None:
        self.get(endpoint).send(msg)

    def encode(self, msg: Any) -> bytes:
        """``msg`` sealed for this channel: ``send_frame`` sends it, to as many peers as need it."""
        return self.codec.encode(msg)

    def send_frame(self, endpoint: str, data: bytes) -> None:
        self.get(endpoint).send_frame(data)

    def rename(self, name: str) -> None:
        """Say ``name`` in the Hello from now on: every connection is dropped and opened again
        on the next send (a peer binds a connection to what its Hello said)."""
        self.name = name
        for endpoint in list(self._clients):
            self.drop(endpoint)

    def connected(self, endpoint: str) -> bool:
        client = self._clients.get(endpoint)
        return client is not None and client.stream.connected and client.stream.sock is not None

    def drop(self, endpoint: str) -> None:
        """Close the connection to one peer; what waits is dropped."""
        with self._io:
            client = self._clients.pop(endpoint, None)
            if client is not None:
                client.dropped = True
                client.connecting = False
                self._retry.discard(client)
                self._connecting.discard(client)
                self._unwatch(client.stream)
                client.stream.close()

    def endpoints(self) -> list[str]:
        return list(self._clients)

    def close(self) -> None:
        with self._io:
            if self._closed:
                return
            streams = [c.stream for c in self._clients.values()]
            for client in self._clients.values():
                client.connecting = False
            self._clients.clear()
            self._retry.clear()
            self._connecting.clear()
            self._close(streams)

    # -- connections (io lock held) --------------------------------------------------------------
    def _send_client(self, client: Client, data: bytes) -> None:
        with self._io:
            if self._closed:
                raise TransferError(f"{self.codec.name} channel is closed")
            if client.dropped:
                raise TransferError(f"{self.codec.name} channel to {client.endpoint} was dropped")
            if client.stream.sock is None and time.monotonic() >= client.retry_at:
                self._connect(client)  # down and due: now rather than at the next loop turn
            elif client.connecting:
                self._finish_connect(client)  # on loopback it is done by now: send at once
            self._send(client.stream, data, client.endpoint)

    def _connect(self, client: Client) -> None:
        """Start connecting (never raises: a failure schedules the next attempt)."""
        family, sockaddr = client.address
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            log.debug("%s channel to %s: no socket (%s); retrying", self.codec.name, client.endpoint, exc)
            self._later(client)
            return
        try:
            sock.setblocking(False)
            _nodelay(sock)
            err = sock.connect_ex(sockaddr)
        except OSError as exc:
            err = exc.errno or errno.EIO
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            sock.close()
            self._later(client)
            return
        self._retry.discard(client)
        client.stream.reset(sock, connected=False)
        client.connecting = True
        client.connect_by = time.monotonic() + CONNECT_TIMEOUT_S
        self._connecting.add(client)
        self._watch(client.stream)
        self._finish_connect(client)

    def _finish_connect(self, client: Client) -> None:
        try:
            self._writable(client.stream)
        except (OSError, KVBridgeError) as exc:
            self._lost(client.stream, str(exc))
        else:
            if client.stream.sock is not None:
                self._interest(client.stream)

    def _writable(self, stream: Stream) -> None:
        client = stream.client
        if client.connecting:
            err = stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            try:  # done only once the socket has a peer
                stream.sock.getpeername()
            except OSError:
                return
            stream.info = self._admit(stream.sock) if self._admit is not None else None
            client.connecting = False
            self._connecting.discard(client)
            stream.connected = True
            client.backoff = RECONNECT_S
        stream.flush()

    def _lost(self, stream: Stream, why: str) -> None:
        client = stream.client
        was_up = stream.connected
        self._connecting.discard(client)
        self._unwatch(stream)
        stream.close()
        if client.dropped or self._clients.get(client.endpoint) is not client:
            return
        log.debug("%s channel to %s: %s; reconnecting", self.codec.name, client.endpoint, why)
        self._later(client)
        if was_up and self._on_lost is not None:
            self._on_lost(client.endpoint)

    def _later(self, client: Client) -> None:
        client.connecting = False
        self._connecting.discard(client)
        client.retry_at = time.monotonic() + client.backoff
        client.backoff = min(2 * client.backoff, RECONNECT_MAX_S)
        self._retry.add(client)

    def _due(self) -> float | None:
        if not self._retry and not self._connecting:
            return None
        return min([c.retry_at for c in self._retry] + [c.connect_by for c in self._connecting])

    def _housekeeping(self) -> None:
        if not self._retry and not self._connecting:
            return
        now = time.monotonic()
        for client in [c for c in self._connecting if c.connect_by <= now]:
            self._lost(client.stream, f"no connection within {CONNECT_TIMEOUT_S:g}s")
        for client in [c for c in self._retry if c.retry_at <= now]:
            self._connect(client)

    def _receive(self, stream: Stream, body: bytes) -> Received[str] | None:
        endpoint = stream.client.endpoint
        result = self._decode(body, endpoint)
        return None if result is None else (endpoint, result)


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


def _listen(family: int, sockaddr: Any) -> socket.socket:
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


def _nodelay(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family != socket.AF_UNIX:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small message, one segment, now
        except OSError:
            pass


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
