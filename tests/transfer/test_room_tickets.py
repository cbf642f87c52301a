"""One decision per room across a prefill instance's CP ranks (issue 32): the room's decider
(cp 0) grants the first claim a signed RoomTicket; the other ranks hold every claim until a
ticket decides the room, then serve only the instance it names. Sans-I/O: two prefill room
machines (cp 0 and cp 1 of one TP column) and two decode instances racing for one room, in
every order the messages can arrive; the test plays the decode ranks' part (a rank hands its
ticket on to cp 1 after its request) and the shells' (the decider's key read from the daemon)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from kvbridge.layout import AuxSchema, BufferDesc, preset_pools
from kvbridge.transfer.actions import Send
from kvbridge.transfer.aux_rows import RegionAddr
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import WriteState, WriteStatus
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.events import AuxFrom, PostWrite
from kvbridge.transfer.prefill.targets import DecodePeer
from kvbridge.transfer.prefill.tickets import MAX_HELD, DeciderRead, ReadDecider, RegisteredAs
from _machines import prefill_machine

SPECS = preset_pools("deepseek-v3.2-fp8", num_layers=2, page_size=4)
AUX = AuxSchema.standard(16, "bfloat16", 1)
DONE = WriteStatus(WriteState.DONE)
DECIDER_ID = "p-cp0"  # the decider's registration at the daemon
INSTANCES = {"A": (b"conn-A", "rA"), "B": (b"conn-B", "rB")}  # decode instance -> (its connection, registration)
HELLO = {ident: rid for ident, rid in INSTANCES.values()}


def bufs(shift: int) -> list[BufferDesc]:
    return [BufferDesc(p, layer, shift + 10**6 * (i * 10 + layer), 16, s.bytes_per_page)
            for i, (p, s) in enumerate(SPECS.items()) for layer in s.layer_ids]


def regions(base: int) -> dict[str, RegionAddr]:
    return {r.name: RegionAddr(r.name, base + AUX.offsets[r.name], 4, AUX.row_bytes) for r in AUX.regions}


def request(inst: str, room: int) -> wire.TransferRequest:
    return wire.TransferRequest(
        room=room, decode_rank=f"{inst}/dp0/tp0", decode_rank_id=INSTANCES[inst][1],
        page_ids=wire.pack_pages(np.arange(2) + 3), first_page=0, pools=sorted(SPECS), aux_slot=1, num_tokens=7,
        deadline_ms=10_000, want_digest=False, fingerprint="x", num_decode_ranks=1)


def sends(actions, msg_type=None):
    return [(a.to, a.msg) for a in actions if isinstance(a, Send) and (msg_type is None or isinstance(a.msg, msg_type))]


class Column:
    """cp 0 (the decider) and cp 1 of one prefill TP column, both keyed as a PrefillEndpoint is."""

    def __init__(self, key: ProofKey | None = None, target_timeout: float = 60.0) -> None:
        self.key = key or ProofKey()
        self.m = []
        for cp in (0, 1):
            cfg = PrefillConfig(instance="p", cp_rank=cp, cp_size=2, peer_timeout=5.0,
                                 target_timeout=target_timeout)
            m = prefill_machine(cfg, SPECS, bufs(cp << 36), AUX, "x", hello_of=HELLO.get,
                                endpoint=lambda: "tcp://127.0.0.1:7000", proof_key=self.key if cp == 0 else ProofKey())
            m.feed(RegisteredAs(DECIDER_ID if cp == 0 else "p-cp1"))
            for inst, (ident, rid) in INSTANCES.items():
                m.peers.entries[rid] = DecodePeer(rank_id=rid, label=f"{inst}/dp0/tp0", session=f"127.0.0.1:{len(rid)}",
                                                  fingerprint="x", buffers=bufs(1 << 40 if inst == "A" else 1 << 41),
                                                  aux=regions(1 << 50), instance=inst)
                m.admission.prove(ident, rid).instance = inst  # each connection proved its registration
            self.m.append(m)
        self.replies: dict[tuple[str, int], list] = {}  # (instance, cp) -> what that rank sent it
        self.tickets: dict[str, wire.RoomTicket] = {}  # instance -> the ticket cp 0 granted it

    def deliver(self, inst: str, cp: int, msg, now: float):
        """``msg`` from decode instance ``inst`` to cp rank ``cp``; its answers are booked, a
        decider-key read is answered as the daemon would (``answer_read``)."""
        acts = list(self.m[cp].message(INSTANCES[inst][0], msg, now))
        while True:
            reads = [a for a in acts if isinstance(a, ReadDecider)]
            self.book(acts)
            if not reads:
                return
            acts = []
            for a in reads:
                acts += self.answer_read(cp, a, now)

    def answer_read(self, cp: int, a: ReadDecider, now: float):
        assert a.rank_id == DECIDER_ID
        return list(self.m[cp].feed(DeciderRead(DECIDER_ID, "p", "prefill", (0, 0, 0, 0), self.key.public_hex, None,
                                                now)))

    def book(self, acts) -> None:
        for to, msg in sends(acts):
            inst = next(i for i, (ident, _) in INSTANCES.items() if to == (ident,))
            cp = getattr(msg, "cp_rank", None)
            self.replies.setdefault((inst, cp), []).append(msg)
            if isinstance(msg, wire.RoomTicket):
                self.tickets[inst] = msg

    def errors(self, inst: str):
        return [m for (i, _), ms in self.replies.items() if i == inst for m in ms
                if isinstance(m, wire.ErrorReply) or (isinstance(m, wire.PagesDone) and m.status == "failed")]


def race(col: Column, order: list[tuple[str, int]], room: int = 7) -> None:
    """Deliver both instances' requests in ``order``; a rank granted a ticket hands it to cp 1
    as soon as it has it (after its own request to cp 1: a decode rank sends all requests first)."""
    now = 1.0
    sent_req: set[tuple[str, int]] = set()
    handed: set[str] = set()
    for inst, cp in order:
        now += 0.001
        col.deliver(inst, cp, request(inst, room), now)
        sent_req.add((inst, cp))
        for winner, t in list(col.tickets.items()):
            if winner not in handed and (winner, 1) in sent_req:
                handed.add(winner)
                col.deliver(winner, 1, t, now)
    for winner, t in list(col.tickets.items()):  # (the winner asked cp 1 last)
        if winner not in handed:
            handed.add(winner)
            col.deliver(winner, 1, t, now + 0.001)


ORDERS = [list(p) for p in itertools.permutations([("A", 0), ("A", 1), ("B", 0), ("B", 1)])]


def check_one_holder(col: Column, room: int = 7) -> str:
    """Both ranks hold the room for the instance that claimed it first at cp 0; the loser was
    refused by name on both ranks, and has no target anywhere."""
    winner = next(iter(col.tickets))
    loser = "B" if winner == "A" else "A"
    assert list(col.tickets) == [winner]  # one decision
    for cp in (0, 1):
        r = col.m[cp].rooms.get(room)
        assert r is not None and r.holder[0] == winner, (cp, r and r.holder)
        assert [t.split("/")[0] for t in r.targets] == [winner], (cp, list(r.targets))
    errs = col.errors(loser)
    assert len(errs) == 2, col.replies
    assert all(f"claimed by decode instance {winner}" in e.reason for e in errs), errs
    assert not col.errors(winner), col.errors(winner)
    return winner


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "-".join(f"{i}{c}" for i, c in o))
def test_every_arrival_order_gives_the_room_to_the_first_claim_at_the_decider_on_both_ranks(order):
    col = Column()
    race(col, order)
    winner = check_one_holder(col)
    first_at_decider = next(inst for inst, cp in order if cp == 0)
    assert winner == first_at_decider


def test_fifty_random_races_serve_one_instance_every_time_and_write_nothing_to_the_loser():
    """The loop test: 50 races in random orders, each then sent to completion on both ranks:
    the winner gets every page of both ranks (one write each), the loser no write at all."""
    rng = random.Random(32)
    served = 0
    for trial in range(50):
        col, room = Column(), 100 + trial
        order = rng.sample([("A", 0), ("A", 1), ("B", 0), ("B", 1)], 4)
        race(col, order, room)
        winner = check_one_holder(col, room)
        writes = []
        for cp, m in enumerate(col.m):
            r = m.open(room, 2.0)
            m.engine_init(r, 7, None, 2.0)
            aux = np.zeros(1, dtype=AUX.dtype) if cp == 1 else None  # the last token's owner (page 1) writes it
            m.chunk(r, [cp], np.array([5]), None, True, aux, None)
            acts = m.post(r, 2.1, AuxFrom(regions(1 << 30), 0) if cp == 1 else None)
            writes += [(cp, a) for a in acts if isinstance(a, PostWrite)]
        assert sorted(cp for cp, _ in writes) == [0, 1], writes
        assert {a.target.decode_rank.split("/")[0] for _, a in writes} == {winner}
        for n, (cp, a) in enumerate(writes):
            col.m[cp].posted(a, 10 + n, 2.2)
            col.book(col.m[cp].write_final(10 + n, DONE, 2.3))
        done = [m for (i, _), ms in col.replies.items() if i == winner for m in ms
                if isinstance(m, wire.PagesDone) and m.status == "ok"]
        assert sorted(d.cp_rank for d in done) == [0, 1]
        assert all(col.m[cp].rooms.get(room).state.state == KVPoll.Success for cp in (0, 1))
        served += 1
    assert served == 50


def test_a_ticket_not_signed_by_the_deciders_key_is_refused_and_the_claims_it_carried_with_it():
    col = Column()
    col.deliver("A", 1, request("A", 7), 1.0)  # held at cp 1
    forged = wire.RoomTicket(room=7, decode_rank_id="rA", decider=DECIDER_ID, instance="A", decode_rank="A/dp0/tp0",
                             binding=b"", signature=ProofKey().sign_ticket(DECIDER_ID, 7, "A", "A/dp0/tp0", b""))
    col.deliver("A", 1, forged, 1.1)
    errs = col.errors("A")
    assert any("not signed by the key of the room's decider" in e.reason for e in errs), errs
    r = col.m[1].rooms.get(7)
    assert r is None or (r.holder is None and not r.targets)


@pytest.mark.parametrize("who", [("p", "decode", (0, 0, 0, 0)), ("p", "prefill", (0, 1, 0, 0)),
                                 ("p", "prefill", (0, 0, 0, 1)), ("other", "prefill", (0, 0, 0, 0)),
                                 ("p", "prefill", (1, 0, 0, 0))], ids=["decode", "cp1", "pp1", "instance", "dp1"])
def test_a_ticket_naming_a_registration_that_is_not_the_deciders_is_refused(who):
    """The attacker signs its own ticket with the key of a registration it made: anything but
    (our instance, our DP group, cp 0, our TP rank, pp 0) is no decider."""
    col = Column()
    col.deliver("A", 1, request("A", 7), 1.0)
    key = ProofKey()
    t = wire.RoomTicket(room=7, decode_rank_id="rA", decider="evil", instance="A", decode_rank="A/dp0/tp0",
                        binding=b"", signature=key.sign_ticket("evil", 7, "A", "A/dp0/tp0", b""))
    (read,) = [a for a in col.m[1].message(b"conn-A", t, 1.1) if isinstance(a, ReadDecider)]
    instance, role, coords = who
    col.book(col.m[1].feed(DeciderRead(read.rank_id, instance, role, coords, key.public_hex, None, 1.2)))
    errs = col.errors("A")
    assert len(errs) == 2 and all("not p/dp0/cp0/tp0/pp0" in e.reason for e in errs), errs  # ticket and claim
    r = col.m[1].rooms.get(7)
    assert (r is None or r.holder is None) and not col.m[1].tickets.held


def test_a_ticket_is_only_read_from_the_instance_it_names():
    col = Column()
    col.deliver("A", 0, request("A", 7), 1.0)
    col.deliver("B", 1, request("B", 7), 1.0)
    t = col.tickets["A"]
    col.deliver("B", 1, t, 1.1)  # B hands on A's ticket as it is: it names A's registration
    (err,) = col.errors("B")
    assert "acts only for its own registration" in err.reason
    relabelled = wire.RoomTicket(room=7, decode_rank_id="rB", decider=t.decider, instance="A",
                                 decode_rank=t.decode_rank, binding=t.binding, signature=t.signature)
    col.deliver("B", 1, relabelled, 1.2)  # on B's own registration
    errs = col.errors("B")
    assert any("hands on its own tickets only" in e.reason for e in errs), errs
    assert col.m[1].rooms.get(7) is None or col.m[1].rooms.get(7).holder is None


def test_the_losers_abort_on_an_undecided_rank_withdraws_its_claim_and_never_ends_the_room():
    col = Column()
    r1 = col.m[1].open(7, 1.0)
    col.m[1].engine_init(r1, 7, None, 1.0)
    col.deliver("B", 1, request("B", 7), 1.0)  # the loser reached cp 1 first
    col.deliver("A", 0, request("A", 7), 1.0)  # and lost at the decider
    col.deliver("B", 0, request("B", 7), 1.01)
    assert any("claimed by decode instance A" in e.reason for e in col.errors("B"))
    col.deliver("B", 1, wire.Abort(room=7, decode_rank="B/dp0/tp0", reason="lost", decode_rank_id="rB"), 1.02)
    assert any(isinstance(m, wire.AbortAck) for m in col.replies[("B", 1)])
    assert not r1.state.final  # the loser's abort is no decision
    col.deliver("A", 1, request("A", 7), 1.03)
    col.deliver("A", 1, col.tickets["A"], 1.04)
    assert r1.holder[0] == "A" and list(r1.targets) == ["A/dp0/tp0"]


def test_a_held_claim_that_no_ticket_reaches_is_refused_naming_the_decider():
    col = Column()
    col.deliver("A", 1, request("A", 7), 1.0)
    col.book(col.m[1].tick(1.0 + 61.0))
    (err,) = col.errors("A")
    assert "no decision on room 7" in err.reason and "p/dp0/cp0/tp0/pp0" in err.reason


def test_held_claims_are_capped():
    col = Column()
    col.m[1].tickets.max_held = 2
    for room in (1, 2, 3):
        col.deliver("A", 1, request("A", room), 1.0)
    (err,) = col.errors("A")
    assert "2 claims already wait" in err.reason and MAX_HELD > 2


def test_without_a_proof_key_each_rank_decides_alone_as_before():
    cfg = PrefillConfig(instance="p", cp_rank=1, cp_size=2)
    m = prefill_machine(cfg, SPECS, bufs(0), AUX, "x", hello_of=HELLO.get)
    m.peers.entries["rA"] = DecodePeer(rank_id="rA", label="A/dp0/tp0", session="127.0.0.1:1", fingerprint="x",
                                       buffers=bufs(1 << 40), aux=regions(1 << 50), instance="A")
    m.admission.prove(b"conn-A", "rA").instance = "A"
    m.message(b"conn-A", request("A", 7), 1.0)
    assert m.rooms.get(7).holder[0] == "A" and not m.tickets.held


# -- the decode side: the winner hands the decider's ticket on -------------------------------------

def test_a_decode_rank_hands_the_deciders_ticket_to_the_other_cp_ranks_it_asked_and_only_that():
    from test_decode_room import requested, sends as decode_sends  # (its machine and topology)
    from kvbridge.layout import deepseek_pools, AuxSchema as Schema
    from kvbridge.transfer.decode.config import DecodeConfig
    from _machines import decode_machine

    m = decode_machine(DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, transfer_timeout=100.0),
                       deepseek_pools(num_layers=2, page_size=4, index=False, draft_layers=0),
                       Schema.standard(hidden_size=8), read_aux_row=lambda slot: (None, 0.0),
                       page_digests=lambda *a: np.zeros(0, np.uint64), rank_id=lambda: "dec-id")
    r = requested(m, room=7, cp=4)
    t = wire.RoomTicket(room=7, decode_rank_id="dec-id", decider="rank0", instance="dec", decode_rank="dec/dp0/tp0",
                        binding=b"", signature=bytes(64))
    (to, msg), = decode_sends(m.message("tcp://p0", t, 1.1), wire.RoomTicket)
    assert set(to) == {"tcp://p1", "tcp://p2", "tcp://p3"} and msg is t  # unchanged, to every other CP rank
    assert decode_sends(m.message("tcp://p1", t, 1.2), wire.RoomTicket) == []  # not the decider: no decision
    other = wire.RoomTicket(room=7, decode_rank_id="someone", decider="rank0", instance="dec",
                            decode_rank="dec/dp0/tp0", binding=b"", signature=bytes(64))
    assert decode_sends(m.message("tcp://p0", other, 1.3), wire.RoomTicket) == []  # not ours to hand on
    assert r.state.state == KVPoll.Transferring


@pytest.mark.parametrize("closed", [False, True], ids=["failed", "closed"])
def test_a_held_claim_on_a_room_the_engine_ended_is_refused_at_the_next_scan(closed):
    col = Column()
    m = col.m[1]
    r = m.open(7, 1.0)
    col.deliver("A", 1, request("A", 7), 1.0)  # held: no decision yet
    m.abort(r, "the engine gave up", 1.1)
    if closed:
        m.close(r, 1.2)
    col.book(m.tick(1.3))
    (err,) = col.errors("A")
    assert "room 7" in err.reason and "the engine gave up" in err.reason and not m.tickets.held


def test_the_decider_sends_its_ticket_before_it_plans_and_posts_the_room_at_the_tick():
    """The ticket is what the other ranks wait for: the decider's request event answers with it
    alone (no write planned yet), and the room is planned and posted at the same turn's Tick."""
    col = Column()
    m = col.m[0]
    r = m.open(7, 1.0)
    m.engine_init(r, 7, None, 1.0)
    m.chunk(r, [0], np.array([5]), None, True, None, None)
    assert not [a for a in m.post(r, 1.0) if isinstance(a, PostWrite)]  # nobody asked yet
    acts = list(m.message(INSTANCES["A"][0], request("A", 7), 1.1))
    (_, ticket), = sends(acts)
    assert isinstance(ticket, wire.RoomTicket) and ticket.instance == "A"
    assert not [a for a in acts if isinstance(a, PostWrite)]
    writes = [a for a in m.tick(1.1) if isinstance(a, PostWrite)]
    assert [a.target.decode_rank for a in writes] == ["A/dp0/tp0"]
    # cp 1 decides nothing: the ticket's event takes its held claim up and plans it at once
    m1 = col.m[1]
    r1 = m1.open(7, 1.0)
    m1.engine_init(r1, 7, None, 1.0)
    m1.chunk(r1, [1], np.array([5]), None, True, np.zeros(1, dtype=AUX.dtype), None)
    m1.post(r1, 1.0, AuxFrom(regions(1 << 30), 0))
    col.deliver("A", 1, request("A", 7), 1.2)  # held
    acts = list(m1.message(INSTANCES["A"][0], ticket, 1.3))
    reads = [a for a in acts if isinstance(a, ReadDecider)]  # the decider's key, read once from the daemon
    if reads:
        acts = col.answer_read(1, reads[0], 1.3)
    assert [a.target.decode_rank for a in acts if isinstance(a, PostWrite)] == ["A/dp0/tp0"]


