"""The bench's pure parts: page allocation, the checkable KV pattern, the trace breakdown."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvbridge.bench import pattern
from kvbridge.bench.alloc import allocate
from kvbridge.bench.trace import breakdown, parse
from kvbridge.layout import OwnerLanes
from kvbridge.layout.plan import describe_buffer, plan_transfer
from kvbridge.worker.resources import allocate_buffers, build_specs

PAGE = 64


@pytest.mark.parametrize("alloc", ["contiguous", "random"])
def test_allocations_are_deterministic_disjoint_and_in_range(alloc):
    lanes = OwnerLanes(2)
    a = allocate(alloc, 37, lanes, src_capacity=40, dst_capacity=50, seed=3)
    b = allocate(alloc, 37, lanes, src_capacity=40, dst_capacity=50, seed=3)
    assert np.array_equal(a.page_ids, b.page_ids)
    assert len(set(a.page_ids.tolist())) == 37 and a.page_ids.max() < 50
    for rank in range(2):
        owned, local = a.for_rank(rank)
        assert np.array_equal(owned, lanes.owned_pages(rank, 37)) and len(set(local.tolist())) == owned.size
        assert local.max() < 40
    if alloc == "contiguous":
        assert np.array_equal(a.local[0], np.arange(19)) and sorted(a.page_ids.tolist()) == list(range(37))
    else:  # scattered: hardly any neighbour pairs on either side
        assert np.count_nonzero(np.diff(a.page_ids) == 1) < 5


def test_a_transfer_of_valid_rows_passes_the_check_and_a_flipped_byte_fails_it():
    """Fill both CP ranks' scattered pages, move the plan's slices (valid rows only, a partial
    last page: index-K as two ranges), check every pool and layer; then corrupt one byte."""
    specs = build_specs("deepseek-v3.2-fp8", 2, PAGE, 1)
    lanes = OwnerLanes(2)
    n = 10 * PAGE + 17
    pages = allocate("random", -(-n // PAGE), lanes, 32, 40, seed=5)
    src = [allocate_buffers(specs, 32) for _ in range(2)]
    dst = allocate_buffers(specs, 40)
    for buf in dst.values():
        pattern.poison(buf, pages.page_ids)
    dst_descs = [describe_buffer(specs[p], lid, b) for (p, lid), b in dst.items()]
    for rank in range(2):
        owned, local = pages.for_rank(rank)
        for (pool, layer), buf in src[rank].items():
            pattern.fill(specs[pool], buf, 7, layer, owned, local)
        plan = plan_transfer(specs, [describe_buffer(specs[p], lid, b) for (p, lid), b in src[rank].items()],
                             dst_descs, owned, local, pages.page_ids[owned], n)
        for s, d, k in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
            ctypes.memmove(d, s, k)
    total = 0
    for (pool, layer), buf in dst.items():
        checked, error = pattern.check(specs[pool], buf, 7, layer, pages.page_ids, n)
        assert error == ""
        total += checked
    assert total == n * sum(s.bytes_per_token * s.num_layers for s in specs.values())
    key = ("index", 0)
    pattern.as_pages(dst[key])[int(pages.page_ids[-1]), -1] ^= 0xFF  # a padding scale byte of the last page
    assert "logical page 10" in pattern.check(specs["index"], dst[key], 7, 0, pages.page_ids, n)[1]
    assert pattern.check(specs["index"], dst[key], 8, 0, pages.page_ids, n)[1]  # another seed: all wrong


# a room up to its targets: decode's request out, on both CP ranks, each rank's target built
ASKED = [
    "x trace room=5 bench recv @10.0000",
    "x trace room=5 rank=d +1.00ms @10.0010 requested from (cp, tp, pp) ranks [(0, 0, 0), (1, 0, 0)]",
    "x trace room=5 rank=p/cp0 @10.0015 request from d pages=4",
    "x trace room=5 rank=p/cp1 @10.0016 request from d pages=4",
    "x trace room=5 rank=p/cp0 +0.10ms @10.0020 target d pages=4 pools=index,target",
    "x trace room=5 rank=p/cp1 +0.10ms @10.0030 target d pages=4 pools=index,target",
]


def test_trace_breakdown_takes_each_event_at_its_last_rank():
    lines = [
        *ASKED,
        "x trace room=5 rank=p/cp0 +0.20ms @10.0040 -> d pages=[0, 2] +aux slices=3 bytes=9",
        "x trace room=5 rank=p/cp1 +0.20ms @10.0050 -> d pages=[1, 3] slices=3 bytes=9",
        "x trace room=5 rank=p/cp0 +9.00ms @10.0100 write of 2 pages +aux to d done",
        "x trace room=5 rank=p/cp1 +9.00ms @10.0120 write of 2 pages to d done",
        "x trace room=5 rank=d +11.0ms @10.0112 report from cp0 pages=2 +aux",
        "x trace room=5 rank=d +12.0ms @10.0124 report from cp1 pages=2",
        "x trace room=5 rank=d +13.0ms @10.0130 committed pages_by_rank={0: 2, 1: 2} aux_owner=cp0 aux_read=0.250ms",
        "x trace room=5 bench final Success @10.0135",
        "x trace room=6 bench recv @11.0",  # incomplete: left out
        "x trace engine=ipc write=3 batch=0 -> s slices=3 bytes=9 @10.0041",
    ]
    hops = {h["hop"]: h["p50_ms"] for h in breakdown(parse(lines))}
    assert hops == {"recv -> requested": 1.0, "requested -> received": 0.6, "received -> target": 1.4,
                    "target -> posted": 2.0, "posted -> written": 7.0, "written -> reported": 0.4,
                    "reported -> committed": 0.6, "committed -> final": 0.5, "recv -> final": 13.5,
                    "aux row read": 0.25, "target skew": 1.0}


def test_trace_breakdown_of_rooms_asked_first_runs_from_the_last_send():
    """The engine's order (``--ask-first``): the request and its targets come before the sends,
    so the room's hops run from the bench's send() lines, not from decode's receiver()."""
    lines = [
        *ASKED,
        "x trace room=5 bench send @10.0500",
        "x trace room=5 bench send @10.0501",
        "x trace room=5 rank=p/cp0 +0.20ms @10.0510 -> d pages=[0, 2] +aux slices=3 bytes=9 submit=0.100ms",
        "x trace room=5 rank=p/cp1 +0.20ms @10.0515 -> d pages=[1, 3] slices=3 bytes=9 submit=0.300ms",
        "x trace room=5 rank=p/cp0 +9.00ms @10.0540 write of 2 pages +aux to d done",
        "x trace room=5 rank=p/cp1 +9.00ms @10.0545 write of 2 pages to d done",
        "x trace room=5 rank=d +11.0ms @10.0543 report from cp0 pages=2 +aux",
        "x trace room=5 rank=d +12.0ms @10.0549 report from cp1 pages=2",
        "x trace room=5 rank=d +13.0ms @10.0553 committed pages_by_rank={0: 2, 1: 2} aux_owner=cp0 aux_read=0.020ms",
        "x trace room=5 bench final Success @10.0555",
    ]
    hops = {h["hop"]: h["p50_ms"] for h in breakdown(parse(lines))}
    assert hops == {"send -> posted": 1.4, "posted -> written": 3.0, "written -> reported": 0.4,
                    "reported -> committed": 0.4, "committed -> final": 0.2, "send -> final": 5.5,
                    "aux row read": 0.02, "engine submit": 0.3}  # (cp1's: the last post)
    # the same room asked last (its sends queued before decode's request) keeps decode's hops
    last = [line.replace("bench send @10.050", "bench send @9.990") for line in lines]
    assert {h["hop"] for h in breakdown(parse(last))} >= {"recv -> requested", "target -> posted", "target skew"}
