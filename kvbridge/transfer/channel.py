"""Control channel: a TCP server per prefill rank, one connection per peer on decode, frames of
``streams.py`` (4-byte length + one wire message) in both directions.

    decode rank                                      prefill rank
    PeerSet ── ControlClient (connects) ─────────▶ ControlServer (listens on host:port)
            ◀──────────────────── replies go back on the connection that asked

The sockets are the channel's own: a message is one ``send`` on the sending thread and one
``recv`` on the receiving loop thread, with no broker thread in between (ZMQ's I/O threads
were two thread hand-offs per message; on these VMs a hand-off to an idle thread costs more
than the rest of the hop: ``scripts/control_rtt.py`` measures both).

One loop thread receives; any thread may send. Every socket call goes through one lock,
and the loop waits on file descriptors only (the wakeup pipe and the sockets), never inside
a socket call, so a send from an engine thread (a decode rank's request from ``init()``, a
prefill rank's completion report from the engine's callback) goes out at once::

    loop thread:   poll(fds) -> lock: accept, read and decode what arrived, flush what waits
    any thread:    lock: send what the kernel takes; the rest waits for the loop (woken)

Other threads hand the loop work through ``wakeup`` (thread-safe, wakes a blocked
``recv_ready`` at once, no busy polling)::

    engine.set_notify(server.wakeup.post)          # write completions wake the loop
    while running:
        for peer, msg in server.recv_ready(timeout_ms=100):
            if isinstance(msg, ProtocolError): continue   # already counted and answered
            handle(peer, msg)
        for work in server.wakeup.drain(): work()

Bad input never raises out of ``recv_ready``: a message that does not decode comes back
as ``(peer, ProtocolError)``, is counted in ``stats.malformed``, and the server answers it
with an ErrorReply naming the problem - every one, oversized ones included: with a secret
the MAC is checked before the size, so an authentic message over ``max_bytes`` is answered
like any other malformed one. Anything that does not authenticate when a secret is set (bad
or missing HMAC) is dropped without a reply and counted in ``stats.unauthenticated``.
Clients never answer errors (no ping-pong). A connection that announces a frame over
``wire.auth_limit(max_bytes)`` (about twice ``max_bytes``) is closed at once, unanswered,
and counted in ``stats.dropped``. Bounded: frames waiting per connection (``hwm``; then
PeerLost), frames per connection per ``recv_ready``, bytes read per socket per call,
connections per server and peers per PeerSet, items in a wakeup queue.

A client connects on first use and again, every RECONNECT_S to RECONNECT_MAX_S, while the
peer is unreachable (a connect nobody answers is given CONNECT_TIMEOUT_S); frames sent
meanwhile wait (up to ``hwm``) and go out once connected, as they would have with a ZMQ
DEALER. A server that cannot accept (out of file descriptors) stops listening for
ACCEPT_PAUSE_S instead of spinning. A connection that ends delivers every complete frame it
carried first. A server's peer is its connection: once it closes,
sending to it is PeerLost. Closing drops what waits, at once (linger 0).
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

from kvbridge.errors import ConfigError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer import wire
from kvbridge.transfer.streams import FrameError, QueueFull, Stream, frame
from kvbridge.transfer.wire import MAX_MESSAGE_BYTES, ErrorReply, Message

log = logging.getLogger(__name__)

DEFAULT_HWM = 1000
MAX_BATCH = 256
MAX_PEERS = 1024
MAX_CONNECTIONS = 4096  # a server's accepted connections; more are closed at once
MAX_WAKEUP_ITEMS = 10_000
RECONNECT_S = 0.05
RECONNECT_MAX_S = 1.0
CONNECT_TIMEOUT_S = 5.0  # a connect nobody answers (a black-holed address) is given up and tried again
ACCEPT_PAUSE_S = 0.1  # accepts pause this long after one failed (out of file descriptors)
_IN = select.POLLIN | select.POLLPRI
_OUT = select.POLLOUT
_BROKEN = select.POLLHUP | select.POLLERR | select.POLLNVAL

PeerT = TypeVar("PeerT", bound=Hashable)
Received = tuple[PeerT, Union[Message, ProtocolError]]  # (peer, message) or (peer, why it was refused)


@dataclass
class ChannelStats:
    received: int = 0
    malformed: int = 0
    unauthenticated: int = 0
    sent: int = 0
    error_replies: int = 0
    dropped: int = 0  # connections closed for an oversized frame (unanswered)


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
            os.read(self._read_fd, 65536)  # (a fuller pipe only wakes the next poll at once)
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read_fd)
            os.close(self._write_fd)


class _Channel(Generic[PeerT]):
    """Shared receive path: poll sockets and the wakeup, decode, count, never raise on bad input."""

    def __init__(self, *, secret: bytes | None, max_bytes: int, hwm: int) -> None:
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise ConfigError("the control-channel secret must be non-empty bytes or None", field="secret")
        self.secret = secret
        self.max_bytes = max_bytes
        self.hwm = hwm
        self.stats = ChannelStats()
        self.wakeup = Wakeup()
        self._max_frame = wire.auth_limit(max_bytes)
        self._io = threading.RLock()  # every socket call (any thread); reentrant: a receive may answer
        self._poller = select.poll()  # file descriptors only: waiting touches no socket
        self._poller.register(self.wakeup.fileno(), select.POLLIN)
        self._by_fd: dict[int, Stream] = {}
        self._backlog: set[Stream] = set()  # streams whose reader holds complete frames (over MAX_BATCH)
        self._loop: int | None = None  # the receiving thread (recv_ready's caller)
        self._closed = False

    # -- what the two ends differ in ----------------------------------------------------------

    def _receive(self, stream: Stream, body: bytes) -> Received[PeerT] | None:
        raise NotImplementedError

    def _lost(self, stream: Stream, why: str) -> None:
        """``stream``'s connection is gone (io lock held)."""
        raise NotImplementedError

    def _other_event(self, fd: int) -> None:
        """An fd of the subclass's own fired (the server's listener)."""

    def _broken(self, stream: Stream, why: str) -> None:
        """Sending on ``stream`` failed (io lock held): by default the connection is lost."""
        self._lost(stream, why)

    def _timeout_ms(self, timeout_ms: int) -> int:
        return timeout_ms

    def _housekeeping(self) -> None:
        """Loop thread, io lock held, after every wait."""

    def _writable(self, stream: Stream) -> None:
        stream.flush()

    # -- receiving (the loop thread) -----------------------------------------------------------

    def recv_ready(self, timeout_ms: int) -> list[Received[PeerT]]:
        """Wait up to ``timeout_ms`` for input; return what arrived (possibly nothing: a wakeup)."""
        if self._closed:
            raise TransferError("control channel is closed")
        self._loop = threading.get_ident()
        with self._io:
            timeout = 0 if self._backlog else self._timeout_ms(max(0, int(timeout_ms)))
        events = self._poller.poll(timeout)
        out: list[Received[PeerT]] = []
        with self._io:
            if self._closed:
                return out
            self._housekeeping()  # (never raises: reconnects and pauses that fail are rescheduled)
            for fd, ev in events:
                stream = self._by_fd.get(fd)
                if stream is None:
                    if fd == self.wakeup.fileno():
                        self.wakeup.clear_signal()
                    else:
                        self._other_event(fd)
                    continue
                try:
                    if ev & _OUT:
                        self._writable(stream)
                    # frames already waiting are handled first: no more bytes are taken from a socket
                    # meanwhile (the reader's memory stays bounded, and the sender feels TCP's push-back)
                    ready = stream.sock is not None and not stream.reader.ready
                    alive = stream.read() if ev & (_IN | _BROKEN) and ready else True
                except OSError as exc:
                    alive, why = False, str(exc)
                else:
                    why = "closed by the peer"
                if stream.sock is None:  # (a connect that failed: already lost)
                    continue
                self._frames(stream, out, limit=MAX_BATCH if alive else None)  # what came before the end counts
                if stream.sock is None:  # an oversized frame closed it
                    continue
                if alive:
                    self._interest(stream)
                else:
                    self._lost(stream, why)
            for stream in list(self._backlog):
                self._backlog.discard(stream)
                self._frames(stream, out)
        return out

    def _frames(self, stream: Stream, out: list[Received[PeerT]], limit: int | None = MAX_BATCH) -> None:
        """Decode the complete frames ``stream`` holds: at most ``limit`` (the rest at the next call),
        or every one (``None``: the connection is ending)."""
        try:
            bodies = stream.reader.frames(limit if limit is not None else 1 << 62)
        except FrameError as exc:  # oversized: the sender gets no answer, its connection is closed
            self.stats.dropped += 1
            log.warning("control channel: closing a connection that sent an oversized frame: %s", exc)
            self._lost(stream, str(exc))
            return
        for body in bodies:
            item = self._receive(stream, body)
            if item is not None:
                out.append(item)
        if stream.reader.ready:
            self._backlog.add(stream)

    def _decode(self, body: bytes, who: str) -> tuple[Message | ProtocolError | None, bytes]:
        """(message or error, body); None when dropped as unauthenticated."""
        self.stats.received += 1
        try:
            body = wire.unseal(body, self.secret, max_bytes=self.max_bytes)
        except ProtocolError as err:
            if self.secret is not None and err.field != "size":  # "size": authentic but too large
                self.stats.unauthenticated += 1
                if _power_of_two(self.stats.unauthenticated):
                    log.warning("dropped %d unauthenticated control message(s); latest from %s: %s",
                                self.stats.unauthenticated, who, err)
                return None, b""
            return self._malformed(err, who), b""
        try:
            return wire.decode_body(body), body
        except ProtocolError as err:
            return self._malformed(err, who), body

    def _malformed(self, err: ProtocolError, who: str) -> ProtocolError:
        self.stats.malformed += 1
        if _power_of_two(self.stats.malformed):
            log.warning("%d malformed control message(s); latest from %s: %s", self.stats.malformed, who, err)
        return err

    # -- sending (any thread) ------------------------------------------------------------------

    def _send(self, stream: Stream, data: bytes, who: str) -> None:
        """Queue one encoded message on ``stream`` (io lock held)."""
        if self._closed:
            raise TransferError(f"control channel to {who} is closed")
        try:
            stream.queue(frame(data))
        except QueueFull:
            raise PeerLost(f"control channel to {who}: send queue full ({self.hwm} messages); peer gone or "
                           "stalled") from None
        except OSError as exc:  # the connection broke under the send
            self.stats.sent += 1
            self._broken(stream, str(exc))
            return
        self.stats.sent += 1
        if stream.wants_write and stream.sock is not None:
            self._interest(stream)

    def _interest(self, stream: Stream) -> None:
        """Poll ``stream`` for input, and for output while frames wait or it connects (io lock
        held); wake the loop when another thread changed what it waits for."""
        events = _IN | (_OUT if stream.wants_write or not stream.connected else 0)
        if events != stream.events:
            stream.events = events
            self._poller.register(stream.fd, events)
            self._wake_loop()

    def _watch(self, stream: Stream) -> None:
        self._by_fd[stream.fd] = stream
        self._interest(stream)
        self._wake_loop()  # it may sleep on the old set of fds

    def _unwatch(self, stream: Stream) -> None:
        fd = stream.fd
        if self._by_fd.get(fd) is stream:
            del self._by_fd[fd]
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
        self._backlog.discard(stream)

    def _wake_loop(self) -> None:
        """Wake the receiving thread, unless this is it (or none waits yet)."""
        if self._loop is not None and threading.get_ident() != self._loop:
            self.wakeup.post()

    def _close(self, streams: list[Stream], others: list[socket.socket] = ()) -> None:
        """Close everything (io lock held by the caller, who collected ``streams`` under it: nothing
        is accepted or connected in between)."""
        self._closed = True
        for stream in streams:
            self._unwatch(stream)
            stream.close()
        for sock in others:
            sock.close()
        self.wakeup.close()


