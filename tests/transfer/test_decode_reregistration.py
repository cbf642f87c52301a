"""A decode rank that registers again while rooms are in flight (decode/machine.py,
"Re-registration"), driven by events alone: the rooms asked under the earlier registration keep
its connections (every message of theirs goes there, naming it), new rooms ask under the new one,
and the earlier connections close once no room can still send or receive on them. The same with
real endpoints, a daemon that restarts and the bytes checked: test_endpoints_local.py."""

from __future__ import annotations

import numpy as np

from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode import events as ev
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.machine import DecodeRooms
from kvbridge.transfer.ownership import PROOF_FAILED, ProofKey, verify_memory, verify_proof
from kvbridge.transfer.poll import KVPoll
from kvbridge.layout import deepseek_pools
from test_decode_room import SCHEMA, PAGE, ask, done, m, ms, of, requested, sends  # noqa: F401  (fixtures)


def vias(actions, msg_type):
    """(to, via, message) of every Send of ``msg_type``."""
    return [(a.to, a.via, a.msg) for a in of(actions, Send) if isinstance(a.msg, msg_type)]


def test_nothing_is_kept_when_no_room_was_asked(m):
    assert of(m.feed(ev.Registered("dec-2")), ev.Rename) == [ev.Rename("dec-2", frozenset())]
    assert not m.retired


def test_a_room_asked_before_the_re_registration_finishes_on_its_own_connections(m):
    """The room's prefill ranks answer it on the connections it asked on: decode keeps them
    (Rename keeps "dec-id"), pings the room's ranks there as "dec-id" (their targets' liveness) and
    as "dec-2" on the new ones, asks a new room as "dec-2", and closes the old connections at the
    scan after the room is done."""
    r = requested(m, room=7)  # asked p0 and p1 as dec-id
    assert of(m.feed(ev.Registered("dec-2")), ev.Rename) == [ev.Rename("dec-2", frozenset({"dec-id"}))]
    pings = vias(m.tick(1.6), wire.Ping)
    assert sorted((to, via or "", p.decode_rank_id) for to, via, p in pings) == [
        (("tcp://p0",), "", "dec-2"), (("tcp://p0",), "dec-id", "dec-id"),
        (("tcp://p1",), "", "dec-2"), (("tcp://p1",), "dec-id", "dec-id")]
    fresh = m.open(8, "pre", None, 1.7)  # (the topology is cached)
    (to, via, req), = vias(m.init(fresh, np.array([20, 21, 22]), 2, 10, 0, 1.7), wire.TransferRequest)
    assert via is None and req.decode_rank_id == "dec-2"
    # what prefill sends for room 7 comes on the old connections, and counts as any report does
    m.feed(ev.Message("tcp://p1", done(7, 1, [1]), 1.8, via="dec-id"))
    m.memory.land(1, 7)
    m.feed(ev.Message("tcp://p0", done(7, 0, [0, 2], aux=True, num_tokens=10), 1.9, via="dec-id"))
    assert r.state.state == KVPoll.Success
    assert of(m.tick(2.0), ev.DropRegistration) == [ev.DropRegistration("dec-id")] and not m.retired
    assert {p.decode_rank_id for _, _, p in vias(m.tick(2.6), wire.Ping)} == {"dec-2"}


def test_an_abort_goes_where_the_room_asked_and_the_old_connections_stay_until_every_sender_is_quiet(m):
    """Hard rule 6: the abort acts for the registration the room's targets are bound to, on its
    connections; the pages stay held, and so do those connections (the acks come on them), until
    every sender acknowledged."""
    r = requested(m, room=7)
    m.feed(ev.Registered("dec-2"))
    aborts = vias(m.abort(r, "the engine gave up", 1.5), wire.Abort)
    assert sorted((to, via, a.decode_rank_id) for to, via, a in aborts) == [
        (("tcp://p0",), "dec-id", "dec-id"), (("tcp://p1",), "dec-id", "dec-id")]
    m.feed(ev.Message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 1.6, via="dec-id"))
    assert not r.pages_releasable and not of(m.tick(1.7), ev.DropRegistration) and m.retired
    m.feed(ev.Message("tcp://p1", wire.AbortAck(room=7, cp_rank=1), 1.8, via="dec-id"))
    assert r.pages_releasable and of(m.tick(1.9), ev.DropRegistration) == [ev.DropRegistration("dec-id")]


