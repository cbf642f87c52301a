"""Control-channel messages: one frozen dataclass per message, one msgpack codec.

    decode -> prefill   TransferRequest  Abort  Ping
    prefill -> decode   PagesDone  AbortAck  Heartbeat  ErrorReply

A write's report is one PagesDone: its pages, and (``aux``) the aux row when the write
carried it (the aux row rides in the last chunk's batch), with the request's length.

On the wire (``encode``)::

    no secret:    body = msgpack map {"v": WIRE_VERSION, "t": <tag>, <field>: <value>, ...}
    with secret:  msgpack array [body (bin), HMAC-SHA256(secret, body) (bin, 32 bytes)]

``decode`` checks, in order, and raises ProtocolError naming the first problem:
with a secret, the envelope and its MAC (constant-time compare), then the size
limit - without one, the size limit, and an envelope is refused too; msgpack; a map with string keys;
version "v"; type tag "t"; every field present and of its declared type; the
few value rules below. Unknown extra fields are *ignored*, and a field with a
default (``PagesDone.aux``, ``PagesDone.num_tokens``) may be missing, so a peer may add optional
fields without a version bump; removing or retyping one needs a bump.
Page lists travel as packed little-endian int32 (``pack_pages``/``unpack_pages``).
The MAC authenticates, it does not stop replays; it is for closed clusters.
Value rules: room in [0, 2**63); other integers >= 0 except aux_slot >= -1 (no
aux row: refused by prefill, every room has one); page byte strings a multiple
of 4; status "ok" or "failed"; decode_rank_id 1 to 128 characters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgpack
import numpy as np

from kvbridge._version import WIRE_VERSION
from kvbridge.errors import ConfigError, ProtocolError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MESSAGE_TYPES",
    "WIRE_VERSION",
    "Abort",
    "AbortAck",
    "ErrorReply",
    "Heartbeat",
    "Message",
    "PagesDone",
    "Ping",
    "TransferRequest",
    "decode",
    "decode_body",
    "encode",
    "pack_pages",
    "peek",
    "unpack_pages",
    "unseal",
    "auth_limit",
]

MAX_MESSAGE_BYTES = 4 << 20
STATUSES = ("ok", "failed")
_ROOM_LIMIT = 2**63
_MAC_BYTES = hashlib.sha256().digest_size


@dataclass(frozen=True)
class _Message:
    TAG: ClassVar[str] = ""

    def __post_init__(self) -> None:
        # every message is checked where it is built and where it is decoded, by a function
        # generated once per class from its type hints (_compile_check): no per-field dispatch
        _FIELD_CHECKS[type(self)](self)
        self._check()

    def _check(self) -> None:
        """Value rules beyond types; overridden per message."""


# ---- decode -> prefill ------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferRequest(_Message):
    """Write the request's KV into my pages. ``decode_rank_id``: my registration at the bootstrap
    daemon, where the prefill rank reads (once) the buffers, aux regions and session it may write
    into (hard rule 5); ``page_ids``: logical page ``first_page + i`` -> my physical page
    ``page_ids[i]`` (LE int32, shared by every pool; pages below ``first_page`` I already hold);
    ``deadline_ms``: how long I wait, from sending; ``num_tokens``: the request's valid tokens, or
    0 when I know only its pages (``first_page`` + the page ids): the prefill rank then knows the
    length from its engine, at the latest with the last chunk, and says it in the ``PagesDone`` that reports the aux row."""

    TAG: ClassVar[str] = "transfer_request"
    room: int
    decode_rank: str
    decode_rank_id: str
    page_ids: bytes
    first_page: int
    pools: list[str]
    aux_slot: int
    num_tokens: int
    deadline_ms: int
    want_digest: bool
    fingerprint: str
    num_decode_ranks: int  # the decode TP size; prefill derives how many decode ranks draw from it (TP route)

    def _check(self) -> None:
        _check_pages(self, "page_ids")
        if not self.decode_rank_id or len(self.decode_rank_id) > 128:
            raise ProtocolError(f"field 'decode_rank_id' of {self.TAG} must be 1 to 128 characters",
                                room=self.room, field="decode_rank_id")


@dataclass(frozen=True)
class Abort(_Message):
    TAG: ClassVar[str] = "abort"
    room: int
    decode_rank: str
    reason: str


@dataclass(frozen=True)
class Ping(_Message):
    TAG: ClassVar[str] = "ping"
    decode_rank: str
    seq: int


# ---- prefill -> decode ------------------------------------------------------------------------
@dataclass(frozen=True)
class PagesDone(_Message):
    """``logical_pages`` (LE int32) of ``pools`` were written by ``cp_rank``, or failed. ``aux``:
    the same write carried the room's aux row (the last chunk's batch, or the row alone), and
    ``num_tokens`` is then the request's valid tokens as the prefill engine knows them by its
    last chunk (0: not said). One report per write: a room's last report needs no second
    message for its aux row (wire v3; v2 sent an AuxDone after it)."""

    TAG: ClassVar[str] = "pages_done"
    room: int
    cp_rank: int
    status: str
    reason: str
    pools: list[str]
    logical_pages: bytes
    digests: bytes | None
    aux: bool = False
    num_tokens: int = 0

    def _check(self) -> None:
        _check_status(self)
        _check_pages(self, "logical_pages")


@dataclass(frozen=True)
class AbortAck(_Message):
    """No write of ``room`` from ``cp_rank`` is in flight any more, nor will be posted."""

    TAG: ClassVar[str] = "abort_ack"
    room: int
    cp_rank: int


@dataclass(frozen=True)
class Heartbeat(_Message):
    TAG: ClassVar[str] = "heartbeat"
    cp_rank: int
    seq: int


@dataclass(frozen=True)
class ErrorReply(_Message):
    """The message of type ``ref_type`` (room ``room`` when known) was refused because ``reason``."""

    TAG: ClassVar[str] = "error_reply"
    ref_type: str
    room: int | None
    reason: str


Message = Union[TransferRequest, Abort, Ping, PagesDone, AbortAck, Heartbeat, ErrorReply]

# The one table from type tag to class.
MESSAGE_TYPES: dict[str, type[_Message]] = {
    cls.TAG: cls for cls in (TransferRequest, Abort, Ping, PagesDone, AbortAck, Heartbeat, ErrorReply)
}
_HINTS = {cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in MESSAGE_TYPES.values()}
_DEFAULTS = {cls: {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
             for cls in MESSAGE_TYPES.values()}


def _type_test(tp: Any, v: str) -> str:
    """A Python expression, true when ``v`` is of type ``tp`` (bools are not ints); exact
    classes are tested first, so the common case costs one comparison."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return "(" + " or ".join(_type_test(arg, v) for arg in typing.get_args(tp)) + ")"
    if origin is list:
        (item,) = typing.get_args(tp) or (object,)
        return f"(isinstance({v}, list) and all({_type_test(item, '_x')} for _x in {v}))"
    if tp is type(None):
        return f"{v} is None"
    if tp is int:
        return f"({v}.__class__ is int or (isinstance({v}, int) and not isinstance({v}, bool)))"
    return f"({v}.__class__ is {tp.__name__} or isinstance({v}, {tp.__name__}))"


