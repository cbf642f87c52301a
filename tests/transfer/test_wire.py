"""Control-channel messages: every message round-trips; every malformed input is a
ProtocolError that says exactly what is wrong; the MAC (keyed BLAKE3); size limit."""

from __future__ import annotations

import hashlib
import hmac
import struct

import blake3

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ConfigError, ProtocolError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel.wire import (
    MESSAGE_TYPES,
    WIRE_VERSION,
    Abort,
    AbortAck,
    Challenge,
    ChallengeEcho,
    ErrorReply,
    Heartbeat,
    KeyChallenge,
    KeyProof,
    PagesDone,
    Ping,
    TransferRequest,
    decode,
    encode,
    pack_pages,
    unpack_pages,
)

SECRET = b"cluster-secret"


def request(**changes: object) -> TransferRequest:
    fields: dict = dict(
        room=2**63 - 1,
        decode_rank="decode-dp0-tp0",
        decode_rank_id="0123456789abcdef",
        page_ids=pack_pages(np.array([9, 3, 4, 100_000])),
        first_page=3,
        pools=["target", "index", "draft"],
        aux_slot=17,
        num_tokens=200,
        deadline_ms=30_000,
        want_digest=True,
        fingerprint="sha256:" + "ab" * 32,
        num_decode_ranks=2,
    )
    fields.update(changes)
    return TransferRequest(**fields)


SAMPLES = [
    request(),
    request(aux_slot=-1, want_digest=False, pools=[], page_ids=b"", first_page=0),
    Abort(room=7, decode_rank="d0", reason="client went away", decode_rank_id="r-1"),
    Ping(decode_rank="d0", seq=0),
    PagesDone(room=7, cp_rank=1, status="ok", reason="", pools=["target"], logical_pages=pack_pages(np.arange(5)), digests=b"\x01" * 40),
    PagesDone(room=7, cp_rank=0, status="failed", reason="page 9 outside capacity", pools=[], logical_pages=b"", digests=None),
    PagesDone(room=7, cp_rank=3, status="ok", reason="", pools=[], logical_pages=b"", digests=None, aux=True,
              num_tokens=130),
    AbortAck(room=7, cp_rank=2),
    Heartbeat(cp_rank=2, seq=2**40),
    ErrorReply(ref_type="transfer_request", room=None, reason="unknown message type 'x'"),
    ErrorReply(ref_type="abort", room=5, reason="no such room"),
    Ping(decode_rank="d0", seq=3, decode_rank_id="r-1"),
    ChallengeEcho(nonce=bytes(range(32))),
    Challenge(offset=4064),
    KeyChallenge(nonce=bytes(range(32, 64))),
    KeyProof(signature=bytes(range(64))),
    wire.RoomTicket(room=7, decode_rank_id="r1", decider="p-cp0", instance="d", decode_rank="d/dp0/tp0",
                    binding=b"\x02" * 16, signature=bytes(range(64))),
    request(staging_slots=8, staging_slot_bytes=8 << 20, staging_base=2**47, staging_only=True),
    wire.SlotRequest(room=7, cp_rank=1, chunk=3, num_bytes=8 << 20,
                     scatter=wire.pack_scatter(np.array([0, 64]), np.array([2**40, 2**41]), np.array([64, 16]))),
    wire.SlotGrant(room=7, decode_rank="d0", chunk=3, slot=5),
    wire.ChunkLanded(room=7, cp_rank=1, chunk=3, slot=5, status="ok", reason=""),
    wire.ChunkLanded(room=7, cp_rank=1, chunk=4, slot=5, status="failed", reason="write failed"),
    wire.Release(room=7, decode_rank="d0", decode_rank_id="r-1", reason="full local prefix hit", binding=b"\x07" * 16),
]


PLAIN = wire.codec()


def body(**fields: object) -> bytes:
    """A plain envelope around a msgpack map."""
    return PLAIN.seal(msgpack.packb(fields, use_bin_type=True))


def valid_map(msg: wire.Message) -> dict:
    return {"t": msg.TAG, **msgspec.structs.asdict(msg)}


