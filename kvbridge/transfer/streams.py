"""Length-prefixed frames over stream sockets, without blocking: what the control channel's
connections (and the IPC engine's side channel) are made of.

    frame = 4-byte big-endian length | body            (length <= max_frame)

:class:`FrameReader` turns received bytes into bodies, refusing a length over its limit as
soon as the header arrives (nothing of an oversized frame is buffered). :class:`Stream` is
one connected socket of a channel:

    queue(frame)   the kernel takes what it can now; the rest waits (at most ``hwm`` frames)
    flush()        when the socket is writable: more of what waits
    read()         what the socket holds, into the reader (bounded per call)

A frame only partly sent when its connection breaks is sent again, whole, on the next
connection (``reset``): the other side drops a partial frame with the connection that
carried it, so it arrives once or not at all. A stream is not thread-safe: the lock of the
channel that owns it guards every call.
"""

from __future__ import annotations

import collections
import socket
import struct

HEADER = struct.Struct(">I")
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a closed peer is an error here, never a SIGPIPE
READ_CHUNK = 256 << 10
READ_PER_CALL = 4 << 20  # bytes one read() takes from one socket (other sockets get their turn)


class FrameError(Exception):
    """A frame the reader refuses (its announced length is over the limit)."""


class QueueFull(Exception):
    """A stream already holds ``hwm`` frames the kernel has not taken."""


class FrameReader:
    """Bytes in, frame bodies out."""

    __slots__ = ("max_frame", "_buf")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def frames(self, limit: int) -> list[bytes]:
        """Up to ``limit`` complete bodies, in order; FrameError for an oversized length."""
        buf, out, pos = self._buf, [], 0
        end = len(buf)
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
            del buf[:pos]
        return out

    @property
    def ready(self) -> bool:
        """A complete frame (or an oversized header) waits in the buffer."""
        if len(self._buf) < HEADER.size:
            return False
        (size,) = HEADER.unpack_from(self._buf)
        return size > self.max_frame or len(self._buf) - HEADER.size >= size

    def clear(self) -> None:
        self._buf.clear()


def frame(body: bytes) -> bytes:
    """``body`` with its length header."""
    return HEADER.pack(len(body)) + body


class Stream:
    """One socket's frames both ways (non-blocking); ``sock`` is None while disconnected."""

    def __init__(self, sock: socket.socket | None, max_frame: int, hwm: int) -> None:
        self.sock = sock
        self.connected = sock is not None  # False while a connect is under way
        self.broken = False  # sending failed (the peer stopped reading): nothing more is sent
        self.events = 0  # what its channel polls it for
        self.reader = FrameReader(max_frame)
        self.hwm = hwm
        self._out: collections.deque[bytes] = collections.deque()
        self._sent = 0  # bytes of _out[0] the kernel already took

    @property
    def fd(self) -> int:
        return -1 if self.sock is None else self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    @property
    def num_queued(self) -> int:
        return len(self._out)

    def queue(self, data: bytes) -> None:
        """Send one frame (header included), or keep it for ``flush``. QueueFull at ``hwm``
        waiting frames; OSError when the connection broke (the frame is kept)."""
        if len(self._out) >= self.hwm:
            raise QueueFull
        self._out.append(data)
        if len(self._out) == 1 and self.connected:
            self.flush()

    def flush(self) -> None:
        """Send what waits until the kernel takes no more (OSError: the connection broke)."""
        out, sock = self._out, self.sock
        while out and self.connected:
            first = out[0]
            try:
                sent = sock.send(memoryview(first)[self._sent :] if self._sent else first, _NOSIGNAL)
            except BlockingIOError:
                return
            self._sent += sent
            if self._sent < len(first):
                return
            out.popleft()
            self._sent = 0

    def read(self) -> bool:
        """Receive what the socket holds (at most READ_PER_CALL bytes); False at end of stream."""
        total = 0
        while total < READ_PER_CALL:
            try:
                data = self.sock.recv(READ_CHUNK)
            except BlockingIOError:
                return True
            if not data:
                return False
            self.reader.feed(data)
            total += len(data)
            if len(data) < READ_CHUNK:  # the socket is (very likely) drained: poll says if not
                return True
        return True

    def reset(self, sock: socket.socket | None, connected: bool = True) -> None:
        """A new connection (or none): partial input is dropped, the frame being sent starts over."""
        self.sock = sock
        self.connected = sock is not None and connected
        self.broken = False
        self.events = 0
        self.reader.clear()
        self._sent = 0

    def drop_output(self) -> None:
        """Forget what waits to be sent (a connection that cannot take it any more)."""
        self._out.clear()
        self._sent = 0

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.reset(None)
