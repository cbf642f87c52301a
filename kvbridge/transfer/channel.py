"""ZMQ control channel: a ROUTER server per prefill rank, one DEALER per peer on decode.

    decode rank                                      prefill rank
    PeerSet ── ControlClient (DEALER) ────────────▶ ControlServer (ROUTER, bound to host:port)
            ◀──────────────────── replies go back to the identity that sent

One loop thread receives; any thread may send. Every socket call goes through one
lock, and the loop waits on file descriptors only (the wakeup pipe and each socket's
``ZMQ_FD``), never inside a socket call, so a send from an engine thread (a decode
rank's request from ``init()``, a prefill rank's completion report from the engine's
callback) goes out at once, without a hop to the loop thread::

    loop thread:   poll(fds) -> lock: drain the sockets whose fd fired (or left a backlog)
    any thread:    lock: send; a send may consume the read signal of its socket, so a
                   socket found readable after it is put on the backlog (and, off the
                   loop thread, the loop is woken to drain it)

Other threads hand the loop work through ``wakeup`` (thread-safe, wakes a blocked
``recv_ready`` at once, no busy polling)::

    engine.set_notify(server.wakeup.post)          # write completions wake the loop
    while running:
        for peer, msg in server.recv_ready(timeout_ms=100):
            if isinstance(msg, ProtocolError): continue   # already counted and answered
            handle(peer, msg)
        for work in server.wakeup.drain(): work()

Bad input never raises out of ``recv_ready``: a message that does not decode comes
back as ``(peer, ProtocolError)``, is counted in ``stats.malformed``, and the server
answers it with an ErrorReply naming the problem - every one, oversized ones
included: with a secret the MAC is checked before the size, so an authentic message
over ``max_bytes`` is answered like any other malformed one. Anything that does not
authenticate when a secret is set (bad or missing HMAC) is dropped without a reply
and counted in ``stats.unauthenticated``. Clients never answer errors (no ping-pong).
Bounded: per-socket queues (``hwm`` messages), message size (ZMQ drops a
connection sending more than ``wire.auth_limit(max_bytes)``, about twice
``max_bytes``: that sender gets no answer), messages per ``recv_ready`` call,
peers per PeerSet, items in a wakeup queue. Sockets close with linger 0.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union

import zmq

from kvbridge.errors import ConfigError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer import wire
from kvbridge.transfer.wire import MAX_MESSAGE_BYTES, ErrorReply, Message

log = logging.getLogger(__name__)

DEFAULT_HWM = 1000
MAX_BATCH = 256
MAX_PEERS = 1024
MAX_WAKEUP_ITEMS = 10_000

PeerT = TypeVar("PeerT", bound=Hashable)
Received = tuple[PeerT, Union[Message, ProtocolError]]  # (peer, message) or (peer, why it was refused)


@dataclass
class ChannelStats:
    received: int = 0
    malformed: int = 0
    unauthenticated: int = 0
    sent: int = 0
    error_replies: int = 0
    rescued: int = 0  # messages only the quiet-spell scan found (a read signal lost: a bug; stays 0)


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
            while os.read(self._read_fd, 4096):
                pass
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

    def __init__(self, *, secret: bytes | None, max_bytes: int, hwm: int, context: zmq.Context | None) -> None:
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise ConfigError("the control-channel secret must be non-empty bytes or None", field="secret")
        self.secret = secret
        self.max_bytes = max_bytes
        self.hwm = hwm
        self.stats = ChannelStats()
        self.wakeup = Wakeup()
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._io = threading.RLock()  # every socket call (any thread); reentrant: a receive may answer
        self._poller = select.poll()  # file descriptors only: waiting touches no socket
        self._poller.register(self.wakeup.fileno(), select.POLLIN)
        self._by_fd: dict[int, zmq.Socket] = {}  # ZMQ_FD -> socket
        self._backlog: set[zmq.Socket] = set()  # sockets that may hold messages their fd will not signal
        self._loop: int | None = None  # the receiving thread (recv_ready's caller)
        self._peer_of: dict[zmq.Socket, Any] = {}  # socket -> peer id (clients); the server uses frame 0
        self._closed = False

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.auth_limit(self.max_bytes))
        return sock

    def _watch(self, sock: zmq.Socket) -> None:
        """Wait on ``sock``'s ZMQ_FD from now on (io lock held)."""
        fd = sock.getsockopt(zmq.FD)
        self._by_fd[fd] = sock
        self._poller.register(fd, select.POLLIN)
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (also arms the fd)
            self._backlog.add(sock)
        self._wake_loop()  # it may sleep on the old set of fds

    def _unwatch(self, sock: zmq.Socket) -> None:
        """Stop waiting on ``sock`` (io lock held; loop thread, or after the loop ended)."""
        for fd, s in list(self._by_fd.items()):
            if s is sock:
                del self._by_fd[fd]
                self._poller.unregister(fd)
        self._backlog.discard(sock)

    def recv_ready(self, timeout_ms: int) -> list[Received[PeerT]]:
        """Wait up to ``timeout_ms`` for input; return what arrived (possibly nothing: a wakeup)."""
        if self._closed:
            raise TransferError("control channel is closed")
        self._loop = threading.get_ident()
        with self._io:
            busy = bool(self._backlog)
        events = self._poller.poll(0 if busy else max(0, int(timeout_ms)))
        out: list[Received[PeerT]] = []
        with self._io:
            if self._closed:
                return out
            socks = set(self._backlog)
            self._backlog.clear()
            for fd, _ in events:
                if fd == self.wakeup.fileno():
                    self.wakeup.clear_signal()
                elif fd in self._by_fd:
                    socks.add(self._by_fd[fd])
            for sock in socks:
                self._drain(sock, out)
            if not events and not socks:  # a quiet spell: look at every socket (a lost signal costs a timeout)
                for sock in list(self._by_fd.values()):
                    self._drain(sock, out)
                self.stats.rescued += len(out)
        return out

    def _drain(self, sock: zmq.Socket, out: list[Received[PeerT]]) -> None:
        """Receive what ``sock`` holds, up to MAX_BATCH messages (io lock held)."""
        for _ in range(MAX_BATCH):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # also re-arms the fd
                return
            item = self._receive(sock, sock.recv_multipart(zmq.NOBLOCK))
            if item is not None:
                out.append(item)
        self._backlog.add(sock)  # more left: the next call goes on without waiting

    def _receive(self, sock: zmq.Socket, frames: list[bytes]) -> Received[PeerT] | None:
        raise NotImplementedError

    def _decode(self, frames: list[bytes], who: str) -> tuple[Message | ProtocolError | None, bytes]:
        """(message or error, body); None when dropped as unauthenticated."""
        self.stats.received += 1
        if len(frames) != 1:
            err = ProtocolError(f"expected one frame per message, got {len(frames)}", field="frames")
            return self._malformed(err, who), b""
        try:
            body = wire.unseal(frames[0], self.secret, max_bytes=self.max_bytes)
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

    def _send(self, sock: zmq.Socket, frames: list[bytes], who: str) -> None:
        """Send from any thread (non-blocking)."""
        with self._io:
            if self._closed or sock.closed:
                raise TransferError(f"control channel to {who} is closed")
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                raise PeerLost(f"control channel to {who}: send queue full ({self.hwm} messages); peer gone or "
                               "stalled") from None
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise PeerLost(f"control channel to {who}: peer not connected") from None
                raise TransferError(f"control channel to {who}: {exc}") from exc
            finally:  # the send may have taken the socket's read signal: the loop must still drain it
                self._keep_draining(sock)
            self.stats.sent += 1

    def _keep_draining(self, sock: zmq.Socket) -> None:
        """After a socket call: put ``sock`` on the backlog if it holds input, and wake the loop
        when another thread made the call (io lock held)."""
        if sock.closed or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return
        self._backlog.add(sock)
        self._wake_loop()

    def _wake_loop(self) -> None:
        """Wake the receiving thread, unless this is it (or none waits yet)."""
        if self._loop is not None and threading.get_ident() != self._loop:
            self.wakeup.post()

    def _close_sockets(self, sockets: list[zmq.Socket]) -> None:
        with self._io:
            for sock in sockets:
                if not sock.closed:
                    self._unwatch(sock)
                    sock.close(linger=0)

    def _close(self, sockets: list[zmq.Socket]) -> None:
        with self._io:
            if self._closed:
                return
            self._closed = True
            self._close_sockets(sockets)
        self.wakeup.close()
        if self._own_context:
            self._context.term()


