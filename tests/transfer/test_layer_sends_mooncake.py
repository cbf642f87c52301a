"""Layer-range sends over real Mooncake TCP between real processes: prefill CP ranks in child
processes send each room's last chunk layer range by layer range (DeepSeek V3.2 shapes:
target, index K by the target ids, the NextN draft layer with the last range), direct and
staged, CP 1 and 2; one decode rank here, pools poisoned first, receives every byte of every
layer at random pages and nothing outside them. Refused ranges fail the room by name once
prefill aborts it; decode's pages are then free (no write can land)."""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final, wait_until
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]

PAGE, LAYERS = 4, 5
LENGTHS = (1, 9, 22)  # a one-token room, partial last pages
RANGES = [[0, 2], [2, 3], [3, 5]]
SLOT = 64 << 10
STAGED = dict(staging="always", staging_bytes=4 * SLOT, staging_slot_bytes=SLOT)


@pytest.mark.parametrize("cp, staged, with_range", [(1, False, False), (2, False, True), (2, True, False)],
                         ids=["cp1-direct", "cp2-direct-last-range", "cp2-staged"])
def test_layer_ranges_deliver_every_byte(daemon, cp, staged, with_range):
    instance = f"layers-cp{cp}-{'staged' if staged else 'direct'}"
    extra = ("--staging", "always", "--staging-bytes", str(2 * SLOT), "--staging-slot-bytes", str(SLOT)) \
        if staged else ()
    procs, decode = [], None
    try:
        procs = [PrefillProc(daemon.url, c, cp, "--random-local", str(5 + c), *extra, instance=instance,
                             layers=LAYERS, page_size=PAGE) for c in range(cp)]
        decode = DecodeRank(daemon.url, layers=LAYERS, page_size=PAGE, pages=64, instance=f"{instance}-d",
                            **(STAGED if staged else {}))
        table = np.random.default_rng(cp).permutation(decode.pages)
        used, receivers = 0, []
        for i, n in enumerate(LENGTHS):
            room = 700 + i
            m = -(-n // PAGE)
            receivers.append(decode.receive(room, n, table[used: used + m], prefill=instance))
            used += m
            # two chunks: the first one's complete pages whole, the last's per layer range, then a send
            # without pages (is_last: the aux row and the page the first chunk ended inside); or one
            # chunk whose last range carries is_last (a held page would be refused: test_layer_sends.py)
            chunks = [n] if with_range else sorted({max(1, n // 2), n})
            for p in procs:
                p.send(room, n, chunks=chunks, layers=RANGES, last_with_range=with_range)
        wait_final(receivers)
        for r in receivers:
            assert r.poll() == KVPoll.Success, r.failure_reason
            assert decode.verify(r) == []
        assert decode.untouched_except(table[:used])
        for i in range(len(LENGTHS)):
            for p in procs:
                res = p.result(700 + i)
                assert res["state"] == "Success", res
                if staged and res["slices"]:
                    assert res["paths"] and set(res["paths"].values()) == {"staged"}
    finally:
        if decode is not None:
            decode.close()
        for p in procs:
            p.stop()


@pytest.mark.parametrize("ranges, error", [
    ([[0, 2], [1, 5]], "layer 1 of logical page 0 was sent twice"),
    ([[0, 2], [2, 6]], r"must be a range \[start, end\) of target layers with 0 <= start < end <= 5"),
    ([[0, 2], [3, 5]], r"misses layers \[2, 3\)"),
], ids=["twice", "outside", "incomplete-at-last"])
def test_a_refused_range_fails_the_room_cleanly(daemon, ranges, error):
    instance = f"layers-refused-{len(error)}"
    proc, decode = None, None
    try:
        proc = PrefillProc(daemon.url, 0, 1, "--random-local", "3", instance=instance, layers=LAYERS, page_size=PAGE)
        decode = DecodeRank(daemon.url, layers=LAYERS, page_size=PAGE, pages=32, instance=f"{instance}-d")
        table = np.random.default_rng(1).permutation(decode.pages)[:3]
        r = decode.receive(710, 9, table, prefill=instance)
        proc.send(710, 9, layers=ranges)
        res = proc.result(710)
        assert res["state"] == "Refused" and res["error"] == "LayerRangeError" and res["field"] == "layers", res
        assert "room=710" in res["reason"] and "rank=cp0" in res["reason"]
        import re

        assert re.search(error, res["reason"]), res["reason"]
        proc.command(op="abort", room=710, reason="layer range refused")
        wait_final([r])
        assert r.poll() == KVPoll.Failed and "layer range refused" in (r.failure_reason or "")
        assert wait_until(lambda: r.pages_releasable, 10)  # every write drained: the pages may be reused
        assert decode.untouched_except(table)  # what was written landed in the room's pages only
    finally:
        if decode is not None:
            decode.close()
        if proc is not None:
            proc.stop()
