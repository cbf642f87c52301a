"""The prefill end of the control channel: a TCP server; a peer is its connection (see ``channel.py``)."""

from __future__ import annotations

import itertools
import logging
import select
import socket
import time

from kvbridge.errors import ConfigError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer import wire
from kvbridge.transfer.channel import (
    ACCEPT_PAUSE_S, DEFAULT_HWM, MAX_CONNECTIONS, Received, _Channel, _nodelay, _power_of_two,
)
from kvbridge.transfer.streams import Stream
from kvbridge.transfer.wire import MAX_MESSAGE_BYTES, ErrorReply, Message

log = logging.getLogger("kvbridge.transfer.channel")


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


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
