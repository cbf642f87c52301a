"""The GPU stager (the slice kernel of ``slicecopy``) on one CUDA device: a staged room gathered
into a device slot and scattered into device pages equals the direct copy. Skipped cleanly
without torch, Triton or a GPU (the module imports without them)."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.layout import deepseek_pools, describe_buffer, plan_transfer, stage_plan
from kvbridge.transfer.staging.stagers import CudaStager

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_gather_then_scatter_on_the_device_equals_the_direct_copy() -> None:
    pytest.importorskip("triton")
    specs = deepseek_pools(num_layers=2, page_size=64, kv_dtype="fp8", index=True, draft_layers=1)
    capacity, num_tokens, num_pages = 64, 64 * 39 + 17, 40
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = {(s.name, lid): torch.randint(0, 256, (capacity, s.bytes_per_page), dtype=torch.uint8, device="cuda",
                                        generator=gen) for s in specs.values() for lid in s.layer_ids}
    staged_dst = {k: torch.full_like(v, 0x55) for k, v in src.items()}
    direct_dst = {k: torch.full_like(v, 0x55) for k, v in src.items()}
    rng = np.random.default_rng(1)
    sp, dp = rng.permutation(capacity)[:num_pages], rng.permutation(capacity)[:num_pages]

    def descs(bufs: dict) -> list:
        return [describe_buffer(specs[p], lid, t) for (p, lid), t in bufs.items()]

    plan = plan_transfer(specs, descs(src), descs(staged_dst), np.arange(num_pages), sp, dp, num_tokens)
    direct = plan_transfer(specs, descs(src), descs(direct_dst), np.arange(num_pages), sp, dp, num_tokens)
    slot_bytes = 1 << 20
    slot = torch.zeros(slot_bytes, dtype=torch.uint8, device="cuda")
    staged = stage_plan(plan, slot_bytes)
    assert staged.num_chunks > 1
    stager = CudaStager(0)
    for k in range(staged.num_chunks):
        stager.gather(staged, k, slot.data_ptr())
        stager.synchronize(stager.scatter(staged, k, slot.data_ptr()))
    stager.copier.launch(*(np.asarray(a) for a in (direct.src, direct.dst, direct.length)))
    stager.synchronize(stager.copier.record())
    for key in src:
        assert torch.equal(staged_dst[key], direct_dst[key]), key


def test_a_copier_makes_its_piece_tables_up_front_and_a_chunk_sized_launch_grows_none() -> None:
    """A 256 MiB staging chunk of a random V3.2 room is 7,800-19,000 pieces: the copier made every
    piece table at that size when it was made, so no room's gather or scatter allocates pinned
    memory on its loop, and the copy is still exact."""
    pytest.importorskip("triton")
    from kvbridge.transfer.engine.slicecopy import MIN_TABLE_ROWS, TABLE_SLOTS, CudaCopier

    copier = CudaCopier(0)
    tables = list(copier._tables)
    assert len(tables) == TABLE_SLOTS and all(t is not None and t.rows >= MIN_TABLE_ROWS for t in tables)
    n, size = 20_000, 64
    src = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(2 * n * size, dtype=torch.uint8, device="cuda")
    order = torch.from_numpy(np.random.default_rng(3).permutation(n)).cuda()
    to = np.random.default_rng(3).permutation(n).astype(np.uint64) * np.uint64(2 * size)  # every other row
    for _ in range(TABLE_SLOTS + 1):  # every table used once, one twice
        copier.launch(np.uint64(src.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(size),
                      np.uint64(dst.data_ptr()) + to, np.full(n, size, dtype=np.uint64))
    copier.stream.synchronize()
    assert [t is u for t, u in zip(copier._tables, tables)] == [True] * TABLE_SLOTS  # none grown, none remade
    got = dst.view(n, 2 * size)[:, :size]  # row i of dst's even rows holds the src row whose destination it was
    assert torch.equal(got[order], src.view(n, size))
