"""The admission machine (prefill/admission.py) on its own: its table, and every event it takes
fed through its one door (a new event type without a case here fails)."""

from __future__ import annotations

import pytest

from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.poll import IllegalTransition
from kvbridge.transfer.prefill import admission as am
from kvbridge.transfer.prefill.admission import (
    EVENTS,
    TABLE,
    TRANSITIONS,
    Admission,
    Admitted,
    Arrived,
    EchoGiven,
    Forget,
    KeyProofGiven,
    NonceWritten,
    Overdue,
    Proof,
    Refused,
    RegistrationRead,
    WriteNonce,
)
from kvbridge.transfer.prefill.targets import DecodePeer, Resolve

C = b"conn"
ME = "tcp://127.0.0.1:7000"
KEY = ProofKey()


def peer() -> DecodePeer:
    return DecodePeer(rank_id="r1", label="d/dp0/tp0", session="127.0.0.1:1", fingerprint="x", buffers=[], aux={},
                      instance="d", scratch=(1 << 40, 4096), proof_key=KEY.public_hex)


def ping(seq: int = 1) -> wire.Ping:
    return wire.Ping(decode_rank="d/dp0/tp0", seq=seq, decode_rank_id="r1")


def of(out, kind):
    return [a for a in out if isinstance(a, kind)]


def test_the_table_moves_only_along_the_transitions():
    """Every (event, state) row of TABLE leads only to states TRANSITIONS allows from there, and
    every event type the door takes is named in EVENTS."""
    for (event, state), targets in TABLE.items():
        assert event in EVENTS
        assert targets <= TRANSITIONS[state] | ({state} if event is Arrived else set()), (event, state)
    assert set(am._HANDLERS) == set(EVENTS)
    assert TRANSITIONS[Proof.PROVEN] == TRANSITIONS[Proof.REFUSED] == frozenset()


def _proven(a: Admission, now: float = 1.0) -> None:
    """Walk connection C through the whole proof; returns once it is proven."""
    out = a.feed(Arrived(C, ping(), "r1", None, now))
    (res,) = of(out, Resolve)
    assert res.rank_id == "r1" and a.conns[C].state is Proof.RESOLVING
    out = a.feed(RegistrationRead("r1", peer(), None, now))
    (ch,) = [s.msg for s in of(out, Send)]
    assert isinstance(ch, wire.KeyChallenge) and a.conns[C].state is Proof.KEYING
    out = a.feed(KeyProofGiven(C, wire.KeyProof(signature=KEY.sign("r1", ME, ch.nonce)), peer(), ME, now))
    (w,) = of(out, WriteNonce)
    assert a.conns[C].state is Proof.WRITING
    out = a.feed(NonceWritten(C, None, now))
    assert [type(s.msg) for s in of(out, Send)] == [wire.Challenge] and a.conns[C].state is Proof.CHALLENGED
    out = a.feed(EchoGiven(C, wire.ChallengeEcho(nonce=w.nonce), peer(), now))
    assert out == [Admitted(C, ping())] and a.conns[C].state is Proof.PROVEN  # the held Ping, delivered


def reading_peer() -> DecodePeer:
    p = peer()
    p.by_read = True
    return p


def _keyed_by_read(a: Admission, ident: bytes, now: float = 1.0) -> wire.Challenge:
    """Walk ``ident`` to its memory challenge (proof by read); returns the Challenge."""
    a.feed(Arrived(ident, ping(), "r1", reading_peer(), now))
    (ch,) = [s.msg for s in of(a.feed(Arrived(ident, ping(2), "r1", reading_peer(), now)), Send)] or [None]
    key_ch = a.conns[ident].key_nonce
    out = a.feed(KeyProofGiven(ident, wire.KeyProof(signature=KEY.sign("r1", ME, key_ch)), reading_peer(), ME, now))
    assert not of(out, WriteNonce)  # nothing is written: it will write its proof itself
    (mem,) = [s.msg for s in of(out, Send)]
    assert isinstance(mem, wire.Challenge) and len(mem.nonce) == wire.NONCE_BYTES and mem.offset % 64 == 0
    assert a.conns[ident].state is Proof.CHALLENGED
    return mem