def test_a_sender_that_refused_the_proof_is_asked_again_under_the_new_registration(m):
    """Nothing of the room was written by a sender that refused its request, so asking it again
    as "dec-2" is safe; the rest of the room stays on "dec-id"'s connections."""
    r = requested(m, room=7)
    m.feed(ev.Registered("dec-2"))
    refusal = wire.ErrorReply(ref_type=wire.TransferRequest.TAG, room=7,
                              reason=f"decode registration dec-id {PROOF_FAILED}: not registered")
    assert m.feed(ev.Message("tcp://p1", refusal, 1.5, via="dec-id")) == ()
    (to, via, req), = vias(m.tick(3.6), wire.TransferRequest)
    assert to == ("tcp://p1",) and via is None and req.decode_rank_id == "dec-2"
    assert r.asked_as == {"tcp://p0": "dec-id", "tcp://p1": "dec-2"}
    (to, via, abort), = [a for a in vias(m.abort(r, "over", 3.7), wire.Abort) if a[0] == ("tcp://p0",)]
    assert via == "dec-id" and abort.decode_rank_id == "dec-id"


def test_the_deciders_ticket_for_the_earlier_registration_is_handed_on_as_it(m):
    r = requested(m, room=7, cp=3)
    m.feed(ev.Registered("dec-2"))
    t = wire.RoomTicket(room=7, decode_rank_id="dec-id", decider="rank0", instance="dec", decode_rank="dec/dp0/tp0",
                        binding=b"", signature=bytes(64))
    (to, via, msg), = vias(m.feed(ev.Message("tcp://p0", t, 1.5, via="dec-id")), wire.RoomTicket)
    assert to == ("tcp://p1", "tcp://p2") and via == "dec-id" and msg is t
    ours = wire.RoomTicket(room=7, decode_rank_id="dec-2", decider="rank0", instance="dec", decode_rank="dec/dp0/tp0",
                           binding=b"", signature=bytes(64))
    assert vias(m.feed(ev.Message("tcp://p0", ours, 1.6)), wire.RoomTicket) == []  # not the claim we made
    assert r.state.state == KVPoll.Transferring


def test_a_slot_grant_goes_on_the_connection_of_the_registration_the_room_asked_under(ms):
    requested(ms, room=7)
    ms.feed(ev.Registered("dec-2"))
    (to, via, grant), = vias(ms.feed(ev.Message("tcp://p0", ask(ms, 7, 0, 0, 10), 1.5, via="dec-id")), wire.SlotGrant)
    assert to == ("tcp://p0",) and via == "dec-id" and grant.room == 7


def test_a_challenge_on_an_earlier_registrations_connection_is_answered_as_that_registration():
    """A connection opened just before the re-registration may still be proving itself: its
    KeyChallenge is signed for the registration its Hello named, and the answer goes back on it."""
    key = ProofKey()
    m = DecodeRooms(DecodeConfig(instance="d"), deepseek_pools(num_layers=2, page_size=PAGE, index=False,
                                                               draft_layers=0), SCHEMA, proof_key=key)
    m.feed(ev.Registered("r1"))
    m.feed(ev.Registered("r2"))
    nonce = bytes(range(32))
    (to, via, proof), = vias(m.feed(ev.Message("tcp://p:1", wire.KeyChallenge(nonce=nonce), 1.0, via="r1")),
                             wire.KeyProof)
    assert via == "r1" and verify_proof(key.public_hex, "r1", "tcp://p:1", nonce, proof.signature)
    assert not verify_proof(key.public_hex, "r2", "tcp://p:1", nonce, proof.signature)
    (_, via, proof), = vias(m.feed(ev.Message("tcp://p:1", wire.KeyChallenge(nonce=nonce), 1.0, via="r2")),
                            wire.KeyProof)
    assert via is None and verify_proof(key.public_hex, "r2", "tcp://p:1", nonce, proof.signature)
    (w,) = of(m.feed(ev.Message("tcp://p:1", wire.Challenge(offset=64, nonce=nonce), 1.1, via="r1")), ev.WriteProof)
    assert w.via == "r1" and verify_memory(key.public_hex, "r1", "tcp://p:1", nonce, 64, w.proof)
    (echo,) = of(m.feed(ev.Message("tcp://p:1", wire.Challenge(offset=32), 1.2, via="r1")), ev.EchoScratch)
    assert echo == ev.EchoScratch("tcp://p:1", 32, "r1")


def test_a_staged_rooms_old_connections_stay_while_a_slot_of_it_is_quarantined(ms):
    """Staged only, a failed room's pages are free at once, but a slot a sender may still write
    into is quarantined until that sender says it is quiet, on the room's connection: the
    connection stays open until then."""
    r = requested(ms, room=7)
    vias(ms.feed(ev.Message("tcp://p0", ask(ms, 7, 0, 0, 10), 1.5)), wire.SlotGrant)  # slot 0 granted to cp0
    ms.feed(ev.Registered("dec-2"))
    ms.abort(r, "the engine gave up", 1.6)
    assert r.pages_releasable and ms.staging.area.slots_of(7)
    assert not of(ms.tick(1.7), ev.DropRegistration)
    ms.feed(ev.Message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 1.8, via="dec-id"))
    assert not ms.staging.area.slots_of(7)
    assert of(ms.tick(1.9), ev.DropRegistration) == [ev.DropRegistration("dec-id")]
