"""Decode's rooms toward a pipeline-parallel prefill instance, as a state machine driven by
events alone (no socket, thread, clock or engine): every stage is asked for the pools it
holds layers of, a page counts only once every stage's layer range arrived, the aux row
comes from the last stage, a stage that fails or stays silent fails the room naming it,
and a look-up whose stages do not tile a pool's layers is refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.bootstrap.schemas import LookupResponse, SenderRank
from kvbridge.bootstrap.topology import LayerRange, OwnerLanePlan, PoolDescriptor, Topology
from kvbridge.layout import AuxSchema, deepseek_pools, stage_specs
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.events import LookUp
from kvbridge.transfer.decode.machine import DecodeRooms
from kvbridge.transfer.poll import KVPoll
from _machines import decode_machine

PAGE = 4
SCHEMA = AuxSchema.standard(hidden_size=8)
INSTANCE = "pre"
LAYERS = 4  # target 0..3, index 0..3, draft 4
SPECS = deepseek_pools(num_layers=LAYERS, page_size=PAGE, kv_dtype="fp8", index=True, draft_layers=1)
SPLIT = [(0, 2), (2, 4)]


def endpoint(cp: int, pp: int) -> str:
    return f"tcp://p{cp}s{pp}"


def sender(cp: int, pp: int, layers: tuple[int, int], extra: tuple[tuple[str, int], ...] = ()) -> SenderRank:
    held = stage_specs(SPECS, layers, LAYERS)
    pools = [PoolDescriptor(pool=p, layer_id=lid, base=4096 * (i + 1), capacity_pages=64,
                            bytes_per_page=SPECS[p].bytes_per_page)
             for i, (p, lid) in enumerate([(p, lid) for p, s in sorted(held.items()) for lid in s.layer_ids] + list(extra))]
    return SenderRank(rank_id=f"r{cp}{pp}", dp_rank=0, cp_rank=cp, tp_rank=0, pp_rank=pp,
                      control_endpoint=endpoint(cp, pp), session_id=f"s{cp}{pp}", pools=pools,
                      pp_layers=LayerRange(start=layers[0], end=layers[1]))


def topology(cp: int = 2, split=SPLIT, extra: dict | None = None) -> LookupResponse:
    ranks = [sender(c, s, layers, (extra or {}).get((c, s), ())) for c in range(cp) for s, layers in enumerate(split)]
    return LookupResponse(instance=INSTANCE, room=1, dp_rank=0, fingerprint="fp", ranks=ranks,
                          topology=Topology(role="prefill", dp_size=1, cp_size=cp, tp_size=1, pp_size=len(split)),
                          plan=OwnerLanePlan(cp_size=cp, rule="interleaved"))


class Memory:
    def __init__(self) -> None:
        self.rows = np.zeros((8, SCHEMA.row_bytes), dtype=np.uint8)

    def land(self, slot: int, room: int) -> None:
        self.rows[slot] = 0
        at = SCHEMA.offsets["room"]
        self.rows[slot, at: at + 8] = np.frombuffer(np.uint64(room).tobytes(), np.uint8)

    def read(self, slot: int) -> tuple[np.ndarray, float]:
        return self.rows[slot].copy(), 0.0


def machine(**cfg) -> DecodeRooms:
    mem = Memory()
    cfg = dict(instance="dec", peer_timeout=5.0, ping_interval=0.5, lease_quarantine=30.0, transfer_timeout=100.0) | cfg
    m = decode_machine(DecodeConfig(**cfg), SPECS, SCHEMA, read_aux_row=mem.read,
                    page_digests=lambda *a: np.zeros(0, np.uint64), rank_id=lambda: "dec-id")
    m.memory = mem
    return m


@pytest.fixture
def m() -> DecodeRooms:
    return machine()


def sends(actions, msg_type):
    return [(a.to, a.msg) for a in actions if isinstance(a, Send) and isinstance(a.msg, msg_type)]


def done(room: int, cp: int, pools: list[str], pages: list[int], aux: bool = False, num_tokens: int = 0) -> wire.PagesDone:
    return wire.PagesDone(room=room, cp_rank=cp, status="ok", reason="", pools=pools,
                          logical_pages=np.asarray(pages, "<i4").tobytes(), digests=None, aux=aux, num_tokens=num_tokens)


def booted(m, topo: LookupResponse, room: int = 7, now: float = 1.0):
    r = m.open(room, INSTANCE, None, now)
    (ask,) = [a for a in m.tick(now) if isinstance(a, LookUp)]
    m.looked_up(room, ask.key, topo, None, now)
    return r


def requested(m, room: int = 7, now: float = 1.0, cp: int = 2, split=SPLIT):
    """10 tokens, 3 pages: with cp 2, cp0 owns pages 0 and 2 (and the last token), cp1 page 1."""
    r = booted(m, topology(cp, split), room, now)
    assert r.state.state == KVPoll.WaitingForInput, r.state.reason
    acts = m.init(r, np.arange(3, dtype=np.int64) + 10, 1, 10, 0, now)
    asked = {to: req.pools for tos, req in sends(acts, wire.TransferRequest) for to in tos}
    assert r.state.state == KVPoll.Transferring
    return r, asked


def test_each_stage_is_asked_for_the_pools_it_holds_and_the_room_waits_for_every_stage(m):
    r, asked = requested(m)
    assert asked == {endpoint(c, 0): ["index", "target"] for c in range(2)} | \
        {endpoint(c, 1): ["draft", "index", "target"] for c in range(2)}
    m.message(endpoint(0, 0), done(7, 0, ["index", "target"], [0, 2]), 2.0)
    m.message(endpoint(1, 0), done(7, 1, ["index", "target"], [1]), 2.0)
    m.message(endpoint(1, 1), done(7, 1, ["draft", "index", "target"], [1]), 2.0)
    assert r.state.state == KVPoll.Transferring  # stage 1 of cp0 (pages 0, 2 and the aux row) still owed
    assert r.ledger.missing() == {"draft@pp1": [0, 2], "index@pp1": [0, 2], "target@pp1": [0, 2]}
    assert r.ledger.missing_stages() == [1]
    m.memory.land(1, 7)
    m.message(endpoint(0, 1), done(7, 0, ["draft", "index", "target"], [0, 2], aux=True), 2.1)
    assert r.state.state == KVPoll.Success, r.state.reason
    stats = r.stats(3.0)
    assert stats["pages_by_stage"] == {0: 3, 1: 3} and stats["pages_by_rank"] == {0: 4, 1: 2}


def test_three_stages_and_one_cp_rank(m):
    split = [(0, 1), (1, 3), (3, 4)]
    r, asked = requested(m, cp=1, split=split)
    assert asked[endpoint(0, 2)] == ["draft", "index", "target"] and asked[endpoint(0, 0)] == ["index", "target"]
    m.memory.land(1, 7)
    m.message(endpoint(0, 2), done(7, 0, ["draft", "index", "target"], [0, 1, 2], aux=True), 2.0)
    m.message(endpoint(0, 0), done(7, 0, ["index", "target"], [0, 1, 2]), 2.0)
    assert r.state.state == KVPoll.Transferring and r.ledger.missing_stages() == [1]
    m.message(endpoint(0, 1), done(7, 0, ["index", "target"], [0, 1, 2]), 2.0)
    assert r.state.state == KVPoll.Success


def test_the_aux_row_from_a_stage_but_the_last_fails_the_room(m):
    r, _ = requested(m)
    m.message(endpoint(0, 0), done(7, 0, ["index", "target"], [0, 2], aux=True), 2.0)
    assert r.state.state == KVPoll.Failed and "aux row reported by pipeline stage pp0; the last stage pp1" in r.state.reason


def test_a_pool_from_a_stage_that_holds_none_of_its_layers_fails_the_room(m):
    r, _ = requested(m)
    m.message(endpoint(0, 0), done(7, 0, ["draft"], [0, 2]), 2.0)
    assert r.state.state == KVPoll.Failed and "pool 'draft' reported by pipeline stage pp0" in r.state.reason


def test_the_same_stage_reporting_twice_fails_the_room_naming_the_stage(m):
    r, _ = requested(m)
    m.message(endpoint(1, 1), done(7, 1, ["draft", "index", "target"], [1]), 2.0)
    m.message(endpoint(1, 1), done(7, 1, ["target"], [1]), 2.0)
    assert r.state.state == KVPoll.Failed and "(layers of stage pp1) reported twice" in r.state.reason


def test_a_silent_stage_times_the_room_out_naming_it():
    m = machine(transfer_timeout=5.0)
    r, _ = requested(m)
    m.memory.land(1, 7)
    for c, pages in ((0, [0, 2]), (1, [1])):
        m.message(endpoint(c, 1), done(7, c, ["draft", "index", "target"], pages, aux=c == 0), 2.0)
    assert r.state.state == KVPoll.Transferring
    m.running(2.0, 7.0)
    assert r.state.state == KVPoll.Failed
    assert "target@pp0" in r.state.reason and "from pipeline stage(s) pp0" in r.state.reason, r.state.reason


@pytest.mark.parametrize("stage", [0, 1])
def test_one_stage_failing_fails_the_room_and_aborts_every_stage(m, stage):
    r, _ = requested(m)
    acts = m.message(endpoint(1, stage), wire.PagesDone(room=7, cp_rank=1, status="failed", reason="stage aborted",
                                                         pools=[], logical_pages=b"", digests=None), 2.0)
    assert r.state.state == KVPoll.Failed and f"prefill cp rank 1/pp{stage} (" in r.state.reason, r.state.reason
    aborted = {to for tos, _ in sends(acts, wire.Abort) for to in tos}
    others = {(c, s) for c in range(2) for s in range(2)} - {(1, stage)}
    assert aborted == {endpoint(c, s) for c, s in others}  # the failed one is quiet already
    assert not r.pages_releasable  # hard rule 6: every stage must be quiet first
    for c, s in sorted(others):
        m.message(endpoint(c, s), wire.AbortAck(room=7, cp_rank=c), 3.0)
    assert r.pages_releasable


@pytest.mark.parametrize("split, extra, words", [
    ([(0, 2), (1, 4)], None, "pool 'index' layer 1 is registered by pipeline stages pp0, pp1"),
    ([(0, 1), (2, 4)], None, "pool 'index' layer 1 is registered by no pipeline stage"),
    (SPLIT, {(0, 0): (("draft", 4),)}, "pool 'draft' layer 4 is registered by pipeline stages pp0, pp1"),
])
def test_a_lookup_whose_stages_do_not_tile_a_pool_is_refused(m, split, extra, words):
    r = booted(m, topology(2, split, extra))
    assert r.state.state == KVPoll.Failed and words in r.state.reason, r.state.reason
    assert not r.requested  # nothing asked of any stage


def test_page_digests_are_checked_per_stage_over_that_stages_layers():
    """Each stage digests its own layers of the pools it sent: decode recomputes each report's
    digests over the same layers (the sender's registered ones) and fails on a difference."""
    asked = []

    def digests(pools, logical, physical, num_tokens, layers=None):
        asked.append((tuple(pools), {p: layers[p] for p in pools} if layers else None))
        return logical.astype(np.uint64) * 7  # "ours": page * 7

    def run(bad: bool):
        m = machine(verify_digest=True)
        m.page_digests = digests
        r, _ = requested(m, cp=1)
        m.memory.land(1, 7)
        for s, pools in ((0, ["index", "target"]), (1, ["draft", "index", "target"])):
            sent = np.arange(3, dtype=np.uint64) * 7 + (1 if bad and s == 1 else 0)
            m.message(endpoint(0, s), wire.PagesDone(room=7, cp_rank=0, status="ok", reason="", pools=pools,
                                                      logical_pages=np.arange(3, dtype="<i4").tobytes(),
                                                      digests=sent.tobytes(), aux=s == 1, num_tokens=10), 2.0)
        return r

    r = run(bad=False)
    assert r.state.state == KVPoll.Success, r.state.reason
    assert asked == [(("index", "target"), {"index": (0, 1), "target": (0, 1)}),
                     (("draft", "index", "target"), {"draft": (4,), "index": (2, 3), "target": (2, 3)})]
    r = run(bad=True)
    assert r.state.state == KVPoll.Failed and "digest mismatch on logical page 0" in r.state.reason