class ControlServer(_Channel[bytes]):
    """Listens on ``tcp://host:port`` (port 0: a free one); a peer is its connection's id (bytes)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        super().__init__(secret=secret, max_bytes=max_bytes, hwm=hwm)
        try:
            self._listener = _listen(host, port)
        except OSError as exc:
            self.wakeup.close()
            raise ConfigError(f"cannot bind the control channel to {host}:{port}: {exc.strerror or exc}",
                              field="control_port") from exc
        self.port = int(self._listener.getsockname()[1])
        self.endpoint: str = f"tcp://{_bracket(host)}:{self.port}"
        self._peers: dict[bytes, Stream] = {}
        self._ids = itertools.count(1)
        self._accept_failures = 0
        self._listen_paused = 0.0  # accepts resume at this monotonic time (0: listening)
        self._poller.register(self._listener.fileno(), select.POLLIN)

    def _timeout_ms(self, timeout_ms: int) -> int:
        if not self._listen_paused:
            return timeout_ms
        return max(0, min(timeout_ms, int((self._listen_paused - time.monotonic()) * 1000) + 1))

    def _housekeeping(self) -> None:
        if self._listen_paused and time.monotonic() >= self._listen_paused:
            self._listen_paused = 0.0
            self._poller.register(self._listener.fileno(), select.POLLIN)

    def send(self, peer: bytes, msg: Message) -> None:
        """Send to a connected peer (any thread); PeerLost when it is gone or its queue is full."""
        self.send_frame(peer, wire.encode(msg, self.secret, max_bytes=self.max_bytes))

    def send_frame(self, peer: bytes, data: bytes) -> None:
        """Send one encoded message (or, in tests, any bytes) to ``peer`` (any thread)."""
        who = f"peer {peer.hex()}"
        with self._io:
            stream = self._peers.get(peer)
            if stream is None or stream.sock is None or stream.broken:
                raise PeerLost(f"control channel to {who}: peer not connected")
            self._send(stream, data, who)
            if stream.sock is None or stream.broken:  # the connection broke under the send
                raise PeerLost(f"control channel to {who}: connection closed")

    def _broken(self, stream: Stream, why: str) -> None:
        """The peer stopped reading: nothing more is sent to it, but what it sent before closing is
        still read (and handled) until its end of the stream."""
        stream.broken = True
        stream.drop_output()
        self._interest(stream)

    def _writable(self, stream: Stream) -> None:
        try:
            stream.flush()
        except OSError as exc:
            self._broken(stream, str(exc))

    def _other_event(self, fd: int) -> None:
        if fd != self._listener.fileno() or self._listen_paused:  # (a readiness event from before the pause)
            return
        for _ in range(64):  # connections accepted per wake-up: the rest wait for the next
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: stop listening for a moment (the
                # listener stays readable, so polling it now would spin), then again
                self._accept_failures += 1
                if _power_of_two(self._accept_failures):
                    log.warning("control channel %s: accept failed (%d times): %s; pausing accepts %.1fs",
                                self.endpoint, self._accept_failures, exc, ACCEPT_PAUSE_S)
                self._poller.unregister(self._listener.fileno())
                self._listen_paused = time.monotonic() + ACCEPT_PAUSE_S
                return
            if len(self._peers) >= MAX_CONNECTIONS:
                log.warning("control channel %s: %d connections open; refusing another", self.endpoint,
                            len(self._peers))
                sock.close()
                continue
            _nodelay(sock)
            stream = Stream(sock, self._max_frame, self.hwm)
            stream.peer = b"\x00" + next(self._ids).to_bytes(4, "big")  # type: ignore[attr-defined]
            self._peers[stream.peer] = stream  # type: ignore[attr-defined]
            self._watch(stream)

    def _receive(self, stream: Stream, body: bytes) -> Received[bytes] | None:
        peer = stream.peer  # type: ignore[attr-defined]
        result, body = self._decode(body, f"peer {peer.hex()}")
        if isinstance(result, ProtocolError):
            ref_type, room = wire.peek(body) if body else ("", None)
            reply = ErrorReply(ref_type=ref_type, room=room, reason=str(result)[:1000])
            try:
                self.send(peer, reply)
                self.stats.error_replies += 1
            except TransferError as exc:
                log.debug("could not answer a malformed message: %s", exc)
        return None if result is None else (peer, result)

    def _lost(self, stream: Stream, why: str) -> None:
        self._unwatch(stream)
        stream.close()
        self._peers.pop(stream.peer, None)  # type: ignore[attr-defined]
        log.debug("control channel %s: connection %s closed (%s)", self.endpoint, stream.peer.hex(), why)

    def close(self) -> None:
        with self._io:
            if self._closed:
                return
            streams = list(self._peers.values())
            self._peers.clear()
            if not self._listen_paused:
                self._poller.unregister(self._listener.fileno())
            self._close(streams, [self._listener])


class ControlClient:
    """The connection to one peer's ControlServer; created and owned by a PeerSet."""

    def __init__(self, owner: PeerSet, endpoint: str, address: tuple[int, Any], max_frame: int, hwm: int) -> None:
        self._owner = owner
        self.endpoint = endpoint
        self.address = address  # (socket family, sockaddr)
        self.stream = Stream(None, max_frame, hwm)
        self.stream.client = self  # type: ignore[attr-defined]
        self.connecting = False
        self.connect_by = 0.0  # a connect under way fails at this monotonic time
        self.retry_at = 0.0
        self.backoff = RECONNECT_S
        self.dropped = False

    def send(self, msg: Message) -> None:
        self.send_frame(self._owner.encode(msg))

    def send_frame(self, frame_: bytes) -> None:
        """Send one encoded message (or, in tests, any bytes) (any thread)."""
        self._owner._send_client(self, frame_)


