"""A bare client of a control channel, for tests that play a hostile or broken peer: a plain
TCP socket that sends whatever bytes it is given (framed, or not) and reads frames back,
checking nothing. The server's first frame is a HelloChallenge; unless ``hello=False`` it is
read and answered with a Hello (signed with ``secret`` when given): a connection's first
frame must be one. ``challenge()`` reads it when ``hello=False``."""

from __future__ import annotations

import select
import socket
import time

import msgspec

from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel.envelope import MAC_BYTES, SIGNED, HelloChallenge
from kvbridge.transfer.channel.frames import HEADER, frame


class RawControl:
    def __init__(self, endpoint: str, timeout: float = 5.0, *, secret: bytes | None = None, hello: bool = True,
                 name: str = "raw") -> None:
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._buf = b""
        self.secret = secret
        self.nonce = b""
        if hello:
            self.sock.sendall(frame(wire.codec(secret).hello(name, self.challenge(timeout))))

    def challenge(self, timeout: float = 5.0) -> bytes:
        """The nonce of the server's HelloChallenge (read once; b"" when none came)."""
        if not self.nonce:
            body = self.recv(timeout)
            if body is not None:  # (its MAC is not checked: a bare client checks nothing)
                signed = len(body) > 2 and body[2] == SIGNED
                self.nonce = msgspec.msgpack.decode(body[3 + MAC_BYTES * signed :], type=HelloChallenge).nonce
        return self.nonce

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