def test_a_frozen_loop_spares_its_held_claims_the_gap_it_did_not_run():
    """A rank whose own loop did not run (a starved process) may have the decider's RoomTicket unread in
    its socket: its held claims count their timeout again from the turn it runs (as its rooms' ask
    deadline does), and are refused only once that long passes with the loop running."""
    col = Column()
    m = col.m[1]
    col.book(m.tick(0.5))  # the loop runs
    col.deliver("A", 1, request("A", 7), 1.0)
    col.book(m.tick(1.0 + 61.0))  # then stood still 61 s, past target_timeout
    assert col.errors("A") == [] and 7 in m.tickets.held
    now = 62.0
    while now < 62.0 + 59.0:  # the loop runs; the claim's 60 s count from 62
        now += 1.0
        col.book(m.tick(now))
    assert col.errors("A") == []
    col.book(m.tick(62.0 + 60.5))
    (err,) = col.errors("A")
    assert "no decision on room 7" in err.reason


def test_a_gap_over_half_the_target_timeout_is_a_frozen_loop_even_under_half_the_peer_timeout():
    """With a target_timeout shorter than peer_timeout (a local cluster's 2 s against 5 s), a gap of more
    than half of it is the loop standing still: the held claim is spared, not refused for a ticket that
    sat unread, and the ticket read after the gap decides the room."""
    col = Column(target_timeout=2.0)
    m = col.m[1]
    col.book(m.tick(0.9))  # the loop runs
    col.deliver("A", 1, request("A", 7), 1.0)
    col.deliver("A", 0, request("A", 7), 1.0)  # the decider grants A at once
    assert "A" in col.tickets
    col.book(m.tick(3.2))  # cp 1 stood still 2.3 s: under peer_timeout / 2, over target_timeout / 2
    assert col.errors("A") == [] and 7 in m.tickets.held  # the claim waited 2.2 s > 2.0, spared
    col.deliver("A", 1, col.tickets["A"], 3.21)  # the ticket, read now
    assert col.errors("A") == []
    assert m.rooms.get(7).holder[0] == "A" and 7 not in m.tickets.held
