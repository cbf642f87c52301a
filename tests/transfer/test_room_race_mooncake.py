"""Two decode instances race for one room against a CP 2 prefill instance (issue 32, "room
ownership decided once per room"): prefill CP ranks in real processes, real Mooncake TCP on
loopback, two decode instances in this process with poisoned pools, both asking at the same
moment. Before, each CP rank let the first claim it saw win, and in 2 of 5 trials each instance
won one rank, so neither was served. Now the room's decider (cp 0) decides once and cp 1 follows
its ticket: in every trial one instance gets every page verified and the other is refused by
name with 0 bytes written into its pools. The decision's orders are in test_room_tickets.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes

TRIALS = 5
TOKENS = 30  # 8 pages of 4: both CP ranks own pages, cp 1 the last one (and the aux row)


def poison(d: DecodeRank) -> None:
    for key, buf in d.buffers.items():
        as_bytes(buf, d.bytes_per_page[key])[:] = SENTINEL_BYTE


@pytest.mark.skipif(not mooncake_available(), reason="needs the Mooncake transfer engine")
def test_two_decode_instances_racing_for_a_room_one_gets_every_page_the_other_nothing(daemon):
    prefill = [PrefillProc(daemon.url, rank, 2, instance="race-p") for rank in range(2)]
    decodes = [DecodeRank(daemon.url, instance=f"race-d{i}") for i in range(2)]
    pages = np.arange(8, 16)
    try:
        outcomes = []
        for trial in range(TRIALS):
            room = 3200 + trial
            start = threading.Barrier(2)
            got: dict[int, object] = {}

            def claim(i: int) -> None:
                start.wait(5)
                got[i] = decodes[i].receive(room, TOKENS, pages, prefill="race-p")

            threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            for p in prefill:
                p.send(room, TOKENS)
            wait_final(list(got.values()))
            ok = [i for i in (0, 1) if got[i].poll() == KVPoll.Success]
            assert len(ok) == 1, [(i, got[i].poll(), got[i].failure_reason) for i in (0, 1)]
            winner, loser = ok[0], 1 - ok[0]
            assert decodes[winner].verify(got[winner]) == []  # every page of both ranks, and the aux row
            reason = got[loser].failure_reason
            assert f"claimed by decode instance race-d{winner}" in reason, reason
            assert decodes[loser].untouched_except(np.array([], dtype=np.int64))  # 0 bytes to the loser
            assert all(p.result(room)["state"] == "Success" for p in prefill)
            outcomes.append(winner)
            for i in (0, 1):
                got[i].close()
            poison(decodes[winner])  # the next trial's loser may be this one
        assert len(outcomes) == TRIALS
    finally:
        for d in decodes:
            d.close()
        for p in prefill:
            p.stop()
