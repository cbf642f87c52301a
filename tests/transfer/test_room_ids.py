"""Signed room ids (``kvbridge.signed_room_id`` / ``check_room_id``): the signature carried in the
63-bit id itself, for engines that carry nothing else (SGLang's ``bootstrap_room``). Pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge import RoomBindingError, check_room_id, signed_room_id
from kvbridge.transfer.binding import ROOM_ID_BITS, ROOM_ID_EPOCH

KEY = b"cluster room key"
NOW = ROOM_ID_EPOCH + 400 * 86400.0  # 2027-02-05
TAG_SHIFT = ROOM_ID_BITS["nonce"]


def test_the_layout_is_63_bits_with_a_32_bit_tag():
    assert sum(ROOM_ID_BITS.values()) == 63 and ROOM_ID_BITS["tag"] >= 32
    room = signed_room_id(KEY, NOW + 300, nonce=5)
    assert 0 <= room < 1 << 63 and room & 511 == 5  # the nonce in the low bits: room % dp_size is the router's
    assert signed_room_id(KEY, NOW + 300, nonce=5) == room  # deterministic given the nonce
    assert signed_room_id(KEY, NOW + 300, nonce=6) != room
    check_room_id(KEY, room, NOW)


@settings(max_examples=40, deadline=None)
@given(key=st.binary(min_size=1, max_size=64), nonce=st.integers(0, 511), ttl=st.floats(1, 30 * 86400))
def test_any_bit_flip_of_the_tag_is_refused_by_field(key, nonce, ttl):
    room = signed_room_id(key, NOW + ttl, nonce=nonce)
    check_room_id(key, room, NOW)
    for bit in range(ROOM_ID_BITS["tag"]):
        with pytest.raises(RoomBindingError, match="forged tag") as err:
            check_room_id(key, room ^ (1 << (TAG_SHIFT + bit)), NOW)
        assert err.value.field == "room_tag"


def test_a_flip_of_expiry_or_nonce_and_another_key_are_refused():
    room = signed_room_id(KEY, NOW + 600, nonce=77)
    for bit in [*range(TAG_SHIFT), *range(TAG_SHIFT + ROOM_ID_BITS["tag"], 63)]:  # nonce bits, expiry bits
        with pytest.raises(RoomBindingError, match="forged tag"):
            check_room_id(KEY, room ^ (1 << bit), NOW)
    with pytest.raises(RoomBindingError, match="forged tag"):
        check_room_id(b"another key", room, NOW)


def test_expiry_rounds_up_to_the_minute_and_is_enforced():
    room = signed_room_id(KEY, NOW + 90)  # valid until NOW + 120 (the next whole minute)
    check_room_id(KEY, room, NOW + 119.9)
    for late in (NOW + 120, NOW + 10_000):
        with pytest.raises(RoomBindingError, match="expired") as err:
            check_room_id(KEY, room, late)
        assert err.value.field == "room_expiry"


@pytest.mark.parametrize("room", [-1, 1 << 63, 2**64 - 1, "12", 1.0, True, None])
def test_what_is_no_room_id_is_refused(room):
    with pytest.raises(RoomBindingError, match="not a signed room id") as err:
        check_room_id(KEY, room, NOW)
    assert err.value.field == "room_tag"


def test_a_random_unsigned_id_is_refused():
    import random

    rng = random.Random(31)
    for _ in range(200):  # SGLang's own router draws random.randint(0, 2**63 - 1)
        with pytest.raises(RoomBindingError, match="forged tag"):
            check_room_id(KEY, rng.randrange(1 << 63), NOW)


@pytest.mark.parametrize(("kw", "field"), [
    ({"key": b""}, "room_key"),
    ({"expires_at": ROOM_ID_EPOCH - 60}, "expires_at"),
    ({"expires_at": ROOM_ID_EPOCH + 60 * 2**22}, "expires_at"),
    ({"nonce": 512}, "nonce"), ({"nonce": -1}, "nonce"), ({"nonce": True}, "nonce"),
])
def test_bad_signing_input_is_refused_by_field(kw, field):
    args = {"key": KEY, "expires_at": NOW + 60, **kw}
    with pytest.raises(RoomBindingError) as err:
        signed_room_id(**args)
    assert err.value.field == field
