"""Prefill's rooms as a state machine, driven by events alone: no socket, no thread, no clock
(the time is passed in), no engine (the test plays the shell: it answers each PostWrite with
``posted`` and later ``write_final``). Every abort/failure order we can name, and what the
machine asks its shell to do for each (Send, PostWrite, Resolve, ReleaseAux, FreeRoom)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import KVBridgeError, LayoutError, RoomInUse
from kvbridge.layout import AuxSchema, BufferDesc, OwnerLanes, preset_pools
from kvbridge.transfer.channel import wire
from kvbridge.transfer.actions import FreeRoom, Send
from kvbridge.transfer.aux_rows import RegionAddr
from kvbridge.transfer.engine import WriteState, WriteStatus
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.admission import PROOF_ATTEMPTS, WriteNonce
from kvbridge.transfer.prefill.targets import DecodePeer, Resolve
from kvbridge.transfer.prefill.events import AuxFrom, Closing, PostWrite, ReleaseAux
from kvbridge.transfer.prefill.machine import PrefillRooms
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.rooms import Stage
from _machines import prefill_machine

SPECS = preset_pools("deepseek-v3.2-fp8", num_layers=2, page_size=4)
AUX = AuxSchema.standard(16, "bfloat16", 1)
DONE = WriteStatus(WriteState.DONE)
D = b"decode-connection"
HELLO = {D: "r1"}  # the registration each connection named in its Hello
ME = "tcp://127.0.0.1:7000"  # this prefill rank's control endpoint (what KeyProofs sign)
KEYS = {"r2": ProofKey()}  # what decode registration r2's process holds


def bufs(shift: int, capacity: int = 16) -> list[BufferDesc]:
    return [BufferDesc(p, layer, shift + 10**6 * (i * 10 + layer), capacity, s.bytes_per_page)
            for i, (p, s) in enumerate(SPECS.items()) for layer in s.layer_ids]


def regions(base: int) -> dict[str, RegionAddr]:
    return {r.name: RegionAddr(r.name, base + AUX.offsets[r.name], 4, AUX.row_bytes) for r in AUX.regions}


AUXF = AuxFrom(regions(1 << 30), 0)  # where the shell staged a room's aux row (plain data, no callback)


def peer() -> DecodePeer:
    return DecodePeer(rank_id="r1", label="d/dp0/tp0", session="127.0.0.1:1", fingerprint="x",
                      buffers=bufs(1 << 40), aux=regions(1 << 50), instance="d",
                      staging=(1 << 45, 3 * 4096, 4096))  # its registered staging area: 3 slots of 4 KiB


def request(room: int = 1, num_tokens: int = 7, deadline_ms: int = 10_000, fingerprint: str = "x",
            decode_rank: str = "d/dp0/tp0", rank_id: str = "r1") -> wire.TransferRequest:
    pages = -(-num_tokens // 4)
    return wire.TransferRequest(
        room=room, decode_rank=decode_rank, decode_rank_id=rank_id, page_ids=wire.pack_pages(np.arange(pages) + 3),
        first_page=0, pools=sorted(SPECS), aux_slot=1, num_tokens=num_tokens, deadline_ms=deadline_ms,
        want_digest=False, fingerprint=fingerprint, num_decode_ranks=1)


@pytest.fixture
def m():
    machine = prefill_machine(PrefillConfig(instance="p", peer_timeout=5.0, target_timeout=60.0), SPECS, bufs(0), AUX,
                           "x", hello_of=lambda ident: HELLO.get(ident), endpoint=lambda: ME)
    machine.peers.entries["r1"] = peer()  # its registration was read before
    machine.admission.prove(D, "r1")  # and connection D proved it holds its memory
    return machine


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def msgs(actions, msg_type):
    return [a.msg for a in of(actions, Send) if isinstance(a.msg, msg_type)]


def _packed(room: int) -> np.ndarray:
    """A packed aux row echoing ``room`` (the engine's row; its content is not looked at here)."""
    r = np.zeros(1, dtype=AUX.dtype)
    r["room"][0] = room
    return r


class Shell:
    """What the endpoint does with PostWrite: hand out engine handles, keep them."""

    def __init__(self, m: PrefillRooms) -> None:
        self.m, self.next = m, 100
        self.posted: list[tuple[int, PostWrite]] = []

    def run(self, actions, now: float):
        out = []
        for a in actions:
            if isinstance(a, PostWrite):
                if not a.target.active:
                    out += self.run(self.m.post_failed(a, None, now), now)
                    continue
                self.next += 1
                self.m.posted(a, self.next, now)
                self.posted.append((self.next, a))
            out.append(a)
        return out


def opened_and_asked(m, room: int = 1, now: float = 1.0, num_tokens: int = 7):
    r = m.open(room, now)
    m.engine_init(r, num_tokens, None, now)
    acts = m.message(D, request(room, num_tokens), now)
    assert r.state.state == KVPoll.WaitingForInput and not of(acts, PostWrite)
    return r


def send_all(m, sh, r, now: float = 1.1):
    """The whole request in one chunk with the aux row: one write."""
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(r.room), None)
    acts = sh.run(m.post(r, now, AUXF), now)
    (w,) = of(acts, PostWrite)
    return w


def test_a_room_writes_once_reports_once_and_leaves_a_tombstone(m):
    sh = Shell(m)
    r = opened_and_asked(m)
    w = send_all(m, sh, r)
    assert r.state.state == KVPoll.Transferring and w.session == "127.0.0.1:1" and len(w.src) == len(w.length)
    (handle, _), = sh.posted
    acts = m.write_final(handle, DONE, 1.2)
    (report,) = msgs(acts, wire.PagesDone)
    assert report.status == "ok" and report.aux and report.num_tokens == 7
    assert r.state.state == KVPoll.Success and of(acts, ReleaseAux) == [ReleaseAux(1)]
    assert of(m.close(r, 1.3), FreeRoom) == [FreeRoom(1)] and r.life.stage == Stage.CLOSED
    late = msgs(m.message(D, request(1), 1.4), wire.PagesDone)
    assert late[0].status == "failed" and "was already closed" in late[0].reason and "Success" in late[0].reason


def test_chunks_sent_before_the_request_are_posted_in_the_turn_that_receives_it(m):
    r = m.open(2, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(2), None)
    assert m.post(r, 1.0, AUXF) == ()  # nobody asked yet
    assert len(of(m.message(D, request(2), 1.1), PostWrite)) == 1


def test_a_request_fed_between_the_last_chunk_and_its_post_waits_for_the_aux_rows_source(m):
    """send() feeds its Chunk, then its Post (where the aux row is written from); the shell feeds
    queued events after each, so a decode request may be fed between them: the last chunk is
    not posted before the Post (it would carry an aux row with no source), and the Post posts it."""
    r = m.open(3, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(3), None)
    acts = m.message(D, request(3), 1.1)
    assert not of(acts, PostWrite) and not msgs(acts, wire.PagesDone) and r.state.state != KVPoll.Failed
    (w,) = of(m.post(r, 1.2, AUXF), PostWrite)
    assert w.target.aux_posted and r.state.state != KVPoll.Failed


def test_decode_asking_first_opens_an_unattached_room_the_engine_attaches_to(m):
    m.message(D, request(3), 1.0)
    r = m.rooms[3]
    assert r.life.stage == Stage.UNATTACHED
    assert m.open(3, 1.1) is r and r.life.stage == Stage.OPEN


