"""Kind pools over layer ranges, sans I/O: prefill's kind book (``prefill/kinds.py``) posts a
layer range's layers of each kind pool only, reports a unit once every layer of it landed, and
sends a state layer once, with its range at the request's full length; decode's kind ledger
(``decode/kinds.py``) counts each unit once per pipeline stage that holds layers of the pool."""

from __future__ import annotations

import numpy as np
import pytest

import kvbridge as kvb
from _kind_rooms import decode_pages, model_specs, prefill_units
from kvbridge.errors import LedgerError
from kvbridge.layout import stage_specs
from kvbridge.transfer.decode.kinds import KindLedger
from kvbridge.transfer.prefill.kinds import KindWrites
from test_kind_rooms_rules import fake_descs, request

V4_LAYERS = 5  # the V4 test model's target layers (the draft window is layer 4)


def book(model: str, n: int, specs=None):
    specs = specs or model_specs(model)
    kw = KindWrites(specs, fake_descs(specs), lanes=kvb.OwnerLanes(1, "interleaved"), cp_rank=0, tp_size=1,
                    rank="p0", num_target_layers=V4_LAYERS if model == "v4" else 4)
    kw.engine_units(9, prefill_units(specs))
    req = request(specs, n, pools=sorted(specs))
    req = request(specs, n, pools=sorted(specs), kind_units={p: u for p, u in req.kind_units.items() if p in specs})
    kw.accept(req, fake_descs(specs, 1 << 30), decode_pages(n), n)
    return specs, kw, np.arange(-(-n // 4)) + 1


def layers_written(specs, plan) -> set[tuple[str, int]]:
    """The (pool, layer) buffers a plan writes into (decode's, from base 1 << 30)."""
    out = set()
    for d in fake_descs(specs, 1 << 30):
        top = d.base + d.capacity_pages * d.bytes_per_page
        if ((plan.dst >= d.base) & (plan.dst < top)).any():
            out.add((d.pool, d.layer_id))
    return out


def units(report: dict) -> dict[str, list[int]]:
    return {p: np.frombuffer(u, "<i4").tolist() for p, u in report.items()}


def test_a_layer_range_writes_its_layers_of_every_kind_pool_only():
    """V4, 131 tokens, range (0, 2) at 128 tokens ready: swa, hca layers 0, 1 only (no CSA: layer
    3; no draft: layer 4); no state (not at full length). Range (2, 5) then: swa 2-4 (the draft
    window, layer 4, with the range ending at the last target layer), hca 2, csa 3."""
    specs, kw, local_of = book("v4", 131)
    plan, write = kw.plan(9, "d0", 131, 128, False, local_of, decode_pages(131), True, (0, 2))
    assert layers_written(specs, plan) == {("swa", 0), ("swa", 1), ("hca", 0), ("hca", 1)}
    plan, write = kw.plan(9, "d0", 131, 128, False, local_of, decode_pages(131), True, (2, 5))
    assert layers_written(specs, plan) == {("swa", 2), ("swa", 3), ("draft", 4), ("hca", 2), ("csa", 3),
                                           ("csa_index", 3)}


def test_a_unit_is_reported_once_every_layer_of_it_landed():
    """HCA (layers 0-2) page 0 is complete at 128 tokens (4 entries): the range (0, 2) landing reports
    nothing of it; the range (2, 5) landing reports it, once."""
    specs, kw, local_of = book("v4", 131)
    _, first = kw.plan(9, "d0", 131, 128, False, local_of, decode_pages(131), True, (0, 2))
    _, second = kw.plan(9, "d0", 131, 128, False, local_of, decode_pages(131), True, (2, 5))
    assert "hca" not in units(kw.landed(9, "d0", first)[0])
    assert units(kw.landed(9, "d0", second)[0])["hca"] == [0]
    assert "hca" not in units(kw.landed(9, "d0", second)[0])  # (a report names a unit once)


def test_state_layers_travel_once_with_their_range_at_the_full_length():
    """hca_tail (state, layers 0-2): nothing before the request's length is ready; at 131 tokens
    the range (0, 2) writes its layers 0, 1 (reported once layer 2 is in too), the range (2, 5)
    layer 2; a later last chunk writes no state again."""
    specs, kw, local_of = book("v4", 131)
    plan, w = kw.plan(9, "d0", 131, 128, False, local_of, decode_pages(131), True, (0, 2))
    assert not {p for p, _ in layers_written(specs, plan)} & {"hca_tail", "csa_tail"}
    kw.landed(9, "d0", w)
    assert kw.wants(9, "d0") and not kw.settled(9, "d0")
    plan, a = kw.plan(9, "d0", 131, 131, False, local_of, decode_pages(131), True, (0, 2))
    assert {k for k in layers_written(specs, plan) if k[0] == "hca_tail"} == {("hca_tail", 0), ("hca_tail", 1)}
    report, final = kw.landed(9, "d0", a)
    assert final and "hca_tail" not in report
    plan, b = kw.plan(9, "d0", 131, 131, False, local_of, decode_pages(131), True, (2, 5))
    assert {k for k in layers_written(specs, plan) if k[0] in ("hca_tail", "csa_tail")} == {("hca_tail", 2),
                                                                                           ("csa_tail", 3)}
    report, final = kw.landed(9, "d0", b)
    assert units(report)["hca_tail"] == [0] and units(report)["csa_tail"] == [0] and final
    assert not kw.wants(9, "d0") and kw.settled(9, "d0")
    plan, c = kw.plan(9, "d0", 131, 131, True, local_of, decode_pages(131), True)  # the last chunk
    assert not c and not plan.num_slices


def test_a_stage_sends_its_layers_of_each_kind_pool():
    """The second of two V4 stages (target layers [2, 5)) holds hca layer 2, the CSA pools and the
    draft window: a whole chunk writes those, reported as whole units of its layers."""
    specs = stage_specs(model_specs("v4"), (2, 5), V4_LAYERS)
    specs, kw, local_of = book("v4", 45, specs)
    plan, write = kw.plan(9, "d0", 45, 45, True, local_of, decode_pages(45), True)
    assert {p for p, _ in layers_written(specs, plan)} == set(specs)
    assert {lid for p, lid in layers_written(specs, plan) if p == "hca"} == {2}
    assert sorted(units(kw.landed(9, "d0", write)[0])) == sorted(specs)


def test_decode_counts_each_unit_once_per_stage_that_holds_the_pool():
    specs = model_specs("v4")
    stages = {p: (0, 1) if p in ("swa", "hca", "hca_tail") else (1,) for p in specs}
    ledger = KindLedger(5, specs, 45, stages)
    ledger.record_units("hca", np.array([0]), last=True, pp_rank=0)
    assert ledger.missing()["hca@pp1"] == [0]
    ledger.record_units("hca", np.array([0]), last=True, pp_rank=1)  # pp1's layer of the same unit
    assert "hca@pp1" not in ledger.missing()
    with pytest.raises(LedgerError, match="reported twice"):
        ledger.record_units("hca", np.array([0]), last=True, pp_rank=1)
    with pytest.raises(LedgerError, match="pipeline stage pp0, which holds no layer") as err:
        ledger.record_units("csa", np.array([0]), last=True, pp_rank=0)
    assert err.value.field == "pp_rank"
    for pool, ext in ledger.extents.items():
        for st in stages[pool]:
            if pool != "hca":
                ledger.record_units(pool, np.arange(ext.first, ext.stop), last=True, pp_rank=st)
    assert ledger.complete


# -- decode's room machine: a state slot from two prefill TP ranks ----------------------------------------------


def test_decode_commits_a_sharded_state_slot_only_once_every_prefill_tp_part_arrived():
    """Prefill TP 2 -> decode TP 1, the hybrid (window + Mamba state): the TP route draws the
    state slots from both prefill TP ranks (each sends its part of every shard group) and the
    window from TP rank 0. With tp0's window, state and aux row in, the room waits for tp1's
    parts of the slots; they come: Success."""
    from _machines import decode_machine
    from kvbridge.bootstrap.schemas import LookupResponse, SenderRank
    from kvbridge.bootstrap.topology import OwnerLanePlan, Topology
    from kvbridge.transfer.actions import Send
    from kvbridge.transfer.channel import wire
    from kvbridge.transfer.decode import events as de
    from kvbridge.transfer.decode.config import DecodeConfig
    from kvbridge.transfer.decode.events import LookUp
    from kvbridge.transfer.poll import KVPoll
    from test_kind_rooms_rules import Memory
    from _kind_rooms import decode_units

    specs, mem = model_specs("hybrid"), Memory()
    m = decode_machine(DecodeConfig(instance="dec", staging="never", transfer_timeout=100.0), specs, kvb.AuxSchema.standard(8),
                       read_aux_row=mem.read, page_digests=lambda *a: np.zeros(0, np.uint64), rank_id=lambda: "dec-id",
                       kind_buffers=fake_descs(specs))
    ranks = [SenderRank(rank_id=f"rank{t}", dp_rank=0, cp_rank=0, tp_rank=t, pp_rank=0, control_endpoint=f"tcp://p{t}",
                        session_id=f"s{t}", pools=[]) for t in (0, 1)]
    topo = LookupResponse(instance="pre", room=1, dp_rank=0, fingerprint="fp", ranks=ranks,
                          topology=Topology(role="prefill", dp_size=1, cp_size=1, tp_size=2, pp_size=1),
                          plan=OwnerLanePlan(cp_size=1, rule="interleaved"))
    r = m.open(7, "pre", None, 1.0)
    ask, = [a for a in m.tick(1.0) if isinstance(a, LookUp)]
    m.looked_up(7, ask.key, topo, None, 1.0)
    m.feed(de.InitKinds(r, m.kinds.check_units(7, decode_units(specs, 22, 3), 22, 0)))
    acts = m.init(r, decode_pages(22), 1, 22, 0, 1.0)
    asked = {a.to: sorted(a.msg.pools) for a in acts if isinstance(a, Send) and isinstance(a.msg, wire.TransferRequest)}
    assert asked == {("tcp://p0",): ["mamba_conv", "mamba_ssm", "swa"], ("tcp://p1",): ["mamba_conv", "mamba_ssm"]}

    def done(kinds: dict, aux: bool = False) -> wire.PagesDone:
        return wire.PagesDone(room=7, cp_rank=0, status="ok", reason="", pools=[], logical_pages=b"", digests=None,
                              aux=aux, num_tokens=22 if aux else 0, kind_last=True,
                              kind_units={p: np.asarray(u, "<i4").tobytes() for p, u in kinds.items()})

    mem.land(1, 7)
    m.message("tcp://p0", done({"swa": [4, 5], "mamba_conv": [0], "mamba_ssm": [0]}, aux=True), 2.0)
    assert r.state.state == KVPoll.Transferring  # tp1's parts of the slots are not in
    m.message("tcp://p1", done({"mamba_conv": [0], "mamba_ssm": [0]}), 2.1)
    assert r.state.state == KVPoll.Success, r.state.reason
