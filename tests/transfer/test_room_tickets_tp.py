"""One decision per room whatever the TP layout (issue 32): with head-sharded pools and other TP
sizes on the two sides, decode ranks ask different prefill TP columns, so a decider per column
could give one room to two instances. The room's decider is the DP group's (cp 0, tp 0, pp 0)
rank; a decode instance's rank that holds its ticket hands it on to the ranks of the instance's
other columns too (transfer/decode/machine.py ``_hand_on``), and a ticket that reaches a rank
before the claim it decides waits there for it (transfer/prefill/tickets.py).

Sans-I/O: prefill TP 2 (CP 1 and 2), head-sharded k/v (4 heads); decode instance A at TP 1 (its
one rank asks both columns) races decode instance B at TP 4 (ranks 0, 1 ask tp 0; ranks 2, 3 ask
tp 1), in many arrival orders. The test plays the decode ranks: each asks the columns of its real
TP route (``kvbridge.layout.tp_route``); a rank handed a ticket by the decider hands it on as
``DecodeRooms._hand_on`` does (checked against the real machine at the end) and the daemon's part
(a ticket's decider registration read)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbridge.layout import AuxSchema, BufferDesc, tp_route
from kvbridge.transfer.actions import Send
from kvbridge.transfer.aux_rows import RegionAddr
from kvbridge.transfer.channel import wire
from kvbridge.transfer.ownership import ProofKey
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.targets import DecodePeer
from kvbridge.transfer.prefill.tickets import DeciderRead, ReadDecider, RegisteredAs
from _machines import prefill_machine
from _models import kv_heads

PAGE, LAYERS, SRC_TP = 4, 2, 2
WHOLE = kv_heads(LAYERS, PAGE)[0]  # whole rows: the routes' head geometry
AUX = AuxSchema.standard(16, "bfloat16", 1)
DECODE_TP = {"A": 1, "B": 4}


def bufs(specs, shift: int) -> list[BufferDesc]:
    return [BufferDesc(p, layer, shift + 10**6 * (i * 10 + layer), 16, s.bytes_per_page)
            for i, (p, s) in enumerate(sorted(specs.items())) for layer in s.layer_ids]


def regions(base: int) -> dict[str, RegionAddr]:
    return {r.name: RegionAddr(r.name, base + AUX.offsets[r.name], 4, AUX.row_bytes) for r in AUX.regions}


def rid(inst: str, j: int) -> str:
    return f"r{inst}{j}"


def ident(inst: str, j: int) -> bytes:
    return f"conn-{inst}{j}".encode()


DECODE = [(inst, j) for inst, tp in DECODE_TP.items() for j in range(tp)]  # every decode rank
HELLO = {ident(i, j): rid(i, j) for i, j in DECODE}
SOURCES = {(i, j): tp_route(WHOLE, SRC_TP, DECODE_TP[i], j).sources for i, j in DECODE}


class Group:
    """One prefill DP group: (cp, tp) ranks, each keyed as a PrefillEndpoint is."""

    def __init__(self, cp_size: int) -> None:
        self.cp_size = cp_size
        self.keys = {(c, t): ProofKey() for c in range(cp_size) for t in range(SRC_TP)}
        self.m = {}
        for (c, t), key in self.keys.items():
            specs = kv_heads(LAYERS, PAGE, SRC_TP, t)[0]
            cfg = PrefillConfig(instance="p", cp_rank=c, cp_size=cp_size, tp_rank=t, tp_size=SRC_TP, peer_timeout=5.0,
                                target_timeout=60.0)
            m = prefill_machine(cfg, specs, bufs(specs, (c * SRC_TP + t) << 36), AUX, "x", hello_of=HELLO.get,
                                endpoint=lambda c=c, t=t: f"tcp://p{c}{t}", proof_key=key)
            m.feed(RegisteredAs(self.reg(c, t)))
            for inst, j in DECODE:
                dspecs = kv_heads(LAYERS, PAGE, DECODE_TP[inst], j)[0]
                m.peers.entries[rid(inst, j)] = DecodePeer(
                    rank_id=rid(inst, j), label=f"{inst}/dp0/tp{j}", session=f"127.0.0.1:{len(DECODE) + j}",
                    fingerprint="x", buffers=bufs(dspecs, (1 << 40) * (1 + j) + (1 << 44) * (inst == "B")),
                    aux=regions(1 << 50), tp_size=DECODE_TP[inst], tp_rank=j, instance=inst)
                m.admission.prove(ident(inst, j), rid(inst, j)).instance = inst
            self.m[(c, t)] = m
        self.replies: dict[tuple[str, int], list] = {}  # decode rank -> what it was sent
        self.tickets: dict[tuple[str, int], wire.RoomTicket] = {}  # decode rank -> its ticket from the decider

    @staticmethod
    def reg(c: int, t: int) -> str:
        return f"p-cp{c}-tp{t}"

    def asks(self, inst: str, j: int) -> list[tuple[int, int]]:
        """The prefill ranks decode rank ``j`` of ``inst`` sends its request to (its TP route)."""
        return [(c, t) for c in range(self.cp_size) for t in SOURCES[(inst, j)]]

    def hand_on(self, inst: str, j: int) -> list[tuple[int, int]]:
        """Where a decode rank hands the decider's ticket on: the other ranks it asked and, from
        decode tp rank 0, every rank of the columns its instance draws from (the rule of
        ``DecodeRooms._hand_on``, checked against it in the last test)."""
        to = set(self.asks(inst, j))
        if j == 0:
            cols = {t for k in range(DECODE_TP[inst]) for t in SOURCES[(inst, k)]}
            to |= {(c, t) for c in range(self.cp_size) for t in cols}
        return sorted(to - {(0, 0)})

    def deliver(self, inst: str, j: int, at: tuple[int, int], msg, now: float) -> None:
        acts = list(self.m[at].message(ident(inst, j), msg, now))
        while acts:
            reads = [a for a in acts if isinstance(a, ReadDecider)]
            self.book(acts, at)
            acts = [x for a in reads for x in self.answer_read(at, a, now)]

    def answer_read(self, at: tuple[int, int], a: ReadDecider, now: float):
        """As the daemon answers: the registration's place and its proof key."""
        (c, t), = [k for k in self.keys if self.reg(*k) == a.rank_id]
        return list(self.m[at].feed(DeciderRead(a.rank_id, "p", "prefill", (0, c, t, 0), self.keys[(c, t)].public_hex,
                                                None, now)))

    def book(self, acts, at: tuple[int, int]) -> None:
        for a in acts:
            if not isinstance(a, Send):
                continue
            (to,) = a.to
            who = next(k for k, v in HELLO.items() if k == to)
            inst, j = who.decode()[5], int(who.decode()[6:])
            self.replies.setdefault((inst, j), []).append((at, a.msg))
            if isinstance(a.msg, wire.RoomTicket) and at == (0, 0):  # (a decode rank takes the decider's only)
                self.tickets.setdefault((inst, j), a.msg)

    def errors(self, inst: str):
        return [(k, at, m) for k, ms in self.replies.items() if k[0] == inst for at, m in ms
                if isinstance(m, wire.ErrorReply) or (isinstance(m, wire.PagesDone) and m.status == "failed")]