class PeerSet(_Channel[str]):
    """One ControlClient per peer endpoint; replies come back as ``(endpoint, message)``."""

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        hwm: int = DEFAULT_HWM,
        max_peers: int = MAX_PEERS,
    ) -> None:
        super().__init__(secret=secret, max_bytes=max_bytes, hwm=hwm)
        self.max_peers = max_peers
        self._clients: dict[str, ControlClient] = {}
        self._retry: set[ControlClient] = set()  # disconnected clients waiting for their next attempt
        self._connecting: set[ControlClient] = set()  # connects under way (each given CONNECT_TIMEOUT_S)

    def get(self, endpoint: str) -> ControlClient:
        """The client of ``endpoint``, connected on first use (any thread)."""
        client = self._clients.get(endpoint)
        if client is not None:
            return client
        address = _address(endpoint)
        with self._io:
            client = self._clients.get(endpoint)
            if client is not None:
                return client
            if self._closed:
                raise TransferError("control channel is closed")
            if len(self._clients) >= self.max_peers:
                raise TransferError(f"more than {self.max_peers} control peers; drop() the ones that are gone")
            client = self._clients[endpoint] = ControlClient(self, endpoint, address, self._max_frame, self.hwm)
            self._connect(client)
        return client

    def send(self, endpoint: str, msg: Message) -> None:
        """Send to ``endpoint`` (any thread)."""
        self.get(endpoint).send(msg)

    def encode(self, msg: Message) -> bytes:
        """``msg`` sealed for this channel: ``send_frame`` sends it, to as many peers as need it."""
        return wire.encode(msg, self.secret, max_bytes=self.max_bytes)

    def send_frame(self, endpoint: str, frame_: bytes) -> None:
        """Send an ``encode()``d message to ``endpoint`` (any thread)."""
        self.get(endpoint).send_frame(frame_)

    def drop(self, endpoint: str) -> None:
        """Close the connection to one peer (for example after PeerLost); what waits is dropped."""
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

    def _send_client(self, client: ControlClient, data: bytes) -> None:
        with self._io:
            if self._closed:
                raise TransferError("control channel is closed")
            if client.dropped:
                raise TransferError(f"control channel to {client.endpoint} was dropped")
            if client.stream.sock is None and not self._closed and time.monotonic() >= client.retry_at:
                self._connect(client)  # down, and due for another attempt: now rather than at the next loop turn
            elif client.connecting:
                self._finish_connect(client)  # on loopback it is done by now: send at once, not at the next loop turn
            self._send(client.stream, data, client.endpoint)

    def _connect(self, client: ControlClient) -> None:
        """Start connecting (never raises: a failure, out of file descriptors included, schedules the
        next attempt)."""
        family, sockaddr = client.address
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            log.debug("control channel to %s: no socket (%s); retrying", client.endpoint, exc)
            self._later(client)
            return
        try:
            sock.setblocking(False)
            if family != socket.AF_UNIX:
                _nodelay(sock)
            err = sock.connect_ex(sockaddr)
        except OSError as exc:
            err = exc.errno or errno.EIO
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            sock.close()
            self._later(client)
            return
        self._retry.discard(client)
        client.stream.reset(sock, connected=err == 0)
        client.connecting = err != 0
        if client.connecting:
            client.connect_by = time.monotonic() + CONNECT_TIMEOUT_S
            self._connecting.add(client)
        self._watch(client.stream)
        if client.connecting:
            self._finish_connect(client)
        else:
            try:
                client.stream.flush()
            except OSError as exc:
                self._lost(client.stream, str(exc))

    def _finish_connect(self, client: ControlClient) -> None:
        """Complete a connect under way if the socket says it is done (never waits)."""
        try:
            self._writable(client.stream)
        except OSError as exc:
            self._lost(client.stream, str(exc))
        else:
            self._interest(client.stream)

    def _writable(self, stream: Stream) -> None:
        client: ControlClient = stream.client  # type: ignore[attr-defined]
        if client.connecting:
            err = stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            try:  # done only once the socket has a peer (a stale readiness event of a reused fd: not yet)
                stream.sock.getpeername()
            except OSError:
                return
            client.connecting = False
            self._connecting.discard(client)
            stream.connected = True
            client.backoff = RECONNECT_S
        stream.flush()

    def _lost(self, stream: Stream, why: str) -> None:
        client: ControlClient = stream.client  # type: ignore[attr-defined]
        self._connecting.discard(client)
        self._unwatch(stream)
        stream.close()
        if client.dropped or self._clients.get(client.endpoint) is not client:
            return
        log.debug("control channel to %s: %s; reconnecting", client.endpoint, why)
        self._later(client)

    def _later(self, client: ControlClient) -> None:
        client.connecting = False
        self._connecting.discard(client)
        client.retry_at = time.monotonic() + client.backoff
        client.backoff = min(2 * client.backoff, RECONNECT_MAX_S)
        self._retry.add(client)

    def _timeout_ms(self, timeout_ms: int) -> int:
        if not self._retry and not self._connecting:
            return timeout_ms
        due = min([c.retry_at for c in self._retry] + [c.connect_by for c in self._connecting]) - time.monotonic()
        return max(0, min(timeout_ms, int(due * 1000) + 1))

    def _housekeeping(self) -> None:
        if not self._retry and not self._connecting:
            return
        now = time.monotonic()
        for client in [c for c in self._connecting if c.connect_by <= now]:  # a peer that never answers
            self._lost(client.stream, f"no connection within {CONNECT_TIMEOUT_S:g}s")
        for client in [c for c in self._retry if c.retry_at <= now]:
            self._connect(client)

    def _receive(self, stream: Stream, body: bytes) -> Received[str] | None:
        endpoint = stream.client.endpoint  # type: ignore[attr-defined]
        result, _ = self._decode(body, endpoint)
        return None if result is None else (endpoint, result)


def _address(endpoint: str) -> tuple[int, Any]:
    """``tcp://host:port`` as (family, sockaddr); ConfigError naming what is wrong."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ConfigError(f"control endpoint must look like tcp://host:port, got {endpoint!r}", field="endpoint")
    host, _, port = endpoint[6:].rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        number = int(port)
        if not 0 < number < 65536:
            raise ValueError(port)
        family, _, _, _, sockaddr = socket.getaddrinfo(host, number, type=socket.SOCK_STREAM)[0]
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot connect to control endpoint {endpoint!r}: {exc}", field="endpoint") from None
    return family, sockaddr


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart on the same port past TIME_WAIT
        sock.bind((host, port))
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _nodelay(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small message, one segment, now
    except OSError:
        pass


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
