"""The room endpoints take every pool kind they carry (``ROOM_POOL_KINDS``): a DeepSeek-V4 rank's
window, compressed and state buffers register; the room's pages are bounded by the token-paged
buffers only (compressed pools page entries, state pools hold slots: their units are checked on
their own, ``transfer/prefill/kinds.py``)."""

from __future__ import annotations

import torch

import kvbridge as kvb
from kvbridge.layout.hybrid import deepseek_v4_pools
from kvbridge.layout.pools import KINDS
from kvbridge.transfer.registration import EndpointBuffers


def _bufs(specs, capacity):
    return {(name, lid): torch.zeros(capacity(spec) * spec.bytes_per_page, dtype=torch.uint8).view(
        getattr(torch, spec.abi)) for name, spec in specs.items() for lid in spec.layer_ids}


def test_the_rooms_carry_every_kind():
    assert kvb.ROOM_POOL_KINDS == frozenset(KINDS)


def test_endpoint_buffers_take_kind_pools_and_bound_pages_by_the_token_paged_ones():
    specs = deepseek_v4_pools(4, 16)
    bufs = EndpointBuffers(specs, _bufs(specs, lambda s: 2 if s.kind == "state" else 9), rank="p0")
    assert {d.pool for d in bufs.descs} == set(specs)
    assert bufs.min_capacity == 9  # the window's pages, not the state pools' 2 slots