def _compile_check(cls: type) -> Callable[[Any], None]:
    """The field checks of ``cls``: each field of its declared type, integers in their range
    ([0, 2**63) for ``room``, [-1, 2**64) for ``aux_slot``, [0, 2**64) otherwise)."""
    lines = ["def check(msg):"]
    for name in _FIELDS[cls]:
        tp = _HINTS[cls][name]
        low, high = -1 if name == "aux_slot" else 0, _ROOM_LIMIT if name == "room" else 2**64
        lines += [f"    v = msg.{name}",
                  f"    if not {_type_test(tp, 'v')}:",
                  f"        _wrong_type(msg, {name!r}, v)",
                  f"    if v.__class__ is int and not {low} <= v < {high}:",
                  f"        _out_of_range(msg, {name!r}, v)"]
        if int in _ints_of(tp):  # an int subclass (not bool) is range-checked too
            lines += [f"    elif isinstance(v, int) and not isinstance(v, bool) and not {low} <= v < {high}:",
                      f"        _out_of_range(msg, {name!r}, v)"]
    scope = {"_wrong_type": _wrong_type, "_out_of_range": _out_of_range, "bytes": bytes, "str": str, "bool": bool,
             "list": list}
    exec("\n".join(lines), scope)  # noqa: S102 - source built above from the message classes' own hints
    return scope["check"]