class ControlServer(_Channel[bytes]):
    """ROUTER bound to ``tcp://host:port`` (port 0: a free one); peers are ZMQ identities (bytes)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__(secret=secret, max_bytes=max_bytes, hwm=hwm, context=context)
        self._sock = self._socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._sock.bind(f"tcp://{host}:{port if port else '*'}")
        except zmq.ZMQError as exc:
            self._close([self._sock])
            raise ConfigError(f"cannot bind the control channel to {host}:{port}: {exc}", field="control_port") from exc
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        with self._io:
            self._watch(self._sock)

    def send(self, peer: bytes, msg: Message) -> None:
        """Send to a connected peer (any thread); PeerLost when it is gone or its queue is full."""
        self._send(self._sock, [peer, wire.encode(msg, self.secret, max_bytes=self.max_bytes)], f"peer {peer.hex()}")

    def _receive(self, sock: zmq.Socket, frames: list[bytes]) -> Received[bytes] | None:
        peer, rest = frames[0], frames[1:]
        result, body = self._decode(rest, f"peer {peer.hex()}")
        if isinstance(result, ProtocolError):
            ref_type, room = wire.peek(body) if body else ("", None)
            reply = ErrorReply(ref_type=ref_type, room=room, reason=str(result)[:1000])
            try:
                self.send(peer, reply)
                self.stats.error_replies += 1
            except TransferError as exc:
                log.debug("could not answer a malformed message: %s", exc)
        return None if result is None else (peer, result)

    def close(self) -> None:
        self._close([self._sock])


class ControlClient:
    """One DEALER connected to one peer's ControlServer; created and owned by a PeerSet."""

    def __init__(self, owner: PeerSet, sock: zmq.Socket, endpoint: str) -> None:
        self._owner = owner
        self.socket = sock
        self.endpoint = endpoint

    def send(self, msg: Message) -> None:
        self.send_frame(self._owner.encode(msg))

    def send_frame(self, frame: bytes) -> None:
        self._owner._send(self.socket, [frame], self.endpoint)


