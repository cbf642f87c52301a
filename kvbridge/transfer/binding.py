"""A room bound to its request, and room ids a router signs.

A room id alone is a bearer capability: whoever names it could claim the KV it carries. So
the engine opens a room with a **binding**, a digest of what the room carries (the request's
token count and its prompt token ids), and a decode rank's claim (its TransferRequest) must
present the same digest, or it is refused at once, by name, before it claims the room and
with nothing written or read:

    prefill engine  sender(room).init(n, binding=room_binding(prompt_ids))     the room's binding
    decode engine   receiver(room).init(pages, slot, binding=room_binding(prompt_ids))
                      -> TransferRequest.binding                                 the claim's
    prefill rank    claim_refusal(): bound room, other digest -> ErrorReply, the room untouched

    room's binding   claim's binding    outcome
    unknown (None)   any                accepted; the first accepted claim's digest is kept and
                                        the engine's init() must agree (else RoomBindingError)
    b"" (unbound)    any                accepted (an engine that binds nothing: as before)
    digest D         D                  accepted
    digest D         other, or b""      refused: "room R is bound to another request"

A longer prompt that ends in the same block, another prompt of the same length, or a room
id taken from another request all give another digest.

Signed rooms (``sign_room`` / ``verify_room``): a router that must choose room ids (rather
than let the engine draw them from its request id) signs ``room``, an expiry and, when it
knows it, the binding, with a key shared by the cluster (HMAC-SHA256); each server checks the
signature, the expiry and the bound digest where the room is opened and where it is claimed.

Signed room ids (``signed_room_id`` / ``check_room_id``): for an engine that carries nothing
but the room id itself (SGLang's ``bootstrap_room``, an int64), the signature lives in the id:

    bit 62 ........ 41 | 40 ........ 9 | 8 ... 0
    expiry (22 bits)   | tag (32 bits) | nonce (9 bits)

``expiry``: minutes since 2026-01-01 00:00 UTC (up to 2033-12); ``tag``: the first 32 bits of
HMAC-SHA256 over (expiry, nonce) under the cluster's key; ``nonce``: the router's (random by
default; the low bits, so ``room % dp_size`` is the nonce's for a power-of-two DP size).

Pure functions: no I/O, no clock but the ``now`` passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

import numpy as np

from kvbridge.errors import RoomBindingError

__all__ = ["BINDING_BYTES", "ROOM_ID_BITS", "check_room_id", "claim_refusal", "room_binding", "sign_room",
           "signed_room_id", "verify_room"]

BINDING_BYTES = 16
_PERSON = b"kvbridge-room1"  # blake2b personalisation: a binding is no other digest of the same bytes


def room_binding(token_ids: Any, num_tokens: int | None = None) -> bytes:
    """The binding of a request: blake2b-128 over its token count and its ``token_ids``
    (int64 little-endian). ``num_tokens`` (default ``len(token_ids)``): the tokens the room
    carries, when they are a prefix of ``token_ids``. Cost: one pass over 8 bytes per token
    (a 128K-token prompt: 1 MiB hashed, about 1 ms)."""
    ids = np.asarray(token_ids, dtype="<i8").reshape(-1)
    n = ids.size if num_tokens is None else int(num_tokens)
    if not 0 < n <= ids.size:
        raise RoomBindingError(f"num_tokens {num_tokens!r} outside [1, {ids.size}] (the token ids given)",
                               field="num_tokens")
    h = hashlib.blake2b(digest_size=BINDING_BYTES, person=_PERSON)
    h.update(n.to_bytes(8, "little"))
    h.update(ids[:n].tobytes())
    return h.digest()


def claim_refusal(room_binding: bytes | None, claimed: bytes | None, claim: bytes, *, room: int,
                  rank: str, decode_rank: str) -> str | None:
    """Why a claim presenting ``claim`` may not have the room (None: it may). ``room_binding``:
    what the engine opened the room with (None: not said yet); ``claimed``: the digest of the
    claims accepted so far (None: none)."""
    expected = room_binding if room_binding is not None else claimed
    if not expected or claim == expected:
        return None
    said = "no binding" if not claim else f"binding {claim.hex()}"
    return (f"room {room} on prefill rank {rank} is bound to another request (binding {expected.hex()}): decode "
            f"rank {decode_rank} presented {said}; refused, nothing written or read")


def engine_binding_refusal(binding: bytes, claimed: bytes | None, *, room: int) -> str | None:
    """The engine's ``init(binding=)`` against the claims that came first (decode asked first)."""
    if not binding or claimed is None or claimed == binding:
        return None
    return (f"room {room} was claimed with binding {claimed.hex() or '(none)'} before the engine opened it with "
            f"{binding.hex()}: the claim is another request's")


def _signed_bytes(room: int, expires_at: int, binding: bytes) -> bytes:
    return b"kvbridge-room-sig1|" + room.to_bytes(8, "little") + expires_at.to_bytes(8, "little") + binding


