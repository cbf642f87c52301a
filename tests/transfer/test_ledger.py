"""The decode-side exactly-once ledger: every (pool, logical page) once, from its
owner; the aux row once, from the owner of the last valid token."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import LedgerError
from kvbridge.layout import OwnerLanes
from kvbridge.transfer.decode.room import PageLedger

POOLS = ("draft", "index", "target")


def ledger(num_pages: int = 5, cp: int = 2, aux_owner: int = 0) -> PageLedger:
    return PageLedger(room=7, pools=POOLS, num_pages=num_pages, lanes=OwnerLanes(cp), aux_owner=aux_owner)


def test_complete_only_when_every_page_of_every_pool_and_the_aux_row_arrived():
    lg = ledger()
    lg.record(0, POOLS, np.array([0, 2]))
    lg.record(1, POOLS, np.array([1, 3]))
    assert not lg.pages_complete and lg.missing() == {p: [4] for p in POOLS}
    lg.record(0, POOLS, np.array([4]))
    assert lg.pages_complete and not lg.complete
    lg.record_aux(0)
    assert lg.complete and lg.pages_by_rank == {0: 3, 1: 2}


def test_a_pool_reported_separately_still_counts_once():
    lg = ledger(num_pages=2)
    lg.record(0, ["target"], np.array([0]))
    lg.record(0, ["index", "draft"], np.array([0]))
    lg.record(1, POOLS, np.array([1]))
    assert lg.pages_complete


@pytest.mark.parametrize(
    "rank, pools, pages, message",
    [
        (0, POOLS, [0, 0], "reported a page twice in one message"),
        (0, POOLS, [5], "outside the request's 5 pages"),
        (0, POOLS, [-1], "outside the request's 5 pages"),
        (1, POOLS, [2], "logical page 2 reported by cp rank 1, but cp rank 0 owns it"),
        (0, ["kv"], [0], "pool 'kv', which this room does not receive"),
    ],
)
def test_bad_reports_are_refused_before_anything_is_marked(rank, pools, pages, message):
    lg = ledger()
    with pytest.raises(LedgerError, match=message) as info:
        lg.record(rank, pools, np.array(pages))
    assert info.value.room == 7 and info.value.rank == f"cp{rank}"
    assert lg.pages_by_rank == {} and lg.missing() == {p: [0, 1, 2, 3, 4] for p in POOLS}


def test_a_page_reported_twice_is_refused():
    lg = ledger()
    lg.record(0, POOLS, np.array([0]))
    with pytest.raises(LedgerError, match="page 0 of pool 'draft' reported twice"):
        lg.record(0, ["draft"], np.array([0]))


def test_aux_row_only_from_the_owner_of_the_last_token_and_only_once():
    lg = ledger(aux_owner=0)
    with pytest.raises(LedgerError, match="cp rank 0 owns the last valid token"):
        lg.record_aux(1)
    lg.record_aux(0)
    with pytest.raises(LedgerError, match="aux row reported twice"):
        lg.record_aux(0)


def test_a_head_sharded_page_counts_only_once_every_slice_arrived():
    """Prefill tp 2 -> decode tp 1: k's pages come as two head slices (tp 0 and tp 1); the aux
    row from the first source (tp 0) of the last token's CP rank."""
    from kvbridge.layout import HeadGeometry, tp_route

    specs = [HeadGeometry(4, 8, "float32").spec("k", 4, (0,))]
    lg = PageLedger(room=7, pools=["k"], num_pages=2, lanes=OwnerLanes(1), aux_owner=0, route=tp_route(specs, 2, 1, 0))
    lg.record(0, ["k"], np.array([0, 1]), tp_rank=0)
    assert not lg.pages_complete and lg.missing() == {"k": [0, 1]}
    lg.record(0, ["k"], np.array([1]), tp_rank=1)
    assert lg.missing() == {"k": [0]}
    with pytest.raises(LedgerError, match=r"page 1 of pool 'k' \(head slice of tp 1\) reported twice") as err:
        lg.record(0, ["k"], np.array([1]), tp_rank=1)
    assert err.value.rank == "cp0/tp1"
    with pytest.raises(LedgerError, match="reported by tp rank 2, which this decode rank's TP route does not draw"):
        lg.record(0, ["k"], np.array([0]), tp_rank=2)
    lg.record(0, ["k"], np.array([0]), tp_rank=1)
    with pytest.raises(LedgerError, match="first source is tp rank 0"):
        lg.record_aux(0, tp_rank=1)
    lg.record_aux(0, tp_rank=0)
    assert lg.complete and lg.pages_by_rank == {0: 4}