# ---- round trips --------------------------------------------------------------------------------
def test_scatter_lists_round_trip_and_bad_ones_are_named() -> None:
    off, dst, length = np.array([0, 64], np.uint64), np.array([2**40, 2**63], np.uint64), np.array([64, 16], np.uint64)
    for a, b in zip(wire.unpack_scatter(wire.pack_scatter(off, dst, length)), (off, dst, length)):
        assert a.dtype == np.uint64 and (a == b).all()
    with pytest.raises(ProtocolError, match="scatter"):
        wire.SlotRequest(room=1, cp_rank=0, chunk=0, num_bytes=64, scatter=b"x" * 23)
    with pytest.raises(ProtocolError, match="scatter"):  # (decoded: the same check)
        PLAIN.decode(body(t="slot_request", room=1, cp_rank=0, chunk=0, num_bytes=64, scatter=b"x" * 25))
    with pytest.raises(ProtocolError, match="staging_only"):
        request(staging_only=True)



def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TAG)
@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
def test_round_trip(msg: wire.Message, secret: bytes | None) -> None:
    data = encode(msg, secret)
    assert decode(data, secret) == msg
    assert type(decode(data, secret)) is type(msg)


def test_plain_encoding_is_a_versioned_envelope_around_a_tagged_map() -> None:
    data = encode(Ping(decode_rank="d", seq=1))
    assert struct.unpack(">HB", data[:3]) == (WIRE_VERSION, 0)
    assert msgpack.unpackb(data[3:]) == {"t": "ping", "decode_rank": "d", "seq": 1, "decode_rank_id": ""}


def test_sealed_envelope_is_version_kind_keyed_blake3_mac_then_body() -> None:
    msg = AbortAck(room=1, cp_rank=0)
    data = encode(msg, SECRET)
    head, mac, inner = data[:3], data[3:35], data[35:]
    assert struct.unpack(">HB", head) == (WIRE_VERSION, 2)
    assert inner == encode(msg)[3:]
    key = blake3.blake3(SECRET, derive_key_context="kvbridge 2026-12-07 control channel MAC").digest()
    assert mac == blake3.blake3(head + inner, key=key).digest()
    assert key != SECRET and len(key) == 32


def test_a_frame_sealed_with_hmac_sha256_as_wire_16_sealed_is_refused_by_name_unchecked() -> None:
    """An older kvbridge's frame (kind 1: HMAC-SHA256 over version | kind | body) is refused by what
    it is, whether its MAC is right or not: it is never checked."""
    msg = AbortAck(room=1, cp_rank=0)
    body = encode(msg)[3:]
    head = struct.pack(">HB", 16, 1)
    for mac in (hmac.new(SECRET, head + body, hashlib.sha256).digest(), b"\x00" * 32):
        with pytest.raises(ProtocolError, match="sealed with HMAC-SHA256, as kvbridge sealed its frames before "
                                                f"control wire 17 .control channel version 16 in its header, {WIRE_VERSION} "
                                                "here.; this side checks keyed BLAKE3") as info:
            decode(head + mac + body, SECRET)
        assert info.value.field == "mac"
    with pytest.raises(ProtocolError, match="a MAC but no secret"):  # and without a secret, as any MAC'd frame
        decode(head + mac + body)


def test_a_frame_sealed_for_another_channel_does_not_verify() -> None:
    """The key is derived per channel: the same secret's ops-channel seal over a control message's
    body does not verify as a control frame."""
    from kvbridge.transfer.channel.envelope import mac_key
    from kvbridge.worker import ops

    assert mac_key(SECRET, "ops") != mac_key(SECRET, "control")
    body = encode(AbortAck(room=1, cp_rank=0))[3:]
    frame = ops.codec(SECRET).with_version(WIRE_VERSION).seal(body)  # (the control channel's version too)
    assert frame[:3] == struct.pack(">HB", WIRE_VERSION, 2)
    with pytest.raises(ProtocolError, match="bad MAC"):
        decode(frame, SECRET)
    assert decode(wire.codec(SECRET).seal(body), SECRET) == AbortAck(room=1, cp_rank=0)


def test_pages_pack_as_little_endian_int32() -> None:
    pages = np.array([0, 1, 2**31 - 1, 70_000], dtype=np.int64)
    packed = pack_pages(pages)
    assert packed == b"".join(int(p).to_bytes(4, "little") for p in pages)
    out = unpack_pages(packed)
    assert out.dtype == np.int32 and out.flags.writeable and out.tolist() == pages.tolist()
    assert unpack_pages(b"").size == 0


