"""kvbridge's one transport and one codec (control, workers' ops, the IPC engine's side channel).

    envelope.py   Codec: typed msgspec structs over MessagePack, version + MAC envelope, HelloChallenge + Hello
    frames.py     length-prefixed frames over one non-blocking socket (FrameReader, Stream)
    transport.py  what the two ends over TCP / Unix sockets share: Channel, Wakeup, Limits (what a connection may cost)
    server.py     the server end (Server: pending connections, Hello, peers within Limits)
    clients.py    the client end (Clients: one reconnecting Client per endpoint)
    wire.py       the control messages (TransferRequest ... ErrorReply), pack_pages/unpack_pages
    control.py    ControlServer (prefill end) and PeerSet (decode end)
"""

from kvbridge.transfer.channel.control import ControlClient, ControlServer, PeerSet
from kvbridge.transfer.channel.envelope import Codec, Hello
from kvbridge.transfer.channel.clients import Clients
from kvbridge.transfer.channel.server import Server
from kvbridge.transfer.channel.transport import ChannelStats, Limits, Received, Wakeup

__all__ = ["ChannelStats", "Clients", "Codec", "ControlClient", "ControlServer", "Hello", "Limits", "PeerSet",
           "Received", "Server", "Wakeup"]