def request(inst: str, j: int, room: int) -> wire.TransferRequest:
    return wire.TransferRequest(
        room=room, decode_rank=f"{inst}/dp0/tp{j}", decode_rank_id=rid(inst, j),
        page_ids=wire.pack_pages(np.arange(2) + 3), first_page=0, pools=["k", "v"], aux_slot=1, num_tokens=7,
        deadline_ms=10_000, want_digest=False, fingerprint="x", num_decode_ranks=DECODE_TP[inst])


def race(g: Group, rng: random.Random, room: int) -> int:
    """Every decode rank's requests, interleaved at random (each rank's own in its order); a rank
    handed a ticket by the decider hands it on after its own requests, at a random later point.
    Returns how many tickets reached a rank before any claim of their instance did."""
    queues = {(i, j): [(at, "req") for at in g.asks(i, j)] for i, j in DECODE}
    now, handed, asked, early = 1.0, set(), set(), 0
    while any(queues.values()):
        k = rng.choice([k for k, q in queues.items() if q])
        at, what = queues[k].pop(0)
        now += 0.001
        early += what == "ticket" and (k[0], at) not in asked
        asked.add((k[0], at))
        g.deliver(*k, at, request(*k, room) if what == "req" else g.tickets[k], now)
        for d in DECODE:  # a ticket just granted: handed on once this rank's requests are out
            if d in g.tickets and not any(w == "req" for _, w in queues[d]) and d not in handed:
                handed.add(d)
                queues[d] += [(at2, "ticket") for at2 in g.hand_on(*d)]
    return early



