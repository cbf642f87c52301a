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
import logging
import os
import select
import socket
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

from kvbridge.errors import ConfigError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer import wire
from kvbridge.transfer.streams import FrameError, QueueFull, Stream, frame
from kvbridge.transfer.wire import Message

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


def _nodelay(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small message, one segment, now
    except OSError:
        pass


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


from kvbridge.transfer.channel_client import ControlClient, PeerSet  # noqa: E402  (the two ends, re-exported:
from kvbridge.transfer.channel_server import ControlServer  # noqa: E402  each imports the base above)

__all__ = ["ChannelStats", "ControlClient", "ControlServer", "PeerSet", "Wakeup"]