def test_an_unknown_registration_is_resolved_once_then_refused_with_the_reason(m):
    m.peers.entries.clear()
    r = m.open(4, 1.0)
    m.engine_init(r, 7, None, 1.0)
    (ask,) = of(m.message(D, request(4), 1.0), Resolve)
    assert ask == Resolve("r1", "d/dp0/tp0")
    assert of(m.message(D, request(4, decode_rank="d/dp0/tp1"), 1.0), Resolve) == []  # one read per rank
    acts = m.resolved("r1", None, "not registered", 1.1)
    assert [x.status for x in msgs(acts, wire.PagesDone)] == ["failed", "failed"]
    assert r.state.state == KVPoll.Failed and "not registered" in r.state.reason


def test_a_fingerprint_mismatch_is_refused_and_writes_nothing(m):
    r = m.open(5, 1.0)
    m.engine_init(r, 7, None, 1.0)
    acts = m.message(D, request(5, fingerprint="other"), 1.0)
    (report,) = msgs(acts, wire.PagesDone)
    assert report.status == "failed" and "hard rule 7" in report.reason and not of(acts, PostWrite)
    assert r.state.state == KVPoll.Failed


def test_abort_before_the_request_refuses_the_late_request(m):
    r = m.open(6, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.abort(r, "engine gave up", 1.0)
    assert r.state.state == KVPoll.Failed
    (report,) = msgs(m.message(D, request(6), 1.1), wire.PagesDone)
    assert report.status == "failed" and "already ended" in report.reason and "engine gave up" in report.reason


def test_decode_abort_mid_write_is_acked_only_once_the_write_is_final(m):
    sh = Shell(m)
    r = opened_and_asked(m, 7)
    send_all(m, sh, r)
    acts = m.message(D, wire.Abort(room=7, decode_rank="d/dp0/tp0", reason="gone", decode_rank_id="r1"), 1.2)
    assert msgs(acts, wire.AbortAck) == [] and r.state.state != KVPoll.Failed  # a write may still land
    (handle, _), = sh.posted
    acts = m.write_final(handle, DONE, 1.3)
    assert msgs(acts, wire.PagesDone) == []  # the write finished, but the target aborted: no ok report
    assert len(msgs(acts, wire.AbortAck)) == 1 and r.state.state == KVPoll.Failed and "gone" in r.state.reason


def test_a_write_failure_then_abort_reports_the_failure_and_acks_at_once(m):
    sh = Shell(m)
    r = opened_and_asked(m, 8)
    send_all(m, sh, r)
    (handle, _), = sh.posted
    acts = m.write_final(handle, WriteStatus(WriteState.FAILED, "queue full"), 1.3)
    (report,) = msgs(acts, wire.PagesDone)
    assert report.status == "failed" and "queue full" in report.reason and r.state.state == KVPoll.Failed
    acts = m.message(D, wire.Abort(room=8, decode_rank="d/dp0/tp0", reason="x", decode_rank_id="r1"), 1.4)
    assert len(msgs(acts, wire.AbortAck)) == 1


def test_a_write_refused_at_submission_fails_the_target_and_the_next_chunk_is_not_posted(m):
    sh = Shell(m)
    r = opened_and_asked(m, 9)
    m.chunk(r, [0], np.array([5]), 4, False, None, None)
    m.chunk(r, [1], np.array([6]), None, True, _packed(9), None)
    first, second = of(m.post(r, 1.1, AUXF), PostWrite)
    acts = m.post_failed(first, "engine refused", 1.2)
    assert msgs(acts, wire.PagesDone) == []  # the second write is still counted in flight
    acts = sh.run([second], 1.2)  # the shell does not submit a write of a failed target
    assert sh.posted == [] and r.state.state == KVPoll.Failed and "engine refused" in r.state.reason


def test_a_silent_decode_rank_fails_its_target_and_a_late_completion_reports_no_success(m):
    sh = Shell(m)
    r = opened_and_asked(m, 10, now=1.0)
    send_all(m, sh, r, now=1.1)
    acts = m.tick(7.0)  # nothing heard from it for 6 s (peer_timeout 5)
    assert msgs(acts, wire.PagesDone) == [] and r.state.state != KVPoll.Failed  # its write is in flight
    (handle, _), = sh.posted
    acts = m.write_final(handle, DONE, 7.1)
    (report,) = msgs(acts, wire.PagesDone)
    assert report.status == "failed" and "presumed dead" in report.reason and r.state.state == KVPoll.Failed


def test_a_missed_deadline_fails_the_target(m):
    r = m.open(11, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.message(D, request(11, deadline_ms=500), 1.0)
    m.message(D, wire.Ping(decode_rank="d/dp0/tp0", seq=1), 1.9)
    (report,) = msgs(m.tick(2.0), wire.PagesDone)
    assert "deadline passed" in report.reason and r.state.state == KVPoll.Failed


def test_nobody_asking_within_target_timeout_fails_the_room(m):
    r = m.open(12, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.tick(62.0)
    assert r.state.state == KVPoll.Failed and "no decode ranks asked" in r.state.reason


def test_a_second_request_from_the_same_rank_and_forged_completions_are_refused(m):
    r = opened_and_asked(m, 13)
    (report,) = msgs(m.message(D, request(13), 1.1), wire.PagesDone)
    assert "asked twice" in report.reason
    assert m.write_final(424242, DONE, 1.2) == ()  # a handle the machine never posted: ignored


def test_close_during_drain_refuses_the_id_until_the_write_is_final(m):
    sh = Shell(m)
    r = opened_and_asked(m, 14)
    send_all(m, sh, r)
    m.close(r, 1.2)  # the engine lets go while the write is in flight
    with pytest.raises(RoomInUse, match=r"draining: 1 write\(s\) of the previous room still in flight") as err:
        m.open(14, 1.3)
    assert err.value.draining
    (handle, _), = sh.posted
    acts = m.write_final(handle, DONE, 1.4)
    assert of(acts, FreeRoom) == [FreeRoom(14)] and r.state.state == KVPoll.Failed
    assert "closed room 14's sender" in r.state.reason
    assert m.open(14, 1.5) is not r


def test_an_open_room_is_refused_and_a_bad_chunk_keeps_nothing(m):
    r = m.open(15, 1.0)
    with pytest.raises(RoomInUse, match="open: a KVSender still holds it"):
        m.open(15, 1.0)
    with pytest.raises(LayoutError, match="before init"):
        m.chunk(r, [0], np.array([5]), 4, False, None, None)
    m.engine_init(r, 7, None, 1.0)
    with pytest.raises(LayoutError, match="aux row goes with the last chunk"):
        m.chunk(r, [0], np.array([5]), 4, False, _packed(15), None)
    assert r.chunks == []


def test_pings_are_answered_and_messages_a_prefill_rank_does_not_take_are_refused(m):
    (beat,) = msgs(m.message(D, wire.Ping(decode_rank="d/dp0/tp0", seq=9), 1.0), wire.Heartbeat)
    assert beat.seq == 9
    (err,) = msgs(m.message(D, wire.AbortAck(room=1, cp_rank=0), 1.0), wire.ErrorReply)
    assert "does not accept AbortAck" in err.reason
    assert m.message(D, KVBridgeError("bad frame"), 1.0) == ()


def test_shutting_down_refuses_new_rooms_and_requests(m):
    r = opened_and_asked(m, 16)
    m.feed(Closing())
    with pytest.raises(KVBridgeError, match="shutting down"):
        m.open(17, 1.0)
    (report,) = msgs(m.message(D, request(18), 1.0), wire.PagesDone)
    assert "shutting down" in report.reason
    m.shutdown("prefill rank p is shutting down", 1.1)
    assert r.state.state == KVPoll.Failed


def test_an_unattached_room_that_failed_lingers_so_the_engine_reads_why(m):
    m.message(D, request(19, deadline_ms=100), 1.0)
    m.tick(1.5)  # its deadline passed before the engine even opened it
    r = m.rooms[19]
    assert r.state.state == KVPoll.Failed
    m.gc(2.0)
    assert m.open(19, 2.1) is r  # attached: sender(19) reads the reason
    m.close(r, 2.2)
    assert 19 not in m.rooms


# -- who is on a connection: binding and the ownership proof (issue 20, findings 1 and 5) ------------

E = b"other-connection"


def fresh_peer(rank_id: str = "r2", instance: str = "d", scratch: tuple[int, int] | None = (1 << 45, 4096),
               label: str = "d/dp0/tp1", session: str = "127.0.0.1:2", keyed: bool = True) -> DecodePeer:
    p = DecodePeer(rank_id=rank_id, label=label, session=session, fingerprint="x", buffers=bufs(1 << 41),
                   aux=regions(1 << 51), instance=instance, scratch=scratch,
                   proof_key=KEYS[rank_id].public_hex if keyed else None)
    return p


def _signed(m, ident: bytes, acts, *, key: ProofKey | None = None, rank_id: str | None = None,
            endpoint: str = ME, now: float = 1.0):
    """Answer the KeyChallenge among ``acts`` as the registration's process does (or with
    another ``key``, ``rank_id`` or ``endpoint``); the machine's answer."""
    (ch,) = msgs(acts, wire.KeyChallenge)
    assert not of(acts, WriteNonce)  # nothing is written before the key proof
    rid = rank_id or HELLO[ident]
    signature = (key or KEYS[HELLO[ident]]).sign(rid, endpoint, ch.nonce)
    return m.message(ident, wire.KeyProof(signature=signature), now)


def test_a_message_naming_another_registration_than_its_hello_is_refused_and_nothing_happens(m):
    HELLO[E] = "r2"
    r = m.open(30, 1.0)
    m.engine_init(r, 7, None, 1.0)
    for msg in (request(30), wire.Abort(room=30, decode_rank="d/dp0/tp0", reason="x", decode_rank_id="r1"),
                wire.Ping(decode_rank="d/dp0/tp0", seq=1, decode_rank_id="r1")):
        acts = m.message(E, msg, 1.1)  # E said it is r2, the message acts for r1
        (err,) = msgs(acts, wire.ErrorReply)
        assert "names decode registration 'r1'" in err.reason and "'r2'" in err.reason, err
        assert len(acts) == 1
    assert r.state.state == KVPoll.Bootstrapping and not r.targets and r.holder is None


def _challenged(m, ident: bytes, rank_id: str, msg, now: float = 1.0):
    """Feed ``msg`` on a new connection: it waits; returns the nonce write the machine asked for."""
    HELLO[ident] = rank_id
    acts = _signed(m, ident, m.message(ident, msg, now), now=now)
    (w,) = of(acts, WriteNonce)
    assert not msgs(acts, wire.ErrorReply) and w.ident == ident and len(w.nonce) == wire.NONCE_BYTES
    return w


def test_a_new_connection_proves_its_memory_before_its_requests_are_served(m):
    m.peers.entries["r2"] = fresh_peer()
    r = m.open(31, 1.0)
    m.engine_init(r, 7, None, 1.0)
    w = _challenged(m, E, "r2", request(31, decode_rank="d/dp0/tp1", rank_id="r2"))
    assert not r.targets  # held until proven
    assert w.session == "127.0.0.1:2" and (1 << 45) <= w.dst < (1 << 45) + 4096
    (ch,) = msgs(m.nonce_written(E, None, 1.01), wire.Challenge)
    assert ch.offset == w.dst - (1 << 45)
    m.message(E, wire.ChallengeEcho(nonce=w.nonce), 1.02)
    assert "d/dp0/tp1" in r.targets and r.holder == ("d", "d/dp0/tp1")


def test_a_nonce_another_rank_overwrote_is_challenged_again_at_a_fresh_offset(m):
    """Two prefill ranks proving themselves to one decode rank at once may pick the same scratch
    offset; the earlier nonce is then replaced and its echo differs. A fresh nonce at a fresh
    offset follows, and the connection is proven by its echo."""
    m.peers.entries["r2"] = fresh_peer()
    r = m.open(33, 1.0)
    m.engine_init(r, 7, None, 1.0)
    w = _challenged(m, E, "r2", request(33, decode_rank="d/dp0/tp1", rank_id="r2"))
    m.nonce_written(E, None, 1.01)
    other = bytes(range(32))  # what the other rank wrote at the same offset
    (w2,) = of(m.message(E, wire.ChallengeEcho(nonce=other), 1.02), WriteNonce)
    assert w2.nonce != w.nonce and not r.targets
    (ch,) = msgs(m.nonce_written(E, None, 1.03), wire.Challenge)
    assert ch.offset == w2.dst - (1 << 45)
    m.message(E, wire.ChallengeEcho(nonce=w2.nonce), 1.04)
    assert "d/dp0/tp1" in r.targets


@pytest.mark.parametrize("how, why", [
    ("wrong_echo", "echoed other bytes"),
    ("write_failed", "nonce write into its scratch region failed: refused"),
    ("no_scratch", "has no scratch region"),
    ("no_key", "has no proof key"),
    ("alias_spelling", "not in canonical form"),
    ("silent", "no echo of the nonce within"),
    ("silent_key", "no key proof within"),
    ("other_key", "not a signature by the proof key"),
    ("other_registration", "not a signature by the proof key"),
    ("other_prefill", "not a signature by the proof key"),
    ("unregistered", "not registered"),
])
def test_a_connection_that_cannot_prove_its_memory_is_refused_naming_why(m, how, why):
    m.peers.entries["r2"] = fresh_peer(scratch=None if how == "no_scratch" else (1 << 45, 4096),
                                       keyed=how != "no_key",
                                       session="localhost:02" if how == "alias_spelling" else "127.0.0.1:2")
    if how == "unregistered":
        del m.peers.entries["r2"]
    r = m.open(32, 1.0)
    m.engine_init(r, 7, None, 1.0)
    HELLO[E] = "r2"
    acts = list(m.message(E, request(32, decode_rank="d/dp0/tp1", rank_id="r2"), 1.0))
    if how == "unregistered":
        (res,) = of(acts, Resolve)
        acts = m.resolved("r2", None, "registration r2 is not registered", 1.01)
    elif how == "silent_key":
        assert msgs(acts, wire.KeyChallenge)
        acts = m.tick(1.0 + m.admission.timeout + 0.1)
    elif how in ("other_key", "other_registration", "other_prefill"):
        # what an attacker who reads and writes every registered byte can sign: not with r2's key
        key = ProofKey() if how == "other_key" else None
        acts = _signed(m, E, acts, key=key, rank_id="r9" if how == "other_registration" else None,
                       endpoint="tcp://127.0.0.1:7001" if how == "other_prefill" else ME)
        assert not of(acts, WriteNonce)  # refused before any write: 0 bytes anywhere
    elif how not in ("no_scratch", "no_key", "alias_spelling"):
        acts = _signed(m, E, acts)
        (w,) = of(acts, WriteNonce)
        if how == "write_failed":
            acts = m.nonce_written(E, "refused", 1.01)
        elif how == "silent":
            m.nonce_written(E, None, 1.01)
            acts = m.tick(1.0 + m.admission.timeout + 0.1)
        else:  # every fresh nonce echoed wrong: refused after PROOF_ATTEMPTS tries
            for attempt in range(PROOF_ATTEMPTS):
                m.nonce_written(E, None, 1.01)
                acts = m.message(E, wire.ChallengeEcho(nonce=bytes(32)), 1.02)
                if attempt < PROOF_ATTEMPTS - 1:
                    assert of(acts, WriteNonce) and not msgs(acts, wire.ErrorReply)
    (err,) = msgs(acts, wire.ErrorReply)
    assert "could not prove it holds the memory it registered" in err.reason and why in err.reason, err
    assert "r2" in err.reason and err.room == 32
    assert not r.targets and r.state.state == KVPoll.Bootstrapping  # nothing else happened
    (again,) = msgs(m.message(E, wire.Ping(decode_rank="d/dp0/tp1", seq=1, decode_rank_id="r2"), 1.5),
                    wire.ErrorReply)
    assert "could not prove" in again.reason  # the connection stays refused


# -- room ids: first claim wins (finding 4) ------------------------------------------------------------

def _second_instance(m, ident: bytes = E) -> None:
    m.peers.entries["r2"] = fresh_peer(instance="intruder", label="intruder/dp0/tp0")
    HELLO[ident] = "r2"
    m.admission.prove(ident, "r2").instance = "intruder"


def intruder_request(room: int) -> wire.TransferRequest:
    return request(room, decode_rank="intruder/dp0/tp0", rank_id="r2")


def test_a_room_claimed_by_one_instance_is_refused_to_another_naming_the_holder(m):
    sh = Shell(m)
    _second_instance(m)
    r = opened_and_asked(m, 40)
    acts = m.message(E, intruder_request(40), 1.05)
    (err,) = msgs(acts, wire.ErrorReply)
    assert "claimed by decode instance d (rank d/dp0/tp0)" in err.reason and "intruder" in err.reason
    assert list(r.targets) == ["d/dp0/tp0"] and r.state.state == KVPoll.WaitingForInput
    send_all(m, sh, r)
    (handle, a), = sh.posted
    assert a.target.decode_rank == "d/dp0/tp0"  # served once, to the holder
    m.write_final(handle, DONE, 1.3)
    assert r.state.state == KVPoll.Success


def test_an_abort_from_another_instance_is_refused_and_never_fails_the_holders_room(m):
    sh = Shell(m)
    _second_instance(m)
    r = opened_and_asked(m, 41)
    acts = m.message(E, wire.Abort(room=41, decode_rank="intruder/dp0/tp0", reason="hostile", decode_rank_id="r2"),
                     1.05)
    (err,) = msgs(acts, wire.ErrorReply)
    assert "abort from decode instance intruder is refused" in err.reason and not msgs(acts, wire.AbortAck)
    assert r.state.state == KVPoll.WaitingForInput
    send_all(m, sh, r)
    (handle, _), = sh.posted
    m.write_final(handle, DONE, 1.3)
    assert r.state.state == KVPoll.Success


def test_the_second_instance_asking_first_holds_the_room_when_decode_asks_before_the_engine(m):
    """Claims are by arrival, also for a room decode asked for before the engine opened it."""
    _second_instance(m)
    m.message(E, intruder_request(42), 1.0)
    (err,) = msgs(m.message(D, request(42), 1.01), wire.ErrorReply)
    assert "claimed by decode instance intruder" in err.reason


def test_a_refused_connection_may_try_again_after_a_pause(m):
    """A nonce write may fail for a passing reason: messages within ``retry_s`` of the refusal
    are refused with it; a later one starts a fresh proof (a fresh nonce)."""
    m.peers.entries["r2"] = fresh_peer()
    first = _challenged(m, E, "r2", wire.Ping(decode_rank="d/dp0/tp1", seq=1, decode_rank_id="r2"))
    m.nonce_written(E, "peer busy", 1.01)
    (err,) = msgs(m.message(E, wire.Ping(decode_rank="d/dp0/tp1", seq=2, decode_rank_id="r2"), 1.5), wire.ErrorReply)
    assert "peer busy" in err.reason
    later = m.message(E, wire.Ping(decode_rank="d/dp0/tp1", seq=3, decode_rank_id="r2"), 1.01 + 1.1)
    again = of(_signed(m, E, later, now=2.15), WriteNonce)
    assert len(again) == 1 and again[0].nonce != first.nonce
    m.nonce_written(E, None, 2.2)
    (beat,) = msgs(m.message(E, wire.ChallengeEcho(nonce=again[0].nonce), 2.3), wire.Heartbeat)
    assert beat.seq == 3  # the held Ping, answered once proven
# ---- staged writes (prefill/staged.py) ---------------------------------------------------------
SLOT = 4096
STAGING_BASE = 1 << 45


@pytest.fixture
def ms():
    """A machine with a gather buffer of 2 slots that stages every target offered a staging area."""
    from kvbridge.transfer.staging.area import StagingArea

    machine = prefill_machine(PrefillConfig(instance="p", peer_timeout=5.0, target_timeout=60.0, staging="always",
                                         staging_bytes=2 * SLOT, staging_slot_bytes=SLOT),
                           SPECS, bufs(0), AUX, "x",
                           gather=StagingArea(2, SLOT),
                           hello_of=lambda ident: HELLO.get(ident))
    machine.peers.entries["r1"] = peer()
    machine.admission.prove(D, "r1")
    return machine


def staged_request(room: int, num_tokens: int = 7, only: bool = False) -> wire.TransferRequest:
    import msgspec

    return msgspec.structs.replace(request(room, num_tokens), staging_slots=3, staging_slot_bytes=SLOT,
                                   staging_base=STAGING_BASE, staging_only=only)


def staged_room(ms, room: int, num_tokens: int = 7):
    """A staged room asked for and sent in one chunk: returns the room and the SlotRequests out."""
    r = ms.open(room, 1.0)
    ms.engine_init(r, num_tokens, None, 1.0)
    ms.message(D, staged_request(room, num_tokens), 1.0)
    pages = -(-num_tokens // 4)
    ms.chunk(r, np.arange(pages), np.arange(pages) + 5, None, True, _packed(room), None)
    return r, ms.post(r, 1.1, AUXF)


def test_a_staged_write_asks_a_slot_per_chunk_posts_into_the_slot_and_reports_after_every_chunk(ms):
    from kvbridge.transfer.prefill.staged import PostChunk

    r, acts = staged_room(ms, 20)
    asks = msgs(acts, wire.SlotRequest)
    # two gather slots: chunks 0 and 1 take them and ask; decode offers 3 slots to one sender, so one
    # more is ours to ask ahead: chunk 2, next in line for a gather slot (credits ahead)
    assert ms.stage.ahead(ms.stage.writes[next(iter(ms.stage.writes))].offer) == 1
    assert [a.chunk for a in asks] == [0, 1, 2]
    assert not of(acts, PostWrite) and not of(acts, PostChunk)  # nothing posted before a grant
    (sw,) = ms.stage.writes.values()
    assert sw.num_chunks == 4 and r.paths == {"d/dp0/tp0": "staged"}

    def grant(k: int) -> list:
        return of(ms.message(D, wire.SlotGrant(room=20, decode_rank="d/dp0/tp0", chunk=k, slot=k % 3), 1.2),
                  PostChunk)

    posts = grant(0) + grant(1)  # chunks 0 and 1 hold a gather slot: written at once
    assert [p.chunk for p in posts] == [0, 1]
    assert grant(2) == [] and sw.ahead == {2: 2}  # chunk 2 keeps its grant until it gets a gather slot
    handle, landed, reports, direct = 500, [], [], []
    for k in range(sw.num_chunks):
        post = posts[k]
        assert post.remote_addr == STAGING_BASE + (k % 3) * SLOT and post.chunk == k
        handle += 1
        ms.chunk_posted(post, handle, 1, int(sw.staged.chunk_bytes[k]), 1.2)
        acts = ms.write_final(handle, DONE, 1.3)
        landed += msgs(acts, wire.ChunkLanded)
        reports += msgs(acts, wire.PagesDone)
        # chunk 0's gather slot goes to chunk 2 (granted ahead: gathered and written now), and chunk 3,
        # next in line, asks ahead; after that every chunk has asked
        assert [a.chunk for a in msgs(acts, wire.SlotRequest)] == ([3] if k == 0 else [])
        if k + 2 < sw.num_chunks:
            (nxt,) = of(acts, PostChunk)
            assert nxt.chunk == k + 2 and nxt.local_slot == post.local_slot
            posts.append(nxt)
        if k == 0:
            assert grant(3) == []  # chunk 3 waits for chunk 1's gather slot
        direct += of(acts, PostWrite)
    assert [c.chunk for c in landed] == list(range(sw.num_chunks)) and all(c.status == "ok" for c in landed)
    off, dst, length = wire.unpack_scatter(asks[0].scatter)  # (the list travels with the chunk's SlotRequest)
    assert int((off + length).max()) <= SLOT and dst.min() >= 1 << 40  # slot offsets -> decode's pages
    for k, ask in enumerate(asks):  # each chunk's own list, the one its plan scatters by
        for got, want in zip(wire.unpack_scatter(ask.scatter), sw.staged.scatter(k, 0)):
            assert (got == want).all()
    (report,) = reports  # one report per write; the aux row rode in it (staged too): nothing went direct
    assert report.status == "ok" and report.aux and wire.unpack_pages(report.logical_pages).tolist() == [0, 1]
    assert direct == [] and r.state.state == KVPoll.Success
    assert r.stats(1.4)["chunks"] == sw.num_chunks and r.stats(1.4)["bytes_staged"] == sw.staged.num_bytes
    assert ms.stage.counters["grants_ahead_used"] == 2


def test_no_chunk_asks_ahead_when_decode_offers_no_more_than_our_share_of_gather_slots(ms):
    """Decode's 3 slots shared by two CP ranks with 2 gather slots each: nothing is left to ask
    ahead (a slot granted ahead would sit idle while another rank's chunk waits)."""
    ms.stage.senders = 2
    _, acts = staged_room(ms, 27)
    assert [a.chunk for a in msgs(acts, wire.SlotRequest)] == [0, 1]
    assert ms.stage.ahead(next(iter(ms.stage.writes.values())).offer) == 0


def test_a_slot_granted_ahead_is_given_back_when_the_room_aborts_and_a_grant_never_asked_is_refused(ms):
    from kvbridge.transfer.prefill.staged import PostChunk

    r, _ = staged_room(ms, 26)
    acts = ms.message(D, wire.SlotGrant(room=26, decode_rank="d/dp0/tp0", chunk=3, slot=0), 1.2)
    (refused,) = msgs(acts, wire.ChunkLanded)  # chunk 3 never asked: refused, the slot handed back unused
    assert refused.status == "failed" and refused.slot == 0 and not of(acts, PostChunk)
    acts = ms.message(D, wire.SlotGrant(room=26, decode_rank="d/dp0/tp0", chunk=2, slot=1), 1.2)
    assert not of(acts, PostChunk)  # chunk 2 waits for a gather slot: nothing written into decode slot 1
    acts = ms.message(D, wire.Abort(room=26, decode_rank="d/dp0/tp0", reason="gone", decode_rank_id="r1"), 1.3)
    # nothing was posted: the slot granted ahead goes back to decode ("failed": nothing landed there)
    (given,) = msgs(acts, wire.ChunkLanded)
    assert given.status == "failed" and given.slot == 1 and given.chunk == 2 and not ms.stage.writes
    assert len(msgs(acts, wire.AbortAck)) == 1 and r.state.state == KVPoll.Failed
    assert ms.stage.gather.num_free == 2


def test_a_staged_abort_is_acked_once_the_posted_chunk_is_final_and_a_late_grant_is_refused(ms):
    from kvbridge.transfer.prefill.staged import PostChunk

    r, acts = staged_room(ms, 21)
    (post,) = of(ms.message(D, wire.SlotGrant(room=21, decode_rank="d/dp0/tp0", chunk=0, slot=2), 1.2), PostChunk)
    ms.chunk_posted(post, 900, 1, 100, 1.2)
    acts = ms.message(D, wire.Abort(room=21, decode_rank="d/dp0/tp0", reason="gone", decode_rank_id="r1"), 1.3)
    assert msgs(acts, wire.AbortAck) == []  # chunk 0 may still land in decode slot 2
    assert ms.stage.gather.num_free == 1  # chunk 1 asked but never granted: its gather slot is free at once
    acts = ms.write_final(900, DONE, 1.4)
    (landed,) = msgs(acts, wire.ChunkLanded)
    assert landed.status == "failed" and landed.slot == 2  # decode frees the slot; nothing scatters
    assert len(msgs(acts, wire.AbortAck)) == 1 and r.state.state == KVPoll.Failed
    late = ms.message(D, wire.SlotGrant(room=21, decode_rank="d/dp0/tp0", chunk=1, slot=0), 1.5)
    assert [m.status for m in msgs(late, wire.ChunkLanded)] == ["failed"] and not of(late, PostChunk)
    assert ms.stage.gather.num_free == 2


def test_a_grant_on_another_connection_or_outside_the_area_posts_nothing(ms):
    from kvbridge.transfer.prefill.staged import PostChunk

    r, _ = staged_room(ms, 22)
    acts = ms.message(b"someone-else", wire.SlotGrant(room=22, decode_rank="d/dp0/tp0", chunk=0, slot=0), 1.2)
    assert not of(acts, PostChunk) and msgs(acts, wire.ChunkLanded)[0].status == "failed"
    acts = ms.message(D, wire.SlotGrant(room=22, decode_rank="d/dp0/tp0", chunk=0, slot=3), 1.2)  # 3 slots: 0..2
    assert not of(acts, PostChunk)
    assert r.state.state == KVPoll.Failed and "outside its 3 staging slots (registered area" in r.state.reason
    assert "field=slot" in r.state.reason


def test_staging_only_decode_and_a_prefill_that_never_stages_fail_the_target_by_name(m):
    r = m.open(23, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.message(D, staged_request(23, only=True), 1.0)
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(23), None)
    acts = m.post(r, 1.1, AUXF)
    assert not of(acts, PostWrite)
    assert r.state.state == KVPoll.Failed and "takes staged writes only" in r.state.reason


def test_an_offer_outlives_gc_while_its_request_waits_for_the_registration(ms):
    """The staging area of a request that waits for the decode rank's registration (its room not
    made yet) survives housekeeping: the room is staged once delivered, never silently direct."""
    ms.peers.entries.clear()
    assert of(ms.message(D, staged_request(24), 1.0), Resolve)
    ms.gc(2.0)  # housekeeping while the registration is read
    ms.peers.entries["r1"] = peer()
    ms.resolved("r1", None, None, 2.1)
    r = ms.open(24, 2.2)
    ms.engine_init(r, 7, None, 2.2)
    ms.chunk(r, np.arange(2), np.arange(2) + 5, None, True, _packed(24), None)
    acts = ms.post(r, 2.3, AUXF)
    assert msgs(acts, wire.SlotRequest) and not of(acts, PostWrite) and r.paths == {"d/dp0/tp0": "staged"}
    ms.message(D, staged_request(25), 3.0)  # refused later or never delivered: pruned after the horizon
    ms.rooms.forget(ms.rooms[25], 3.0, tombstone=False)
    ms.gc(3.0 + 2 * 60.0 + 1)
    assert (25, "d/dp0/tp0") not in ms.stage.offers


@pytest.mark.parametrize("field, value", [("staging_base", STAGING_BASE + SLOT), ("staging_slot_bytes", 2 * SLOT),
                                          ("staging_slots", 4)])
def test_a_staging_area_other_than_the_registered_one_is_refused_naming_the_field(ms, field, value):
    """Hard rule 5 for staging: the area a request offers must be the one its decode rank
    registered, slot for slot; one field off refuses the request (nothing posted, the room fails)."""
    import msgspec

    r = ms.open(26, 1.0)
    ms.engine_init(r, 7, None, 1.0)
    acts = ms.message(D, msgspec.structs.replace(staged_request(26), **{field: value}), 1.0)
    (failed,) = msgs(acts, wire.PagesDone)
    assert failed.status == "failed" and f"field={field}" in failed.reason and "registered" in failed.reason
    assert "room=26" in failed.reason and "rank=d/dp0/tp0" in failed.reason
    assert r.state.state == KVPoll.Failed and not r.targets and (26, "d/dp0/tp0") not in ms.stage.offers
    ms.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(26), None)
    acts = ms.post(r, 1.1, AUXF)
    assert not of(acts, PostWrite) and not msgs(acts, wire.SlotRequest)


def test_a_staging_area_offered_by_a_rank_that_registered_none_is_refused(ms):
    ms.peers.entries["r1"].staging = None
    r = ms.open(27, 1.0)
    ms.engine_init(r, 7, None, 1.0)
    (failed,) = msgs(ms.message(D, staged_request(27), 1.0), wire.PagesDone)
    assert "registered none" in failed.reason and "field=staging_slots" in failed.reason
    assert r.state.state == KVPoll.Failed


def test_the_registered_area_is_the_one_written_and_a_request_without_staging_goes_direct(ms):
    r, acts = staged_room(ms, 28)
    assert ms.stage.offers[(28, "d/dp0/tp0")].end == STAGING_BASE + 3 * SLOT
    r2 = ms.open(29, 1.0)
    ms.engine_init(r2, 7, None, 1.0)
    ms.message(D, request(29), 1.0)  # no area offered: direct, though one is registered
    ms.chunk(r2, [0, 1], np.array([5, 6]), None, True, _packed(29), None)
    assert of(ms.post(r2, 1.1, AUXF), PostWrite) and r2.paths == {"d/dp0/tp0": "direct"}


# -- the decode prefix: decode_first_page and init(first_page=) ------------------------------

D2 = b"decode-connection-2"
HELLO[D2] = "r2"


def prefix_request(room: int, first_page: int, *, num_tokens: int = 15, decode_rank: str = "d/dp0/tp0",
                   rank_id: str = "r1", num_decode_ranks: int = 1) -> wire.TransferRequest:
    """A request for the pages of a ``num_tokens`` request (page 4) after a decode prefix."""
    pages = -(-num_tokens // 4)
    return wire.TransferRequest(
        room=room, decode_rank=decode_rank, decode_rank_id=rank_id,
        page_ids=wire.pack_pages(np.arange(first_page, pages) + 3), first_page=first_page, pools=sorted(SPECS),
        aux_slot=1, num_tokens=0, deadline_ms=10_000, want_digest=False, fingerprint="x",
        num_decode_ranks=num_decode_ranks)  # fmt: skip


def test_the_decode_prefix_is_read_once_decode_asked_and_only_pages_after_it_move(m):
    """15 tokens (4 pages of 4), decode holds pages 0, 1. Before decode asked the prefix is an error,
    not 0; then the engine sends from page 2 on (SGLang: pop_decode_prefix_len, init of the
    pages after it): the last chunk needs no page below, and one below is refused."""
    sh = Shell(m)
    r = m.open(40, 1.0)
    with pytest.raises(LayoutError, match="not known before every decode rank asked") as err:
        r.decode_first_page
    assert err.value.field == "decode_first_page" and err.value.room == 40
    m.message(D, prefix_request(40, 2), 1.0)
    assert r.state.state == KVPoll.WaitingForInput and r.decode_first_page == 2
    m.engine_init(r, None, 4, 1.0, first_page=2)
    assert r.num_to_send == 2 and r.engine_first_page == 2
    with pytest.raises(LayoutError, match="logical page 1 lies below first page 2"):
        m.chunk(r, [1, 2], np.array([5, 6]), 12, False, None, None)
    m.chunk(r, [2], np.array([6]), 12, False, None, None)  # tokens [0, 12) exist: page 2 complete
    m.chunk(r, [3], np.array([7]), 15, True, _packed(40), None)
    writes = of(sh.run(m.post(r, 1.1, AUXF), 1.1), PostWrite)
    assert len(writes) == 2 and [c[0].tolist() for c in r.chunks] == [[2], [3]]
    reports = [msgs(m.write_final(handle, DONE, 1.2), wire.PagesDone)[0] for handle, _ in sh.posted]
    assert [np.frombuffer(x.logical_pages, "<i4").tolist() for x in reports] == [[2], [3]]
    assert reports[1].aux and reports[1].num_tokens == 15 and r.state.state == KVPoll.Success


def two_decode_ranks(m) -> None:
    """Decode TP 2 (an MLA cache: each rank takes whole rows from our one TP rank)."""
    m.peers.entries["r1"] = DecodePeer(**{**vars(peer()), "tp_size": 2, "tp_rank": 0, "checked": {}})
    m.peers.entries["r2"] = DecodePeer(**{**vars(peer()), "rank_id": "r2", "label": "d/dp0/tp1", "tp_size": 2,
                                          "tp_rank": 1, "checked": {}})  # fmt: skip
    m.admission.prove(D2, "r2")


def test_decode_ranks_holding_different_prefixes_are_named_with_their_first_pages(m):
    two_decode_ranks(m)
    r = m.open(41, 1.0)
    m.message(D, prefix_request(41, 1, num_decode_ranks=2), 1.0)
    with pytest.raises(LayoutError, match=r"1 of 2 of its decode ranks"):
        r.decode_first_page
    m.message(D2, prefix_request(41, 2, decode_rank="d/dp0/tp1", rank_id="r2", num_decode_ranks=2), 1.0)
    assert r.state.state == KVPoll.WaitingForInput
    with pytest.raises(LayoutError) as err:
        r.decode_first_page
    assert "decode ranks of room 41 hold different prefixes (d/dp0/tp0 first page 1, d/dp0/tp1 first page 2)" in str(
        err.value) and err.value.field == "first_page"
    m.engine_init(r, 15, None, 1.0)  # an engine that sends every page still serves both
    assert r.num_to_send == 4


def test_a_decode_rank_holding_less_than_the_engine_skips_is_refused_by_name(m):
    """The engine skips pages [0, 2) (init before decode asked); a decode rank that holds only page
    0 would wait for page 1 forever: its request is refused and the room fails, naming both."""
    r = m.open(42, 1.0)
    m.engine_init(r, 15, None, 1.0, first_page=2)
    acts = m.message(D, prefix_request(42, 1), 1.1)
    (report,) = msgs(acts, wire.PagesDone)
    assert report.status == "failed" and "holds pages [0, 1) of room 42" in report.reason
    assert "sends pages from 2 on: pages [1, 2) would never come" in report.reason
    assert r.state.state == KVPoll.Failed
    r2 = m.open(43, 1.0)
    m.message(D, prefix_request(43, 1), 1.0)
    with pytest.raises(LayoutError, match=r"decode rank d/dp0/tp0 holds pages \[0, 1\) of room 43"):
        m.engine_init(r2, 15, None, 1.1, first_page=3)
    for bad in (-1, 5, True):
        with pytest.raises(LayoutError, match="first_page") as err:
            m.engine_init(m.open(44 + (bad is True) + 2 * (bad == 5), 1.0), 15, None, 1.0, first_page=bad)
        assert err.value.field == "first_page"


def test_only_the_last_pipeline_stage_writes_the_aux_row():
    """A stage before the last holds no last hidden state: it neither needs nor takes the aux
    row; the last stage's owner of the last token must carry it."""
    row = np.zeros(8, dtype=np.uint8)
    first = PrefillRoom(1, 0, OwnerLanes(1), 4, pp=(0, 2))
    first.engine_init(10)
    assert not first.owns_last_token and first.ctx["rank"] == "cp0/pp0"
    with pytest.raises(LayoutError, match="aux row given to pipeline stage pp0 of 2; the last stage writes it"):
        first.add_chunk([0, 1, 2], [0, 1, 2], 10, True, row, None)
    first.add_chunk([0, 1, 2], [0, 1, 2], 10, True, None, None)  # no aux row needed
    last = PrefillRoom(1, 0, OwnerLanes(1), 4, pp=(1, 2))
    last.engine_init(10)
    assert last.owns_last_token and last.stats(0.0)["pp_rank"] == 1
    with pytest.raises(LayoutError, match="must carry the aux row"):
        last.add_chunk([0, 1, 2], [0, 1, 2], 10, True, None, None)


def test_each_chunk_is_gathered_when_it_takes_its_gather_slot_before_its_grant_comes(ms):
    """Credits: a chunk holding a gather slot is gathered at once (Gather) while it asks decode for
    a slot, its SlotRequest sent first (the grant's round trip runs while the shell gathers); the
    grant then writes it, nothing left to copy."""
    from kvbridge.transfer.prefill.staged import Gather, PostChunk

    r, acts = staged_room(ms, 30)
    gathers, asks = of(acts, Gather), msgs(acts, wire.SlotRequest)
    assert [(g.chunk, g.local_slot) for g in gathers] == [(0, 0), (1, 1)] and [a.chunk for a in asks] == [0, 1, 2]
    ask_at = [i for i, a in enumerate(acts) if isinstance(a, Send) and isinstance(a.msg, wire.SlotRequest)]
    assert [acts.index(g) for g in gathers] == [ask_at[0] + 1, ask_at[1] + 1]  # each right after its own ask
    (post,) = of(ms.message(D, wire.SlotGrant(room=30, decode_rank="d/dp0/tp0", chunk=1, slot=2), 1.2), PostChunk)
    assert (post.chunk, post.local_slot) == (1, 1)  # grants may come in any order: each writes its own slot


def test_a_chunk_granted_twice_is_refused_by_name_and_never_frees_the_slot_it_writes(ms):
    from kvbridge.transfer.prefill.staged import PostChunk

    r, _ = staged_room(ms, 31)
    (post,) = of(ms.message(D, wire.SlotGrant(room=31, decode_rank="d/dp0/tp0", chunk=0, slot=1), 1.2), PostChunk)
    ms.chunk_posted(post, 950, 1, 100, 1.2)
    other = ms.message(D, wire.SlotGrant(room=31, decode_rank="d/dp0/tp0", chunk=0, slot=2), 1.25)
    (answer,) = msgs(other, wire.ChunkLanded)  # a second slot for chunk 0: that slot is handed back unused
    assert not of(other, PostChunk) and answer.slot == 2 and answer.status == "failed"
    assert "granted chunk 0 twice (slot 2; it holds slot 1)" in answer.reason
    same = ms.message(D, wire.SlotGrant(room=31, decode_rank="d/dp0/tp0", chunk=0, slot=1), 1.3)
    assert not of(same, PostChunk) and msgs(same, wire.ChunkLanded) == []  # slot 1 is being written: not freed
    assert ms.stage.counters["grants_refused"] == 2
    acts = ms.write_final(950, DONE, 1.4)  # the write into slot 1 is final: now it is reported, failed
    assert [(c.slot, c.status) for c in msgs(acts, wire.ChunkLanded)] == [(1, "failed")]
    (report,) = msgs(acts, wire.PagesDone)
    assert report.status == "failed" and "granted chunk 0 twice" in report.reason and "field=slot" in report.reason
    assert r.state.state == KVPoll.Failed


def test_a_staged_chunk_larger_than_a_slot_is_planned_group_by_group_and_reported_whole(ms, monkeypatch):
    """The first group's gathers go out before the rest is planned: one slot-sized group per
    tick, each its own staged write and report; every page reported once, the aux row with the
    last group, and the room succeeds."""
    import kvbridge.transfer.prefill.staged as staged
    from kvbridge.transfer.prefill.staged import Gather, PostChunk

    monkeypatch.setattr(staged, "GROUP_MIN_SLICES", 5)  # groups of one page here (tests' pages are small)
    r, acts = staged_room(ms, 32, num_tokens=13)  # 4 pages
    assert ms.later == {32} and of(acts, Gather)  # group 0 is gathering; groups 1-3 wait for the next ticks
    (sw,) = ms.stage.writes.values()
    assert sw.staged.num_plan_slices < 20  # one page's slices, not the room's
    queue, reports, handle, now, ticks = list(acts), [], 700, 1.2, 0
    while queue or ms.later:
        if not queue:
            queue, ticks = list(ms.tick(now)), ticks + 1
            continue
        a = queue.pop(0)
        if isinstance(a, Send) and isinstance(a.msg, wire.SlotRequest):
            grant = wire.SlotGrant(room=32, decode_rank="d/dp0/tp0", chunk=a.msg.chunk, slot=a.msg.chunk % 3)
            (post,) = of(ms.message(D, grant, now), PostChunk)
            handle += 1
            queue += list(ms.chunk_posted(post, handle, 1, 64, now))
            queue += list(ms.write_final(handle, DONE, now))
        elif isinstance(a, Send) and isinstance(a.msg, wire.PagesDone):
            reports.append(a.msg)
        now += 0.01
    assert ticks == 3 and r.state.state == KVPoll.Success
    pages = [p for m in reports for p in wire.unpack_pages(m.logical_pages).tolist()]
    assert sorted(pages) == [0, 1, 2, 3] and [m.aux for m in reports] == [False, False, False, True]
    assert all(m.status == "ok" for m in reports) and r.paths == {"d/dp0/tp0": "staged"}


def spy_planning(monkeypatch) -> list[tuple[str, int]]:
    """(function, pages) of each plan the writes module makes from here on: a first group's
    ``plan_target``, a write's ``plan_chunk``."""
    import kvbridge.transfer.prefill.writes as writes

    planned: list[tuple[str, int]] = []
    for name in ("plan_target", "plan_chunk"):
        f = getattr(writes, name)
        monkeypatch.setattr(writes, name, lambda *a, _f=f, _n=name, **k: planned.append((_n, a[4].size)) or _f(*a, **k))
    return planned


def test_auto_plans_each_page_of_a_direct_chunk_once_the_first_group_chose_its_path(ms, monkeypatch):
    """Staging auto on a chunk larger than a group: the path is chosen on the first group's plan.
    When that says direct, the write is that plan and the rest's after it (no page planned twice),
    and it carries what one plan of the whole chunk would: the same bytes, source to destination."""
    import kvbridge.transfer.prefill.staged as staged
    from kvbridge.transfer.prefill.staged import SetMode

    monkeypatch.setattr(staged, "GROUP_MIN_SLICES", 5)  # groups of one page here (tests' pages are small)
    ms.machine.feed(SetMode("never"))
    _, whole = staged_room(ms, 36, num_tokens=13)  # 4 pages, planned whole (never stages: no group)
    planned = spy_planning(monkeypatch)
    ms.machine.feed(SetMode("auto"))
    r, acts = staged_room(ms, 37, num_tokens=13)
    assert planned == [("plan_target", 1), ("plan_chunk", 3)]  # the first group, then the three pages after it
    assert r.paths == {"d/dp0/tp0": "direct"} and not ms.later and not ms.stage.writes

    def merged(w: PostWrite) -> list[tuple[int, int, int]]:  # the slices, contiguous ones joined
        out: list[list[int]] = []
        for src, dst, n in sorted(zip(w.src.tolist(), w.dst.tolist(), w.length.tolist())):
            if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
                out[-1][2] += n
            else:
                out.append([src, dst, n])
        return [tuple(x) for x in out]

    (split,), (one,) = of(acts, PostWrite), of(whole, PostWrite)
    assert merged(split) == merged(one) and int(split.length.sum()) == int(one.length.sum())


def test_auto_plans_a_chunk_whole_on_a_route_it_never_stages(ms, monkeypatch):
    """A decode rank reached through an engine auto never stages (IPC: one launch copies any
    number of slices) gets its chunk planned once, whole: no first group to choose a path on."""
    import dataclasses

    import kvbridge.transfer.prefill.staged as staged
    from kvbridge.transfer.prefill.staged import SetMode

    monkeypatch.setattr(staged, "GROUP_MIN_SLICES", 5)
    ms.peers.entries["r1"] = dataclasses.replace(ms.peers.entries["r1"], engine_kind="ipc")
    planned = spy_planning(monkeypatch)
    ms.machine.feed(SetMode("auto"))
    r, acts = staged_room(ms, 38, num_tokens=13)
    assert planned == [("plan_chunk", 4)] and r.paths == {"d/dp0/tp0": "direct"} and len(of(acts, PostWrite)) == 1


# ---- the door: every event type the machine takes, fed through feed() -------------------------------

def test_every_event_type_of_the_prefill_machine_is_fed_through_its_one_door(ms):
    """``events.EVENTS`` lists what PrefillRooms.feed takes; one room of each path walks through
    every type (a new event type without a case here fails), and the machine answers anything
    else with a TypeError."""
    from kvbridge.transfer.actions import AbortRoom, CloseRoom, Shutdown, Tick
    from kvbridge.transfer.prefill import events as ev
    from kvbridge.transfer.prefill.admission import NonceWritten
    from kvbridge.transfer.prefill.staged import ChunkPostFailed, ChunkPosted, PostChunk, SetMode

    fed: set[type] = set()

    def feed(event):
        fed.add(type(event))
        return ms.machine.feed(event)

    feed(ev.Serving(ME))
    assert ms.machine.endpoint == ME
    feed(SetMode("always"))
    # a staged room: request, init, chunk, post, grant, chunk posted, final
    r = ms.open(50, 1.0)
    feed(ev.Message(D, staged_request(50), "r1", 1.0))
    feed(ev.EngineInit(r, 7, None, 1.0))
    feed(ev.Chunk(r, np.arange(2), np.arange(2) + 5, None, True, _packed(50), None))
    feed(ev.Post(r, 1.1, AUXF))
    (sw,) = ms.stage.writes.values()
    for k in range(sw.num_chunks):
        (post,) = of(feed(ev.Message(D, wire.SlotGrant(room=50, decode_rank="d/dp0/tp0", chunk=k, slot=k % 3),
                                     "r1", 1.2)), PostChunk)
        if k == 0:  # the first chunk's submission refused: the staged write fails
            acts = feed(ChunkPostFailed(post, "refused", 1.2))
            assert [c.status for c in msgs(acts, wire.ChunkLanded)] == ["failed"]
            break
    assert r.state.state == KVPoll.Failed
    feed(CloseRoom(r, 1.3))
    # a direct room: its write posted, then final; another refused at submission
    feed(SetMode("never"))
    for room in (51, 52):
        r = ms.open(room, 2.0)
        feed(ev.Message(D, request(room), "r1", 2.0))
        feed(ev.EngineInit(r, 7, None, 2.0))
        feed(ev.Chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(room), None))
        (w,) = of(feed(ev.Post(r, 2.1, AUXF)), PostWrite)
        if room == 51:
            feed(ev.Posted(w, 700, 2.1))
            assert msgs(feed(ev.WriteFinal(700, DONE, 2.2)), wire.PagesDone)[0].status == "ok"
            assert r.state.state == KVPoll.Success
        else:
            feed(ev.PostFailed(w, "engine refused", 2.1))
            assert r.state.state == KVPoll.Failed
    # a staged chunk that was posted: its handle is booked (ChunkPosted), its final reported
    feed(SetMode("always"))
    r = ms.open(53, 3.0)
    feed(ev.Message(D, staged_request(53), "r1", 3.0))
    feed(ev.EngineInit(r, 7, None, 3.0))
    feed(ev.Chunk(r, np.arange(2), np.arange(2) + 5, None, True, _packed(53), None))
    feed(ev.Post(r, 3.1, AUXF))
    (post,) = of(feed(ev.Message(D, wire.SlotGrant(room=53, decode_rank="d/dp0/tp0", chunk=0, slot=0), "r1", 3.2)),
                 PostChunk)
    feed(ChunkPosted(post, 800, 1, 100, 3.2))
    assert msgs(feed(ev.WriteFinal(800, DONE, 3.3)), wire.ChunkLanded)[0].status == "ok"
    feed(AbortRoom(r, "the engine gave up", 3.4))
    # the proof's answers and the daemon's
    HELLO[E] = "r2"
    ms.peers.entries["r2"] = fresh_peer()
    feed(ev.Message(E, wire.Ping(decode_rank="d/dp0/tp1", seq=1, decode_rank_id="r2"), "r2", 4.0))
    feed(NonceWritten(E, "not asked for", 4.0))  # no nonce write out yet: ignored
    feed(ev.ProofReadBack(E, b"", "not asked for", 4.0))  # no proof read out yet: ignored
    acts = feed(ev.Resolved("r9", None, "registration r9 is not registered", 4.0))
    assert acts == ()  # nobody waited for it
    # room tickets (tickets.py): our registration, and a decider's registration nobody waits for
    feed(ev.RegisteredAs("p-cp0"))
    assert feed(ev.DeciderRead("p-cp0", "p", "prefill", (0, 0, 0, 0), None, "not asked for", 4.0)) == ()
    feed(Tick(4.1))
    feed(ev.Gc(4.2))
    feed(ev.Closing())
    with pytest.raises(KVBridgeError, match="shutting down"):
        ms.open(54, 4.3)
    feed(ev.KindUnits(r, {}))  # the engine's units of kind pools (a paged model has none: nothing kept)
    feed(Shutdown("the endpoint closes", 4.4))
    assert fed == set(ev.EVENTS), set(ev.EVENTS) - fed
    with pytest.raises(TypeError, match="does not take"):
        ms.machine.feed(wire.Ping(decode_rank="x", seq=1))


def test_every_event_type_of_the_staged_writes_machine_has_a_handler():
    """``staged.EVENTS`` is what StagedWrites.feed takes (each fed through the room machine's door
    in the test above, or by it); anything else is refused."""
    from kvbridge.transfer.prefill import staged

    m = staged.StagedWrites("auto", None, 0, "p/cp0")
    assert set(staged._HANDLERS) == set(staged.EVENTS)
    assert m.feed(staged.SetMode("never")) == [] and m.mode == "never"
    assert m.feed(staged.RoomGone(1)) == [] and m.feed(staged.Prune(frozenset(), 1.0, 2.0)) == []
    assert m.feed(staged.Settle(7)) == []  # no such write: nothing
    with pytest.raises(TypeError, match="does not take"):
        m.feed(object())
