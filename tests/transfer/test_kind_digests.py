"""Sans-I/O: the digest of each kind unit (``kind_unit_digests``) over exactly the bytes the
rooms move of it. Prefill's source units and decode's destination units, moved by
``plan_kind``, give the same digests; a flipped byte that travels changes its unit's digest
only; a byte that does not travel (a row outside the window, an entry of an incomplete window,
a tail slot's unused rows) changes nothing; a pipeline stage digests its own layers."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch

import kvbridge as kvb
from _kind_rooms import CAP, PAGE, buffers, descs, model_specs
from kvbridge.layout.pools import STATE
from kvbridge.transfer.digest import kind_unit_digests


def _specs() -> list[tuple[str, kvb.PoolSpec]]:
    out = [(f"v4:{n}", s) for n, s in model_specs("v4").items()]
    out += [(f"hybrid:{n}", s) for n, s in model_specs("hybrid").items()]
    out.append(("ring", kvb.window_pool("ring", [0, 1], 16, window=8, page_size=PAGE, ring_stride=8)))
    # a TP rank's cut of sharded Mamba slots (prefill TP 2 -> decode TP 2: rank r's slot whole to rank r)
    out += [(f"tp2:{n}", s) for n, s in kvb.mamba_pools([1, 3], conv_groups=(4, 2, 2), conv_kernel=4, num_heads=2,
                                                         head_dim=4, state_size=8, tp_size=2).items()]
    # padded pages (DeepSeek-V4's FlashMLA rows under SGLang): the digest covers the payload only,
    # a padding byte (below: "a byte that does not travel") changes nothing
    out += [(f"padded:{n}", dataclasses.replace(s, page_stride=s.payload_bytes_per_page + 64))
            for n, s in model_specs("v4").items() if s.kind == "compressed"]
    return out


SPECS = _specs()


def _moved(spec: kvb.PoolSpec, n: int, as_numpy: bool):
    """Prefill's seeded buffers, decode's (zeros, then what plan_kind moves), the logical units
    of the needed extent, each side's units, and the plan's destination byte ranges per layer."""
    specs = {spec.name: spec}
    src, dst = buffers(specs, seed=5), buffers(specs, seed=None)
    ext = kvb.needed_extent(spec, n)
    one = spec.kind == STATE or bool(spec.ring_stride)
    logical = np.array([ext.first]) if one else np.arange(ext.first, ext.stop)
    s_units = np.array([2]) if one else logical[::-1] + 1
    d_units = np.array([4]) if one else np.arange(logical.size) * 2 + 3
    r = spec.tp_size - 1  # (the last TP rank: its part of every group)
    tp = (spec.tp_size, r, spec.tp_size, r) if spec.kind == STATE and spec.shard_units else (1, 0, 1, 0)
    plan = kvb.plan_kind(spec, descs(specs, src), descs(specs, dst), ext, s_units, d_units,
                         logical=None if one else logical, tp=tp)
    for s, d, k in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        ctypes.memmove(d, s, k)
    if as_numpy:
        src = {k: v.view(torch.uint8).numpy() for k, v in src.items()}
        dst = {k: v.view(torch.uint8).numpy() for k, v in dst.items()}
    base = {lid: int(dst[(spec.name, lid)].data_ptr() if not as_numpy else dst[(spec.name, lid)].ctypes.data)
            for lid in spec.layer_ids}
    return src, dst, logical, s_units, d_units, plan, base


def _flip(buf, off: int) -> None:
    (buf.view(-1).view(torch.uint8) if isinstance(buf, torch.Tensor) else buf.reshape(-1))[off] ^= 0x5A


@pytest.mark.parametrize("label, spec", SPECS, ids=[label for label, _ in SPECS])
@pytest.mark.parametrize("n", [45, 131])
def test_a_kind_units_digest_covers_exactly_the_bytes_it_moves(label, spec, n):
    as_numpy = n == 45  # torch (CPU) and numpy buffers: the host paths of page_bytes
    src, dst, logical, s_units, d_units, plan, base = _moved(spec, n, as_numpy)
    assert logical.size and plan.num_bytes, f"{label}: nothing of it travels for {n} tokens"
    sent = kind_unit_digests(spec, src, logical, s_units, n)
    got = kind_unit_digests(spec, dst, logical, d_units, n)
    assert sent.dtype == np.uint64 and sent.shape == logical.shape
    assert (sent == got).all()
    assert np.unique(sent).size == sent.size  # units tell apart (and so do misplaced ones)
    # one byte that travels: only its unit's digest changes
    lid = spec.layer_ids[-1]
    key = (spec.name, lid)
    at = int(plan.dst[-1]) - base[lid] + int(plan.length[-1]) - 1  # the last byte of the last layer's last range
    _flip(dst[key], at)
    bad = kind_unit_digests(spec, dst, logical, d_units, n)
    unit = 0 if logical.size == 1 else int(np.flatnonzero(d_units == at // spec.bytes_per_page)[0])
    assert np.flatnonzero(bad != sent).tolist() == [unit]
    _flip(dst[key], at)
    # a byte of a unit's page that does not travel (when there is one): nothing changes
    moved = np.zeros(CAP * spec.bytes_per_page, bool)
    for d, k in zip(plan.dst.tolist(), plan.length.tolist()):
        if base[lid] <= d < base[lid] + moved.size:
            moved[d - base[lid]:d - base[lid] + k] = True
    page = d_units[0] * spec.bytes_per_page if not spec.ring_stride else d_units[0] * spec.ring_stride * \
        spec.bytes_per_page // spec.page_size
    idle = np.flatnonzero(~moved[page:page + spec.bytes_per_page])
    if idle.size:
        _flip(dst[key], page + int(idle[0]))
        assert (kind_unit_digests(spec, dst, logical, d_units, n) == sent).all()
    if spec.page_stride:  # the page's padding: never travels, never digested
        assert not moved[page + spec.payload_bytes_per_page:page + spec.bytes_per_page].any()
        _flip(dst[key], page + spec.bytes_per_page - 1)
        assert (kind_unit_digests(spec, dst, logical, d_units, n) == sent).all()


def test_a_pipeline_stage_digests_its_own_layers():
    """``layers``: the digest over a stage's layers of the pool equals the one over a buffer set
    holding those layers only, and differs from the whole pool's."""
    spec = model_specs("v4")["swa"]
    src, _, logical, s_units, _, _, _ = _moved(spec, 131, False)
    first = spec.layer_ids[:2]
    stage = {k: v for k, v in src.items() if k[1] in first}
    part = kind_unit_digests(spec, src, logical, s_units, 131, layers=first)
    assert (part == kind_unit_digests(spec, stage, logical, s_units, 131, layers=first)).all()
    assert (part != kind_unit_digests(spec, src, logical, s_units, 131)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("label, spec", SPECS, ids=[label for label, _ in SPECS])
def test_a_kind_units_digest_over_cuda_buffers_equals_the_hosts(label, spec):
    """The GPU path (``page_bytes`` indexes the units on the device): the same digests as the
    host copies of the same buffers."""
    src, _, logical, s_units, _, _, _ = _moved(spec, 131, False)
    on_gpu = {k: v.to("cuda:0") for k, v in src.items()}
    assert (kind_unit_digests(spec, on_gpu, logical, s_units, 131)
            == kind_unit_digests(spec, src, logical, s_units, 131)).all()
