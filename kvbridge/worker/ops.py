"""The ops channel: how a router, the demo, the bench or a test tells a worker what to run.

ZMQ ROUTER (worker) / DEALER (client), one msgpack map per message:

    {"v": OPS_VERSION, "t": <tag>, "id": <request id>, ...fields}

    client -> worker                          worker -> client (same id)
    Prefill(room, num_tokens, chunk_tokens)   RoomResult  when the room succeeded or failed
      [+ prompt, batch_id, batch_size: model mode]
    Decode(room, num_tokens, prefill_instance) RoomResult
      [+ max_new_tokens: model mode]
    Stats()                                   StatsReply
    Shutdown()                                Ack         then the worker drains and exits
    anything malformed / refused              OpError(reason)

When a secret is set, a second frame carries HMAC-SHA256 of the first; a message
without a valid one is refused. Replies arrive in completion order, not request
order: a client matches them by ``id``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from kvbridge.errors import ConfigError, ProtocolError, TransferTimeout

OPS_VERSION = 1
MAX_OP_BYTES = 1 << 20


@dataclass(frozen=True)
class Prefill:
    room: int
    num_tokens: int
    chunk_tokens: int = 0  # 0: one chunk
    # model mode: the prompt's token ids; ops with the same batch id run as one batch once
    # batch_size of them arrived (bs > 1: requests share the pools, one writer call per step)
    prompt: list = field(default_factory=list)
    batch_id: int = 0
    batch_size: int = 1


@dataclass(frozen=True)
class Decode:
    room: int
    num_tokens: int
    prefill_instance: str
    prefill_dp_rank: int = 0
    max_new_tokens: int = 0  # model mode: greedy steps after the first token (TP rank 0 generates)


@dataclass(frozen=True)
class Stats:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RoomResult:
    room: int
    ok: bool
    reason: str = ""
    rank: str = ""
    num_bytes: int = 0  # bytes moved (prefill: posted; decode: received)
    bytes_verified: int = 0
    num_slices: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase


@dataclass(frozen=True)
class StatsReply:
    stats: dict[str, Any]


@dataclass(frozen=True)
class Ack:
    pass


@dataclass(frozen=True)
class OpError:
    reason: str


Op = Prefill | Decode | Stats | Shutdown
Reply = RoomResult | StatsReply | Ack | OpError
TAGS: dict[str, type] = {
    "prefill": Prefill,
    "decode": Decode,
    "stats": Stats,
    "shutdown": Shutdown,
    "room_result": RoomResult,
    "stats_reply": StatsReply,
    "ack": Ack,
    "error": OpError,
}
TAG_OF = {cls: tag for tag, cls in TAGS.items()}


def encode(msg: Op | Reply, request_id: int, secret: bytes | None = None) -> list[bytes]:
    body = msgpack.packb({"v": OPS_VERSION, "t": TAG_OF[type(msg)], "id": request_id, **dataclasses.asdict(msg)})
    return [body, _mac(secret, body)] if secret else [body]


def decode(frames: list[bytes], secret: bytes | None = None) -> tuple[int, Op | Reply]:
    """``(request id, message)``; raises ProtocolError naming what is wrong."""
    if not frames or len(frames[0]) > MAX_OP_BYTES:
        raise ProtocolError("ops message empty or over 1 MiB", field="body")
    body = frames[0]
    if secret and (len(frames) != 2 or not hmac.compare_digest(frames[1], _mac(secret, body))):
        raise ProtocolError("ops message not authenticated (missing or wrong HMAC)", field="mac")
    try:
        data = msgpack.unpackb(body, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"ops message is not msgpack: {exc}", field="body") from None
    if not isinstance(data, dict):
        raise ProtocolError("ops message is not a map", field="body")
    if data.pop("v", None) != OPS_VERSION:
        raise ProtocolError(f"ops version must be {OPS_VERSION}", field="v")
    tag, request_id = data.pop("t", None), data.pop("id", None)
    if not isinstance(tag, str) or tag not in TAGS:
        raise ProtocolError(f"unknown ops message type {tag!r}", field="t")
    if not isinstance(request_id, int):
        raise ProtocolError("ops message needs an integer id", field="id")
    cls = TAGS[tag]
    names = {f.name for f in dataclasses.fields(cls)}
    if set(data) - names:
        raise ProtocolError(f"{tag}: unknown fields {sorted(set(data) - names)}", field=tag)
    try:
        msg = cls(**data)
    except TypeError as exc:
        raise ProtocolError(f"{tag}: {exc}", field=tag) from None
    for f in dataclasses.fields(cls):
        want = {"int": int, "str": str, "bool": bool}.get(str(f.type))
        if want is not None and not isinstance(getattr(msg, f.name), want):
            raise ProtocolError(f"{tag}.{f.name} must be {f.type}", field=f"{tag}.{f.name}")
    return request_id, msg


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


class OpsServer:
    """Worker side: a ROUTER socket; ``receive`` never raises on a bad message (it answers OpError)."""

    def __init__(self, host: str, port: int = 0, secret: bytes | None = None, ctx: zmq.Context | None = None) -> None:
        self.secret = secret
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 500)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ConfigError(f"cannot bind the ops channel to {host}:{port}: {exc}", field="ops_port") from None
        self.endpoint = f"tcp://{host}:{port}"

    def receive(self, timeout: float) -> list[tuple[bytes, int, Op]]:
        """Ops that arrived within ``timeout`` seconds: ``(peer, request id, op)``."""
        out: list[tuple[bytes, int, Op]] = []
        if not self._sock.poll(int(timeout * 1000)):
            return out
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            peer, payload = frames[0], frames[1:]
            try:
                request_id, op = decode(payload, self.secret)
                if not isinstance(op, (Prefill, Decode, Stats, Shutdown)):
                    raise ProtocolError(f"{type(op).__name__} is a reply, not an op", field="t")
            except ProtocolError as exc:
                self.reply(peer, -1, OpError(str(exc)))
                continue
            out.append((peer, request_id, op))

    def reply(self, peer: bytes, request_id: int, msg: Reply) -> None:
        self._sock.send_multipart([peer, *encode(msg, request_id, self.secret)])

    def close(self) -> None:
        self._sock.close()


class OpsClient:
    """Client side: a DEALER socket; several ops may be in flight, matched by id."""

    _ids = itertools.count(1)

    def __init__(self, endpoint: str, secret: bytes | None = None, ctx: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.secret = secret
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._replies: dict[int, Reply] = {}

    def submit(self, op: Op) -> int:
        request_id = next(self._ids)
        self._sock.send_multipart(encode(op, request_id, self.secret))
        return request_id

    def poll(self, timeout: float = 0.0) -> None:
        """Read whatever replies arrive within ``timeout`` seconds."""
        if not self._sock.poll(int(timeout * 1000)):
            return
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request_id, msg = decode(frames, self.secret)
            self._replies[request_id] = msg

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
        self._sock.close()
