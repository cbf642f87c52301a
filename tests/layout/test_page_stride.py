"""Padded pages (``PoolSpec.page_stride``): page p starts at p * stride, only its payload
travels (the padding after it never does), the stride is in the runtime contract, diffed by
name, and left out of the encoding of an unpadded pool (existing fingerprints keep their form).
DeepSeek-V4's FlashMLA pages are the case: 64 entries x 584 B padded to whole 576-byte rows."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from kvbridge.bootstrap.contract import RuntimeContract, canonical_json, contract_for, contract_from_preset
from kvbridge.bootstrap.diff import diff_contracts
from kvbridge.errors import LayoutError
from kvbridge.layout import AuxSchema, PoolSpec
from kvbridge.layout.kinds import needed_bytes, needed_extent, plan_kind

from test_layout_kinds import Memory  # noqa: E402  (tests/layout is on the path: numpy regions by address)

PADDED = 37_440  # ceil(64 * 584 / 576) * 576


def c4(**kw) -> PoolSpec:
    base = dict(name="c4", dtype="v4_fp8_nope_bf16_rope", abi="uint8", bytes_per_token=584, page_size=64,
                layer_ids=(2, 5), layout="values_then_scales", value_bytes_per_token=576, scale_bytes_per_token=8,
                kind="compressed", ratio=4, page_stride=PADDED)
    return PoolSpec(**{**base, **kw})


def test_a_padded_page_is_addressed_by_its_stride_and_only_its_payload_travels():
    spec = c4()
    assert (spec.bytes_per_page, spec.payload_bytes_per_page, spec.padding_bytes_per_page) == (PADDED, 37_376, 64)
    mem = Memory()
    src, dst = mem.buffers(spec, 6, seed=3), mem.buffers(spec, 6, fill=0xEE)
    n = 5 * 256 + 77  # 339 complete entries: 5 whole pages and 19 entries of the sixth
    ext = needed_extent(spec, n)
    src_pages, dst_pages = np.array([4, 0, 5, 2, 1, 3]), np.array([1, 2, 3, 4, 5, 0])
    plan = plan_kind(spec, src, dst, ext, src_pages, dst_pages)
    assert plan.num_bytes == needed_bytes(spec, n) == (n // 4) * 584 * 2
    mem.apply(plan)
    for s, d in zip(src, dst):
        sp = mem.region(s).reshape(6, PADDED)
        dp = mem.region(d).reshape(6, PADDED)
        for e in range(n // 4):  # every complete entry's values and scales, at the stride's pages
            page, row = divmod(e, 64)
            a, b = sp[src_pages[page]], dp[dst_pages[page]]
            assert np.array_equal(b[row * 576:(row + 1) * 576], a[row * 576:(row + 1) * 576])
            assert np.array_equal(b[64 * 576 + row * 8:64 * 576 + (row + 1) * 8], a[64 * 576 + row * 8:][:8])
        assert (dp[:, 37_376:] == 0xEE).all(), "padding bytes travelled"
        assert (dp[dst_pages[5]][19 * 576:64 * 576] == 0xEE).all(), "an entry of an incomplete page travelled"


def test_buffers_are_whole_padded_pages():
    spec = c4()
    assert spec.validate_buffer(2, np.zeros((3, PADDED), np.uint8)) == 3
    with pytest.raises(Exception, match=r"37440-byte pages \(64 tokens x 584 B padded to 37440 B\)"):
        spec.validate_buffer(2, np.zeros((3, 37_376), np.uint8))


def test_an_address_of_padded_pages_may_end_with_the_last_payload():
    """A region cut out of larger pages (vLLM's Mamba SSM state: from its offset in block 0 to its
    end in the last block) holds N pages though its last one stops at the payload; anything else
    is refused."""
    from kvbridge.layout import RawBuffer

    state = PoolSpec(name="ssm", dtype="float32", abi="float32", bytes_per_token=2048, page_size=1, layer_ids=(0,),
                     kind="state", page_stride=8192)
    region = np.zeros(3 * 8192, np.uint8)
    ptr = region.ctypes.data
    assert state.validate_buffer(0, RawBuffer(ptr, 2 * 8192 + 2048)) == 3
    assert state.validate_buffer(0, RawBuffer(ptr, 3 * 8192)) == 3
    with pytest.raises(Exception, match="not a whole number of 8192-byte"):
        state.validate_buffer(0, RawBuffer(ptr, 2 * 8192 + 2047))


@pytest.mark.parametrize("kw, match", [
    (dict(page_stride=37_000), "at least the page's payload of 37376"),
    (dict(page_stride=-1), "non-negative integer"),
    (dict(kind="paged", ratio=0), "paged planner coalesces whole pages"),
    (dict(abi="bfloat16", dtype="bfloat16", layout="rows", bytes_per_token=584, page_stride=37_441,
          value_bytes_per_token=0, scale_bytes_per_token=0), "whole bfloat16 elements"),
])
def test_a_stride_that_cannot_be_one_is_refused_by_name(kw, match):
    with pytest.raises(LayoutError, match=match) as err:
        c4(**kw)
    assert err.value.field == "page_stride"


def test_an_unpadded_stride_is_the_payload_and_encodes_as_before():
    assert c4(page_stride=37_376) == c4(page_stride=0)


def _contract(spec: PoolSpec) -> RuntimeContract:
    return contract_for({spec.name: spec}, model="t/v4", aux=AuxSchema.standard(0, "bfloat16", 0))


def test_the_stride_is_in_the_contract_and_diffed_by_name():
    padded, other = _contract(c4()), _contract(c4(page_stride=37_440 + 576))
    pool = json.loads(canonical_json(padded))["pools"][0]
    assert pool["page_stride"] == PADDED
    assert padded.pool("c4").bytes_per_page == PADDED and padded.pool("c4").to_spec() == c4()
    assert padded.fingerprint() != other.fingerprint()
    diff = diff_contracts(padded, other)
    assert [d.path for d in diff] == ["pools.c4.page_stride"] and "stride" in diff[0].breaks
    unpadded = json.loads(canonical_json(_contract(c4(page_stride=0))))["pools"][0]
    assert "page_stride" not in unpadded
    v32 = contract_from_preset("deepseek-v3.2", num_layers=2, page_size=16)
    assert all("page_stride" not in p for p in json.loads(canonical_json(v32))["pools"])
    d = copy.deepcopy(v32.model_dump(mode="json"))
    d["pools"][0]["page_stride"] = 10**6  # a paged pool may not be padded, in the contract either
    with pytest.raises(ValueError, match="paged planner"):
        RuntimeContract.model_validate(d)
