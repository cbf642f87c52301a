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
