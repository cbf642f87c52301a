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
    AuxRegion,
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
    schema = AuxSchema.standard(hidden_size, hidden_dtype, topk)
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
    schema = AuxSchema.standard(4, "bfloat16", 2)
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


@FAST
@given(topk=st.integers(0, 4), count=st.integers(-3, 7), flag=st.integers(0, 255), room=st.integers(0, 2**63 - 1))
def test_head_reads_the_echo_and_what_unpacking_would_refuse(topk, count, flag, room):
    """The commit's check (one struct read) says exactly what check_row / unpack say."""
    schema = AuxSchema.standard(3, "float32", topk)
    row = np.zeros(1, dtype=schema.dtype)
    row["room"], row["topk"], row["hidden_is_cp_local"] = room, count, flag
    data = row.view(np.uint8).reshape(-1)
    echoed, problem = schema.head(data)
    assert echoed == room == schema.room_of(data)
    try:
        schema.check_row(data)
    except LayoutError as exc:
        assert problem is not None and problem in str(exc)
    else:
        assert problem is None
    custom = AuxSchema((AuxRegion("flag", "uint8"), AuxRegion("room", "uint64"), AuxRegion("ids", "int32", (3,))))
    other = np.zeros(1, dtype=custom.dtype)
    other["room"], other["flag"] = room, flag
    assert custom.head(other.view(np.uint8).reshape(-1)) == (room, None)


def test_schema_dict_names_regions_dtypes_shapes():
    d = AuxSchema.standard(7168, "bfloat16", 8).to_dict()
    assert [r["name"] for r in d["regions"]] == [
        "room", "first_token", "num_cached_tokens", "hidden_is_cp_local", "topk", "topk_ids", "topk_probs", "hidden",
    ]  # fmt: skip
    regions = {r["name"]: r for r in d["regions"]}
    assert regions["hidden"]["dtype"] == "bfloat16" and regions["hidden"]["shape"] == [7168]
    assert regions["topk_ids"]["shape"] == [8] and regions["room"]["dtype"] == "uint64"
    assert all(r["offset"] % AuxRegion(r["name"], r["dtype"]).storage.itemsize == 0 for r in d["regions"])  # aligned
    assert d["row_bytes"] == aux_dtype(7168, "bfloat16", 8).itemsize
    assert AuxSchema.from_dict(d) == AuxSchema.standard(7168, "bfloat16", 8)
    with pytest.raises(LayoutError):
        AuxSchema.from_dict({**d, "row_bytes": 1})
    with pytest.raises(LayoutError):
        AuxSchema.standard(16, "float16", 1)


def test_the_standard_row_keeps_its_byte_layout():
    """Packed rows are byte-identical to the structured record kvbridge always wrote."""
    old = np.dtype([("room", "<u8"), ("first_token", "<i4"), ("num_cached_tokens", "<i4"), ("hidden_is_cp_local", "u1"),
                    ("topk", "<i4"), ("topk_ids", "<i4", (2,)), ("topk_probs", "<f4", (2,)), ("hidden", "<f4", (5,))],
                   align=True)
    assert AuxSchema.standard(5, "float32", 2).dtype == old


def test_custom_regions_pack_and_unpack_by_name():
    """Any engine's metadata rows, e.g. SGLang's MetadataBuffers: one region per tensor."""
    schema = AuxSchema((AuxRegion("output_ids", "int32", (16,)), AuxRegion("room", "uint64", (8,)),
                        AuxRegion("hidden", "bfloat16", (4,))))
    assert not schema.is_standard and schema.offsets == {"output_ids": 0, "room": 64, "hidden": 128}
    assert schema.row_bytes == 64 + 64 + 8
    row = schema.pack(room=77, output_ids=np.arange(16), hidden=np.array([1.0, -2.0, 0.5, 3.0], np.float32))
    regions = schema.unpack_regions(row.view(np.uint8))
    assert regions["room"].tolist() == [77, 0, 0, 0, 0, 0, 0, 0] and schema.room_of(row.tobytes()) == 77
    assert regions["output_ids"].tolist() == list(range(16))
    assert (regions["hidden"].astype(np.uint32) << 16).view(np.float32).tolist() == [1.0, -2.0, 0.5, 3.0]
    assert AuxSchema.from_dict(schema.to_dict()) == schema
    with pytest.raises(LayoutError, match="no aux regions \\['bogus'\\]"):
        schema.pack(room=1, bogus=1)
    with pytest.raises(LayoutError, match="of 3 elements, expected 16"):
        schema.pack(room=1, output_ids=[1, 2, 3])
    with pytest.raises(LayoutError, match="unpack_regions"):
        schema.unpack(row)
    assert schema.pack_row({"output_ids": np.arange(16)}, room=5)["room"][0, 0] == 5
    with pytest.raises(LayoutError, match="carries room 6"):
        schema.pack_row(schema.pack(room=6), room=5)


@pytest.mark.parametrize("regions, message", [
    ((AuxRegion("first_token", "int32"),), "needs region 'room'"),
    ((AuxRegion("room", "uint32"),), "needs region 'room'"),
    ((AuxRegion("room", "uint64"), AuxRegion("room", "int32")), "distinct"),
])
def test_the_room_echo_region_is_mandatory(regions, message):
    with pytest.raises(LayoutError, match=message):
        AuxSchema(regions)
    with pytest.raises(LayoutError, match="dtype 'complex64'"):
        AuxRegion("x", "complex64")


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
