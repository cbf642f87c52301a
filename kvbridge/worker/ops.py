"""The ops channel: how a router, the demo, the bench or a test tells a worker what to run.

kvbridge's one transport and codec (``kvbridge.transfer.channel``): the worker is a Server,
a client one Clients connection; every message is an ``OpsFrame`` (request id + one typed op
or reply) in the envelope (version OPS_VERSION, a MAC under the cluster secret when set):

    client -> worker                          worker -> client (same id)
    Prefill(room, num_tokens, chunk_tokens)   RoomResult  when the room succeeded or failed
      [+ prompt, batch_id, batch_size: model mode]
    Decode(room, num_tokens, prefill_instance) RoomResult
      [+ max_new_tokens: model mode]
    Stats()                                   StatsReply
    Shutdown()                                Ack         then the worker drains and exits
    anything malformed / refused              OpError(reason)  (id -1 when it could not be read)

Unknown fields are refused (a typo in a router's op is an error, not a default). A connection
that does not open with a valid Hello is closed; a message that does not authenticate is
dropped. Replies arrive in completion order, not request order: a client matches them by id.
"""

from __future__ import annotations

import itertools
import time
from typing import Annotated, Any, Union

import msgspec

from kvbridge.errors import ConfigError, PeerLost, ProtocolError, TransferTimeout
from kvbridge.transfer.channel import Clients, Codec, Limits, Server

OPS_VERSION = 3  # 3: the Hello answers the server's challenge (transfer/channel/envelope.py)
MAX_OP_BYTES = 1 << 20

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Room = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _Op(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    pass


class Prefill(_Op, frozen=True, tag="prefill"):
    room: _Room
    num_tokens: int
    chunk_tokens: _Count = 0  # 0: one chunk
    # model mode: the prompt's token ids; ops with the same batch id run as one batch once
    # batch_size of them arrived (bs > 1: requests share the pools, one writer call per step)
    prompt: list[int] = []
    batch_id: _Count = 0
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    binding: bytes = b""  # the request's digest: the room is opened bound to it (kvbridge.room_binding)


class Decode(_Op, frozen=True, tag="decode"):
    room: _Room
    num_tokens: int
    prefill_instance: str
    prefill_dp_rank: _Count = 0
    max_new_tokens: _Count = 0  # model mode: greedy steps after the first token (TP rank 0 generates)
    binding: bytes = b""  # the digest presented with the claim (a room bound to another refuses it)


class Stats(_Op, frozen=True, tag="stats"):
    pass


class Shutdown(_Op, frozen=True, tag="shutdown"):
    pass


class RoomResult(_Op, frozen=True, tag="room_result"):
    room: int
    ok: bool
    reason: str = ""
    rank: str = ""
    num_bytes: int = 0  # bytes moved (prefill: posted; decode: received)
    bytes_verified: int = 0
    num_slices: int = 0
    timings: dict[str, float] = {}  # seconds per phase


class StatsReply(_Op, frozen=True, tag="stats_reply"):
    stats: dict[str, Any]


class Ack(_Op, frozen=True, tag="ack"):
    pass


class OpError(_Op, frozen=True, tag="error"):
    reason: str


Op = Union[Prefill, Decode, Stats, Shutdown]
Reply = Union[RoomResult, StatsReply, Ack, OpError]
OPS = (Prefill, Decode, Stats, Shutdown)


class OpsFrame(msgspec.Struct, frozen=True, tag="ops", tag_field="t", forbid_unknown_fields=True):
    """One message on the ops channel: the request id and the op or reply."""

    id: int
    msg: Union[Prefill, Decode, Stats, Shutdown, RoomResult, StatsReply, Ack, OpError]


def codec(secret: bytes | None = None) -> Codec[OpsFrame]:
    return Codec("ops", OPS_VERSION, (OpsFrame,), secret=secret, max_bytes=MAX_OP_BYTES)


def encode(msg: Op | Reply, request_id: int, secret: bytes | None = None) -> bytes:
    return codec(secret).encode(OpsFrame(id=request_id, msg=msg))


def decode(data: bytes, secret: bytes | None = None) -> tuple[int, Op | Reply]:
    """``(request id, message)``; raises ProtocolError naming what is wrong."""
    frame = codec(secret).decode(data)
    return frame.id, frame.msg


# The ops channel's limits: its clients are operators and harnesses (a few connections), so its
# budgets are a small fraction of the control channel's (docs/security.md: the worst case of a
# worker process is the two channels' together)
OPS_LIMITS = Limits(max_connections=256, max_connections_per_address=64, frame_budget=4 << 20,
                    max_queued_bytes=8 << 20)


class OpsServer(Server):
    """Worker side; ``receive`` never raises on a bad message (it answers OpError)."""

    def __init__(self, host: str, port: int = 0, secret: bytes | None = None) -> None:
        bracketed = f"[{host}]" if ":" in host else host
        try:
            super().__init__(codec(secret), f"tcp://{bracketed}:{port}", limits=OPS_LIMITS)
        except ConfigError as exc:
            raise ConfigError(exc.reason, field="ops_port") from None  # (it names the channel and address)

    def receive(self, timeout: float) -> list[tuple[bytes, int, Op]]:
        """Ops that arrived within ``timeout`` seconds: ``(peer, request id, op)``."""
        out: list[tuple[bytes, int, Op]] = []
        for peer, frame in self.recv_ready(int(timeout * 1000)):
            if isinstance(frame, ProtocolError):
                continue  # (answered by _refusal)
            if not isinstance(frame.msg, OPS):
                try:
                    self.reply(peer, frame.id, OpError(f"{type(frame.msg).__name__} is a reply, not an op"))
                except PeerLost:
                    pass  # it sent a reply and left: nobody to tell
                continue
            out.append((peer, frame.id, frame.msg))
        return out

    def _refusal(self, err: ProtocolError, body: bytes) -> OpsFrame:
        return OpsFrame(id=-1, msg=OpError(str(err)[:1000]))

    def reply(self, peer: bytes, request_id: int, msg: Reply) -> None:
        self.send(peer, OpsFrame(id=request_id, msg=msg))


class OpsClient:
    """Client side; several ops may be in flight, matched by id. Not thread-safe: one caller."""

    _ids = itertools.count(1)

    def __init__(self, endpoint: str, secret: bytes | None = None) -> None:
        self.endpoint = endpoint
        self.secret = secret
        self._clients = Clients(codec(secret), max_peers=1)
        self._client = self._clients.get(endpoint)
        self._replies: dict[int, Reply] = {}

    def submit(self, op: Op) -> int:
        request_id = next(self._ids)
        self._client.send(OpsFrame(id=request_id, msg=op))
        return request_id

    def poll(self, timeout: float = 0.0) -> None:
        """Read whatever replies arrive within ``timeout`` seconds (ProtocolError on a bad one)."""
        for _, frame in self._clients.recv_ready(int(timeout * 1000)):
            if isinstance(frame, ProtocolError):
                raise frame
            self._replies[frame.id] = frame.msg

    def take(self, request_id: int) -> Reply | None:
        return self._replies.pop(request_id, None)

    def wait(self, request_id: int, timeout: float) -> Reply:
        deadline = time.monotonic() + timeout
        while (msg := self.take(request_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s", field="ops")
            self.poll(min(left, 0.2))
        return msg

    def call(self, op: Op, timeout: float = 30.0) -> Reply:
        return self.wait(self.submit(op), timeout)

    def close(self) -> None:
        self._clients.close()
