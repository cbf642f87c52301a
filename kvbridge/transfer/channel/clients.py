"""The client end of the transport (``transport.py``): one reconnecting ``Client`` per endpoint,
each answering its server's challenge with a Hello before anything else goes out.

A connection says the channel's ``name`` in its Hello, and a server binds the connection to it.
``rename`` changes the name for the connections opened from then on; those of an earlier name that
the caller still needs (a decode rank's rooms asked on them: the prefill rank answers a room only
on the connection that asked) stay open, *retired*, until ``drop_name``:

    name R:   endpoint -> Client(R)                    (send_frame(endpoint, data))
    rename(R', keep={R})
    name R':  endpoint -> Client(R')                   opened on the next send
              (endpoint, R) -> Client(R), retired      still read; send_frame(endpoint, data, name=R)
    drop_name(R): the retired connections of R close
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvbridge.errors import KVBridgeError, ProtocolError, TransferError
from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES, Codec
from kvbridge.transfer.channel.frames import HEADER, Stream, frame
from kvbridge.transfer.channel.transport import (CONNECT_TIMEOUT_S, DEFAULT_HWM, GREET_WAIT_LOOP_S, GREET_WAIT_S,
                                                 MAX_PEERS, RECONNECT_MAX_S, RECONNECT_S, Channel, Received,
                                                 parse_address, power_of_two, set_nodelay)

log = logging.getLogger("kvbridge.transfer.channel")


class Client:
    """The connection to one server; created and owned by a ``Clients``."""

    def __init__(self, owner: Clients, endpoint: str, address: tuple[int, Any], max_frame: int, hwm: int,
                 name: str) -> None:
        self._owner = owner
        self.endpoint = endpoint
        self.name = name  # what its Hello says: the channel's name when it was opened
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


class Clients(Channel[Client]):
    """One reconnecting ``Client`` per server endpoint; replies come back as ``(endpoint, message)``
    (``recv_named``: ``(endpoint, name, message)``, the name the connection's Hello said).
    ``name``: who this side is, said in the Hello of every connection; ``rename`` may keep the
    connections of an earlier name open (retired), sent on by that name."""

    def __init__(self, codec: Codec[Any], *, name: str = "", hwm: int = DEFAULT_HWM, max_peers: int = MAX_PEERS,
                 admit: Callable[[socket.socket], Any] | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        super().__init__(codec, hwm=hwm)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.max_peers = max_peers
        self._admit = admit
        self._on_lost = on_lost
        self._clients: dict[str, Client] = {}  # endpoint -> its connection under ``name``
        self._retired: dict[tuple[str, str], Client] = {}  # (endpoint, earlier name) -> a connection kept open
        self._retry: set[Client] = set()
        self._connecting: set[Client] = set()

    def get(self, endpoint: str, name: str | None = None) -> Client:
        """The client of ``endpoint`` whose Hello says ``name`` (None: the channel's name; an
        earlier one: its retired connection, opened again under that name if there is none),
        connected on first use (any thread)."""
        client = self._clients.get(endpoint) if name is None else self._of(endpoint, name)
        if client is not None:
            return client
        family, sockaddr, _ = parse_address(endpoint)
        with self._io:
            name = self.name if name is None else name
            client = self._of(endpoint, name)
            if client is not None:
                return client
            if self._closed:
                raise TransferError(f"{self.codec.name} channel is closed")
            if len(self._clients) + len(self._retired) >= self.max_peers:
                raise TransferError(f"more than {self.max_peers} {self.codec.name} peers; drop() the ones that are gone")
            client = Client(self, endpoint, (family, sockaddr), self._max_frame, self.hwm, name)
            if name == self.name:
                self._clients[endpoint] = client
            else:
                self._retired[(endpoint, name)] = client
            self._connect(client)
        return client

    def _of(self, endpoint: str, name: str) -> Client | None:
        """The open client of ``endpoint`` under ``name`` (current or retired), if any."""
        if name == self.name:
            return self._clients.get(endpoint)
        return self._retired.get((endpoint, name))

    def send(self, endpoint: str, msg: Any) -> None:
        self.get(endpoint).send(msg)

    def encode(self, msg: Any) -> bytes:
        """``msg`` sealed for this channel: ``send_frame`` sends it, to as many peers as need it."""
        return self.codec.encode(msg)

    def send_frame(self, endpoint: str, data: bytes, name: str | None = None) -> None:
        """``data`` to ``endpoint`` on the connection whose Hello says ``name`` (None: the channel's)."""
        self.get(endpoint, name).send_frame(data)

    def recv_ready(self, timeout_ms: int) -> list[Received[str]]:  # type: ignore[override]
        return [(client.endpoint, msg) for client, msg in super().recv_ready(timeout_ms)]

    def recv_named(self, timeout_ms: int) -> list[tuple[str, str, Any]]:
        """``recv_ready``, each message with the name its connection's Hello said."""
        return [(client.endpoint, client.name, msg) for client, msg in super().recv_ready(timeout_ms)]

    def rename(self, name: str, keep: frozenset[str] | set[str] = frozenset()) -> None:
        """Say ``name`` in the Hello from now on (a peer binds a connection to what its Hello
        said): the open connections of a name in ``keep`` stay open, retired (still read; sent on
        with ``send_frame(..., name=)``) until ``drop_name``; every other one is dropped, and opened
        again under ``name`` on the next send."""
        with self._io:
            if name != self.name:
                for endpoint, client in list(self._clients.items()):
                    del self._clients[endpoint]
                    if client.name in keep:
                        self._retired[(endpoint, client.name)] = client
                    else:
                        self._drop(client)
                self.name = name
            for key, client in list(self._retired.items()):
                if key[1] not in keep or key[1] == name:
                    del self._retired[key]
                    self._drop(client)

    def drop_name(self, name: str) -> None:
        """Close the retired connections of ``name``; what waits on them is dropped."""
        with self._io:
            for key in [k for k in self._retired if k[1] == name]:
                self._drop(self._retired.pop(key))

    def retired(self) -> list[tuple[str, str]]:
        """The retired connections still open, as ``(endpoint, name)``."""
        return sorted(self._retired)

    def connected(self, endpoint: str) -> bool:
        client = self._clients.get(endpoint)
        return client is not None and client.stream.connected and client.stream.sock is not None

    def drop(self, endpoint: str) -> None:
        """Close the connections to one peer (its retired ones too); what waits is dropped."""
        with self._io:
            client = self._clients.pop(endpoint, None)
            if client is not None:
                self._drop(client)
            for key in [k for k in self._retired if k[0] == endpoint]:
                self._drop(self._retired.pop(key))

    def _drop(self, client: Client) -> None:
        """(io lock held) Close a client taken out of the tables."""
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
            clients = [*self._clients.values(), *self._retired.values()]
            streams = [c.stream for c in clients]
            for client in clients:
                client.connecting = False
            self._clients.clear()
            self._retired.clear()
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
            set_nodelay(sock)
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
        if client.dropped or self._of(client.endpoint, client.name) is not client:
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

    def _housekeeping(self, out: list[Received[Client]]) -> None:
        if not self._retry and not self._connecting:
            return
        now = time.monotonic()
        for client in [c for c in self._connecting if c.connect_by <= now]:
            self._lost(client.stream, f"no connection within {CONNECT_TIMEOUT_S:g}s")
        for client in [c for c in self._retry if c.retry_at <= now]:
            self._connect(client)

    def _receive(self, stream: Stream, body: bytes) -> Received[Client] | None:
        client = stream.client
        if stream.held:  # the connection's first frame: the server's challenge
            return self._answer(stream, body)
        result = self._decode(body, client.endpoint)
        return None if result is None else (client, result)

    def _answer(self, stream: Stream, body: bytes) -> Received[Client] | None:
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
            if power_of_two(self.stats.unauthenticated + self.stats.malformed):
                log.warning("%s channel to %s: the server's first frame is no hello challenge we can answer "
                            "(%d so far): %s", self.codec.name, endpoint,
                            self.stats.unauthenticated + self.stats.malformed, err)
            self._lost(stream, f"no hello challenge: {err}")
            return None
        try:
            stream.open(frame(self.codec.hello(stream.client.name, challenge.nonce)))
        except OSError as exc:
            self._lost(stream, str(exc))
            return None
        self._interest(stream)
        return None
