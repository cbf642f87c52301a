"""A bare client of a control channel, for tests that play a hostile or broken peer: a plain
TCP socket that sends whatever bytes it is given (framed, or not) and reads frames back,
checking nothing. It opens with a Hello (signed with ``secret`` when given) unless
``hello=False``: a connection's first frame must be one."""

from __future__ import annotations

import select
import socket
import time

from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel.frames import HEADER, frame


class RawControl:
    def __init__(self, endpoint: str, timeout: float = 5.0, *, secret: bytes | None = None, hello: bool = True,
                 name: str = "raw") -> None:
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._buf = b""
        if hello:
            self.sock.sendall(frame(wire.codec(secret).hello(name)))

    def send(self, body: bytes) -> None:
        """One frame holding ``body``."""
        self.sock.sendall(frame(body))

    def send_bytes(self, data: bytes) -> None:
        """Raw bytes, framing included (or not)."""
        self.sock.sendall(data)

    def recv(self, timeout: float) -> bytes | None:
        """The next frame's body within ``timeout`` s, or None (also at end of stream)."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self._buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buf)
                if len(self._buf) >= HEADER.size + size:
                    body, self._buf = self._buf[HEADER.size : HEADER.size + size], self._buf[HEADER.size + size :]
                    return body
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self._buf += data

    def closed_by_peer(self, timeout: float) -> bool:
        """True when the other side closed this connection within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                try:
                    if not self.sock.recv(1 << 16):
                        return True
                except ConnectionResetError:
                    return True
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