def sign_room(key: bytes, room: int, expires_at: int, binding: bytes = b"") -> str:
    """A router's signature (hex) of ``room`` until ``expires_at`` (Unix seconds), bound to
    ``binding`` when the router knows it (b"": any request)."""
    if not key:
        raise RoomBindingError("an empty room key signs nothing", room=room, field="room_key")
    return hmac.new(key, _signed_bytes(room, expires_at, binding), hashlib.sha256).hexdigest()


def verify_room(key: bytes, room: int, expires_at: Any, signature: Any, *, now: float,
                binding: bytes = b"") -> None:
    """Raise RoomBindingError, naming the field, unless ``signature`` is ``key``'s over ``room``
    and ``expires_at`` (with ``binding``, or with none) and ``now`` is before the expiry."""
    if isinstance(expires_at, bool) or not isinstance(expires_at, int) or not 0 < expires_at < 1 << 63:
        raise RoomBindingError(f"room expiry {expires_at!r} is not a Unix time in seconds", room=room,
                               field="kvbridge_room_expires")
    if not isinstance(signature, str) or len(signature) != 64:
        raise RoomBindingError("room signature missing or not 64 hex digits", room=room, field="kvbridge_room_sig")
    ok = any(hmac.compare_digest(sign_room(key, room, expires_at, b), signature.lower())
             for b in ({b"", binding} if binding else {b""}))
    if not ok:
        raise RoomBindingError("room signature does not verify with this cluster's room key (forged, or signed for "
                               "another room, expiry or request)", room=room, field="kvbridge_room_sig")
    if now >= expires_at:
        raise RoomBindingError(f"room signature expired {now - expires_at:.0f}s ago", room=room,
                               field="kvbridge_room_expires")


# -- signed room ids (the signature inside the id) ----------------------------------------------

ROOM_ID_BITS = {"expiry": 22, "tag": 32, "nonce": 9}  # 63 bits: a non-negative int64
ROOM_ID_EPOCH = 1_767_225_600  # 2026-01-01 00:00:00 UTC, Unix seconds
_EXP, _TAG, _NONCE = ROOM_ID_BITS["expiry"], ROOM_ID_BITS["tag"], ROOM_ID_BITS["nonce"]


def _room_tag(key: bytes, minutes: int, nonce: int) -> int:
    msg = b"kvbridge-room-id1|" + minutes.to_bytes(4, "little") + nonce.to_bytes(4, "little")
    return int.from_bytes(hmac.new(key, msg, hashlib.sha256).digest()[: _TAG // 8], "big")


def signed_room_id(key: bytes, expires_at: float, nonce: int | None = None) -> int:
    """A room id signed with ``key`` (the cluster's room key), valid until ``expires_at`` (Unix
    seconds, rounded up to the minute). ``nonce``: 0 <= nonce < 512, random when None; two live
    rooms of one expiry minute need two nonces (a router past 512 a minute takes later minutes)."""
    if not key:
        raise RoomBindingError("an empty room key signs nothing", field="room_key")
    minutes = -int(-(float(expires_at) - ROOM_ID_EPOCH) // 60)  # ceiling
    if not 0 < minutes < 1 << _EXP:
        raise RoomBindingError(f"expiry {expires_at!r} is outside what a signed room id carries (minutes after "
                               f"2026-01-01 UTC, fewer than 2**{_EXP})", field="expires_at")
    nonce = secrets.randbelow(1 << _NONCE) if nonce is None else nonce
    if isinstance(nonce, bool) or not isinstance(nonce, int) or not 0 <= nonce < 1 << _NONCE:
        raise RoomBindingError(f"nonce {nonce!r} is not an integer in [0, {1 << _NONCE})", field="nonce")
    return (minutes << (_TAG + _NONCE)) | (_room_tag(key, minutes, nonce) << _NONCE) | nonce


def check_room_id(key: bytes, room: Any, now: float) -> None:
    """Raise RoomBindingError, naming the field, unless ``room`` is a room id ``key`` signed
    (field ``room_tag``: unsigned or forged) and ``now`` (Unix seconds) is before its expiry
    (field ``room_expiry``)."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 63:
        raise RoomBindingError(f"room id {room!r} is not a signed room id (an integer in [0, 2**63))",
                               field="room_tag")
    minutes, nonce = room >> (_TAG + _NONCE), room & ((1 << _NONCE) - 1)
    tag = (room >> _NONCE) & ((1 << _TAG) - 1)
    if not hmac.compare_digest(_room_tag(key, minutes, nonce).to_bytes(4, "big"), tag.to_bytes(4, "big")):
        raise RoomBindingError(f"room id {room} is not signed with this cluster's room key (unsigned or forged "
                               "tag)", room=room, field="room_tag")
    expiry = ROOM_ID_EPOCH + 60 * minutes
    if now >= expiry:
        raise RoomBindingError(f"signed room id {room} expired {now - expiry:.0f}s ago", room=room,
                               field="room_expiry")
