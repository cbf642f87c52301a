"""The IPC engine's side channel: what a peer registered, and its withdrawal, on this host only.

Every IPC engine listens on an abstract Unix socket named after its session
(``\\0kvbridge-ipc/<session>``): only processes in the same network namespace can
connect, so reaching it *is* the same-host test, and each side checks that the
other runs under the same user (``SO_PEERCRED``). Frames are ``streams.py``'s (a 4-byte
big-endian length) holding a msgpack map.

    writer (submit_write)                       target (registered the memory)
    connect -------------------------------------> accept            (same uid only)
    {"t": "get", "id": 1} ----------------------->
      <------------------- {"t": "regions", "id": 1, "regions": [[start, nbytes, kind, device, handle, offset], ...]}
                                                  unregister(ptr):
      <------------------- {"t": "revoke", "seq": 7, "start": ptr}
    (no copy into ptr in flight; mapping closed)
    {"t": "revoked", "seq": 7} ------------------> unregister(ptr) returns

One I/O thread per engine reads every socket (its listener, the connections it
accepted, the connections it opened to peers) and hands messages to the engine's
callbacks; any thread may send (a lock per connection). A request waits for its
reply on an event, never on the socket.
"""

from __future__ import annotations

import itertools
import logging
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from kvbridge.errors import EngineError
from kvbridge.transfer.streams import FrameError, FrameReader, frame

log = logging.getLogger(__name__)

MAX_FRAME = 64 << 20  # a region table of thousands of regions is well under this
SEND_TIMEOUT_S = 5.0
_CRED = struct.Struct("3i")  # pid, uid, gid


def socket_name(session: str) -> str:
    """The abstract socket address of the engine whose session is ``session``."""
    return "\0kvbridge-ipc/" + session


class Conn:
    """One side-channel connection; ``peer_pid`` is the other process (from the kernel)."""

    def __init__(self, sock: socket.socket, session: str, outgoing: bool) -> None:
        self.sock = sock
        self.session = session  # the peer's session (outgoing) or ours (accepted)
        self.outgoing = outgoing
        pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid != os.getuid():
            sock.close()
            raise EngineError(f"IPC side channel {session}: peer process {pid} runs as uid {uid}, not {os.getuid()}")
        self.peer_pid = pid
        self.same_process = pid == os.getpid()
        self.closed = False
        self.served: set[int] = set()  # accepted side: region starts this writer was told about
        self._send_lock = threading.Lock()
        self._reader = FrameReader(MAX_FRAME)
        sock.settimeout(SEND_TIMEOUT_S)

    def send(self, msg: dict[str, Any]) -> None:
        body = msgpack.packb(msg, use_bin_type=True)
        try:
            with self._send_lock:
                self.sock.sendall(frame(body))
        except OSError as exc:
            raise EngineError(f"IPC side channel to {self.session}: send failed: {exc}") from exc

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Frames completed by ``data``."""
        self._reader.feed(data)
        out = []
        try:
            bodies = self._reader.frames(1 << 30)
        except FrameError as exc:
            raise EngineError(f"IPC side channel {self.session}: {exc}") from None
        for body in bodies:
            msg = msgpack.unpackb(body, raw=False)
            if not isinstance(msg, dict) or "t" not in msg:
                raise EngineError(f"IPC side channel {self.session}: malformed message")
            out.append(msg)
        return out


class Channel:
    """Listener + connections + the I/O thread. ``on_message(conn, msg)`` and ``on_closed(conn)``
    run on the I/O thread, for every message in the order it came (a reply to ``request`` too,
    before the requester wakes)."""

    def __init__(self, session: str, on_message: Callable[[Conn, dict], None],
                 on_closed: Callable[[Conn], None]) -> None:
        self.session = session
        self._on_message = on_message
        self._on_closed = on_closed
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(socket_name(session))
        except OSError as exc:
            self._listener.close()
            raise EngineError(f"IPC side channel: cannot listen as {session!r}: {exc}") from exc
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._new: list[Conn] = []
        self._accepted: list[Conn] = []
        self._replies: dict[int, list[Any]] = {}  # id -> [event, reply or None, conn]
        self._ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvb-ipc-{session}", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------
    def connect(self, session: str, timeout: float) -> Conn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(socket_name(session))
        except OSError as exc:
            sock.close()
            raise EngineError(f"no IPC engine with session {session} on this host ({exc.strerror or exc})") from exc
        conn = Conn(sock, session, outgoing=True)
        with self._lock:
            if self._closed:
                sock.close()
                raise EngineError(f"IPC side channel {self.session} is closed")
            self._new.append(conn)
        self._wake()
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
            return [c for c in self._accepted if not c.closed]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(10)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ---- I/O thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        break
                    new, self._new = self._new, []
                for conn in new:
                    self._sel.register(conn.sock, selectors.EVENT_READ, conn)
                for key, _ in self._sel.select(1.0):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._read(key.data)
        finally:
            for key in list(self._sel.get_map().values()):
                if isinstance(key.data, Conn):
                    self._drop(key.data)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            conn = Conn(sock, self.session, outgoing=False)
        except (OSError, EngineError) as exc:
            log.warning("IPC side channel %s: refused a connection: %s", self.session, exc)
            return
        with self._lock:
            self._accepted.append(conn)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
            msgs = conn.feed(data) if data else None
        except (OSError, EngineError, ValueError) as exc:  # a broken peer: drop its connection
            log.warning("IPC side channel %s: dropping connection to pid %d: %s", self.session, conn.peer_pid, exc)
            msgs = None
        if msgs is None:
            self._drop(conn)
            return
        for msg in msgs:
            try:  # replies too, in socket order: the engine installs a table before a later revoke
                self._on_message(conn, msg)
            except Exception:  # one bad message must not stop the channel; logged with its cause
                log.exception("IPC side channel %s: handling %s failed", self.session, msg.get("t"))
            rid = msg.get("id")
            if conn.outgoing and rid is not None:
                with self._lock:
                    slot = self._replies.get(rid)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()

    def _drop(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        with self._lock:
            if conn in self._accepted:
                self._accepted.remove(conn)
            waiting = [slot for slot in self._replies.values() if slot[2] is conn]
        for slot in waiting:  # replies that will never come: wake their requesters
            slot[0].set()
        try:
            self._on_closed(conn)
        except Exception:  # logged; the channel goes on
            log.exception("IPC side channel %s: close callback failed", self.session)
