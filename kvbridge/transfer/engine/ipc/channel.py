"""The IPC engine's side channel: what a peer registered, and its withdrawal, on this host only.

Every IPC engine listens on an abstract Unix socket named after its session
(``unix:@kvbridge-ipc/<session>``): only processes in the same network namespace can
connect, so reaching it *is* the same-host test, and each side checks that the other runs
under the same user (``SO_PEERCRED``). It is kvbridge's one transport and codec
(``kvbridge.transfer.channel``): a Hello first, then typed messages (below)::

    writer (submit_write)                       target (registered the memory)
    connect -------------------------------------> accept            (same uid only)
    Get(id=1) ----------------------------------->
      <------------------- Regions(id=1, regions=[(start, nbytes, kind, device, handle, offset), ...])
                                                  unregister(ptr):
      <------------------- Revoke(seq=7, start=ptr)
    (no copy into ptr in flight; mapping closed)
    Revoked(seq=7) ------------------------------> unregister(ptr) returns

The engine's tables speak plain dicts (``{"t": "revoke", "seq": 7, "start": ptr}``): a dict is
checked against its message type when sent, and a message is handed over as its dict. One I/O
thread per end (the listener's connections; the connections this engine opened) hands messages
to the engine's callbacks in the order they came (a reply to ``request`` too, before the
requester wakes); any thread may send. A request waits for its reply on an event.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Annotated, Any, Union

import msgspec

from kvbridge.errors import ConfigError, EngineError, ProtocolError, TransferError
from kvbridge.transfer.channel import Clients, Codec, Limits, Server

log = logging.getLogger(__name__)

IPC_VERSION = 2  # 2: the Hello answers the server's challenge (transfer/channel/envelope.py)
MAX_MESSAGE_BYTES = 64 << 20  # a region table of thousands of regions is well under this
_CRED = struct.Struct("3i")  # pid, uid, gid
# the server's limits: peers are processes of this user on this host (admitted by their
# credentials) holding a connection for an engine's life, so no idle deadline and no cap per
# address (every peer's is "unix"); budgets that hold a whole region table
_LIMITS = Limits(idle_timeout=None, max_connections_per_address=None, frame_budget=3 * MAX_MESSAGE_BYTES,
                 max_queued_bytes=4 * MAX_MESSAGE_BYTES)
_Count = Annotated[int, msgspec.Meta(ge=0)]


class Get(msgspec.Struct, frozen=True, tag="get", tag_field="t"):
    id: _Count = 0


class Regions(msgspec.Struct, frozen=True, tag="regions", tag_field="t"):
    regions: list[tuple[_Count, _Count, str, int, bytes, _Count]]
    id: _Count | None = None


class Revoke(msgspec.Struct, frozen=True, tag="revoke", tag_field="t"):
    seq: _Count
    start: _Count


class Revoked(msgspec.Struct, frozen=True, tag="revoked", tag_field="t"):
    seq: int


IpcMessage = Union[Get, Regions, Revoke, Revoked]
TYPES = (Get, Regions, Revoke, Revoked)


def codec() -> Codec[IpcMessage]:
    return Codec("ipc", IPC_VERSION, TYPES, max_bytes=MAX_MESSAGE_BYTES)


def socket_name(session: str) -> str:
    """The abstract socket address of the engine whose session is ``session``."""
    return "\0kvbridge-ipc/" + session


def _endpoint(session: str) -> str:
    return "unix:@kvbridge-ipc/" + session


def _same_user(sock: socket.socket) -> int:
    """The peer's pid; EngineError unless it runs under this user."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise EngineError(f"IPC side channel: peer process {pid} runs as uid {uid}, not {os.getuid()}")
    return pid


class Conn:
    """One side-channel connection; ``peer_pid`` is the other process (from the kernel)."""

    def __init__(self, send: Callable[[bytes], None], codec_: Codec[IpcMessage], session: str, outgoing: bool,
                 peer_pid: int) -> None:
        self._send = send
        self._codec = codec_
        self.session = session  # the peer's session (outgoing) or ours (accepted)
        self.outgoing = outgoing
        self.peer_pid = peer_pid
        self.same_process = peer_pid == os.getpid()
        self.closed = False
        self.served: set[int] = set()  # accepted side: region starts this writer was told about

    def send(self, msg: dict[str, Any]) -> None:
        try:
            typed = msgspec.convert(msg, IpcMessage)
        except msgspec.ValidationError as exc:
            raise EngineError(f"IPC side channel to {self.session}: bad {msg.get('t')!r} message: {exc}") from None
        if self.closed:
            raise EngineError(f"IPC side channel to {self.session}: connection closed")
        try:
            self._send(self._codec.encode(typed))
        except TransferError as exc:
            raise EngineError(f"IPC side channel to {self.session}: send failed: {exc}") from exc