@pytest.mark.parametrize("cp_size", [1, 2])
def test_two_instances_of_other_tp_sizes_racing_one_room_get_one_decision_on_every_rank(cp_size):
    """50 races each: every prefill rank that holds the room holds it for the same instance, the
    first claim at (cp 0, tp 0), and the loser got only refusals, on every rank it asked."""
    rng = random.Random(32 + cp_size)
    split, early = [], 0
    for trial in range(50):
        g, room = Group(cp_size), 100 + trial
        early += race(g, rng, room)
        holders = {at: (m.rooms.get(room).holder or (None,))[0] for at, m in g.m.items() if m.rooms.get(room)}
        if len(set(holders.values()) - {None}) != 1 or None in holders.values() or len(holders) != len(g.m):
            split.append((trial, holders))
            continue
        (winner,) = set(holders.values())
        loser = "B" if winner == "A" else "A"
        for at, m in g.m.items():
            assert {t.split("/")[0] for t in m.rooms.get(room).targets} == {winner}, (trial, at)
        assert not g.errors(winner), (trial, g.errors(winner))
        loser_asked = {(j, at) for i, j in DECODE if i == loser for at in g.asks(i, j)}
        refused = {(k[1], at) for k, at, m in g.errors(loser)}
        assert refused == loser_asked, (trial, sorted(loser_asked - refused))
        assert all(f"claimed by decode instance {winner}" in m.reason for _, _, m in g.errors(loser))
    assert not split, f"{len(split)} of 50 rooms split or left undecided: {split[:3]}"
    assert early > 0  # tickets that overtook their instance's claim were among them


# -- the decode side, on the real machine: where the decider's ticket is handed on ----------------


def _decode_rank(inst: str, j: int, cp_size: int):
    """The real DecodeRooms of decode rank ``j`` of ``inst`` with a room whose requests went out
    to a prefill TP 2 group of ``cp_size`` CP ranks (endpoint ``tcp://p{cp}{tp}``)."""
    from kvbridge.bootstrap.schemas import LookupResponse, SenderRank
    from kvbridge.bootstrap.topology import OwnerLanePlan, Topology
    from kvbridge.transfer.decode.config import DecodeConfig
    from kvbridge.transfer.decode.events import LookUp
    from _machines import decode_machine

    specs = kv_heads(LAYERS, PAGE, DECODE_TP[inst], j)[0]
    m = decode_machine(DecodeConfig(instance=inst, tp_rank=j, tp_size=DECODE_TP[inst], peer_timeout=5.0,
                                    ping_interval=0.5, transfer_timeout=100.0),
                       specs, AUX, read_aux_row=lambda slot: (None, 0.0),
                       page_digests=lambda *a: np.zeros(0, np.uint64), rank_id=lambda: rid(inst, j))
    ranks = [SenderRank(rank_id=Group.reg(c, t), dp_rank=0, cp_rank=c, tp_rank=t, pp_rank=0,
                        control_endpoint=f"tcp://p{c}{t}", session_id=f"s{c}{t}", pools=[])
             for c in range(cp_size) for t in range(SRC_TP)]
    topo = LookupResponse(instance="p", room=1, dp_rank=0, fingerprint="fp", ranks=ranks,
                          topology=Topology(role="prefill", dp_size=1, cp_size=cp_size, tp_size=SRC_TP, pp_size=1),
                          plan=OwnerLanePlan(cp_size=cp_size, rule="interleaved"))
    r = m.open(7, "p", None, 1.0)
    (ask,) = [a for a in m.tick(1.0) if isinstance(a, LookUp)]
    m.looked_up(7, ask.key, topo, None, 1.0)
    acts = m.init(r, np.arange(2, dtype=np.int64) + 3, 1, 7, 0, 1.0)
    asked = {e for a in acts if isinstance(a, Send) and isinstance(a.msg, wire.TransferRequest) for e in a.to}
    return m, r, asked


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("inst,j", DECODE, ids=[f"{i}{j}" for i, j in DECODE])
def test_the_decode_machine_hands_the_deciders_ticket_where_the_race_model_does(inst, j, cp_size):
    m, r, asked = _decode_rank(inst, j, cp_size)
    g = Group.__new__(Group)
    g.cp_size = cp_size
    assert asked == {f"tcp://p{c}{t}" for c, t in g.asks(inst, j)}  # the route the race asks
    t = wire.RoomTicket(room=7, decode_rank_id=rid(inst, j), decider=Group.reg(0, 0), instance=inst,
                        decode_rank=f"{inst}/dp0/tp{j}", binding=b"", signature=bytes(64))
    for other in sorted(asked - {"tcp://p00"}):  # a ticket from any rank but the decider decides nothing
        assert not [a for a in m.message(other, t, 1.1) if isinstance(a, Send)]
    out = [a for a in m.message("tcp://p00", t, 1.2) if isinstance(a, Send)] if "tcp://p00" in asked else []
    want = {f"tcp://p{c}{tt}" for c, tt in g.hand_on(inst, j)} if "tcp://p00" in asked else set()
    assert {e for a in out for e in a.to} == want and all(a.msg is t for a in out)
    if j == 0 and cp_size == 2:  # tp rank 0 reaches the other column, which it does not ask (B at TP 4)
        assert want >= {"tcp://p01", "tcp://p11"}


