"""Any model's cache over real Mooncake between real processes: a k/v float32 model
described with ``contract_for`` (public names only, token-major buffers, aux rows in
one tensor per region on both sides), and a decode prefix (``first_page``).

Decode pools are poisoned (SENTINEL_BYTE) first: every byte outside the room's
destination pages (the decode prefix included) must keep the poison, and padding
rows of a partial last page too.
"""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]

PAGE, CP = 4, 2
INSTANCE = "kv-fp32-prefill"


@pytest.fixture(scope="module")
def prefill(daemon):
    procs = []
    try:
        for rank in range(CP):
            procs.append(PrefillProc(daemon.url, rank, CP, "--model", "kv-fp32", instance=INSTANCE))
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def decode(daemon, request):
    d = DecodeRank(daemon.url, model="kv-fp32", pages=128, instance=f"kv-decode-{request.node.name[:30]}")
    yield d
    d.close()


def test_a_kv_float32_model_moves_byte_exact(prefill, decode):
    """Two pools per layer (k, v), float32, chunked prefill with pages held across chunk
    boundaries, aux rows from the engine's own region tensors into decode's region tensors."""
    rng = np.random.default_rng(7)
    free = rng.permutation(decode.pages)
    rooms, at = [], 0
    for i, n in enumerate((1, 9, 23, 40)):
        pages = free[at: at + -(-n // PAGE)]
        at += pages.size
        room = 90_000 + i
        cuts = sorted({max(1, n // 3), max(1, (2 * n) // 3), n})
        rooms.append(decode.receive(room, n, pages, prefill=INSTANCE))
        for p in prefill:
            p.send(room, n, chunks=cuts)
    wait_final(rooms)
    for r in rooms:
        assert r.poll() == KVPoll.Success, r.failure_reason
        assert decode.verify(r) == []
        assert r.aux is None and int(r.aux_regions["room"][0]) == r.room  # a custom schema: regions, no AuxRow
        for p in prefill:
            assert p.result(r.room)["state"] == "Success"
    assert decode.untouched_except(free[:at])


def test_a_decode_prefix_is_skipped_and_left_untouched(prefill, decode):
    """Decode already holds logical pages [0, 3): prefill writes only pages 3.. (owned pages
    below the prefix are skipped for this decode rank), and the ledger counts only those."""
    n, first = 30, 3  # 8 pages; cp0 owns 0 2 4 6, cp1 owns 1 3 5 7
    pages = np.array([100, 90, 91, 60, 61])  # logical pages 3..7
    r = decode.receive(91_000, n, pages, prefill=INSTANCE, first_page=first)
    for p in prefill:
        p.send(91_000, n)
    wait_final([r])
    assert r.poll() == KVPoll.Success, r.failure_reason
    assert r.stats["pages_by_rank"] == {0: 2, 1: 3}  # cp0: 4, 6; cp1: 3, 5, 7
    assert decode.verify(r) == []
    assert decode.untouched_except(pages)  # no prefix page, nor anything else, was written
    for p in prefill:
        assert p.result(91_000)["state"] == "Success"
