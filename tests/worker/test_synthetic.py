"""Synthetic KV: deterministic, distinct per (room, pool, layer, token), and verification catches one flipped byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.layout.pools import preset_pools
from kvbridge.worker.synthetic import (
    SENTINEL_BYTE,
    as_bytes,
    fill_pages,
    page_images,
    prepare_destination,
    token_bytes,
    verify_pages,
)

SPECS = preset_pools("deepseek-v3.2-fp8", num_layers=2, page_size=4, draft_layers=1)


def test_token_bytes_are_deterministic_and_distinct():
    tokens = np.arange(1000)
    a = token_bytes(7, "target", 0, tokens, 656)
    assert a.shape == (1000, 656) and a.dtype == np.uint8
    assert np.array_equal(a, token_bytes(7, "target", 0, tokens, 656))
    assert np.array_equal(a[10:20], token_bytes(7, "target", 0, tokens[10:20], 656))
    assert len({row.tobytes() for row in a}) == 1000
    for other in (token_bytes(8, "target", 0, tokens, 656), token_bytes(7, "draft", 0, tokens, 656),
                  token_bytes(7, "target", 1, tokens, 656)):
        assert not np.array_equal(a, other)


def test_index_pages_are_values_then_scales():
    spec = SPECS["index"]
    img = page_images(spec, 3, 0, np.array([1]), num_tokens=100, fill=0)[0]
    rows = token_bytes(3, "index", 0, np.arange(4, 8), spec.bytes_per_token)
    assert np.array_equal(img[: 4 * 128].reshape(4, 128), rows[:, :128])
    assert np.array_equal(img[4 * 128 :].reshape(4, 4), rows[:, 128:])


@pytest.mark.parametrize("pool", ["target", "index", "draft"])
def test_round_trip_verifies_and_catches_a_flipped_byte(pool):
    spec, layer, room, num_tokens = SPECS[pool], SPECS[pool].layer_ids[0], 42, 4 * 5 + 3  # partial last page
    src = torch.zeros(16, spec.bytes_per_page, dtype=torch.uint8)
    dst = torch.zeros(16, spec.bytes_per_page, dtype=torch.uint8)
    logical, local, dest = np.arange(6), np.array([9, 2, 3, 4, 0, 11]), np.array([5, 6, 7, 8, 9, 10])
    fill_pages(spec, src, room, layer, logical, local, num_tokens)
    prepare_destination(spec, dst, dest, num_tokens)
    s, d = as_bytes(src), as_bytes(dst)
    d[dest[:5]] = s[local[:5]]
    for off, length in spec.row_ranges(0, 3):  # only the valid rows of the last page travel
        d[dest[5], off : off + length] = s[local[5], off : off + length]
    verdict = verify_pages(spec, dst, room, layer, dest, num_tokens)
    assert verdict.ok and verdict.bytes_checked == num_tokens * spec.bytes_per_token

    d[dest[2], 17] ^= 1
    verdict = verify_pages(spec, dst, room, layer, dest, num_tokens)
    assert not verdict.ok and verdict.bad_bytes == 1 and "logical page 2" in verdict.first_error
    d[dest[2], 17] ^= 1

    d[dest[5]] = s[local[5]]  # the whole last page, compute padding included: hard rule 1
    verdict = verify_pages(spec, dst, room, layer, dest, num_tokens)
    assert not verdict.ok and "padding row written" in verdict.first_error


def test_wrong_room_or_swapped_pages_fail():
    spec = SPECS["target"]
    buf = torch.zeros(8, spec.bytes_per_page, dtype=torch.uint8)
    fill_pages(spec, buf, 1, 0, np.arange(4), np.arange(4), 16)
    assert verify_pages(spec, buf, 1, 0, np.arange(4), 16).ok
    assert not verify_pages(spec, buf, 2, 0, np.arange(4), 16).ok
    assert not verify_pages(spec, buf, 1, 0, np.array([0, 2, 1, 3]), 16).ok


def test_bf16_buffers_are_viewed_as_bytes():
    spec = preset_pools("deepseek-v3.2", num_layers=1, page_size=4, draft_layers=0)["target"]
    buf = torch.zeros(3, 4 * 576, dtype=torch.bfloat16)
    prepare_destination(spec, buf, np.array([2]), 1)
    assert as_bytes(buf).shape == (3, spec.bytes_per_page) and as_bytes(buf)[2, 0] == SENTINEL_BYTE


def test_aux_row_round_trip_and_mismatch():
    from kvbridge.layout.aux import AuxRegion, AuxSchema
    from kvbridge.worker.synthetic import make_aux, verify_aux

    for schema in (AuxSchema.standard(64, "bfloat16", 2), AuxSchema.standard(8, "float32", 1)):
        row = make_aux(schema, 9, 300)
        assert verify_aux(schema, schema.unpack(row), 9, 300) == ""
        assert verify_aux(schema, row.view(np.uint8).tobytes(), 9, 300) == ""
        assert "num_cached_tokens" in verify_aux(schema, schema.unpack(row), 9, 301)
        assert "room" in verify_aux(schema, schema.unpack(make_aux(schema, 10, 300)), 9, 300)
        assert verify_aux(schema, None, 9, 300)
    custom = AuxSchema((AuxRegion("output_ids", "int32", (16,)), AuxRegion("room", "uint64", (8,)),
                        AuxRegion("hidden", "bfloat16", (4,))))
    row = make_aux(custom, 9, 300)
    assert custom.room_of(row) == 9 and verify_aux(custom, row.view(np.uint8), 9, 300) == ""
    assert verify_aux(custom, custom.unpack_regions(row), 9, 300) == ""
    assert "output_ids differs" in verify_aux(custom, make_aux(custom, 10, 300), 9, 300)
