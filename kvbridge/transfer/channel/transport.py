"""kvbridge's one transport: length-prefixed frames over stream sockets (TCP or Unix), a
server end (a peer is its connection) and a client end (one reconnecting client per
endpoint), both on ``selectors``, both carrying one codec's envelopes (``envelope.py``).

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
import errno
import itertools
import logging
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

from kvbridge.errors import ConfigError, KVBridgeError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES, Codec, Hello, auth_limit
from kvbridge.transfer.channel.frames import HEADER, READ_PER_CALL, FrameError, Meter, QueueFull, Stream, frame

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
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE

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
        """Watch ``stream`` for input (unless throttled), and for output while frames wait or it
        connects."""
        events = (0 if stream.throttled else _R) | (_W if stream.wants_write or not stream.connected else 0)
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
class Server(_Channel[bytes]):
    """Listens on ``address`` (``tcp://host:port``, port 0: a free one; ``unix:@name`` abstract,
    ``unix:/path``); a peer is its connection's id (bytes). ``admit(sock)`` may refuse a new
    connection by raising (its result is kept as the stream's ``info``)."""

    def __init__(self, codec: Codec[Any], address: str, *, hwm: int = DEFAULT_HWM, limits: Limits | None = None,
                 admit: Callable[[socket.socket], Any] | None = None,
                 on_lost: Callable[[bytes], None] | None = None) -> None:
        super().__init__(codec, hwm=hwm)
        self.limits = limits or Limits()
        if self.limits.frame_allowance < 64:
            raise ConfigError(f"the {codec.name} channel's frame_allowance ({self.limits.frame_allowance} bytes) must "
                              "hold at least a frame header and a small message (64 bytes)", field="frame_allowance")
        if self.limits.frame_budget < self._max_frame + HEADER.size:
            raise ConfigError(f"the {codec.name} channel's frame_budget ({self.limits.frame_budget} bytes) must hold "
                              f"its largest frame ({self._max_frame + HEADER.size} bytes)", field="frame_budget")
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
        self._by_address: dict[str, dict[Stream, None]] = {}  # authenticated peers per address (oldest first)
        self._budget_used = 0  # bytes of frame_budget the readers hold
        self._throttled: dict[Stream, None] = {}  # readers waiting for frame_budget (oldest first)
        self._meter = Meter()  # unsent output of every connection
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

    @property
    def peers(self) -> list[bytes]:
        """The connected peers (authenticated connections), in no promised order."""
        return list(self._peers)

    def peers_from(self, address: str) -> int:
        """Authenticated connections from one source address."""
        return len(self._by_address.get(address, ()))

    @property
    def buffered_bytes(self) -> int:
        """Bytes every connection's reader holds (what the frame budgets bound)."""
        with self._io:
            return sum(s.reader.buffered for s in self._by_fd.values())

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting unsent for every peer (what max_queued_bytes bounds)."""
        return self._meter.queued

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
            if self._meter.queued > self.limits.max_queued_bytes:
                self._shed_output()
                if stream.sock is None:
                    raise PeerLost(f"{self.codec.name} channel to {who}: closed holding the most unsent output "
                                   f"(over {self.limits.max_queued_bytes} bytes for all peers)")

    def _shed_output(self) -> None:
        """Over max_queued_bytes: close the peers holding the most unsent output (ones that do
        not read) until under it again."""
        while self._meter.queued > self.limits.max_queued_bytes:
            hoarder = max(self._peers.values(), key=lambda s: s.queued_bytes, default=None)
            if hoarder is None or not hoarder.queued_bytes:
                return
            self.stats.output_closed += 1
            if _power_of_two(self.stats.output_closed):
                log.warning("%s channel %s: closed %d connection(s) holding the most unsent output; latest from %s "
                            "(%d bytes)", self.codec.name, self.endpoint, self.stats.output_closed, hoarder.address,
                            hoarder.queued_bytes)
            self._lost(hoarder, f"{hoarder.queued_bytes} bytes unsent: the peer does not read")

    def _refusal(self, err: ProtocolError, body: bytes) -> Any:
        """The answer to a malformed message (None: no answer)."""
        return None

    def _receive(self, stream: Stream, body: bytes) -> Received[bytes] | None:
        if stream.hello is None:
            self._authenticate(stream, body)
            return None
        stream.last_rx = time.monotonic()
        result = self._decode(body, f"peer {stream.ident.hex()}")
        if result is None:  # it failed its MAC
            stream.bad_macs += 1
            if stream.bad_macs >= self.limits.max_bad_macs:
                self.stats.bad_mac_closed += 1
                if _power_of_two(self.stats.bad_mac_closed):
                    log.warning("%s channel %s: closed %d connection(s) whose frames failed their MAC; latest from %s",
                                self.codec.name, self.endpoint, self.stats.bad_mac_closed, stream.address)
                self._lost(stream, f"{stream.bad_macs} frames failed their MAC")
            return None
        if isinstance(result, ProtocolError):
            reply = None
            if stream.queued_frames < REFUSALS_QUEUED:  # (a peer that does not read gets no pile of them)
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
            hello = self.codec.open_hello(body, stream.challenge)
        except ProtocolError as err:
            self.stats.unauthenticated += 1
            if _power_of_two(self.stats.unauthenticated):
                log.warning("%s channel %s: closed %d connection(s) without a valid hello; latest from %s: %s",
                            self.codec.name, self.endpoint, self.stats.unauthenticated, stream.address, err)
            self._lost(stream, f"no valid hello: {err}")
            return
        self._unpend(stream)
        limits, address = self.limits, stream.address
        cap = limits.max_connections_per_address
        why = None
        if cap is not None and self.peers_from(address) >= cap:
            why = f"{cap} connections from {address} already"
        elif len(self._peers) >= limits.max_connections:
            busiest = self._displaceable(address)
            if busiest is None:
                why = f"{len(self._peers)} peers connected"
            else:
                self.stats.displaced += 1
                if _power_of_two(self.stats.displaced):
                    log.warning("%s channel %s: every slot taken; %d connection(s) of the busiest address displaced "
                                "for newcomers (latest: one of %s's for %s)", self.codec.name, self.endpoint,
                                self.stats.displaced, busiest.address, address)
                self._lost(busiest, f"displaced: every slot taken, and {busiest.address} holds the most")
        if why is not None:
            self.stats.refused += 1
            if _power_of_two(self.stats.refused):
                log.warning("%s channel %s: refused %d authenticated connection(s); latest from %s: %s",
                            self.codec.name, self.endpoint, self.stats.refused, address, why)
            self._lost(stream, f"too many peers: {why}")
            return
        stream.hello = hello
        stream.last_rx = time.monotonic()
        stream.reader.max_frame = self._max_frame
        self._peers[stream.ident] = stream
        self._by_address.setdefault(address, {})[stream] = None

    def _displaceable(self, address: str) -> Stream | None:
        """The oldest connection of the address holding the most, when it holds more than one
        more than ``address`` does (so that displacing it makes the table fairer), else None."""
        busiest = max(self._by_address, key=lambda a: len(self._by_address[a]), default=None)
        if busiest is None or len(self._by_address[busiest]) <= self.peers_from(address) + 1:
            return None
        return next(iter(self._by_address[busiest]))

    def _greeting(self, stream: Stream) -> bool:
        return stream.hello is None

    def _readable(self, stream: Stream) -> bool:
        if stream.hello is None:  # pending: never more than one Hello's frame is buffered
            return stream.read(max(0, HEADER.size + HELLO_MAX_BYTES - stream.reader.buffered))
        room = self._room(stream)
        if room <= 0:
            self._throttle(stream)
            return True
        alive = stream.read(min(READ_PER_CALL, room))
        self._taken(stream)
        return alive

    # -- the frame budget ------------------------------------------------------------------------
    #   a reader's bytes:  [0, frame_allowance)                its own: small frames, headers
    #                      [frame_allowance, end of frame)     reserved whole from frame_budget
    # A frame larger than the allowance is read only once its whole excess is reserved (all or
    # nothing, first come first served): whoever holds a reservation can finish its frame, so
    # the readers never wait on one another in a circle, and the budget comes back when the frame
    # is taken out or its connection closes.
    def _room(self, stream: Stream) -> int:
        """Bytes ``stream`` may read now (<= 0: it waits for the budget)."""
        return self.limits.frame_allowance + stream.budget - stream.reader.buffered

    def _taken(self, stream: Stream) -> None:
        if stream.hello is None:
            return
        size = stream.reader.announced if stream.sock is not None else 0
        need = max(0, HEADER.size + size - self.limits.frame_allowance) if size else 0
        if need == stream.budget:
            return
        first = next(iter(self._throttled), stream)
        if need > stream.budget and (first is not stream or
                                     self._budget_used - stream.budget + need > self.limits.frame_budget):
            need = 0  # not now: what it held goes back, and it waits its turn
        freed = need < stream.budget
        self._budget_used += need - stream.budget
        stream.budget = need
        if freed and self._throttled:
            self._unthrottle()

    def _throttle(self, stream: Stream) -> None:
        if not stream.throttled:
            stream.throttled = time.monotonic()
            self._throttled[stream] = None
            self.stats.throttled += 1
            self._interest(stream)

    def _unthrottle(self) -> None:
        """Readers waiting for the budget are read again, oldest first, while it has room; their
        frame's clock did not run while they waited."""
        now = time.monotonic()
        while self._throttled:
            stream = next(iter(self._throttled))
            self._taken(stream)
            if self._room(stream) <= 0:
                return
            del self._throttled[stream]
            if stream.partial_since:
                stream.partial_since += now - stream.throttled
            stream.throttled = 0.0
            if stream.sock is not None:
                self._interest(stream)

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
        stream.meter = self._meter
        stream.hello_by = time.monotonic() + limits.hello_timeout
        stream.challenge, challenge = self.codec.challenge()
        self._pending[stream] = None
        self._pending_by_address[address] += 1
        try:
            stream.queue(frame(challenge))  # (a few dozen bytes: the kernel takes them at once)
        except OSError as exc:
            self._lost(stream, f"could not send the hello challenge: {exc}")
            return
        self._watch(stream)

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
        if self._pending or (self._peers and self.limits.idle_timeout is not None) or any(
                s.partial_since for s in self._peers.values()):
            due = min(due or self._next_scan, self._next_scan)
        return due

    def _housekeeping(self, out: list[Received[bytes]]) -> None:
        now = time.monotonic()
        if self._listen_paused and now >= self._listen_paused:
            self._listen_paused = 0.0
            self._sel.register(self._listener, _R, None)
        if now < self._next_scan:
            return
        urgent = self._pending or any(s.partial_since for s in self._peers.values())
        self._next_scan = now + (SCAN_S if urgent else IDLE_SCAN_S)
        for stream in [s for s in self._pending if s.hello_by <= now]:
            self._expire(stream, f"no hello within {self.limits.hello_timeout:g}s")
        for stream in [s for s in self._peers.values() if self._overdue(s, now)]:
            if stream.sock is not None and not stream.throttled:  # what it sent meanwhile counts first
                self._service(stream, _R, out)
            if stream.sock is not None and (why := self._overdue(stream, time.monotonic())):
                self._expire(stream, why)

    def _overdue(self, stream: Stream, now: float) -> str | None:
        """Why ``stream`` missed a deadline, or None (a throttled reader's frame clock is stopped)."""
        limits = self.limits
        if stream.partial_since and not stream.throttled:
            size = stream.reader.announced
            allowed = limits.frame_deadline(size)
            if now - stream.partial_since > allowed:
                return f"a frame of {size} bytes not completed within {allowed:.3g}s"
        if limits.idle_timeout is not None and now - stream.last_rx > limits.idle_timeout:
            return f"idle for {limits.idle_timeout:g}s"
        return None

    def _expire(self, stream: Stream, why: str) -> None:
        self.stats.timed_out += 1
        if _power_of_two(self.stats.timed_out):
            log.warning("%s channel %s: closed %d connection(s) on a deadline; latest from %s: %s",
                        self.codec.name, self.endpoint, self.stats.timed_out, stream.address, why)
        self._lost(stream, why)

    def _lost(self, stream: Stream, why: str) -> None:
        self._unwatch(stream)
        self._unpend(stream)
        self._throttled.pop(stream, None)
        stream.throttled = 0.0
        stream.drop_output()
        stream.close()
        self._taken(stream)  # (its budget back)
        same = self._by_address.get(stream.address)
        if same is not None and same.pop(stream, 0) is None and not same:
            del self._by_address[stream.address]
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
            self._by_address.clear()
            self._throttled.clear()
            if not self._listen_paused:
                self._sel.unregister(self._listener)
            self._close(streams, [self._listener])


# ---- the client end ---------------------------------------------------------------------------------
class Client:
    """The connection to one server; created and owned by a ``Clients``."""

    def __init__(self, owner: Clients, endpoint: str, address: tuple[int, Any], max_frame: int, hwm: int) -> None:
        self._owner = owner
        self.endpoint = endpoint
        self.address = address  # (socket family, sockaddr)
        self.stream = Stream(None, max_frame, hwm)
        self.stream.client = self
        self.stream.holds = True  # every connection: nothing goes out before the Hello that answers its challenge
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
            client = self._clients[endpoint] = Client(self, endpoint, (family, sockaddr), self._max_frame, self.hwm)
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
            if client.stream.held and client.stream.connected:
                self._greet(client)
            self._send(client.stream, data, client.endpoint)
        if client.stream.held:
            self._await_challenge(client, GREET_WAIT_S if threading.get_ident() != self._loop else GREET_WAIT_LOOP_S)

    def _await_challenge(self, client: Client, wait_s: float) -> None:
        """A send on a connection whose challenge has not come yet waits for it, up to
        ``wait_s``, and answers it: what it sent goes out now even if no thread turns this side's
        loop (a caller that sends, then waits on another peer), or the loop stalls after the send.
        A connection the server closed meanwhile (one that waited unanswered past the server's
        hello deadline) is opened again within the same wait, its backoff permitting."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._io:
                stream = client.stream
                if self._closed or client.dropped or not stream.held:
                    return
                retry_in = client.retry_at - time.monotonic()
                if stream.sock is None and retry_in <= 0 and stream.wants_write:
                    self._connect(client)  # (its backoff holds: a server that refuses us is not hammered)
                elif stream.sock is not None and stream.connected and self._greet(client):
                    continue
                fd = stream.fd
            left = deadline - time.monotonic()
            if left <= 0 or (fd < 0 and (not stream.wants_write or retry_in >= left)):
                return
            if fd < 0:
                time.sleep(max(0.0, retry_in))
                continue
            poll = select.poll()
            poll.register(fd, select.POLLIN | select.POLLOUT if not stream.connected else select.POLLIN)
            try:
                poll.poll(max(1, int(left * 1000)))
            except OSError:
                return
            with self._io:
                if client.connecting and client.stream.fd == fd:
                    self._finish_connect(client)

    def _greet(self, client: Client) -> bool:
        """Answer the connection's challenge from this thread when it is here already (on
        loopback it usually is), so that what is sent now goes out now, not at the loop's turn.
        True when it is settled (answered, refused, or the connection found closed)."""
        stream = client.stream
        try:
            alive = stream.read(HEADER.size + HELLO_MAX_BYTES)
        except OSError as exc:
            alive, why = False, str(exc)
        else:
            why = "closed by the peer"
        if stream.sock is not None:
            self._frames_of(stream, [], 1)  # (the challenge: answered, or refused and logged; nothing for the caller)
        if stream.sock is not None and not alive:
            self._lost(stream, why)
        return not alive or not stream.held or stream.sock is None

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

    def _housekeeping(self, out: list[Received[str]]) -> None:
        if not self._retry and not self._connecting:
            return
        now = time.monotonic()
        for client in [c for c in self._connecting if c.connect_by <= now]:
            self._lost(client.stream, f"no connection within {CONNECT_TIMEOUT_S:g}s")
        for client in [c for c in self._retry if c.retry_at <= now]:
            self._connect(client)

    def _receive(self, stream: Stream, body: bytes) -> Received[str] | None:
        endpoint = stream.client.endpoint
        if stream.held:  # the connection's first frame: the server's challenge
            return self._answer(stream, body)
        result = self._decode(body, endpoint)
        return None if result is None else (endpoint, result)

    def _answer(self, stream: Stream, body: bytes) -> Received[str] | None:
        """Send the Hello that answers the server's challenge, then what waits. A first frame
        that is no challenge of this channel (another channel, version or secret: the server
        said nothing, so the caller hears nothing) is logged and counted, and the connection is
        tried again later."""
        endpoint = stream.client.endpoint
        try:
            challenge = self.codec.open_challenge(body)
        except ProtocolError as err:
            self.stats.received += 1
            if err.field == "mac":
                self.stats.unauthenticated += 1
            else:
                self.stats.malformed += 1
            if _power_of_two(self.stats.unauthenticated + self.stats.malformed):
                log.warning("%s channel to %s: the server's first frame is no hello challenge we can answer "
                            "(%d so far): %s", self.codec.name, endpoint,
                            self.stats.unauthenticated + self.stats.malformed, err)
            self._lost(stream, f"no hello challenge: {err}")
            return None
        try:
            stream.open(frame(self.codec.hello(self.name, challenge.nonce)))
        except OSError as exc:
            self._lost(stream, str(exc))
            return None
        self._interest(stream)
        return None


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
