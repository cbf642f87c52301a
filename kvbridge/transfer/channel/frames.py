"""Length-prefixed frames over one stream socket, without blocking: what every connection of
the transport (``transport.py``) is made of.

    frame = 4-byte big-endian length | body            (length <= max_frame)

:class:`FrameReader` turns received bytes into bodies, refusing a length over its limit as
soon as the header arrives (nothing of an oversized frame is buffered). :class:`Stream` is one
connected socket:

    queue(frame)   the kernel takes what it can now; the rest waits (at most ``hwm`` frames)
    flush()        when the socket is writable: more of what waits
    read(limit)    what the socket holds, at most ``limit`` bytes, into the reader
    open(hello)    a client's stream (``holds``) sends nothing until its Hello, which goes first

A frame only partly sent when its connection breaks is sent again, whole, on the next
connection (``reset``), after that connection's Hello. What waits unsent is counted in
``queued_bytes`` and in the owner's ``meter`` (one counter shared by a server's streams). A
stream is not thread-safe: the lock of the channel that owns it guards every call.
"""

from __future__ import annotations

import collections
import socket
import struct
from typing import Any

from kvbridge.transfer.channel.envelope import Hello

HEADER = struct.Struct(">I")
READ_CHUNK = 256 << 10
READ_PER_CALL = 4 << 20  # bytes one read takes from one socket (other sockets get their turn)
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a closed peer is an error here, never a SIGPIPE


class QueueFull(Exception):
    """A stream already holds ``hwm`` frames the kernel has not taken."""


class FrameError(Exception):
    """A frame whose announced length is over the reader's limit."""


class FrameReader:
    """Bytes in, frame bodies out; ``max_frame`` may change (after a Hello)."""

    __slots__ = ("max_frame", "_buf")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def frames(self, limit: int) -> list[bytes]:
        """Up to ``limit`` complete bodies, in order; FrameError for an oversized length."""
        buf, out, pos, end = self._buf, [], 0, len(self._buf)
        while len(out) < limit and end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > self.max_frame:
                raise FrameError(f"frame of {size} bytes announced, over the {self.max_frame}-byte limit")
            if end - pos - HEADER.size < size:
                break
            start = pos + HEADER.size
            out.append(bytes(buf[start : start + size]))
            pos = start + size
        if pos:
            if end - pos < pos:  # mostly taken: a fresh buffer, so that a large frame's memory goes back
                self._buf = buf[pos:]
            else:
                del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def announced(self) -> int:
        """The length the first buffered frame's header announces (0: no whole header yet)."""
        return HEADER.unpack_from(self._buf)[0] if len(self._buf) >= HEADER.size else 0

    @property
    def ready(self) -> bool:
        """A complete frame (or an oversized header) waits."""
        if len(self._buf) < HEADER.size:
            return False
        (size,) = HEADER.unpack_from(self._buf)
        return size > self.max_frame or len(self._buf) - HEADER.size >= size

    def clear(self) -> None:
        self._buf = bytearray()


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


class Meter:
    """Bytes waiting unsent in a channel's streams, all together."""

    __slots__ = ("queued",)

    def __init__(self) -> None:
        self.queued = 0


class Stream:
    """One socket's frames both ways (non-blocking); ``sock`` is None while disconnected."""

    def __init__(self, sock: socket.socket | None, max_frame: int, hwm: int) -> None:
        self.sock = sock
        self.connected = sock is not None
        self.broken = False  # sending failed (the peer stopped reading): nothing more is sent
        self.events = 0
        self.reader = FrameReader(max_frame)
        self.hwm = hwm
        self.ident = b""  # a server's name for the connection
        self.address = ""  # the source address (server side)
        self.hello: Hello | None = None  # server side: set once the peer authenticated
        self.info: Any = None  # what the owner's admit() returned (the IPC side channel: the peer's pid)
        self.client: Any = None  # a client end's Client
        self.hello_by = 0.0  # server side, pending: monotonic deadline of the Hello
        self.challenge = b""  # server side: the nonce this connection's Hello must carry
        self.last_rx = 0.0
        self.partial_since = 0.0  # when the frame now buffered began (0: none)
        self.budget = 0  # server side: bytes of the shared frame budget the reader holds
        self.throttled = 0.0  # server side: since when reading waits for the shared budget (0: not)
        self.bad_macs = 0  # server side: frames after the Hello that failed their MAC
        self.holds = False  # client side: send nothing on a connection before its Hello (``open``)
        self.held = False
        self.meter: Meter | None = None
        self.queued_bytes = 0
        self._hello: bytes | None = None  # the Hello queued first on this connection
        self._out: collections.deque[bytes] = collections.deque()
        self._sent = 0

    @property
    def fd(self) -> int:
        return -1 if self.sock is None else self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    @property
    def queued_frames(self) -> int:
        return len(self._out)

    def queue(self, data: bytes) -> None:
        """Send one frame or keep it for ``flush``; QueueFull at ``hwm`` waiting frames (a client's
        Hello not counted); OSError when the connection broke (the frame is kept)."""
        hello_waits = self._hello is not None and bool(self._out) and self._out[0] is self._hello
        if len(self._out) - hello_waits >= self.hwm:
            raise QueueFull
        self._out.append(data)
        self._count(len(data))
        if len(self._out) == 1 and self.connected and not self.held:
            self.flush()

    def open(self, hello: bytes) -> None:
        """A client's connection answered: ``hello`` first, then what waits (OSError: broken)."""
        self._out.appendleft(hello)
        self._hello = hello
        self._count(len(hello))
        self.held = False
        self.flush()

    def flush(self) -> None:
        out, sock = self._out, self.sock
        while out and self.connected and not self.held:
            first = out[0]
            try:
                sent = sock.send(memoryview(first)[self._sent :] if self._sent else first, _NOSIGNAL)
            except BlockingIOError:
                return
            self._sent += sent
            self._count(-sent)
            if self._sent < len(first):
                return
            if out.popleft() is self._hello:
                self._hello = None
            self._sent = 0

    def _count(self, n: int) -> None:
        self.queued_bytes += n
        if self.meter is not None:
            self.meter.queued += n

    def read(self, limit: int = READ_PER_CALL) -> bool:
        """Receive up to ``limit`` bytes; False at end of stream."""
        total = 0
        while total < limit:
            try:
                data = self.sock.recv(min(READ_CHUNK, limit - total))
            except BlockingIOError:
                return True
            if not data:
                return False
            self.reader.feed(data)
            total += len(data)
            if len(data) < READ_CHUNK:
                return True
        return True

    def reset(self, sock: socket.socket | None, connected: bool = True) -> None:
        """A new connection (or none): partial input dropped, the frame being sent starts over,
        the last connection's Hello is dropped, and (``holds``) nothing goes out before ``open``."""
        self.sock = sock
        self.connected = sock is not None and connected
        self.broken = False
        self.events = 0
        self.reader.clear()
        self._count(self._sent)
        self._sent = 0
        if self._hello is not None and self._out and self._out[0] is self._hello:
            self._out.popleft()
            self._count(-len(self._hello))
        self._hello = None
        self.held = self.holds

    def drop_output(self) -> None:
        self._count(-self.queued_bytes)
        self._out.clear()
        self._sent = 0
        self._hello = None

    def close(self) -> None:
        """Close the socket; what waits stays for the next connection (a client's; a server's
        streams ``drop_output`` first)."""
        if self.sock is not None:
            self.sock.close()
        self.reset(None)
