"""DeepSeek-V4's window, compressed and state pools between two processes over real Mooncake:
a prefill process (this one) plans each chunk's share of every pool (``chunk_extent`` +
``plan_kind``) and writes it into a decode process's registered pools, directly or staged
(gathered into a staging buffer, written as large pieces into the peer's staging slot, scattered
there: ``stage_plan``); the peer's memory then equals a local mirror that received the same
plans by memcpy, byte for byte (hash), and holds what decode needs and nothing else."""

from __future__ import annotations

import ctypes
import hashlib
import json

import numpy as np
import pytest

from _engines import needs_mooncake
from _transfer_peer import peer_process
from kvbridge.layout import BufferDesc, chunk_extent, deepseek_v4_pools, needed_bytes, needed_extent, plan_kind
from kvbridge.layout.staging import stage_plan
from kvbridge.transfer.engine import create_engine

pytestmark = needs_mooncake

SPECS = deepseek_v4_pools(4, 4, sliding_window=16, hca_ratio=32, head_dim=16, index_head_dim=8, draft_layers=1)
CAP = 48  # units per (pool, layer) on both sides
SLOT = 4096  # the decode side's staging slot, at the end of its region


def _layout(base: int) -> tuple[list[BufferDesc], int]:
    descs, at = [], 0
    for name, spec in SPECS.items():
        for lid in spec.layer_ids:
            descs.append(BufferDesc(name, lid, base + at, CAP, spec.bytes_per_page))
            at += CAP * spec.bytes_per_page
    return descs, at


REGION = _layout(0)[1] + SLOT


def _copy(src, dst, length) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
        ctypes.memmove(d, s, n)


def _units(n: int):
    """Prefill: logical units from 0 (state: slot 1); decode: the needed extent, reversed (state: slot 3)."""
    src, dst = {}, {}
    for name, spec in SPECS.items():
        ext = needed_extent(spec, n)
        if spec.kind == "state":
            src[name], dst[name] = np.array([1]), np.array([3])
        else:
            src[name] = np.arange(CAP, dtype=np.int64)
            dst[name] = np.arange(ext.count, dtype=np.int64)[::-1] + 5
    return src, dst


@pytest.mark.parametrize("n, cuts, staged_from", [(131, (40, 96), 1), (45, (), 0)])  # mixed; all staged
def test_v4_pools_between_processes_direct_and_staged(tmp_path, n, cuts, staged_from):
    prefill = np.random.default_rng(n).integers(0, 256, REGION, dtype=np.uint8)
    src_descs, _ = _layout(prefill.ctypes.data)
    mirror = np.zeros(REGION, dtype=np.uint8)
    mirror_descs, _ = _layout(mirror.ctypes.data)
    gather = np.zeros(SLOT, dtype=np.uint8)
    src_units, dst_units = _units(n)
    engine = create_engine("mooncake")
    try:
        engine.register(prefill.ctypes.data, prefill.nbytes)
        engine.register(gather.ctypes.data, gather.nbytes)
        with peer_process(REGION, log_path=tmp_path / "peer.log") as (_, info, ask):
            peer_descs, _ = _layout(info["addr"])
            peer_slot = info["addr"] + REGION - SLOT
            bounds = [0, *cuts, n]
            moved = 0
            for i, (done, end) in enumerate(zip(bounds, bounds[1:])):
                last = i == len(bounds) - 2
                for name, spec in SPECS.items():
                    ext = chunk_extent(spec, n, done, end, last)
                    if not ext.count:
                        continue
                    final = needed_extent(spec, n)
                    s = src_units[name] if spec.kind == "state" else src_units[name][ext.first : ext.stop]
                    d = dst_units[name] if spec.kind == "state" else \
                        dst_units[name][ext.first - final.first : ext.stop - final.first]
                    plan = plan_kind(spec, src_descs, peer_descs, ext, s, d, room=n)
                    local = plan_kind(spec, src_descs, mirror_descs, ext, s, d)
                    _copy(local.src, local.dst, local.length)
                    moved += plan.num_bytes
                    if i < staged_from:
                        engine.write(info["session"], plan.src, plan.dst, plan.length)
                        continue
                    staged = stage_plan(plan, SLOT, room=n)
                    for k in range(staged.num_chunks):
                        _copy(*staged.gather(k, gather.ctypes.data))
                        engine.write(info["session"], *staged.wire(k, gather.ctypes.data, peer_slot))
                        off, dst, length = staged.scatter(k, peer_slot)
                        moves = [[int(a) - info["addr"], int(b) - info["addr"], int(c)]
                                 for a, b, c in zip(off, dst, length)]
                        assert ask("copy " + json.dumps(moves)) == "ok"
            assert moved == sum(needed_bytes(spec, n) for spec in SPECS.values())
            pools = REGION - SLOT  # the staging slot is scratch on the peer: compare the pools
            assert ask(f"sha256 0 {pools}") == hashlib.sha256(mirror[:pools].tobytes()).hexdigest()
            assert np.count_nonzero(mirror[:pools]) > 0
    finally:
        engine.close()
