"""A decode prefix the prefill engine skips: ``KVSender.decode_first_page`` read once decode
asked (poll WaitingForInput), then ``init(first_page=)`` and only the pages after it handed in,
as SGLang's prefill does with ``pop_decode_prefix_len``. CP 2 in one process, over the local
engine and over real Mooncake TCP on loopback; poisoned decode pools."""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import wait_final, wait_until
from _local import PAGE
from kvbridge.errors import LayoutError
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, fill_pages, make_aux, verify_pages

ENGINES = ["local", pytest.param("mooncake", marks=[pytest.mark.mooncake, pytest.mark.skipif(
    not mooncake_available(), reason="Mooncake not importable")])]  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
def test_only_pages_after_the_decode_prefix_are_handed_in_and_moved(cluster, engine):
    """22 tokens (6 pages of 4), decode holds pages 0-2. Each CP rank reads the prefix (an error
    before decode asked), starts at page 3 and hands in only its owned pages from there, in two
    chunks whose num_tokens_ready count the prefix too; nothing lands below page 3."""
    c = cluster(cp=2, engine=engine)
    room, n, first = 61, 22, 3
    dest = np.array([40, 41, 42])
    senders = [ep.sender(room) for ep in c.prefill]
    with pytest.raises(LayoutError, match="not known before every decode rank asked") as err:
        senders[0].decode_first_page
    assert err.value.room == room and err.value.field == "decode_first_page"
    r = c.decode.receiver(room, f"{c.name}-p")
    r.init(dest, 0, None, first_page=first)
    assert wait_until(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders), 10)
    for rank, (ep, s) in enumerate(zip(c.prefill, senders)):
        assert s.decode_first_page == first
        s.init(num_pages=6, first_page=s.decode_first_page)
        owned = c.lanes.owned_pages(rank, 6)
        owned = owned[owned >= first]
        local = owned + 10
        assert s.owned_pages.tolist() == c.lanes.owned_pages(rank, 6).tolist()  # ownership itself is unchanged
        for (pool, layer), buf in ep.buffers.tensors.items():
            fill_pages(c.specs[pool], buf, room, layer, owned, local, n)
        early = owned < 4  # tokens [0, 16) exist after the first chunk: page 3 is complete
        s.send(owned[early], local[early], num_tokens_ready=16)
        s.send(owned[~early], local[~early], num_tokens_ready=n, is_last=True,
               aux=make_aux(c.aux_schema, room, n) if s.writes_aux else None)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success, r.failure_reason
    assert all(s.poll() == KVPoll.Success for s in senders), [s.failure_reason for s in senders]
    untouched = np.setdiff1d(np.arange(64), dest)
    for (pool, layer), buf in c.dbufs.items():
        assert verify_pages(c.specs[pool], buf, room, layer, dest, n, first_page=first).ok, (pool, layer)
        assert (as_bytes(buf, c.specs[pool].bytes_per_page)[untouched] == SENTINEL_BYTE).all(), (pool, layer)
    assert r.stats["pages_by_rank"] == {0: 1, 1: 2}  # pages 3, 5 from cp1; page 4 from cp0
    assert PAGE == 4