def test_a_rank_reporting_its_whole_share_twice_or_another_ranks_share_is_refused():
    """The one-comparison path (a rank's whole share, unseen) must not let a repeat or a
    forgery through: both fall to the page-by-page checks."""
    lg = ledger(num_pages=6)
    with pytest.raises(LedgerError, match="cp rank 0 owns it"):
        lg.record(1, POOLS, np.array([0, 2, 4]))  # cp0's share, claimed by cp1
    lg.record(0, POOLS, np.array([0, 2, 4]))
    with pytest.raises(LedgerError, match="reported twice"):
        lg.record(0, POOLS, np.array([0, 2, 4]))
    lg.record(1, POOLS, np.array([5, 3, 1]))  # its share in another order: checked page by page, accepted
    lg.record_aux(0)
    assert lg.complete and lg.pages_by_rank == {0: 3, 1: 3}


def test_a_pool_named_twice_in_one_report_is_refused():
    """Pages are counted, not rescanned: a pool named twice must not count twice."""
    lg = ledger(num_pages=2)
    with pytest.raises(LedgerError, match="name a pool twice"):
        lg.record(0, ["target", "target", "index"], np.array([0]))
    assert lg.pages_by_rank == {} and not lg.pages_complete


STAGES = {"draft": (2,), "index": (0, 1, 2), "target": (0, 1, 2)}  # pp 3: the draft with the last stage


@pytest.mark.parametrize("seed", range(20))
def test_with_pipeline_stages_a_page_counts_once_every_stage_sent_it_in_any_order(seed):
    """Reports of every (cp rank, stage), in chunks, in a random order: the ledger is complete
    exactly at the last one, and never before (every stage's layer range counts)."""
    rng = np.random.default_rng(seed)
    num_pages, cp = 7, 2
    lanes = OwnerLanes(cp)
    lg = PageLedger(room=7, pools=POOLS, num_pages=num_pages, lanes=lanes, aux_owner=0, stages=STAGES, aux_stage=2)
    reports = []
    for c in range(cp):
        owned = lanes.owned_pages(c, num_pages)
        for s in range(3):
            pools = tuple(p for p in POOLS if s in STAGES[p])
            for chunk in np.array_split(owned, rng.integers(1, 3)):
                reports.append((c, s, pools, chunk))
    rng.shuffle(reports)
    lg.record_aux(0, pp_rank=2)
    for c, s, pools, chunk in reports:
        assert not lg.pages_complete
        lg.record(c, pools, chunk, pp_rank=s)
    assert lg.complete and lg.pages_by_stage == {0: num_pages, 1: num_pages, 2: num_pages}


def test_with_pipeline_stages_missing_names_the_stage_and_wrong_reports_fail():
    lg = PageLedger(room=7, pools=POOLS, num_pages=2, lanes=OwnerLanes(1), aux_owner=0, stages=STAGES, aux_stage=2)
    lg.record(0, ("index", "target"), np.array([0, 1]), pp_rank=0)
    lg.record(0, ("draft", "index", "target"), np.array([0, 1]), pp_rank=2)
    assert lg.missing() == {"index@pp1": [0, 1], "target@pp1": [0, 1]} and lg.missing_stages() == [1, 2]
    with pytest.raises(LedgerError, match="pool 'draft' reported by pipeline stage pp1, which holds no layer"):
        lg.record(0, ("draft",), np.array([0]), pp_rank=1)
    with pytest.raises(LedgerError, match=r"page 0 of pool 'index' \(layers of stage pp0\) reported twice"):
        lg.record(0, ("index",), np.array([0]), pp_rank=0)
    with pytest.raises(LedgerError, match="aux row reported by pipeline stage pp1; the last stage pp2"):
        lg.record_aux(0, pp_rank=1)
    lg.record(0, ("index", "target"), np.array([0, 1]), pp_rank=1)
    lg.record_aux(0, pp_rank=2)
    assert lg.complete and lg.missing() == {} and lg.missing_stages() == []