def test_a_ticket_before_its_instances_claim_waits_for_it_unchecked_then_decides_or_expires():
    g = Group(1)
    tp1 = g.m[(0, 1)]
    g.deliver("B", 0, (0, 0), request("B", 0, 7), 1.0)  # B's rank 0 wins at the decider
    g.deliver("B", 0, (0, 1), g.tickets[("B", 0)], 1.01)  # and hands on before B's rank 2 asked tp 1
    assert tp1.tickets.num_early == 1 and not tp1.tickets.keys  # kept, and nothing checked yet
    g.deliver("A", 0, (0, 1), request("A", 0, 7), 1.02)  # A's claim is held: no decision for A
    assert tp1.rooms.get(7) is None or tp1.rooms.get(7).holder is None
    g.deliver("B", 2, (0, 1), request("B", 2, 7), 1.03)  # B's claim: the ticket decides the room
    r = tp1.rooms.get(7)
    assert r.holder[0] == "B" and list(r.targets) == ["B/dp0/tp2"] and tp1.tickets.num_early == 0
    assert any("claimed by decode instance B" in m.reason for _, _, m in g.errors("A"))
    g.deliver("B", 1, (0, 1), g.tickets[("B", 0)], 1.04)  # a ticket for a room decided here: ignored
    assert tp1.tickets.num_early == 0
    t = g.tickets[("B", 0)]
    g.deliver("B", 0, (0, 1), wire.RoomTicket(room=8, decode_rank_id=t.decode_rank_id, decider=t.decider,
                                              instance=t.instance, decode_rank=t.decode_rank, binding=t.binding,
                                              signature=t.signature), 1.05)
    assert tp1.tickets.num_early == 1  # no claim follows: dropped at the first scan past target_timeout
    tp1.tick(2.0)
    tp1.tick(70.0)  # the loop stood still 68 s: the claim it waits for may be unread, so it counts from 70
    assert tp1.tickets.num_early == 1
    for now in range(71, 130):  # the loop runs
        tp1.tick(float(now))
    assert tp1.tickets.num_early == 1
    tp1.tick(130.5)
    assert tp1.tickets.num_early == 0 and not tp1.tickets.early


def test_early_tickets_count_with_the_held_claims_cap():
    g = Group(1)
    tp1 = g.m[(0, 1)]
    tp1.tickets.max_held = 2
    for room in (1, 2):
        g.deliver("B", 0, (0, 0), request("B", 0, room), 1.0)
        g.deliver("B", 0, (0, 1), g.tickets.pop(("B", 0)), 1.0)
    assert tp1.tickets.num_early == 2
    g.deliver("B", 2, (0, 1), request("B", 2, 3), 1.1)  # one more claim waiting: refused by name
    (err,) = [m for _, _, m in g.errors("B")]
    assert "2 claims already wait" in err.reason
