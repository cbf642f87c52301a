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


class _Cuda:
    """The CUDA runtime's stand-in for a device ``AuxStaging``: records every call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.done = False

    def on_device(self, device):
        import contextlib

        return contextlib.nullcontext()

    def event_create(self):
        self.calls.append(("create",))
        return 0xE0 + len(self.calls)

    def memcpy_async(self, dst, src, nbytes, stream):
        self.calls.append(("copy", dst, src, nbytes, stream))

    def event_record(self, event, stream):
        self.calls.append(("record", event, stream))

    def event_query(self, event):
        self.calls.append(("query", event))
        return self.done

    def event_synchronize(self, event):
        self.calls.append(("sync", event))

    def stream_wait_event(self, stream, event):
        self.calls.append(("wait", stream, event))


class _Ptr:
    def __init__(self, addr: int) -> None:
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


class _HostEvent:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def synchronize(self) -> None:
        self.calls.append(("producer",))


def _device_staging(num_slots: int = 2):
    """An ``AuxStaging`` as ``device="cuda:N"`` builds it, on stand-ins (no GPU here)."""
    import threading

    from kvbridge.transfer.aux_rows import AuxStaging

    staging = object.__new__(AuxStaging)
    cuda = _Cuda()
    vars(staging).update(_pinned=_Ptr(0x1000), _pinned_rows=np.zeros((num_slots, SCHEMA.row_bytes), np.uint8),
                         _stream_handle=0x5, _cuda=cuda, _device=0, _slot_events=[None] * num_slots,
                         _copy_lock=threading.Lock(), storage=_Ptr(0x90000), _free=list(range(num_slots - 1, -1, -1)),
                         _by_room={}, _events={}, _rank="t", schema=SCHEMA)
    return staging, cuda


def test_a_device_staged_row_is_copied_on_its_first_use_only():
    """On a GPU the staged row waits in its pinned row: ``send()`` queues no copy, event or wait.
    The first write that asks for the room's event queues the copy (after the producer's events),
    once; a room whose decode ranks took the row in their reports never copies it; a slot staged
    again first waits for its last copy."""
    from kvbridge.transfer.engine.base import is_ready, wait_ready

    staging, cuda = _device_staging()
    rb = staging.schema.row_bytes
    a = staging.stage(11, np.full(rb, 7, np.uint8), after=_HostEvent(cuda.calls))
    b = staging.stage(12, np.full(rb, 8, np.uint8))
    assert staging.stage(11, np.full(rb, 9, np.uint8)) == a and cuda.calls == []  # staged: nothing on the GPU
    assert bytes(staging._pinned_rows[a]) == bytes([7] * rb)
    ev = staging.ready_event(11)
    assert not ev.queued and not is_ready(ev)  # a write asks: the copy is queued, then queried
    event = cuda.calls[3][1]  # the slot's event, made on its first copy
    assert cuda.calls == [("create",), ("producer",), ("copy", 0x90000 + a * rb, 0x1000 + a * rb, rb, 0x5),
                          ("record", event, 0x5), ("query", event)] and ev.queued
    cuda.calls.clear()
    wait_ready(ev)
    ev.wait_on(0x77)
    assert cuda.calls == [("sync", event), ("wait", 0x77, event)]  # once queued, never again
    assert not staging.ready_event(12).queued  # room 12 was never asked: no copy of its row
    cuda.calls.clear()
    staging.release(11)
    c = staging.stage(13, np.full(rb, 3, np.uint8))
    assert c == a and cuda.calls == [("sync", event)]  # the slot's last copy passed before its row changed
    cuda.calls.clear()
    staging.release(12)
    assert staging.stage(14, np.full(rb, 4, np.uint8)) == b and cuda.calls == []  # never copied: nothing to wait


def test_the_slice_copier_makes_its_stream_wait_on_a_staged_rows_copy():
    """``CudaCopier.wait_for``: a CUDA event and a ``RowCopy`` are waited on by the stream (the
    host goes on); any other event by the host."""
    import types

    from kvbridge.transfer.engine import slicecopy

    staging, cuda = _device_staging()
    staging.stage(21, np.ones(staging.schema.row_bytes, np.uint8))
    host = _HostEvent(cuda.calls)
    copier = object.__new__(slicecopy.CudaCopier)
    vars(copier).update(_torch=types.SimpleNamespace(cuda=types.SimpleNamespace(Event=type("Event", (), {}))),
                        _stream_handle=0xABC)
    copier.wait_for((staging.ready_event(21), None, host))
    kinds = [c[0] for c in cuda.calls]
    assert kinds == ["create", "copy", "record", "wait", "producer"] and cuda.calls[3][1] == 0xABC