@pytest.mark.parametrize(("pages", "match"), [(np.array([2**31]), "fit int32"), (np.zeros((2, 2), int), "1-D"), (np.array([0.5]), "integer")])
def test_pack_pages_refuses(pages: np.ndarray, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        pack_pages(pages)


def test_unpack_pages_refuses_a_partial_int() -> None:
    with pytest.raises(ProtocolError, match="multiple of 4 bytes, got 7"):
        unpack_pages(b"\x00" * 7)


def test_unknown_extra_fields_are_ignored() -> None:
    msg = AbortAck(room=3, cp_rank=1)
    assert decode(body(**valid_map(msg), added_in_a_later_release=[1, 2])) == msg


def test_a_pages_report_without_the_aux_fields_reports_no_aux_row() -> None:
    fields = valid_map(SAMPLES[4])
    del fields["aux"], fields["num_tokens"]
    msg = decode(body(**fields))
    assert isinstance(msg, PagesDone) and msg.aux is False and msg.num_tokens == 0


def test_the_v2_aux_report_is_refused_by_version_and_by_tag() -> None:
    old = msgpack.packb({"t": "aux_done", "room": 7, "cp_rank": 0, "status": "ok", "reason": ""})
    with pytest.raises(ProtocolError, match="unsupported wire version 2"):
        decode(PLAIN.with_version(2).seal(old))
    with pytest.raises(ProtocolError, match="unknown message type 'aux_done'"):
        decode(PLAIN.seal(old))


def test_a_v5_abort_without_its_registration_is_refused_by_version_and_by_field() -> None:
    """Wire v6: an Abort names the decode registration it acts for (prefill binds it to the
    connection's Hello); a v5 Abort had none."""
    old = msgpack.packb({"t": "abort", "room": 7, "decode_rank": "d", "reason": "x"})
    with pytest.raises(ProtocolError, match="unsupported wire version 5"):
        decode(PLAIN.with_version(5).seal(old))
    with pytest.raises(ProtocolError, match="missing field 'decode_rank_id' in abort") as info:
        decode(PLAIN.seal(old))
    assert info.value.field == "decode_rank_id" and info.value.room == 7


@pytest.mark.parametrize("fields, name", [
    ({"t": "challenge_echo", "nonce": b"\0" * 31}, "nonce"),
    ({"t": "challenge_echo", "nonce": b"\0" * 33}, "nonce"),
    ({"t": "challenge_echo", "nonce": "x" * 32}, "nonce"),
    ({"t": "challenge", "offset": -32}, "offset"),
    ({"t": "abort", "room": 1, "decode_rank": "d", "reason": "", "decode_rank_id": ""}, "decode_rank_id"),
    ({"t": "ping", "decode_rank": "d", "seq": 1, "decode_rank_id": "x" * 129}, "decode_rank_id"),
])
def test_ownership_messages_refuse_bad_fields_naming_them(fields: dict, name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(body(**fields))
    assert info.value.field == name, info.value


def test_a_nonce_of_the_wrong_length_fails_at_the_sender() -> None:
    with pytest.raises(ProtocolError, match="must be 32 bytes") as info:
        ChallengeEcho(nonce=b"short")
    assert info.value.field == "nonce"
    with pytest.raises(ProtocolError, match="must be 32 bytes") as info:
        KeyChallenge(nonce=bytes(33))
    assert info.value.field == "nonce"
    with pytest.raises(ProtocolError, match="must be 64 bytes") as info:
        KeyProof(signature=bytes(63))
    assert info.value.field == "signature"


def test_a_ping_without_a_registration_is_a_probe() -> None:
    """A Ping's registration may be left out (``kvbridge doctor``): prefill answers it with a
    Heartbeat and nothing else."""
    assert decode(body(t="ping", decode_rank="doctor", seq=1)).decode_rank_id == ""


def test_a_v4_message_is_refused_by_version() -> None:
    """Wire v4 sent a bare msgpack map {"v": 4, ...}: its first bytes read as another version."""
    with pytest.raises(ProtocolError, match="unsupported wire version") as info:
        decode(msgpack.packb({"v": 4, "t": "ping", "decode_rank": "d", "seq": 1}))
    assert info.value.field == "v"


# ---- malformed input ----------------------------------------------------------------------------
ACK = valid_map(AbortAck(room=3, cp_rank=1))
MALFORMED = [
    (PLAIN.seal(b"\xc1"), "not msgpack"),
    (PLAIN.seal(b"\x82\xa1t"), "not msgpack: Input data was truncated"),
    (body(**ACK) + b"\x00", "not msgpack"),
    (b"", "shorter than the 3-byte envelope header"),
    (PLAIN.seal(msgpack.packb([1, 2, 3])), "not a map: expected `object`, got `array`"),
    (PLAIN.seal(msgpack.packb(7)), "not a map: expected `object`, got `int`"),
    (PLAIN.seal(msgpack.packb({1: 2})), "map keys must be strings"),
    (PLAIN.with_version(WIRE_VERSION + 1).seal(msgpack.packb(ACK)), f"unsupported wire version {WIRE_VERSION + 1}"),
    (PLAIN.with_version(1).seal(msgpack.packb(ACK)), "unsupported wire version 1"),
    (body(room=3, cp_rank=1), "missing type tag 't'"),
    (body(**{**ACK, "t": "launch_missiles"}), "unknown message type 'launch_missiles'"),
    (body(**{**ACK, "t": 5}), "unknown message type 5"),
    (body(t="abort_ack", room=3), "missing field 'cp_rank' in abort_ack"),
    (body(**{**ACK, "room": "3"}), "field 'room' of abort_ack has wrong type: expected `int`, got `str`"),
    (body(**{**ACK, "cp_rank": True}), "field 'cp_rank' of abort_ack has wrong type: expected `int`, got `bool`"),
    (body(**{**ACK, "room": -1}), "field 'room' of abort_ack is out of range: expected `int` >= 0"),
    (body(**{**ACK, "room": 2**63}), "field 'room' of abort_ack is out of range"),
    (body(**{**valid_map(request()), "want_digest": 1}), "field 'want_digest' .* expected `bool`, got `int`"),
    (body(**{**valid_map(request()), "pools": ["target", 3]}), "field 'pools' .* expected `str`, got `int`"),
    (body(**{**valid_map(request()), "page_ids": "0123"}), "field 'page_ids' .* expected `bytes`, got `str`"),
    (body(**{**valid_map(request()), "page_ids": b"\x00" * 6}), "field 'page_ids' .* multiple of 4 bytes\\), got 6 bytes"),
    (body(**{**valid_map(request()), "decode_rank_id": ""}), "field 'decode_rank_id' .* length >= 1"),
    (body(**{**valid_map(request()), "decode_rank_id": "x" * 129}), "field 'decode_rank_id' .* length <= 128"),
    (body(**{**valid_map(request()), "first_page": -1}), "field 'first_page' .* out of range"),
    (body(**{**valid_map(request()), "aux_slot": -2}), "field 'aux_slot' .* out of range: expected `int` >= -1"),
    (body(**{**valid_map(SAMPLES[4]), "status": "maybe"}), "field 'status' of pages_done is not allowed"),
    (body(**{**valid_map(SAMPLES[4]), "digests": 5}), "field 'digests' .* expected `bytes \\| null`, got `int`"),
]


@pytest.mark.parametrize(("data", "match"), MALFORMED)
def test_malformed_input_names_the_problem(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_error_carries_room_and_field_when_known() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(body(t="abort", room=12, decode_rank="d"))
    assert (info.value.room, info.value.field) == (12, "reason")
    assert "[room=12 field=reason]" in str(info.value)


def test_a_bad_message_fails_at_the_sender() -> None:
    """Value rules run where a message is built; a value msgpack cannot carry fails its encoding."""
    with pytest.raises(ProtocolError, match="field 'logical_pages' of pages_done must be packed int32"):
        PagesDone(room=1, cp_rank=0, status="ok", reason="", pools=[], logical_pages=b"\x00" * 3, digests=None)
    with pytest.raises(ProtocolError, match="field 'status' of pages_done must be one of"):
        PagesDone(room=1, cp_rank=0, status="maybe", reason="", pools=[], logical_pages=b"", digests=None)
    with pytest.raises(ProtocolError, match="cannot encode AbortAck: Encoding objects of type numpy.int64"):
        encode(AbortAck(room=np.int64(3), cp_rank=0))

    class Fake(msgspec.Struct):
        pass

    with pytest.raises(ProtocolError, match="not a control message"):
        encode(Fake())


@given(st.binary(max_size=256))
@settings(max_examples=300, deadline=None)
def test_random_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)


@given(tag=st.sampled_from(sorted(MESSAGE_TYPES)), fields=st.dictionaries(st.sampled_from(["room", "cp_rank", "seq", "status", "pools", "page_ids", "decode_rank_id", "reason", "digests", "decode_rank"]), values))
@settings(max_examples=300, deadline=None)
def test_random_maps_only_ever_raise_protocol_error(tag: str, fields: dict) -> None:
    try:
        decode(body(t=tag, **fields))
    except ProtocolError:
        pass


# ---- MAC and size -------------------------------------------------------------------------------
def test_message_signed_with_another_secret_is_refused() -> None:
    with pytest.raises(ProtocolError, match="bad MAC") as info:
        decode(encode(SAMPLES[3], b"other-secret"), SECRET)
    assert info.value.field == "mac"


def test_tampered_body_or_version_is_refused() -> None:
    signed = encode(AbortAck(room=1, cp_rank=0), SECRET)
    forged = signed[:35] + encode(AbortAck(room=2, cp_rank=0))[3:]
    with pytest.raises(ProtocolError, match="bad MAC"):
        decode(forged, SECRET)
    with pytest.raises(ProtocolError, match="bad MAC"):
        decode(struct.pack(">HB", WIRE_VERSION + 1, 2) + signed[3:], SECRET)  # the version is under the MAC
    with pytest.raises(ProtocolError, match="bad MAC"):
        decode(signed[:20] + signed[35:], SECRET)


@pytest.mark.parametrize("data", [encode(SAMPLES[3]), b"\xc1", b"\x00\x05\x02" + b"x" * 10],
                         ids=["plain", "garbage", "short-mac"])
def test_unsigned_message_is_refused_when_a_secret_is_set(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="missing MAC"):
        decode(data, SECRET)


def test_signed_message_is_refused_when_no_secret_is_set() -> None:
    with pytest.raises(ProtocolError, match="a MAC but no secret"):
        decode(encode(SAMPLES[3], SECRET))


def test_an_empty_secret_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="secret"):
        encode(SAMPLES[3], b"")


def test_an_authentic_oversized_message_is_refused_by_size_a_forged_one_by_mac() -> None:
    big = PagesDone(room=1, cp_rank=0, status="ok", reason="", pools=["t"], logical_pages=b"\x00" * 1600, digests=None)
    data = encode(big, SECRET)
    with pytest.raises(ProtocolError, match="over the 1024-byte limit") as info:
        decode(data, SECRET, max_bytes=1024)
    assert info.value.field == "size"
    with pytest.raises(ProtocolError, match="bad MAC") as info:
        decode(data[:10] + b"\xff" + data[11:], SECRET, max_bytes=1024)
    assert info.value.field == "mac"
    with pytest.raises(ProtocolError, match="too large to authenticate"):
        decode(b"\x00" * (wire.auth_limit(1024) + 1), SECRET, max_bytes=1024)


def test_oversized_messages_are_refused_both_ways() -> None:
    big = PagesDone(room=1, cp_rank=0, status="ok", reason="", pools=["t"], logical_pages=b"\x00" * 4096, digests=None)
    with pytest.raises(ProtocolError, match="over the 1024-byte limit"):
        encode(big, max_bytes=1024)
    data = encode(big)
    with pytest.raises(ProtocolError, match=f"message of {len(data)} bytes is over the 1024-byte limit"):
        decode(data, max_bytes=1024)
    with pytest.raises(ProtocolError, match="over the"):
        decode(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))
    assert decode(data) == big


def test_kind_digests_must_hold_one_digest_per_reported_unit() -> None:
    units = {"csa": pack_pages(np.array([0, 1, 2]))}
    ok = PagesDone(room=1, cp_rank=0, status="ok", reason="", pools=[], logical_pages=b"", digests=None,
                   kind_units=units, kind_digests={"csa": b"\x01" * 24})
    assert decode(encode(ok, SECRET), SECRET) == ok
    for digests in ({"csa": b"\x01" * 16}, {"hca": b"\x01" * 8}):  # a unit short; a pool the report names no unit of
        with pytest.raises(ProtocolError, match="kind_digests"):
            PagesDone(room=1, cp_rank=0, status="ok", reason="", pools=[], logical_pages=b"", digests=None,
                      kind_units=units, kind_digests=digests)