def _proven_by_read(a: Admission, ident: bytes, now: float = 1.0) -> None:
    mem = _keyed_by_read(a, ident, now)
    out = a.feed(EchoGiven(ident, wire.ChallengeEcho(nonce=b"\0" * 32), reading_peer(), now))
    (rp,) = of(out, am.ReadProof)
    assert rp.src == (1 << 40) + mem.offset and rp.length == 64 and rp.session == "127.0.0.1:1"
    assert a.conns[ident].state is Proof.READING
    written = KEY.sign_memory("r1", ME, mem.nonce, mem.offset)  # what the rank wrote into its scratch
    out = a.feed(am.ProofRead(ident, written, None, reading_peer(), ME, now))
    assert out == [Admitted(ident, ping()), Admitted(ident, ping(2))] and a.conns[ident].state is Proof.PROVEN


def test_proof_by_read_writes_nothing_and_refuses_memory_without_the_keys_proof():
    """Issue 32: the memory step reads what the rank wrote into its own scratch region; prefill
    never writes there. Memory holding anything but the registration key's signature over this
    challenge (the victim's memory an impostor named, a proof for another offset or nonce, a
    signature by another key) is challenged again at a fresh offset, then refused; a failed read
    is refused by name. No WriteNonce in any of it."""
    a = Admission("p/cp0")
    _proven_by_read(a, b"good")
    other = ProofKey()
    for ident, forge in ((b"victim-memory", lambda m: b"\0" * 64),
                         (b"other-key", lambda m: other.sign_memory("r1", ME, m.nonce, m.offset)),
                         (b"stale", lambda m: KEY.sign_memory("r1", ME, m.nonce, m.offset + 64))):
        mem = _keyed_by_read(a, ident)
        outs = []
        for _ in range(am.PROOF_ATTEMPTS):
            outs += a.feed(EchoGiven(ident, wire.ChallengeEcho(nonce=b"\0" * 32), reading_peer(), 1.0))
            out = a.feed(am.ProofRead(ident, forge(mem), None, reading_peer(), ME, 1.0))
            outs += out
            again = [s.msg for s in of(out, Send) if isinstance(s.msg, wire.Challenge)]
            mem = again[0] if again else mem
        assert a.conns[ident].state is Proof.REFUSED and "held no proof by its key" in a.conns[ident].why
        assert not of(outs, WriteNonce) and of(outs, Refused)
    _keyed_by_read(a, b"unreadable")
    a.feed(EchoGiven(b"unreadable", wire.ChallengeEcho(nonce=b"\0" * 32), reading_peer(), 1.0))
    a.feed(am.ProofRead(b"unreadable", b"", "rc -1", reading_peer(), ME, 1.0))
    assert "could not be read" in a.conns[b"unreadable"].why


def test_every_event_type_is_fed_through_the_door():
    a = Admission("p/cp0")
    fed = set()
    _proven(a)
    fed |= {Arrived, RegistrationRead, KeyProofGiven, NonceWritten, EchoGiven}
    _proven_by_read(a, b"by-read")
    fed.add(am.ProofRead)
    assert a.feed(Arrived(C, ping(2), "r1", peer(), 1.1)) == [Admitted(C, ping(2))]  # proven: at once
    # a connection that says it is another registration: refused by name, nothing else
    (ref,) = a.feed(Arrived(b"x", ping(), "r9", None, 1.1))
    assert isinstance(ref, Refused) and "'r9'" in ref.why
    # the clock: a connection silent after its KeyChallenge is refused, its held message answered
    a.feed(Arrived(b"y", wire.Ping(decode_rank="d/dp0/tp0", seq=1, decode_rank_id="r1"), "r1", peer(), 2.0))
    assert a.conns[b"y"].state is Proof.KEYING
    out = a.feed(Overdue(2.0 + a.timeout + 0.1))
    fed.add(Overdue)
    (ref,) = of(out, Refused)
    assert "no key proof within" in ref.why and "d/dp0/tp0" in ref.why and a.conns[b"y"].state is Proof.REFUSED
    assert a.feed(Forget(frozenset({C}))) == []
    fed.add(Forget)
    assert set(a.conns) == {C}  # the refused connection, no longer heard from, is forgotten
    assert fed == set(EVENTS)
    with pytest.raises(TypeError, match="does not take"):
        a.feed(object())


