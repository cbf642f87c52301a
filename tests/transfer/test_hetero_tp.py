"""Decode TP other than prefill TP, over real Mooncake between real processes.

A head-sharded k/v float32 model (4 KV heads of 4 values): every prefill rank
(cp, tp) is a process whose pools hold its heads of every row; decode TP ranks
(in this process) hold theirs, poisoned first. The synthetic KV is generated as
whole rows and sliced, so each decode rank checks its head slice byte for byte
whatever the prefill TP size was; padding rows and pages outside the room keep
the poison.

    prefill p=1, cp=1  -> decode d=2    each decode rank: half of tp0's row per valid row
    prefill p=2, cp=2  -> decode d=1    decode rank 0: tp0's heads + tp1's, both CP ranks
    prefill p=2, cp=2  -> decode d=4    decode rank j: head j from tp j//2
"""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]

PAGE = 4
LENGTHS = (1, 9, 22)  # a lone partial page, a partial last page, 6 pages with 2 valid rows in the last


def start_prefill(daemon, instance: str, cp: int, tp: int) -> list[PrefillProc]:
    procs = []
    try:
        for c in range(cp):
            for t in range(tp):
                procs.append(PrefillProc(daemon.url, c, cp, "--model", "kv-heads", instance=instance, tp_rank=t,
                                         tp_size=tp))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


@pytest.fixture(scope="module")
def prefill_p1(daemon):
    procs = start_prefill(daemon, "heads-p1", cp=1, tp=1)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def prefill_p2(daemon):
    procs = start_prefill(daemon, "heads-p2", cp=2, tp=2)
    yield procs
    for p in procs:
        p.stop()


def run_rooms(procs: list[PrefillProc], instance: str, decodes: list[DecodeRank], base: int) -> None:
    """Rooms of LENGTHS, chunked, into every decode rank at random pages (one page table
    per decode rank); every byte of each rank's head slice and the aux row checked."""
    rng = np.random.default_rng(base)
    tables = {j: rng.permutation(d.pages) for j, d in enumerate(decodes)}
    used = {j: 0 for j in tables}
    receivers = []
    for i, n in enumerate(LENGTHS):
        room = base + i
        for j, d in enumerate(decodes):
            m = -(-n // PAGE)
            pages = tables[j][used[j]: used[j] + m]
            used[j] += m
            receivers.append((d, d.receive(room, n, pages, prefill=instance)))
        cuts = sorted({max(1, n // 2), n})
        for p in procs:
            p.send(room, n, chunks=cuts)
    wait_final([r for _, r in receivers])
    for d, r in receivers:
        assert r.poll() == KVPoll.Success, r.failure_reason
        assert d.verify(r) == [], f"decode tp{d.ep.config.tp_rank}"
    for j, d in enumerate(decodes):
        assert d.untouched_except(tables[j][: used[j]])
    for i in range(len(LENGTHS)):
        for p in procs:
            assert p.result(base + i)["state"] == "Success"


def decode_ranks(daemon, d: int, instance: str) -> list[DecodeRank]:
    return [DecodeRank(daemon.url, model="kv-heads", tp_rank=j, tp_size=d, pages=64, instance=instance)
            for j in range(d)]


@pytest.mark.parametrize("prefill_name, d", [("prefill_p1", 2), ("prefill_p2", 1), ("prefill_p2", 4)],
                         ids=["p1-d2", "p2-d1-cp2", "p2-d4-cp2"])
def test_each_decode_rank_receives_exactly_its_head_slice(request, daemon, prefill_name, d):
    procs = request.getfixturevalue(prefill_name)
    instance = "heads-p1" if prefill_name == "prefill_p1" else "heads-p2"
    decodes = decode_ranks(daemon, d, f"heads-d{d}-{prefill_name[-2:]}")
    try:
        widths = {dr.specs["k"].bytes_per_token for dr in decodes}
        assert widths == {4 * 4 * 4 // d}  # its heads of the 64-byte row
        run_rooms(procs, instance, decodes, base=70_000 + 1000 * d + 100 * len(procs))
    finally:
        for dr in decodes:
            dr.close()


def test_the_ledger_counts_every_head_slice_of_every_page(prefill_p2, daemon):
    """p=2 -> d=1: each page of k and v arrives as two slices (one per prefill TP rank), each
    reported once; pages_by_rank counts the reports per CP rank."""
    (d,) = decode_ranks(daemon, 1, "heads-ledger")
    try:
        n = 22  # 6 pages: cp0 owns 0 2 4, cp1 owns 1 3 5
        r = d.receive(75_000, n, np.arange(6) + 10, prefill="heads-p2")
        for p in prefill_p2:
            p.send(75_000, n)
        wait_final([r])
        assert r.poll() == KVPoll.Success, r.failure_reason
        assert r.stats["pages_by_rank"] == {0: 6, 1: 6}  # 3 pages x 2 TP sources
        assert d.verify(r) == []
    finally:
        d.close()
