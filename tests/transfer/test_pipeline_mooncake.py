"""Pipeline-parallel prefill over real Mooncake TCP between real processes: every prefill
rank (cp, pp) is a process holding only its stage's layers (target and index-K by the
split, the NextN layer and the aux row with the last stage), at scattered local pages;
one pp-1 decode rank in this process, its pools poisoned first, receives every layer at
random pages, byte for byte, and nothing outside them."""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]

PAGE, LAYERS = 4, 5
LENGTHS = (1, 9, 22)
SPLITS = {2: [(0, 3), (3, 5)], 3: [(0, 1), (1, 4), (4, 5)]}


@pytest.mark.parametrize("pp, cp", [(2, 2), (3, 1)], ids=["pp2-cp2", "pp3-cp1"])
def test_every_stage_sends_its_layers_into_one_decode_rank(daemon, pp, cp):
    instance = f"mc-pp{pp}-cp{cp}"
    procs: list[PrefillProc] = []
    decode = None
    try:
        for c in range(cp):
            for s in range(pp):
                procs.append(PrefillProc(daemon.url, c, cp, "--random-local", str(11 + 3 * c + s), instance=instance,
                                         layers=LAYERS, pp_rank=s, pp_size=pp, pp_layers=SPLITS[pp][s]))
        decode = DecodeRank(daemon.url, layers=LAYERS, pages=64, instance=f"{instance}-d")
        rng = np.random.default_rng(pp * 10 + cp)
        table = rng.permutation(decode.pages)
        used, receivers = 0, []
        for i, n in enumerate(LENGTHS):
            room = 500 + i
            m = -(-n // PAGE)
            receivers.append(decode.receive(room, n, table[used: used + m], prefill=instance))
            used += m
            for p in procs:
                p.send(room, n, chunks=sorted({max(1, n // 2), n}))
        wait_final(receivers)
        for r in receivers:
            assert r.poll() == KVPoll.Success, r.failure_reason
            assert decode.verify(r) == []
            assert set(r.stats["pages_by_stage"]) == set(range(pp))
        assert decode.untouched_except(table[:used])
        for i in range(len(LENGTHS)):
            for p in procs:
                assert p.result(500 + i)["state"] == "Success"
    finally:
        if decode is not None:
            decode.close()
        for p in procs:
            p.stop()
