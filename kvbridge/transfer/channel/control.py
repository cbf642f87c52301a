"""The control channel's two ends: the transport with the control codec (``wire.py``).

    decode rank                                      prefill rank
    PeerSet ── ControlClient (connects) ─────────▶ ControlServer (listens on host:port)
            ◀──────────────────── replies go back on the connection that asked

A malformed message gets an ErrorReply naming the problem (its type tag and room when they
can be read); see ``transport.py`` for everything else.
"""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.errors import ProtocolError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel.envelope import Hello, check_secret
from kvbridge.transfer.channel.clients import Client, Clients
from kvbridge.transfer.channel.server import Server
from kvbridge.transfer.channel.transport import DEFAULT_HWM, MAX_PEERS, Limits
from kvbridge.transfer.channel.wire import MAX_MESSAGE_BYTES, ErrorReply, Message

ControlClient = Client


class ControlServer(Server):
    """Listens on ``tcp://host:port`` (port 0: a free one); a peer is its connection's id (bytes)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None,
                 max_bytes: int = MAX_MESSAGE_BYTES, hwm: int = DEFAULT_HWM, limits: Limits | None = None,
                 vouch: Callable[[Hello], bool] | None = None, protected: Callable[[bytes], bool] | None = None) -> None:
        bracketed = f"[{host}]" if ":" in host else host
        super().__init__(wire.codec(check_secret(secret), max_bytes), f"tcp://{bracketed}:{port}", hwm=hwm,
                         limits=limits, vouch=vouch, protected=protected)

    def send(self, peer: bytes, msg: Message) -> None:
        self.send_frame(peer, wire.encode(msg, self.secret, max_bytes=self.max_bytes))

    def _refusal(self, err: ProtocolError, body: bytes) -> ErrorReply:
        ref_type, room = self.codec.peek(body) if body else ("", None)
        return ErrorReply(ref_type=ref_type, room=room, reason=str(err)[:1000])


class PeerSet(Clients):
    """One ControlClient per prefill endpoint; replies come back as ``(endpoint, message)``.
    ``name``: this rank, said in the Hello of every connection."""

    def __init__(self, *, secret: bytes | None = None, max_bytes: int = MAX_MESSAGE_BYTES, hwm: int = DEFAULT_HWM,
                 max_peers: int = MAX_PEERS, name: str = "") -> None:
        super().__init__(wire.codec(check_secret(secret), max_bytes), name=name, hwm=hwm, max_peers=max_peers)

    def encode(self, msg: Message) -> bytes:
        """``msg`` sealed for this channel (``wire.encode``): ``send_frame`` sends it to as many peers as need it."""
        return wire.encode(msg, self.secret, max_bytes=self.max_bytes)