class Channel:
    """Listener + connections + the I/O threads. ``on_message(conn, msg)`` and ``on_closed(conn)``
    run on an I/O thread, for every message in the order it came."""

    def __init__(self, session: str, on_message: Callable[[Conn, dict], None],
                 on_closed: Callable[[Conn], None]) -> None:
        self.session = session
        self._on_message = on_message
        self._on_closed = on_closed
        self._codec = codec()
        self._lock = threading.Lock()
        self._accepted: dict[bytes, Conn] = {}
        self._outgoing: dict[str, Conn] = {}
        self._replies: dict[int, list[Any]] = {}  # id -> [event, reply or None, conn]
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        try:
            self._server = Server(self._codec, _endpoint(session), admit=_same_user, on_lost=self._server_lost,
                                  limits=_LIMITS)
        except ConfigError as exc:  # the name is taken
            raise EngineError(f"IPC side channel: cannot listen as {session!r}: {exc}") from exc
        self._clients = Clients(self._codec, name=session, admit=_same_user, on_lost=self._client_lost)
        self._threads = [threading.Thread(target=self._run, args=(end,), name=f"kvb-ipc-{session}", daemon=True)
                         for end in (self._server, self._clients)]
        for thread in self._threads:
            thread.start()

    # ---- any thread -------------------------------------------------------------------------
    def connect(self, session: str, timeout: float) -> Conn:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # reachable, and the same user?
        probe.settimeout(timeout)
        try:
            probe.connect(socket_name(session))
            pid = _same_user(probe)
        except OSError as exc:
            raise EngineError(f"no IPC engine with session {session} on this host ({exc.strerror or exc})") from exc
        finally:
            probe.close()
        endpoint = _endpoint(session)
        with self._lock:
            if self._closed.is_set():
                raise EngineError(f"IPC side channel {self.session} is closed")
            old = self._outgoing.get(endpoint)
            if old is not None:  # the caller connects again once it saw the old one closed (or forgot it)
                old.closed = True
            self._clients.drop(endpoint)
            client = self._clients.get(endpoint)
            conn = self._outgoing[endpoint] = Conn(client.send_frame, self._codec, session, True, pid)
        return conn

    def request(self, conn: Conn, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        rid = next(self._ids)
        slot: list[Any] = [threading.Event(), None, conn]
        with self._lock:
            self._replies[rid] = slot
        try:
            conn.send({**msg, "id": rid})
            if not slot[0].wait(timeout) or slot[1] is None:
                raise EngineError(f"IPC side channel: no answer from {conn.session} within {timeout:g}s"
                                  + (" (connection closed)" if conn.closed else ""))
            return slot[1]
        finally:
            with self._lock:
                self._replies.pop(rid, None)

    def accepted(self) -> list[Conn]:
        with self._lock:
            return [c for c in self._accepted.values() if not c.closed]

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for end in (self._server, self._clients):
            end.wakeup.post()
        for thread in self._threads:
            thread.join(10)
        for end in (self._server, self._clients):
            end.close()
        with self._lock:
            conns = list(self._accepted.values()) + list(self._outgoing.values())
            self._accepted.clear()
            self._outgoing.clear()
        for conn in conns:
            self._drop(conn)

    # ---- I/O threads ------------------------------------------------------------------------
    def _run(self, end: Server | Clients) -> None:
        while not self._closed.is_set():
            try:
                received = end.recv_ready(1000)
            except TransferError:  # closed
                return
            for peer, msg in received:
                if isinstance(msg, ProtocolError):
                    log.warning("IPC side channel %s: refused a message: %s", self.session, msg)
                    continue
                conn = self._conn(end, peer)
                if conn is not None:
                    self._deliver(conn, msg)

    def _conn(self, end: Server | Clients, peer: Any) -> Conn | None:
        with self._lock:
            if end is self._clients:
                return self._outgoing.get(peer)
            conn = self._accepted.get(peer)
            if conn is None:
                send = lambda data, _peer=peer: self._server.send_frame(_peer, data)  # noqa: E731
                conn = self._accepted[peer] = Conn(send, self._codec, self.session, False,
                                                   self._server.info_of(peer) or 0)
            return conn

    def _deliver(self, conn: Conn, msg: Any) -> None:
        data = msgspec.to_builtins(msg, builtin_types=(bytes,))
        try:  # replies too, in socket order: the engine installs a table before a later revoke
            self._on_message(conn, data)
        except Exception:  # one bad message must not stop the channel; logged with its cause
            log.exception("IPC side channel %s: handling %s failed", self.session, data.get("t"))
        rid = data.get("id")
        if conn.outgoing and rid is not None:
            with self._lock:
                slot = self._replies.get(rid)
            if slot is not None:
                slot[1] = data
                slot[0].set()

    def _server_lost(self, peer: bytes) -> None:
        with self._lock:
            conn = self._accepted.pop(peer, None)
        if conn is not None:
            self._drop(conn)

    def _client_lost(self, endpoint: str) -> None:
        with self._lock:
            conn = self._outgoing.pop(endpoint, None)
        if conn is not None:
            self._clients.drop(endpoint)  # no reconnect: the engine connects again when it needs to
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        with self._lock:
            waiting = [slot for slot in self._replies.values() if slot[2] is conn]
        for slot in waiting:  # replies that will never come: wake their requesters
            slot[0].set()
        try:
            self._on_closed(conn)
        except Exception:  # logged; the channel goes on
            log.exception("IPC side channel %s: close callback failed", self.session)
