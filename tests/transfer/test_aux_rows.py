"""Aux rows in memory: a packed store or one tensor per region, the same bytes either way;
one row moves as one slice between packed stores, else one slice per region (merged where
both sides are contiguous)."""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.layout import AuxRegion, AuxSchema
from kvbridge.transfer.aux_rows import AuxBuffers, RegionAddr, aux_slices, is_packed

SCHEMA = AuxSchema((AuxRegion("room", "uint64", (8,)), AuxRegion("output_ids", "int32", (16,)),
                    AuxRegion("flag", "uint8"), AuxRegion("hidden", "bfloat16", (4,))))


def by_region(rows: int) -> dict[str, torch.Tensor]:
    return {r.name: torch.zeros((rows, *r.shape), dtype=getattr(torch, r.dtype)) for r in SCHEMA.regions}


def test_both_stores_read_back_the_same_row():
    row = SCHEMA.pack(room=5, output_ids=np.arange(16), flag=1, hidden=np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    packed = AuxBuffers(SCHEMA, np.zeros((3, SCHEMA.row_bytes), np.uint8), rank="r")
    packed.storage[2] = row.view(np.uint8)
    regions = AuxBuffers(SCHEMA, by_region(3), rank="r")
    for name, value in SCHEMA.unpack_regions(row).items():
        regions.tensors[name][2].view(torch.uint8).reshape(-1).copy_(torch.from_numpy(value.reshape(-1).view(np.uint8)))
    for store in (packed, regions):
        assert store.read_room(2) == 5 and store.read_row(2).tobytes() == row.tobytes()
    assert packed.packed and is_packed(SCHEMA, packed.regions) and not is_packed(SCHEMA, regions.regions)
    assert packed.packed_descriptor().row_bytes == SCHEMA.row_bytes and regions.packed_descriptor() is None
    assert [d.name for d in regions.descriptors()] == ["room", "output_ids", "flag", "hidden"]


def test_a_row_moves_in_one_slice_between_packed_stores_else_one_per_region():
    src = {r.name: RegionAddr(r.name, 1000 + SCHEMA.offsets[r.name], 4, SCHEMA.row_bytes) for r in SCHEMA.regions}
    dst = {r.name: RegionAddr(r.name, 9000 + SCHEMA.offsets[r.name], 4, SCHEMA.row_bytes) for r in SCHEMA.regions}
    s, d, n = aux_slices(SCHEMA, src, 1, dst, 2)
    assert (s, d, n) == ([1000 + SCHEMA.row_bytes], [9000 + 2 * SCHEMA.row_bytes], [SCHEMA.row_bytes])
    assert aux_slices(SCHEMA, src, 1, dst, 2, src_base=1000, dst_base=9000) == (s, d, n)  # bases kept by their owners
    separate = {r.name: RegionAddr(r.name, 100_000 * (i + 1), 4, r.nbytes) for i, r in enumerate(SCHEMA.regions)}
    s, d, n = aux_slices(SCHEMA, src, 0, separate, 3)  # packed -> per region: one slice per region
    assert n == [64, 64, 1, 8] and d == [100_000 * (i + 1) + 3 * r.nbytes for i, r in enumerate(SCHEMA.regions)]
    merged = dict(separate, room=RegionAddr("room", 100_000, 4, 64), output_ids=RegionAddr("output_ids", 100_064, 4, 64))
    s, d, n = aux_slices(SCHEMA, src, 0, merged, 0)  # room and output_ids back to back on both sides: one slice
    assert n == [128, 1, 8] and s[0] == 1000


def test_host_rows_are_read_through_a_view_that_follows_later_writes():
    """Packed rows in host memory (a numpy array or a CPU tensor) are read without a torch call,
    through a view of the same bytes: a row written after the store was built reads back, and
    the bytes equal the generic (tensor) path's."""
    from kvbridge.transfer.aux_rows import _row_bytes

    for storage in (np.zeros((3, SCHEMA.row_bytes), np.uint8), torch.zeros((3, SCHEMA.row_bytes), dtype=torch.uint8)):
        store = AuxBuffers(SCHEMA, storage, rank="r")
        assert store._host_rows is not None
        row = SCHEMA.pack(room=9, output_ids=np.arange(16), flag=1)
        target = storage[1] if isinstance(storage, np.ndarray) else storage[1].numpy()
        target[:] = row.view(np.uint8)  # written after the store was built
        got = store.read_row(1)
        assert got.tobytes() == row.tobytes() == _row_bytes(storage, 1).tobytes()
        got[:] = 0  # a copy: the store keeps its bytes
        assert store.read_room(1) == 9
    assert AuxBuffers(SCHEMA, by_region(3), rank="r")._host_rows is None  # per-region stores read per region
