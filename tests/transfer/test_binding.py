"""A room bound to its request (``transfer/binding.py``): the digest, the claim table and room
signatures as pure functions; then the claim of a bound room through real endpoints in one
process (local engine, real bootstrap daemon): another request's claim is refused at once,
nothing written, and the owner is served afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import wait_final, wait_until
from _local import PAGE
from kvbridge import KVPoll, RoomBindingError, room_binding, sign_room, verify_room
from kvbridge.transfer.binding import claim_refusal, engine_binding_refusal
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes

PROMPT = list(range(100, 114))  # 14 tokens: 4 pages of 4, the last one partial


def test_the_digest_covers_every_token_and_the_count():
    b = room_binding(PROMPT)
    assert len(b) == 16 and room_binding(np.array(PROMPT)) == b
    assert room_binding(PROMPT + [7]) != b  # a longer prompt ending in the same page
    assert room_binding(PROMPT[:-1] + [PROMPT[-1] + 1]) != b  # same length, one token differs
    assert room_binding(PROMPT + [7], num_tokens=14) == b  # the room carries a prefix of the ids
    for bad in (0, 15):
        with pytest.raises(RoomBindingError, match="num_tokens"):
            room_binding(PROMPT, num_tokens=bad)


@pytest.mark.parametrize("room_b, claimed, claim, refused", [
    (None, None, b"x" * 16, False),   # nothing known yet: the first claim sets what the engine must match
    (None, b"a" * 16, b"a" * 16, False),
    (None, b"a" * 16, b"b" * 16, True),
    (b"", None, b"b" * 16, False),    # the engine binds nothing
    (b"a" * 16, None, b"a" * 16, False),
    (b"a" * 16, None, b"b" * 16, True),
    (b"a" * 16, None, b"", True),     # a bound room refuses a claim without a digest
])
def test_the_claim_table(room_b, claimed, claim, refused):
    why = claim_refusal(room_b, claimed, claim, room=7, rank="p/cp0", decode_rank="d/tp0")
    assert (why is not None) == refused
    if refused:
        assert "room 7" in why and "bound to another request" in why and "d/tp0" in why


def test_the_engine_must_agree_with_a_claim_that_came_first():
    assert engine_binding_refusal(b"a" * 16, None, room=3) is None
    assert engine_binding_refusal(b"", b"b" * 16, room=3) is None
    assert "another request" in engine_binding_refusal(b"a" * 16, b"b" * 16, room=3)


def test_room_signatures_verify_expire_and_bind():
    key, room, exp, b = b"k" * 32, 12345, 2_000_000_000, room_binding(PROMPT)
    sig = sign_room(key, room, exp)
    verify_room(key, room, exp, sig, now=exp - 1)
    verify_room(key, room, exp, sig, now=exp - 1, binding=b)  # unbound signature: any request
    bound = sign_room(key, room, exp, b)
    verify_room(key, room, exp, bound, now=exp - 1, binding=b)
    cases = [
        (dict(key=b"other"), "kvbridge_room_sig"),  # forged: another key
        (dict(room=room + 1), "kvbridge_room_sig"),  # another room
        (dict(expires_at=exp + 1), "kvbridge_room_sig"),  # expiry moved
        (dict(now=exp), "kvbridge_room_expires"),  # expired
        (dict(signature="00" * 32), "kvbridge_room_sig"),
        (dict(signature=None), "kvbridge_room_sig"),
        (dict(expires_at="soon"), "kvbridge_room_expires"),
        (dict(signature=bound, binding=room_binding(PROMPT + [1])), "kvbridge_room_sig"),  # another request
    ]
    for change, field in cases:
        args = dict(key=key, room=room, expires_at=exp, signature=sig, now=exp - 1, binding=b"")
        if "signature" not in change and "binding" in change:
            args["signature"] = bound
        args.update(change)
        with pytest.raises(RoomBindingError) as e:
            verify_room(args.pop("key"), args.pop("room"), args.pop("expires_at"), args.pop("signature"), **args)
        assert e.value.field == field, change


def test_another_requests_claim_is_refused_at_once_and_the_owner_is_served(cluster):
    c = cluster()
    room, n = 0x5151, 14
    pages = np.arange(-(-n // PAGE)) + 20
    senders = c.send(room, n, binding=room_binding(PROMPT))
    foreign = c.decode.receiver(room, f"{c.name}-p")
    foreign.init(pages, 0, n, binding=room_binding(PROMPT + [7], num_tokens=n + 1)[:16])
    wait_final([foreign], 20)
    assert foreign.poll() == KVPoll.Failed and "bound to another request" in foreign.failure_reason
    assert all(s.poll() != KVPoll.Failed for s in senders)  # the room is untouched
    for b in c.dbufs.values():
        assert (as_bytes(b).reshape(64, -1)[pages] == SENTINEL_BYTE).all()  # nothing written
    assert wait_until(lambda: foreign.pages_releasable, 10)
    foreign.close()
    owner = c.decode.receiver(room, f"{c.name}-p", wait=10)
    owner.init(pages, 1, n, binding=room_binding(PROMPT))
    wait_final([owner, *senders], 30)
    assert owner.poll() == KVPoll.Success, owner.failure_reason
    assert c.verified(room, n, pages)


def test_a_claim_before_the_engine_opens_must_match_its_binding(cluster):
    c = cluster(cp=1)
    room, n = 0x5152, 8
    r = c.decode.receiver(room, f"{c.name}-p")
    r.init(np.array([3, 4]), 0, n, binding=room_binding(PROMPT[:n]))
    s = c.prefill[0].sender(room)
    assert wait_until(lambda: s.poll() == KVPoll.WaitingForInput, 10)  # decode asked first
    with pytest.raises(RoomBindingError, match="another request"):
        s.init(n, binding=room_binding(PROMPT[1:n + 1]))
    s.abort("bound to another request")
    wait_final([r], 20)
    assert r.poll() == KVPoll.Failed


def test_a_room_bound_when_it_opens_refuses_a_foreign_claim_before_init(cluster):
    """KVSender.bind (SGLang: decode asks before prefill's init): the binding is said at open, so a
    claim of another request is refused at once, the owner's is accepted, and init() keeps it."""
    c = cluster(cp=1)
    room, n = 0x5153, 8
    own = room_binding(PROMPT[:n])
    s = c.prefill[0].sender(room)
    s.bind(own)
    foreign = c.decode.receiver(room, f"{c.name}-p")
    foreign.init(np.array([3, 4]), 0, n, binding=room_binding(PROMPT[1:n + 1]))
    wait_final([foreign], 20)
    assert foreign.poll() == KVPoll.Failed and "bound to another request" in foreign.failure_reason
    assert s.poll() == KVPoll.Bootstrapping  # the room is untouched, still waiting for its owner
    with pytest.raises(RoomBindingError, match="was bound to"):
        s.bind(room_binding(PROMPT[2:n + 2]))
    assert wait_until(lambda: foreign.pages_releasable, 10)
    foreign.close()
    owner = c.decode.receiver(room, f"{c.name}-p", wait=10)
    owner.init(np.array([5, 6]), 1, n, binding=own)
    assert wait_until(lambda: s.poll() == KVPoll.WaitingForInput, 10)
    with pytest.raises(RoomBindingError, match="was bound to"):
        s.init(n, binding=room_binding(PROMPT[2:n + 2]))
    s.init(n)  # no binding given: the one said at open stands
    s.abort("test over")
    wait_final([owner], 20)
