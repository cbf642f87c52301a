"""The aux row (hard rule 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import LayoutError
from kvbridge.layout import (
    LANE_RULES,
    AuxSchema,
    OwnerLanes,
    aux_dtype,
    float32_to_bf16_bits,
    local_row_order,
    owner_of_last_token,
)

FAST = settings(max_examples=60, deadline=None)


@FAST
@given(
    hidden_size=st.integers(0, 64),
    hidden_dtype=st.sampled_from(["bfloat16", "float32"]),
    topk=st.integers(0, 8),
    room=st.integers(0, 2**63 - 1),
    cp_local=st.booleans(),
    data=st.data(),
)
def test_pack_unpack_round_trip(hidden_size, hidden_dtype, topk, room, cp_local, data):
    schema = AuxSchema(hidden_size, hidden_dtype, topk)
    count = data.draw(st.integers(0, topk))
    ids = np.arange(count, dtype=np.int32) * 7 - 3
    probs = np.linspace(0.9, 0.1, count, dtype=np.float32)
    hidden = np.random.default_rng(room % 1000).standard_normal(hidden_size).astype(np.float32)
    row = schema.pack(
        room=room, first_token=-5, num_cached_tokens=123, hidden_is_cp_local=cp_local,
        hidden=hidden, topk_ids=ids, topk_probs=probs,
    )  # fmt: skip
    assert row.dtype == schema.dtype and row.nbytes == schema.row_bytes and schema.row_bytes % 8 == 0
    for form in (row, row.view(np.uint8), row.tobytes()):
        got = schema.unpack(form)
        assert (got.room, got.first_token, got.num_cached_tokens, got.hidden_is_cp_local) == (room, -5, 123, cp_local)
        assert got.topk_ids.tolist() == ids.tolist() and got.topk_probs.tolist() == probs.tolist()
        want = hidden if hidden_dtype == "float32" else torch.from_numpy(hidden).bfloat16().float().numpy()
        assert np.array_equal(got.hidden_float32, want)


def test_bf16_bits_match_torch():
    values = np.concatenate([np.random.default_rng(0).standard_normal(1000) * 1e3, [0.0, -0.0, np.inf, -np.inf, 1e38]])
    values = values.astype(np.float32)
    want = torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(float32_to_bf16_bits(values), want)
    assert float32_to_bf16_bits(np.array([np.nan], dtype=np.float32))[0] == 0x7FC0


def test_cp_local_flag_is_explicit_and_rows_are_checked():
    schema = AuxSchema(4, "bfloat16", 2)
    base = dict(room=1, first_token=2, num_cached_tokens=3, hidden=np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="hidden_is_cp_local"):
        schema.pack(**base)  # no default: the caller must say where the hidden state lives
    with pytest.raises(LayoutError, match="hidden_is_cp_local"):
        schema.pack(**base, hidden_is_cp_local=1)
    with pytest.raises(LayoutError, match="hidden state of 3 elements, expected 4"):
        schema.pack(**{**base, "hidden": np.zeros(3)}, hidden_is_cp_local=True)
    with pytest.raises(LayoutError, match="63-bit"):
        schema.pack(**{**base, "room": 2**63}, hidden_is_cp_local=True)
    with pytest.raises(LayoutError, match="top-k"):
        schema.pack(**base, hidden_is_cp_local=True, topk_ids=[1, 2, 3], topk_probs=[0.1, 0.2, 0.3])
    row = schema.pack(**base, hidden_is_cp_local=False)
    with pytest.raises(LayoutError, match="bytes"):
        schema.unpack(row.tobytes()[:-1])
    corrupt = row.copy()
    corrupt["hidden_is_cp_local"] = 2
    with pytest.raises(LayoutError, match="corrupt"):
        schema.unpack(corrupt)


def test_schema_dict_names_fields_dtypes_shapes():
    d = AuxSchema(7168, "bfloat16", 8).to_dict()
    assert [f["name"] for f in d["fields"]] == [
        "room", "first_token", "num_cached_tokens", "hidden_is_cp_local", "topk", "topk_ids", "topk_probs", "hidden",
    ]  # fmt: skip
    fields = {f["name"]: f for f in d["fields"]}
    assert fields["hidden"]["dtype"] == "<u2" and fields["hidden"]["shape"] == [7168]
    assert fields["topk_ids"]["shape"] == [8] and fields["room"]["dtype"] == "<u8"
    assert all(f["offset"] % np.dtype(f["dtype"]).itemsize == 0 for f in d["fields"])  # naturally aligned
    assert d["row_bytes"] == aux_dtype(7168, "bfloat16", 8).itemsize
    assert AuxSchema.from_dict(d) == AuxSchema(7168, "bfloat16", 8)
    with pytest.raises(LayoutError):
        AuxSchema.from_dict({**d, "row_bytes": 1})
    with pytest.raises(LayoutError):
        AuxSchema(16, "float16", 1)


@settings(max_examples=80, deadline=None)
@given(
    num_tokens=st.integers(1, 700),
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    cp_size=st.integers(1, 4),
    rule=st.sampled_from(LANE_RULES),
)
def test_aux_writer_is_the_rank_holding_the_last_valid_row(num_tokens, page_size, cp_size, rule):
    lanes = OwnerLanes(cp_size, rule)
    owner = owner_of_last_token(num_tokens, page_size, lanes)
    num_pages = -(-num_tokens // page_size)
    holders = []
    for rank in range(cp_size):
        table = np.arange(lanes.num_local_pages(rank, num_pages))
        order = local_row_order(rank, [num_tokens], page_size, lanes, [table])
        if (order.positions == num_tokens - 1).any():
            holders.append(rank)
    assert holders == [owner]
