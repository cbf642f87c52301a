"""Control-channel messages: one frozen ``msgspec.Struct`` per message, tagged by ``t``.

    decode -> prefill   TransferRequest  Abort  Ping  KeyProof  ChallengeEcho  SlotGrant  RoomTicket  Release
    prefill -> decode   PagesDone  AbortAck  Heartbeat  ErrorReply  KeyChallenge  Challenge  SlotRequest
                        ChunkLanded  RoomTicket

Room ownership is decided once per room, by the room's decider (the prefill rank at CP rank 0 and
pipeline stage 0 of the decode rank's TP column): it grants the first decode instance to claim the
room a ``RoomTicket`` signed with its proof key, and the decode rank hands that ticket on to the
column's other ranks, which serve the room only to the instance a ticket names
(``transfer/prefill/tickets.py``, docs/concepts.md "Room ownership").

A decode rank acts only for its own registration: every TransferRequest, Abort and Ping names
it (``decode_rank_id``), and prefill accepts one only when it equals what the connection said
in its Hello and the connection proved it is that registration and holds its memory: prefill
sends ``KeyChallenge(nonce)`` and the rank answers ``KeyProof``, a signature with the proof key
whose public half is in its registration (``transfer/ownership.py``); then prefill writes a fresh
nonce into the registration's scratch region through its transfer engine and sends
``Challenge(offset)``; the rank reads its scratch there and answers ``ChallengeEcho``.

Staged transfers (``docs/staging.md``): a TransferRequest that describes the decode rank's
staging area (``staging_slots`` > 0) lets the prefill rank stage a target. Per chunk the prefill
rank asks for a slot (SlotRequest, with the chunk's scatter list: slot offset -> page address,
length, which the decode rank checks then), the decode rank grants one when it is free (SlotGrant,
FIFO), the prefill rank writes the chunk into the slot only, and reports it (ChunkLanded); the
decode rank scatters it into its pages by the list it checked. A decode rank that keeps slots
for it (``DecodeConfig.staging_granted_slots``) grants the recipient's first chunk of the room a
slot in the request itself (``staging_granted``): that chunk is written as soon as it is gathered,
its SlotRequest sent ahead of the write on the same connection, and no SlotGrant comes for it.
The write's PagesDone follows its chunks' ChunkLanded on the same connection.

A decode instance that needs nothing of a room (a full local prefix hit, a prompt whose KV it
computes itself, a request cancelled before it loaded) says so with ``Release``: the prefill rank
ends the room at once (its blocks free now, not after ``target_timeout``). A Release acts for a
registration like an Abort, and it must present the room's binding: only the decode that could
claim the room can release it (``prefill/intake.py``).

A write's report is one PagesDone: its pages, and (``aux``) the aux row when the write
carried it (the aux row rides in the last chunk's batch), with the request's length; the
window, compressed and state units it completed (``kind_units``), and when decode wants
digests, theirs (``digests`` per page, ``kind_digests`` per unit).

They travel in ``envelope.py``'s envelope (version WIRE_VERSION, a keyed BLAKE3 MAC under the cluster secret)
and are checked by one typed decoder: types, ranges and the value rules below, each refusal
naming its field. Page lists travel as packed little-endian int32 (``pack_pages``/
``unpack_pages``). Value rules: room in [0, 2**63); other integers >= 0 except aux_slot >= -1
(no aux row: refused by prefill, every room has one); page byte strings a multiple of 4;
status "ok" or "failed"; decode_rank_id 1 to 128 characters (a Ping's may be empty: a probe
that acts for no registration, answered with a Heartbeat and nothing else); a nonce
NONCE_BYTES long. The value rules run where a
message is built too (``__post_init__``); types and ranges are checked where it is decoded.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

import msgspec
import numpy as np

from kvbridge._version import WIRE_VERSION
from kvbridge.errors import ProtocolError
from kvbridge.transfer.channel.envelope import Codec, auth_limit

__all__ = [
    "MAX_AUX_ROW_BYTES",
    "MAX_MESSAGE_BYTES",
    "MESSAGE_TYPES",
    "WIRE_VERSION",
    "Abort",
    "AbortAck",
    "NONCE_BYTES",
    "Challenge",
    "ChallengeEcho",
    "KeyChallenge",
    "KeyProof",
    "SIGNATURE_BYTES",
    "ChunkLanded",
    "ErrorReply",
    "Heartbeat",
    "Message",
    "PagesDone",
    "Ping",
    "RoomTicket",
    "Release",
    "SlotGrant",
    "SlotRequest",
    "TransferRequest",
    "auth_limit",
    "codec",
    "decode",
    "encode",
    "pack_pages",
    "pack_scatter",
    "unpack_pages",
    "unpack_scatter",
]

MAX_MESSAGE_BYTES = 4 << 20
MAX_AUX_ROW_BYTES = 1 << 20  # an aux row carried in a report (PagesDone.aux_row): DeepSeek's is 14 KiB
NONCE_BYTES = 32  # the ownership proof's nonce (prefill/admission.py)
SIGNATURE_BYTES = 64  # an Ed25519 signature (transfer/ownership.py)

Room = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0)]
RankId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class _Message(msgspec.Struct, frozen=True, tag_field="t"):
    TAG: ClassVar[str] = ""  # each class's tag (set below from its ``tag=``)


# ---- decode -> prefill ------------------------------------------------------------------------
class TransferRequest(_Message, frozen=True, tag="transfer_request"):
    """Write the request's KV into my pages. ``decode_rank_id``: my registration at the bootstrap
    daemon, where the prefill rank reads (once) the buffers, aux regions and session it may write
    into (hard rule 5); ``page_ids``: logical page ``first_page + i`` -> my physical page
    ``page_ids[i]`` (LE int32, shared by every pool; pages below ``first_page`` I already hold);
    ``deadline_ms``: how long I wait, from sending; ``num_tokens``: the request's valid tokens, or
    0 when I know only its pages (``first_page`` + the page ids): the prefill rank then knows the
    length from its engine, at the latest with the last chunk, and says it in the ``PagesDone``
    that reports the aux row. ``num_decode_ranks``: the decode TP size; prefill derives how many
    decode ranks draw from it (TP route)."""

    room: Room
    decode_rank: str
    decode_rank_id: RankId
    page_ids: bytes
    first_page: Count
    pools: list[str]
    aux_slot: Annotated[int, msgspec.Meta(ge=-1)]
    num_tokens: Count
    deadline_ms: Count
    want_digest: bool
    fingerprint: str
    num_decode_ranks: Count
    # my staging area (staged transfers): ``staging_slots`` slots of ``staging_slot_bytes`` from
    # address ``staging_base`` in my registered memory (0 slots: none, every write is direct);
    # ``staging_only``: write my pages through staging only, never directly (an aborted room's
    # pages are then free at once)
    staging_slots: Count = 0
    staging_slot_bytes: Count = 0
    staging_base: Count = 0
    staging_only: bool = False
    # the digest of the request I decode (``transfer/binding.py``): a room its engine opened bound to
    # another digest refuses me at once (b"": I bind nothing; refused by a bound room)
    binding: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    # the pool kinds beyond paged KV (``transfer/prefill/kinds.py``): per compressed or state pool,
    # my physical units (LE int32) of the units I need, from the needed extent's first (state: the
    # slot); window pools use ``page_ids`` (token-paged pools share one mapping)
    kind_units: dict[str, bytes] = {}
    # send me the aux row in the report that carries it (``PagesDone.aux_row``), not as a write into
    # my aux rows: I write it into slot ``aux_slot`` myself, at the commit (false: write it there)
    aux_inline: bool = False
    # with aux_inline: send the row in a report of its own right after you post the write of the
    # pages it comes with, not in that write's report (my aux rows are device memory: I write it
    # into its slot while the pages land, not at the commit); false: in the pages' report
    aux_ahead: bool = False
    # my staging slots granted to your first chunks of this room, in order (chunk i of yours, numbered per room,
    # writes into slot staging_granted[i] with no SlotGrant; its SlotRequest still goes first, with the scatter
    # list I check before I scatter). Only in a request that offers a staging area; a slot you do not use I
    # free when the room commits
    staging_granted: Annotated[list[Count], msgspec.Meta(max_length=64)] = []

    def __post_init__(self) -> None:
        _check_pages(self, "page_ids", self.page_ids)
        for pool, units in self.kind_units.items() if isinstance(self.kind_units, dict) else ():
            _check_pages(self, f"kind_units.{pool}", units)
        if self.staging_only and not self.staging_slots:
            raise ProtocolError("staging_only without a staging area (staging_slots 0)", room=self.room,
                                field="staging_only")


class Abort(_Message, frozen=True, tag="abort"):
    """Stop room ``room`` for my registration ``decode_rank_id`` (refused from another instance
    than the one that claimed the room)."""

    room: Room
    decode_rank: str
    reason: str
    decode_rank_id: RankId


class Release(_Message, frozen=True, tag="release"):
    """My instance needs nothing of room ``room`` (``reason``): end it now. ``binding``: the digest
    of the request I decode, as a claim presents it (a bound room refuses another); acts for my
    registration ``decode_rank_id`` (refused from another instance than the one that claimed the
    room). Nothing is written either way; a room already ended is left as it is."""

    room: Room
    decode_rank: str
    decode_rank_id: RankId
    reason: Annotated[str, msgspec.Meta(max_length=512)] = ""
    binding: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class Ping(_Message, frozen=True, tag="ping"):
    """Are you alive? ``decode_rank_id``: the registration I ping for (my rooms' liveness), or
    empty for a probe that acts for nobody (``kvbridge doctor``)."""

    decode_rank: str
    seq: Count
    decode_rank_id: Annotated[str, msgspec.Meta(max_length=128)] = ""


class ChallengeEcho(_Message, frozen=True, tag="challenge_echo"):
    """The NONCE_BYTES I read from my scratch region at the offset a Challenge named."""

    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]

    def __post_init__(self) -> None:
        if isinstance(self.nonce, bytes) and len(self.nonce) != NONCE_BYTES:
            raise ProtocolError(f"field 'nonce' of challenge_echo must be {NONCE_BYTES} bytes, got {len(self.nonce)}",
                                field="nonce")


class KeyProof(_Message, frozen=True, tag="key_proof"):
    """My proof key's signature over the KeyChallenge's nonce (``transfer/ownership.py``)."""

    signature: Annotated[bytes, msgspec.Meta(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES)]

    def __post_init__(self) -> None:
        if isinstance(self.signature, bytes) and len(self.signature) != SIGNATURE_BYTES:
            raise ProtocolError(f"field 'signature' of key_proof must be {SIGNATURE_BYTES} bytes, got "
                                f"{len(self.signature)}", field="signature")


class RoomTicket(_Message, frozen=True, tag="room_ticket"):
    """Both ways: the decision on who holds ``room``. The decider (registration ``decider``) grants
    it to the decode rank whose claim won, signed with its proof key over (decider, room,
    instance, decode_rank, binding) (``ownership.ticket_message``); that decode rank hands it on,
    unchanged, to the other prefill ranks it asked for the room. ``instance``/``decode_rank``: the
    decode instance that holds the room and the rank whose claim won; ``binding``: the digest the
    winning claim presented (``transfer/binding.py``); ``decode_rank_id``: the registration of the
    winning claim, on whose connection the ticket travels both ways (prefill admits it as it admits
    that registration's requests)."""

    room: Room
    decode_rank_id: RankId  # the decode registration that claimed and hands it on (its connection's)
    decider: RankId
    instance: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    decode_rank: Annotated[str, msgspec.Meta(max_length=256)]
    binding: Annotated[bytes, msgspec.Meta(max_length=64)]
    signature: Annotated[bytes, msgspec.Meta(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES)]

    def __post_init__(self) -> None:
        if isinstance(self.signature, bytes) and len(self.signature) != SIGNATURE_BYTES:
            raise ProtocolError(f"field 'signature' of room_ticket must be {SIGNATURE_BYTES} bytes, got "
                                f"{len(self.signature)}", room=self.room, field="signature")


# ---- prefill -> decode ------------------------------------------------------------------------
class PagesDone(_Message, frozen=True, tag="pages_done"):
    """``logical_pages`` (LE int32) of ``pools`` were written by ``cp_rank``, or failed. ``aux``:
    the same write carried the room's aux row (the last chunk's batch, or the row alone), and
    ``num_tokens`` is then the request's valid tokens as the prefill engine knows them by its
    last chunk (0: not said). One report per write."""

    room: Room
    cp_rank: Count
    status: Literal["ok", "failed"]
    reason: str
    pools: list[str]
    logical_pages: bytes
    digests: bytes | None
    aux: bool = False
    num_tokens: Count = 0
    # the pool kinds beyond paged KV: per window, compressed or state pool, the logical units
    # (LE int32) the write carried; ``kind_last``: the write carried the room's last chunk of them
    # (state travels only then)
    kind_units: dict[str, bytes] = {}
    kind_last: bool = False
    # decode checks digests (TransferRequest.want_digest): per pool of ``kind_units``, one LE uint64
    # digest per unit it names, in its order, over the bytes the rooms move of that unit
    # (transfer/digest.py ``kind_unit_digests``)
    kind_digests: dict[str, bytes] = {}
    # the room's aux row itself (its packed bytes), when the request asked for it inline
    # (``TransferRequest.aux_inline``) and this report carries the row (``aux``): then no write
    # carried it; None: the write did, or no row
    aux_row: Annotated[bytes, msgspec.Meta(max_length=MAX_AUX_ROW_BYTES)] | None = None

    def __post_init__(self) -> None:
        if self.status not in ("ok", "failed"):
            raise ProtocolError(f"field 'status' of pages_done must be one of ('ok', 'failed'), got {self.status!r:.40}",
                                room=self.room, field="status")
        _check_pages(self, "logical_pages", self.logical_pages)
        if self.aux_row is not None and not (self.aux and self.status == "ok"):
            raise ProtocolError("field 'aux_row' of pages_done comes only in a successful report that carries the "
                                "aux row (aux true)", room=self.room, field="aux_row")
        for pool, units in self.kind_units.items() if isinstance(self.kind_units, dict) else ():
            _check_pages(self, f"kind_units.{pool}", units)
        for pool, digests in self.kind_digests.items() if isinstance(self.kind_digests, dict) else ():
            units = self.kind_units.get(pool) if isinstance(self.kind_units, dict) else None
            if units is None or len(digests) != 2 * len(units):
                raise ProtocolError(f"field 'kind_digests.{pool:.40}' of pages_done must hold one 8-byte digest per "
                                    f"unit of kind_units.{pool:.40}", room=self.room, field=f"kind_digests.{pool:.40}")


class AbortAck(_Message, frozen=True, tag="abort_ack"):
    """No write of ``room`` from ``cp_rank`` is in flight any more, nor will be posted."""

    room: Room
    cp_rank: Count


class Heartbeat(_Message, frozen=True, tag="heartbeat"):
    cp_rank: Count
    seq: Count


class Challenge(_Message, frozen=True, tag="challenge"):
    """Prove you hold the memory you registered, at ``offset`` of your scratch region. With a
    ``nonce`` (proof by read): write your proof key's signature over it (``ownership.memory_message``)
    there yourself and say so (ChallengeEcho: the SHA-256 of what you wrote); I read it back, and
    I write nothing. Without (engines that cannot read): I wrote a fresh nonce there; echo it."""

    offset: Count
    nonce: bytes = b""

    def __post_init__(self) -> None:
        if isinstance(self.nonce, bytes) and len(self.nonce) not in (0, NONCE_BYTES):
            raise ProtocolError(f"field 'nonce' of challenge must be 0 or {NONCE_BYTES} bytes, got {len(self.nonce)}",
                                field="nonce")


class KeyChallenge(_Message, frozen=True, tag="key_challenge"):
    """Sign ``nonce`` with your registration's proof key (KeyProof) on this connection: the
    proof that you are the registration your Hello named (``transfer/ownership.py``)."""

    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]

    def __post_init__(self) -> None:
        if isinstance(self.nonce, bytes) and len(self.nonce) != NONCE_BYTES:
            raise ProtocolError(f"field 'nonce' of key_challenge must be {NONCE_BYTES} bytes, got {len(self.nonce)}",
                                field="nonce")


class ErrorReply(_Message, frozen=True, tag="error_reply"):
    """The message of type ``ref_type`` (room ``room`` when known) was refused because ``reason``."""

    ref_type: str
    room: Room | None
    reason: str


# ---- staged transfers ---------------------------------------------------------------------------
class SlotRequest(_Message, frozen=True, tag="slot_request"):
    """prefill -> decode: chunk ``chunk`` (numbered per room, CP rank and TP rank from 0) of
    ``num_bytes`` bytes needs a staging slot; once it lands, decode scatters it by ``scatter``
    (packed little-endian uint64 triples: slot offset, page address, length), which decode checks
    when the request comes, not on the landing's path (wire 16)."""

    room: Room
    cp_rank: Count
    chunk: Count
    num_bytes: Count
    scatter: bytes

    def __post_init__(self) -> None:
        _check_scatter(self)


class SlotGrant(_Message, frozen=True, tag="slot_grant"):
    """decode -> prefill: write chunk ``chunk`` into my staging slot ``slot`` (and nowhere else)."""

    room: Room
    decode_rank: str
    chunk: Count
    slot: Count


class ChunkLanded(_Message, frozen=True, tag="chunk_landed"):
    """prefill -> decode: chunk ``chunk``'s write into ``slot`` is final: ``ok`` (decode scatters it
    by the list its SlotRequest carried) or ``failed`` (nothing of it is in flight any more)."""

    room: Room
    cp_rank: Count
    chunk: Count
    slot: Count
    status: Literal["ok", "failed"]
    reason: str

    def __post_init__(self) -> None:
        if self.status not in ("ok", "failed"):
            raise ProtocolError(f"field 'status' of chunk_landed must be 'ok' or 'failed', got {self.status!r:.40}",
                                room=self.room, field="status")


def _check_scatter(msg: _Message) -> None:
    value = msg.scatter
    if isinstance(value, bytes) and len(value) % 24:
        raise ProtocolError(f"field 'scatter' of {msg.TAG} must be packed uint64 triples (a multiple of 24 bytes), "
                            f"got {len(value)}", room=msg.room, field="scatter")


Message = Union[TransferRequest, Abort, Ping, ChallengeEcho, PagesDone, AbortAck, Heartbeat, Challenge, ErrorReply,
                SlotRequest, SlotGrant, ChunkLanded, KeyChallenge, KeyProof, RoomTicket, Release]

# The one table from type tag to class.
MESSAGE_TYPES: dict[str, type[_Message]] = {
    cls.__struct_config__.tag: cls
    for cls in (TransferRequest, Abort, Ping, ChallengeEcho, PagesDone, AbortAck, Heartbeat, Challenge, ErrorReply,
                SlotRequest, SlotGrant, ChunkLanded, KeyChallenge, KeyProof, RoomTicket, Release)
}


for _cls in MESSAGE_TYPES.values():
    _cls.TAG = _cls.__struct_config__.tag


def codec(secret: bytes | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> Codec[Message]:
    """The control channel's codec (one typed decoder over the union above)."""
    return Codec("control", WIRE_VERSION, tuple(MESSAGE_TYPES.values()), secret=secret, max_bytes=max_bytes)


_CODECS: dict[tuple[bytes | None, int], Codec[Message]] = {}


def _codec(secret: bytes | None, max_bytes: int) -> Codec[Message]:
    key = (secret, max_bytes)
    found = _CODECS.get(key)
    if found is None:
        if len(_CODECS) > 64:  # (a few secrets and limits per process; never grows without bound)
            _CODECS.clear()
        found = _CODECS[key] = codec(secret, max_bytes)
    return found


def encode(msg: Message, secret: bytes | None = None, *, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """``msg`` in its envelope (the endpoints' channels call this, so a test may wrap it)."""
    return _codec(secret, max_bytes).encode(msg)


def decode(data: bytes, secret: bytes | None = None, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Open and decode one envelope; ProtocolError naming what is wrong."""
    return _codec(secret, max_bytes).decode(data)


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


def pack_scatter(off: np.ndarray, dst: np.ndarray, length: np.ndarray) -> bytes:
    """A chunk's scatter list -> packed little-endian uint64 triples (SlotRequest.scatter)."""
    return np.stack([np.asarray(a, dtype="<u8").reshape(-1) for a in (off, dst, length)], axis=1).tobytes()


def unpack_scatter(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SlotRequest.scatter -> (slot offsets, page addresses, lengths) as uint64 arrays."""
    if len(data) % 24:
        raise ProtocolError(f"a scatter list must be a multiple of 24 bytes, got {len(data)}", field="scatter")
    cols = np.frombuffer(data, dtype="<u8").reshape(-1, 3).T.astype(np.uint64)  # one copy: three contiguous rows
    return cols[0], cols[1], cols[2]


def _check_pages(msg: _Message, name: str, value: bytes) -> None:
    if not isinstance(value, bytes):
        return  # (a wrong type is the decoder's or the encoder's to refuse, naming it)
    if len(value) % 4:
        raise ProtocolError(
            f"field '{name}' of {msg.TAG} must be packed int32 (a multiple of 4 bytes), got {len(value)} bytes",
            room=getattr(msg, "room", None),
            field=name,
        )
