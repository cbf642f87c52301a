"""A decode rank's TransferRequest becomes a checked Target before anything is posted;
each decode peer's buffer table is parsed and paired once."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import LayoutError, PageRangeError, PairingError
from kvbridge.layout import AuxSchema, BufferDesc, preset_pools
from kvbridge.transfer import wire
from kvbridge.transfer.targets import DestinationCache, target_from_request

SPECS = preset_pools("deepseek-v3.2-fp8", num_layers=2, page_size=4)
AUX = AuxSchema.standard(16, "bfloat16", 1)


def bufs(shift: int, capacity: int = 16) -> list[BufferDesc]:
    return [BufferDesc(p, layer, shift + 10**6 * (i * 10 + layer), capacity, s.bytes_per_page)
            for i, (p, s) in enumerate(SPECS.items()) for layer in s.layer_ids]


def request(pages, buffers=None, room: int = 1, aux_slot: int = 0) -> wire.TransferRequest:
    return wire.TransferRequest(
        room=room, decode_rank="d/dp0/tp0", session="127.0.0.1:1", page_ids=wire.pack_pages(np.array(pages)),
        pools=sorted(SPECS), buffers=[b.to_list() for b in (buffers or bufs(1 << 40))], aux_base=1 << 50,
        aux_capacity=4, aux_row_bytes=AUX.row_bytes, aux_slot=aux_slot, num_tokens=4 * len(pages), deadline_ms=1000,
        want_digest=False, fingerprint="x", num_decode_ranks=1)


def test_a_peer_is_parsed_and_paired_once():
    cache, src = DestinationCache(), bufs(0)
    a = target_from_request(request([0, 1]), b"i", SPECS, src, AUX, 2, cache)
    b = target_from_request(request([2, 3], room=2), b"i", SPECS, src, AUX, 2, cache)
    assert a.paired is b.paired and a.aux_addr == (1 << 50)
    other = target_from_request(request([0, 1], buffers=bufs(1 << 41)), b"i", SPECS, src, AUX, 2, cache)
    assert other.paired is not a.paired  # a different buffer table is a different entry


@pytest.mark.parametrize(
    "req, error, message",
    [
        (request([0, 16]), PageRangeError, "destination page 16 outside pool 'draft' layer 2's 16 registered pages"),
        (request([0, 1], aux_slot=4), PageRangeError, "aux slot 4 outside the 4 registered aux rows"),
        (request([0, 1], buffers=bufs(1 << 40)[1:]), PairingError, "no destination buffer"),
        (request([0, 1, 2]), LayoutError, "3 destination pages for a request of 2 pages"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(req, error, message):
    with pytest.raises(error, match=message):
        target_from_request(req, b"i", SPECS, bufs(0), AUX, 2, DestinationCache())