def test_a_state_change_outside_the_table_raises():
    a = Admission("p/cp0")
    c = a.prove(C, "r1")
    with pytest.raises(IllegalTransition):
        am._to(c, Proof.KEYING)


def test_an_echo_nobody_waits_for_is_refused_and_a_late_nonce_answer_ignored():
    a = Admission("p/cp0")
    (ref,) = a.feed(EchoGiven(C, wire.ChallengeEcho(nonce=bytes(32)), peer(), 1.0))
    assert isinstance(ref, Refused) and "no challenge is waiting" in ref.why
    assert a.feed(NonceWritten(C, None, 1.0)) == []


def _big(seq: int, pages: int) -> wire.TransferRequest:
    return wire.TransferRequest(room=seq, decode_rank="d/dp0/tp0", decode_rank_id="r1", page_ids=b"\0" * (4 * pages),
                                first_page=0, pools=["target"], aux_slot=0, num_tokens=1, deadline_ms=1000,
                                want_digest=False, fingerprint="x", num_decode_ranks=1)


def test_a_held_requests_kind_units_count_in_its_weight():
    """The pool kinds' units travel in a dict (``kind_units``): a request carrying 400 KB of them
    weighs 400 KB while held, as its page list would."""
    plain = am.held_bytes(_big(0, 0))
    units = wire.TransferRequest(room=1, decode_rank="d/dp0/tp0", decode_rank_id="r1", page_ids=b"", first_page=0,
                                 pools=["target"], aux_slot=0, num_tokens=1, deadline_ms=1000, want_digest=False,
                                 fingerprint="x", num_decode_ranks=1, kind_units={"csa": b"\0" * 400_000})
    assert am.held_bytes(units) >= plain + 400_000


def test_messages_held_while_proving_are_capped_in_bytes_per_connection_and_in_all():
    """Issue 32: held messages were capped by count only (16 connections held +422 MiB on a
    prefill rank). Large requests on connections that never finish their proof are refused once
    their connection holds the per-connection cap, or all of them the total; those held are
    released (and counted off) when the proof settles."""
    a = Admission("p/cp0", max_waiting_bytes=3 << 20, max_waiting_bytes_per_connection=1 << 20)
    one = am.held_bytes(_big(0, 100_000))  # about 400 KB each
    assert 400_000 < one < 401_000
    refused = []
    for conn in range(6):
        ident = b"c%d" % conn
        for seq in range(3):
            out = a.feed(Arrived(ident, _big(seq, 100_000), "r1", None, 1.0))
            refused += of(out, am.Refused)
        assert a.conns[ident].waiting_bytes <= 1 << 20
    assert a.waiting_bytes <= 3 << 20
    # two fit per connection (the third is over 1 MiB), and the total stops the fourth connection on
    held = sum(len(c.waiting) for c in a.conns.values())
    assert held == 7 and len(refused) == 18 - 7 and "bytes of messages wait" in refused[0].why
    a.feed(RegistrationRead("r1", None, "gone", 2.0))  # every proof refused: what they held is answered
    assert a.waiting_bytes == 0 and all(c.waiting_bytes == 0 and not c.waiting for c in a.conns.values())
