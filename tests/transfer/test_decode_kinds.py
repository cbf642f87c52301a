"""A decode rank's books for the pool kinds (kvbridge.transfer.decode.kinds): the ledger counts
every kind (a room is complete only when every window page, compressed entry page and state
slot arrived, each once, state only with the last chunk), and a failed room's state slots are
released only once every asked prefill rank is quiet (hard rule 6), as its pages are."""

from __future__ import annotations

import pytest

from kvbridge.errors import LedgerError, StagingSlotError
from kvbridge.layout import chunk_extent, deepseek_v4_pools
from kvbridge.transfer.decode.kinds import KindLedger, StateSlots

SPECS = deepseek_v4_pools(4, 4, sliding_window=16, hca_ratio=32, head_dim=8, index_head_dim=4, draft_layers=1)


def _feed(ledger, n, cuts, skip=()):
    bounds = [0, *cuts, n]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = i == len(bounds) - 2
        for name, spec in SPECS.items():
            ext = chunk_extent(spec, n, a, b, last)
            if ext.count and name not in skip:
                ledger.record(name, ext.first, ext.count, last=last, rank="cp0")


@pytest.mark.parametrize("n, cuts", [(45, ()), (131, (40, 96)), (9, (4,))])
def test_the_ledger_completes_when_every_kind_arrived(n, cuts):
    ledger = KindLedger(1, SPECS, n)
    _feed(ledger, n, cuts)
    assert ledger.complete and ledger.missing() == {}


@pytest.mark.parametrize("pool", ["swa", "hca", "csa_index", "hca_tail", "csa_overlap", "draft"])
def test_a_missing_kind_keeps_the_room_incomplete(pool):
    ledger = KindLedger(1, SPECS, 131)
    _feed(ledger, 131, (40, 96), skip=(pool,))
    assert not ledger.complete and pool in ledger.missing()


def test_state_only_with_the_last_chunk_and_once():
    ledger = KindLedger(3, SPECS, 45)
    with pytest.raises(LedgerError) as err:
        ledger.record("hca_tail", 0, 1, last=False, rank="cp0")
    assert err.value.field == "state" and "room=3" in str(err.value)
    ledger.record("hca_tail", 0, 1, last=True)
    with pytest.raises(LedgerError, match="state slot reported twice"):
        ledger.record("hca_tail", 0, 1, last=True)


def test_window_units_outside_the_window_and_repeats_are_refused():
    ledger = KindLedger(4, SPECS, 45)  # window 15 tokens: 30..44 = pages 7..11
    with pytest.raises(LedgerError, match=r"outside what decode needs \[7, 12\)"):
        ledger.record("swa", 6, 1, last=False)
    ledger.record("swa", 7, 2, last=False)
    with pytest.raises(LedgerError, match="unit 8 reported twice"):
        ledger.record("swa", 8, 1, last=False)
    with pytest.raises(LedgerError, match="does not receive"):
        ledger.record("nope", 0, 1, last=True)


def test_abort_frees_state_slots_only_once_every_asked_rank_is_quiet():
    slots = StateSlots(2)
    a, b = slots.assign(10), slots.assign(11)
    assert {a, b} == {0, 1} and slots.num_free == 0
    with pytest.raises(StagingSlotError):
        slots.assign(12)
    assert slots.fail(10, asked={"cp0", "cp1"}) == []  # a write may still land: held
    assert slots.num_free == 0
    with pytest.raises(StagingSlotError):
        slots.release(a)  # not the engine's while draining
    assert slots.quiet(10, "cp0") == []
    assert slots.quiet(10, "cp1") == [a] and slots.num_free == 1
    assert slots.assign(12) == a
    assert slots.succeed(11) == b and slots.num_free == 0
    slots.release(b)
    with pytest.raises(StagingSlotError):
        slots.release(b)
    assert slots.fail(12, asked=()) == [a]


@pytest.mark.parametrize("rule", ["interleaved", "contiguous"])
def test_cp_ranks_report_their_lanes_and_the_ledger_completes_once(rule):
    from kvbridge.layout import OwnerLanes, lane_units

    specs = {k: v for k, v in SPECS.items() if v.kind != "compressed"}  # compressed pools are CP 1 only
    lanes, n = OwnerLanes(2, rule), 45
    ledger = KindLedger(9, specs, n)
    for r in range(2):
        for name, spec in specs.items():
            ext = chunk_extent(spec, n, 0, n, True)
            ledger.record_units(name, lane_units(spec, ext, lanes, r, n, 4), last=True, rank=f"cp{r}")
    assert ledger.complete
    with pytest.raises(LedgerError, match="reported twice"):
        ledger.record_units("swa", lane_units(specs["swa"], chunk_extent(specs["swa"], n, 0, n, True), lanes, 1, n, 4),
                            last=True, rank="cp1")