class PeerSet(_Channel[str]):
    """One cached ControlClient per peer endpoint; replies come back as ``(endpoint, message)``."""

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        hwm: int = DEFAULT_HWM,
        max_peers: int = MAX_PEERS,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__(secret=secret, max_bytes=max_bytes, hwm=hwm, context=context)
        self.max_peers = max_peers
        self._clients: dict[str, ControlClient] = {}

    def get(self, endpoint: str) -> ControlClient:
        """The client of ``endpoint``, connected on first use (any thread)."""
        client = self._clients.get(endpoint)
        if client is not None:
            return client
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"control endpoint must look like tcp://host:port, got {endpoint!r}", field="endpoint")
        with self._io:
            client = self._clients.get(endpoint)
            if client is not None:
                return client
            if self._closed:
                raise TransferError("control channel is closed")
            if len(self._clients) >= self.max_peers:
                raise TransferError(f"more than {self.max_peers} control peers; drop() the ones that are gone")
            sock = self._socket(zmq.DEALER)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ConfigError(f"cannot connect to control endpoint {endpoint!r}: {exc}", field="endpoint") from exc
            client = self._clients[endpoint] = ControlClient(self, sock, endpoint)
            self._peer_of[sock] = endpoint
            self._watch(sock)
        return client

    def send(self, endpoint: str, msg: Message) -> None:
        """Send to ``endpoint`` (any thread)."""
        self.get(endpoint).send(msg)

    def encode(self, msg: Message) -> bytes:
        """``msg`` sealed for this channel: ``send_frame`` sends it, to as many peers as need it."""
        return wire.encode(msg, self.secret, max_bytes=self.max_bytes)

    def send_frame(self, endpoint: str, frame: bytes) -> None:
        """Send an ``encode()``d message to ``endpoint`` (any thread)."""
        self.get(endpoint).send_frame(frame)

    def drop(self, endpoint: str) -> None:
        """Close the connection to one peer (for example after PeerLost); the receiving thread only."""
        with self._io:
            client = self._clients.pop(endpoint, None)
            if client is not None:
                self._peer_of.pop(client.socket, None)
                self._close_sockets([client.socket])

    def endpoints(self) -> list[str]:
        return list(self._clients)

    def _receive(self, sock: zmq.Socket, frames: list[bytes]) -> Received[str] | None:
        endpoint = self._peer_of[sock]
        result, _ = self._decode(frames, endpoint)
        return None if result is None else (endpoint, result)

    def close(self) -> None:
        with self._io:
            sockets = [c.socket for c in self._clients.values()]
            self._clients.clear()
            self._peer_of.clear()
            self._close(sockets)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
