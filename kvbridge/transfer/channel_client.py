"""The decode end of the control channel: one reconnecting client per prefill peer (see ``channel.py``)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from typing import Any

from kvbridge.errors import ConfigError, TransferError
from kvbridge.transfer import wire
from kvbridge.transfer.channel import (
    CONNECT_TIMEOUT_S, DEFAULT_HWM, MAX_PEERS, RECONNECT_MAX_S, RECONNECT_S, Received, _Channel, _nodelay,
)
from kvbridge.transfer.streams import Stream
from kvbridge.transfer.wire import MAX_MESSAGE_BYTES, Message

log = logging.getLogger("kvbridge.transfer.channel")


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