def _ints_of(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)


def _wrong_type(msg: Any, name: str, value: Any) -> None:
    tp = _HINTS[type(msg)][name]
    raise ProtocolError(f"field '{name}' of {msg.TAG} has wrong type: expected {_name(tp)}, got {type(value).__name__}",
                        field=name)


def _out_of_range(msg: Any, name: str, value: Any) -> None:
    raise ProtocolError(f"field '{name}' of {msg.TAG} is out of range: {value}", field=name)


_FIELD_CHECKS = {cls: _compile_check(cls) for cls in MESSAGE_TYPES.values()}


# ---- codec ------------------------------------------------------------------------------------
def encode(msg: Message, secret: bytes | None = None, *, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TAG", "")) is not cls:
        raise ProtocolError(f"cannot encode a {cls.__name__}: not a wire message")
    body_map: dict[str, Any] = {"v": WIRE_VERSION, "t": cls.TAG, **msg.__dict__}  # (exactly the fields: frozen)
    try:
        body = msgpack.packb(body_map, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot encode {cls.TAG}: {exc}", room=getattr(msg, "room", None)) from exc
    data = body if secret is None else msgpack.packb([body, _mac(secret, body)], use_bin_type=True)
    if len(data) > max_bytes:
        raise ProtocolError(
            f"encoded {cls.TAG} is {len(data)} bytes, over the {max_bytes}-byte limit",
            room=getattr(msg, "room", None),
            field="size",
        )
    return data


def decode(data: bytes, secret: bytes | None = None, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    return decode_body(unseal(data, secret, max_bytes=max_bytes))


def unseal(data: bytes, secret: bytes | None = None, *, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Size check and (with a secret) the HMAC envelope; returns the body.

    Errors name what failed: ``field="mac"`` means *not authenticated* (no envelope, a
    wrong MAC, or with a secret a message too large to authenticate at all, over
    ``auth_limit(max_bytes)``); ``field="size"`` means over ``max_bytes`` and, with a
    secret, authentic: the MAC is checked before the size, so a sender who holds the
    secret learns why its message was refused (the channel answers it)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}", field="size")
    too_big = ProtocolError(f"message of {len(data)} bytes is over the {max_bytes}-byte limit", field="size")
    if secret is None:
        if len(data) > max_bytes:
            raise too_big
        return bytes(data)
    if len(data) > auth_limit(max_bytes):
        raise ProtocolError(f"message of {len(data)} bytes is too large to authenticate", field="mac")
    try:
        envelope = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception:  # any malformed input: unauthenticated
        envelope = None
    if not (
        isinstance(envelope, list)
        and len(envelope) == 2
        and isinstance(envelope[0], bytes)
        and isinstance(envelope[1], bytes)
    ):
        raise ProtocolError("missing HMAC: message is not an authenticated [body, mac] envelope", field="mac")
    body, mac = envelope
    if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, _mac(secret, body)):
        raise ProtocolError("bad HMAC: message not signed with this cluster's secret", field="mac")
    if len(data) > max_bytes:
        raise too_big
    return body


def auth_limit(max_bytes: int) -> int:
    """The largest message read far enough to authenticate (the channel's frame limit too)."""
    return 2 * max_bytes + 1024


def decode_body(body: bytes) -> Message:
    """Parse an (authenticated or unauthenticated) body into its message class."""
    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not msgpack: {type(exc).__name__}: {exc or 'invalid bytes'}"[:300]) from None
    if not isinstance(obj, dict):
        if isinstance(obj, list) and len(obj) == 2 and all(isinstance(x, bytes) for x in obj):
            raise ProtocolError("message carries an HMAC envelope but no secret is configured here", field="mac")
        raise ProtocolError(f"not a map: got a msgpack {type(obj).__name__}")
    for key in obj:
        if key.__class__ is not str and not isinstance(key, str):
            raise ProtocolError(f"map keys must be strings, got {key!r:.40}")
    if "v" not in obj:
        raise ProtocolError("missing version field 'v'", field="v")
    if obj["v"] != WIRE_VERSION or isinstance(obj["v"], bool):
        raise ProtocolError(f"unsupported wire version {obj['v']!r:.40} (this side speaks {WIRE_VERSION})", field="v")
    if "t" not in obj:
        raise ProtocolError("missing type tag 't'", field="t")
    cls = MESSAGE_TYPES.get(obj["t"]) if isinstance(obj["t"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {obj['t']!r:.60}", field="t")
    room = obj.get("room") if isinstance(obj.get("room"), int) else None
    fields = dict(_DEFAULTS[cls])
    for name in _FIELDS[cls]:
        if name in obj:
            fields[name] = obj[name]
        elif name not in fields:
            raise ProtocolError(f"missing field '{name}' in {cls.TAG}", room=room, field=name)
    msg = object.__new__(cls)  # the fields as decoded, then the checks __post_init__ runs
    msg.__dict__.update(fields)
    try:
        _FIELD_CHECKS[cls](msg)
        msg._check()
    except ProtocolError as exc:
        raise ProtocolError(exc.reason, room=room, field=exc.field) from None
    return msg


def peek(body: bytes) -> tuple[str, int | None]:
    """Best-effort (type tag, room) of a body that failed to decode, for an ErrorReply."""
    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False)
    except Exception:  # unreadable: nothing to report
        return "", None
    if not isinstance(obj, dict):
        return "", None
    tag, room = obj.get("t"), obj.get("room")
    valid_room = isinstance(room, int) and not isinstance(room, bool) and 0 <= room < _ROOM_LIMIT
    return (tag[:64] if isinstance(tag, str) else ""), (room if valid_room else None)


# ---- pages ------------------------------------------------------------------------------------
def pack_pages(pages: np.ndarray) -> bytes:
    """1-D integer page numbers -> packed little-endian int32."""
    arr = np.asarray(pages)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ProtocolError(f"pages must be a 1-D integer array, got {arr.dtype} of shape {arr.shape}", field="pages")
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
        raise ProtocolError(f"page numbers must fit int32, got [{int(arr.min())}, {int(arr.max())}]", field="pages")
    return arr.astype("<i4").tobytes()


def unpack_pages(data: bytes) -> np.ndarray:
    """Packed little-endian int32 -> a fresh (writable) int32 array."""
    if len(data) % 4:
        raise ProtocolError(f"packed pages must be a multiple of 4 bytes, got {len(data)}", field="pages")
    return np.frombuffer(data, dtype="<i4").astype(np.int32)


# ---- helpers ----------------------------------------------------------------------------------
def _mac(secret: bytes, body: bytes) -> bytes:
    if not isinstance(secret, bytes) or not secret:
        raise ConfigError("the control-channel secret must be non-empty bytes", field="secret")
    return hmac.new(secret, body, hashlib.sha256).digest()


def _check_pages(msg: _Message, name: str) -> None:
    size = len(getattr(msg, name))
    if size % 4:
        raise ProtocolError(
            f"field '{name}' of {msg.TAG} must be packed int32 (a multiple of 4 bytes), got {size} bytes",
            room=getattr(msg, "room", None),
            field=name,
        )


def _check_status(msg: Any) -> None:
    if msg.status not in STATUSES:
        raise ProtocolError(
            f"field 'status' of {msg.TAG} must be one of {STATUSES}, got {msg.status!r:.40}", room=msg.room, field="status"
        )


def _name(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{_name(typing.get_args(tp)[0])}]"
    return "None" if tp is type(None) else tp.__name__
