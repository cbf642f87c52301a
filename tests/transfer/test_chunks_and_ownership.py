"""Chunk boundaries (issue 8 bug 5), ownership helpers, and waiting for the prefill
topology without a polling loop. In-process over the local engine; poisoned pools."""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import wait_final, wait_until
from _local import PAGE
from kvbridge.errors import ContractMismatch, LayoutError, TransferError
from kvbridge.layout import OwnerLanes
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, fill_pages, make_aux


def test_a_page_a_chunk_ends_inside_is_never_written_before_its_rows_exist(cluster):
    """10 tokens, page 4: the first chunk computes tokens 0..5, so page 1 holds 2 of 4 rows
    (rows 6, 7 are still garbage). It must travel with the chunk that completes it."""
    c = cluster(cp=1)
    ep, room, n = c.prefill[0], 37, 10
    dest = np.array([20, 21, 22])
    r = c.decode.receiver(room, f"{c.name}-p")
    r.init(dest, 0, n)
    logical, local = np.arange(3), np.array([10, 11, 12])
    for (pool, layer), buf in ep.buffers.tensors.items():  # tokens 0..5 computed; rows 6.. are PAD garbage
        fill_pages(c.specs[pool], buf, room, layer, logical, local, 6)
    s = ep.sender(room)
    s.init(n)
    s.send(logical[:2], local[:2], num_tokens_ready=6)
    assert wait_until(lambda: r.stats["pages_by_rank"] == {0: 1}, 10)  # page 0 landed ...
    for (pool, layer), buf in c.dbufs.items():  # ... page 1 is held: its destination is still poison
        assert (as_bytes(buf, c.specs[pool].bytes_per_page)[21] == SENTINEL_BYTE).all(), (pool, layer)
    for (pool, layer), buf in ep.buffers.tensors.items():  # the next chunk computes tokens 6..9
        fill_pages(c.specs[pool], buf, room, layer, logical[1:], local[1:], n)
    s.send(logical[2:], local[2:], num_tokens_ready=n, is_last=True, aux=make_aux(c.aux_schema, room, n))
    wait_final([r, s])
    assert r.poll() == KVPoll.Success, r.failure_reason
    assert c.verified(room, n, dest)  # page 1 carries its real rows 6, 7: sent once, complete


def test_a_rank_with_nothing_to_send_completes_on_init_alone(cluster):
    """cp 3, one page: cp0 owns it and the last token; cp1 and cp2 only call init()."""
    c = cluster(cp=3)
    r = c.decode.receiver(38, f"{c.name}-p")
    r.init(np.array([5]), 0, 3)
    assert wait_until(lambda: all(38 in ep.machine.rooms for ep in c.prefill), 10)  # decode asked first
    assert all(ep.machine.rooms[38].state.state == KVPoll.WaitingForInput for ep in c.prefill)  # not done before init
    idle = [ep.sender(38) for ep in c.prefill[1:]]
    for s in idle:
        s.init(3)
        assert s.owned_pages.size == 0 and not s.writes_aux
    (busy,) = c.send(38, 3, ranks=[0])
    assert busy.writes_aux and busy.owned_pages.tolist() == [0]
    wait_final([r, busy, *idle])
    assert all(x.poll() == KVPoll.Success for x in (r, busy, *idle)), [x.failure_reason for x in (r, busy, *idle)]
    idle[0].send(np.zeros(0, np.int64), np.zeros(0, np.int64), is_last=True)  # an engine may still call it


def test_select_gives_the_pages_this_rank_sends_from_its_page_table(cluster):
    c = cluster(cp=2)
    s = c.prefill[1].sender(39)
    s.init(21)  # 6 pages: cp1 owns 1, 3, 5 and stores them as its local pages 0, 1, 2
    logical, local = s.select(np.array([40, 41, 42]))
    assert logical.tolist() == [1, 3, 5] and local.tolist() == [40, 41, 42]
    logical, local = s.select([40])  # chunked prefill: the table so far
    assert logical.tolist() == [1] and local.tolist() == [40]
    with pytest.raises(LayoutError, match="page table of 4 int64 entries; this rank stores 3 pages"):
        s.select(np.array([1, 2, 3, 4]))
    s.close()


def test_wait_bootstrapped_gives_the_lanes_or_says_why_not(cluster):
    c = cluster(cp=2, bootstrap_timeout=0.5)
    r = c.decode.receiver(40, f"{c.name}-p")
    assert r.wait_bootstrapped(10) == OwnerLanes(2, "interleaved")
    lost = c.decode.receiver(41, "no-such-instance")
    with pytest.raises(TransferError, match="no-such-instance"):
        lost.wait_bootstrapped(10)
    c.decode.contract = c.contract.model_copy(update={"kernel": c.contract.kernel.model_copy(update={"abi": "x"})})
    c.decode.machine.topologies.clear()  # this decode rank now speaks another contract: ask the daemon again
    refused = c.decode.receiver(42, f"{c.name}-p")
    with pytest.raises(ContractMismatch, match="kernel.abi") as err:
        refused.wait_bootstrapped(10)
    assert any(d.path == "kernel.abi" for d in err.value.diff)
    for x in (r, lost, refused):
        x.close()


def test_a_decode_prefix_is_skipped_by_every_rank(cluster):
    """first_page 2 of 4 pages: cp0 skips its page 0, cp1 skips page 1; nothing below lands."""
    c = cluster(cp=2)
    r = c.decode.receiver(43, f"{c.name}-p")
    r.init(np.array([30, 31]), 0, 14, first_page=2)
    senders = c.send(43, 14)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success, r.failure_reason
    assert r.stats["pages_by_rank"] == {0: 1, 1: 1}
    untouched = np.setdiff1d(np.arange(64), [30, 31])
    assert all((as_bytes(b, c.specs[p].bytes_per_page)[untouched] == SENTINEL_BYTE).all() for (p, _), b in c.dbufs.items())
    with pytest.raises(LayoutError, match=r"2 pages for logical pages \[1, 4\)"):
        c.decode.receiver(44, f"{c.name}-p").init(np.array([0, 1]), 0, 14, first_page=1)
    assert PAGE == 4
