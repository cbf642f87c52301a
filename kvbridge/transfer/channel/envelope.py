"""One codec for every channel: typed messages (``msgspec.Struct``s, a tagged union) over
MessagePack, inside one envelope that carries the channel's version and, when a cluster
secret is set, a MAC of the rest: keyed BLAKE3 under a key derived from the secret per channel.

    envelope = version (2 bytes, big-endian) | kind (1 byte) | [mac (32 bytes)] | body
               kind 0: plain; kind 2: mac = BLAKE3(key = K(channel), version | kind | body)
               K(channel) = BLAKE3 derive_key(context "kvbridge 2026-12-07 <channel> channel MAC", secret)
               (kind 1, HMAC-SHA256(secret, version | kind | body), is what wire 16 and before sealed
               with: refused by name, it is never checked)
    body     = msgpack map {"t": <tag>, <field>: <value>, ...}      (one Struct of the union)

Why BLAKE3: a staged chunk's SlotRequest carries its scatter list (hundreds of KB at the GPU's
256 MiB slots), sealed on prefill's loop and checked on decode's; keyed BLAKE3 (the ``blake3``
package, the Rust crate's binding that vLLM pins too) is a MAC at the 128-bit security level
HMAC-SHA256 gave, and costs about a third of its time on such a frame (docs/performance.md,
round 25). The per-channel key keeps a frame sealed for one channel (ops, say) from verifying on
another.

``Codec.decode`` checks, in order, and raises ProtocolError naming the first problem:
with a secret, the length against ``auth_limit(max_bytes)`` and the MAC (constant-time
compare), then the size limit; without one, the size limit, and a MAC'd envelope is
refused. Then the version, then the body through one ``msgspec.msgpack.Decoder`` of the
channel's union: unknown tag, missing field, wrong type, value out of range, each named
(``field``). Unknown extra fields are ignored, and a field with a default may be missing,
so a peer may add optional fields without a version bump.

A connection opens with a challenge, so that a Hello opens only the connection it was made for:

    server ── HelloChallenge(channel, nonce: CHALLENGE_BYTES fresh random bytes) ──▶ client
    server ◀── Hello(channel, challenge=nonce, peer)   (MAC over all of it) ──────── client

The server keeps the nonce it sent and accepts a Hello only when its MAC is good and it
carries that nonce (constant-time compare): a Hello captured from another connection
carries another nonce, and without the secret nobody can make one that carries this one.
The secret never travels; only MACs do. Both frames are in this same envelope, at most
``HELLO_MAX_BYTES``; the transport reads nothing larger from a connection before its Hello.
Messages after the Hello carry the cluster secret's MAC, which authenticates them but does not
bind them to a connection: only a connection that authenticated can carry them.
"""

from __future__ import annotations

import hmac
import re
import secrets
import struct
from typing import Annotated, Any, Generic, TypeVar, Union

import blake3
import msgspec

from kvbridge.errors import ConfigError, ProtocolError

__all__ = ["CHALLENGE_BYTES", "HELLO_MAX_BYTES", "Codec", "Hello", "HelloChallenge", "auth_limit", "check_secret"]

HEADER = struct.Struct(">HB")
MAC_BYTES = 32  # BLAKE3's default output
PLAIN, HMAC_SHA256, SIGNED = 0, 1, 2  # HMAC_SHA256: wire 16 and before, refused by name
MAC_CONTEXT = "kvbridge 2026-12-07 {channel} channel MAC"  # BLAKE3 key derivation's context, per channel
HELLO_MAX_BYTES = 4096  # a connection's first frame: what an unauthenticated peer can make a server buffer
CHALLENGE_BYTES = 16  # a server's challenge nonce (128 bits: never drawn twice)

M = TypeVar("M")
Nonce = Annotated[bytes, msgspec.Meta(min_length=CHALLENGE_BYTES, max_length=CHALLENGE_BYTES)]
ChannelName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]


class HelloChallenge(msgspec.Struct, frozen=True, tag="hello_challenge", tag_field="t"):
    """A server's first frame on every connection: the nonce the client's Hello must carry."""

    channel: ChannelName
    nonce: Nonce


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="t"):
    """A client's first frame: ``channel`` names what it connects to ("control", "ops", "ipc"),
    ``challenge`` is the nonce of this connection's HelloChallenge, ``peer`` who connects (a
    rank's name or registration id)."""

    channel: ChannelName
    challenge: Nonce
    peer: Annotated[str, msgspec.Meta(max_length=256)] = ""


def check_secret(secret: bytes | None) -> bytes | None:
    if secret is not None and (not isinstance(secret, bytes) or not secret):
        raise ConfigError("the channel secret must be non-empty bytes or None", field="secret")
    return secret


def mac_key(secret: bytes, channel: str) -> bytes:
    """The 32-byte BLAKE3 key that seals ``channel``'s frames: derived from the cluster secret with
    the channel's name in the context (a frame MAC'd for one channel does not verify on another)."""
    return blake3.blake3(secret, derive_key_context=MAC_CONTEXT.format(channel=channel)).digest()


def auth_limit(max_bytes: int) -> int:
    """The largest frame read far enough to authenticate (a transport's frame limit too)."""
    return 2 * max_bytes + 1024


class _Peek(msgspec.Struct):
    t: Any = None
    room: Any = None


_PEEK = msgspec.msgpack.Decoder(_Peek)
_ROOM_LIMIT = 2**63
_AT = re.compile(r" - at `\$\.([A-Za-z_][A-Za-z0-9_.]*)([^`]*)`$")  # field, then any [index] / .key
_MISSING = re.compile(r"missing required field `([A-Za-z_][A-Za-z0-9_]*)`")
_FIELD_IN = re.compile(r"^field '([A-Za-z_][A-Za-z0-9_]*)'")


class Codec(Generic[M]):
    """Seal and open one channel's messages: ``types`` is its union (tagged Structs)."""

    def __init__(self, name: str, version: int, types: tuple[type, ...], *, secret: bytes | None = None,
                 max_bytes: int) -> None:
        self.name = name
        self.version = version
        self.secret = check_secret(secret)
        self.max_bytes = max_bytes
        self.types = types
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Union[types])  # type: ignore[valid-type]
        self._hello = msgspec.msgpack.Decoder(Hello)
        self._challenge = msgspec.msgpack.Decoder(HelloChallenge)
        self._plain = HEADER.pack(version, PLAIN)
        self._signed = HEADER.pack(version, SIGNED)
        self._key = None if self.secret is None else mac_key(self.secret, name)

    def with_secret(self, secret: bytes | None) -> Codec[M]:
        return Codec(self.name, self.version, self.types, secret=secret, max_bytes=self.max_bytes)

    def with_version(self, version: int) -> Codec[M]:
        """The same codec speaking another version (tests of a version skew)."""
        return Codec(self.name, version, self.types, secret=self.secret, max_bytes=self.max_bytes)

    # ---- sealing ----------------------------------------------------------------------------
    def encode(self, msg: M, *, max_bytes: int | None = None) -> bytes:
        if type(msg) not in self.types and type(msg) not in (Hello, HelloChallenge):
            raise ProtocolError(f"cannot encode a {type(msg).__name__}: not a {self.name} message")
        try:
            body = self._encoder.encode(msg)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}", room=getattr(msg, "room", None)) from None
        data = self.seal(body)
        limit = self.max_bytes if max_bytes is None else max_bytes
        if len(data) > limit:
            raise ProtocolError(f"encoded {_tag(msg)} is {len(data)} bytes, over the {limit}-byte limit",
                                room=getattr(msg, "room", None), field="size")
        return data

    def seal(self, body: bytes) -> bytes:
        if self.secret is None:
            return self._plain + body
        return self._signed + blake3.blake3(self._signed, key=self._key).update(body).digest() + body

    def challenge(self) -> tuple[bytes, bytes]:
        """A fresh ``(nonce, sealed HelloChallenge)`` for a new connection (server side)."""
        nonce = secrets.token_bytes(CHALLENGE_BYTES)
        return nonce, self.seal(self._encoder.encode(HelloChallenge(channel=self.name, nonce=nonce)))

    def hello(self, peer: str, challenge: bytes) -> bytes:
        """The sealed Hello answering the connection's ``challenge`` nonce (client side)."""
        return self.seal(self._encoder.encode(Hello(channel=self.name, challenge=challenge, peer=peer)))

    # ---- opening ----------------------------------------------------------------------------
    def unseal(self, data: bytes | memoryview) -> memoryview:
        """The body of an envelope: ``field="mac"`` means not authenticated; ``"size"`` over the
        limit (and, with a secret, authentic: the MAC is checked first, so a holder of the
        secret learns why its message was refused); ``"v"`` another version."""
        view = memoryview(data)
        size = len(view)
        if self.secret is None:
            if size > self.max_bytes:
                raise self._too_big(size)
            if size < HEADER.size:
                raise ProtocolError(f"message of {size} bytes is shorter than the {HEADER.size}-byte envelope header",
                                    field="v")
            version, kind = HEADER.unpack_from(view)
            if kind in (SIGNED, HMAC_SHA256):
                raise ProtocolError("message carries a MAC but no secret is configured here", field="mac")
            body = view[HEADER.size :]
        else:
            if size > auth_limit(self.max_bytes):
                raise ProtocolError(f"message of {size} bytes is too large to authenticate", field="mac")
            if size >= HEADER.size and view[2] == HMAC_SHA256:
                raise ProtocolError(f"message is sealed with HMAC-SHA256, as kvbridge sealed its frames before control "
                                    f"wire 17 ({self.name} channel version {HEADER.unpack_from(view)[0]} in its "
                                    f"header, {self.version} here); this side checks keyed BLAKE3: run one kvbridge "
                                    "version on both sides", field="mac")
            if size < HEADER.size + MAC_BYTES or view[2] != SIGNED:
                raise ProtocolError("missing MAC: message is not an authenticated envelope", field="mac")
            mac = blake3.blake3(view[: HEADER.size], key=self._key).update(view[HEADER.size + MAC_BYTES :])
            if not hmac.compare_digest(mac.digest(), view[HEADER.size : HEADER.size + MAC_BYTES]):
                raise ProtocolError("bad MAC: message not signed with this cluster's secret", field="mac")
            if size > self.max_bytes:
                raise self._too_big(size)
            version, _ = HEADER.unpack_from(view)
            body = view[HEADER.size + MAC_BYTES :]
        if version != self.version:
            raise ProtocolError(f"unsupported wire version {version} on the {self.name} channel (this side speaks "
                                f"{self.version})", field="v")
        return body

    def _too_big(self, size: int) -> ProtocolError:
        return ProtocolError(f"message of {size} bytes is over the {self.max_bytes}-byte limit", field="size")

    def decode(self, data: bytes | memoryview) -> M:
        return self.decode_body(self.unseal(data))

    def decode_body(self, body: bytes | memoryview) -> M:
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError: first)
            raise _refusal(str(exc), body) from None
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"not msgpack: {exc}"[:300]) from None

    def open_hello(self, data: bytes | memoryview, challenge: bytes) -> Hello:
        """A connection's first frame: ProtocolError unless it is this channel's Hello answering
        ``challenge`` (the nonce this side sent on the connection)."""
        try:
            hello = self._hello.decode(self.unseal(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"first frame is not a hello: {exc}"[:300], field="hello") from None
        if hello.channel != self.name:
            raise ProtocolError(f"hello for channel {hello.channel!r:.40}, this is {self.name!r}", field="hello")
        if not hmac.compare_digest(hello.challenge, challenge):
            raise ProtocolError("hello answers another connection's challenge (replayed?)", field="challenge")
        return hello

    def open_challenge(self, data: bytes | memoryview) -> HelloChallenge:
        """A server's first frame: ProtocolError unless it is this channel's HelloChallenge."""
        try:
            challenge = self._challenge.decode(self.unseal(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"first frame from the server is not a hello challenge: {exc}"[:300],
                                field="hello") from None
        if challenge.channel != self.name:
            raise ProtocolError(f"the server speaks the {challenge.channel!r:.40} channel, not {self.name!r}",
                                field="hello")
        return challenge

    def peek(self, body: bytes | memoryview) -> tuple[str, int | None]:
        """Best-effort (type tag, room) of a body that failed to decode, for an error reply."""
        return _peek(body)


def _peek(body: bytes | memoryview) -> tuple[str, int | None]:
    try:
        head = _PEEK.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "", None
    tag, room = head.t, head.room
    valid_room = type(room) is int and 0 <= room < _ROOM_LIMIT
    return (tag[:64] if isinstance(tag, str) else ""), (room if valid_room else None)


def _refusal(detail: str, body: bytes | memoryview) -> ProtocolError:
    """msgspec's ValidationError as a ProtocolError naming the message type and the field."""
    tag, room = _peek(body)
    if detail.startswith("Expected `object`"):
        return ProtocolError(f"not a map: {detail[0].lower()}{detail[1:]}")
    if "- at `key` in `$`" in detail:
        return ProtocolError("map keys must be strings")
    missing = _MISSING.search(detail)
    if missing is not None:
        name = missing.group(1)
        if name == "t":
            return ProtocolError("missing type tag 't'", field="t", room=room)
        return ProtocolError(f"missing field '{name}' in {tag}", room=room, field=name)
    at = _AT.search(detail)
    if at is not None:
        name, what = at.group(1), detail[: at.start()]
        if name == "t":
            return ProtocolError(f"unknown message type {_shown(body)}", field="t", room=room)
        what = what[0].lower() + what[1:]
        if what.startswith("expected") and ", got " in what:
            what = "has wrong type: " + what
        elif what.startswith("expected") and ("=" in what or "length" in what):
            what = "is out of range: " + what
        elif what.startswith("invalid enum value"):
            what = "is not allowed: " + what
        else:
            what = "is invalid: " + what
        where = f" (at {at.group(2)})" if at.group(2) else ""
        return ProtocolError(f"field '{name}' of {tag} {what}{where}", room=room, field=name)
    named = _FIELD_IN.search(detail)  # a value rule (__post_init__) names its field itself
    return ProtocolError(f"{detail} ({tag})" if named else f"{tag}: {detail}", room=room,
                         field=named.group(1) if named else None)


def _shown(body: bytes | memoryview) -> str:
    try:
        tag = _PEEK.decode(body).t
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "?"
    return f"{tag!r:.60}"


def _tag(msg: Any) -> str:
    return getattr(type(msg), "__struct_config__").tag or type(msg).__name__
