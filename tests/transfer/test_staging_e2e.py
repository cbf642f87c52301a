"""Staged transfers end to end on the CPU, with the local engine and real Mooncake TCP between
two engines: gather into a registered send area, write wire pieces into the receiver's
registered staging area, scatter into its pages. Every room's destination must equal what
the direct path (the plan's slices posted as they are) writes, byte for byte, with poison
left everywhere else (padding rows, tails of partial pages, pages not in the room)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvbridge.errors import EngineError
from kvbridge.layout import TransferPlan, deepseek_pools, describe_buffer, plan_transfer, stage_plan
from kvbridge.layout.heads import HeadGeometry, head_slices, plan_head_transfer
from kvbridge.transfer.digest import page_digests
from kvbridge.transfer.engine import LocalFabric, TransferEngine, create_engine, mooncake_available, tensor_region
from kvbridge.transfer.staging import HostStager, StagedWriter, copy_slices
from kvbridge.transfer.staging.area import SlotState, StagingArea

POISON = 0x55
needs_mooncake = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")]
KINDS = [pytest.param("local", id="local"), pytest.param("mooncake", id="mooncake", marks=needs_mooncake)]


@dataclass
class Pair:
    a: TransferEngine  # prefill: writes
    b: TransferEngine  # decode: receives
    registered: list  # (engine, ptr, array): unregistered at the end; the array kept alive till then


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    fabric = LocalFabric() if request.param == "local" else None
    a = create_engine(request.param, fabric=fabric)
    b = create_engine(request.param, fabric=fabric)
    p = Pair(a, b, [])
    yield p
    for engine, ptr, _ in p.registered:
        engine.unregister(ptr)
    a.close()
    b.close()


def register(p: Pair, engine: TransferEngine, arr: np.ndarray) -> np.ndarray:
    ptr, n = tensor_region(arr)
    engine.register(ptr, n)
    p.registered.append((engine, ptr, arr))
    return arr


class Side:
    """One rank's pools: a (capacity, bytes_per_page) uint8 array per (pool, layer)."""

    def __init__(self, specs: dict, capacity: int, fill: int | None, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.specs = specs
        self.arrays = {}
        for spec in specs.values():
            for lid in spec.layer_ids:
                shape = (capacity, spec.bytes_per_page)
                self.arrays[(spec.name, lid)] = (rng.integers(0, 256, shape, dtype=np.uint8) if fill is None
                                                 else np.full(shape, fill, np.uint8))
        self.descs = [describe_buffer(specs[pool], lid, arr) for (pool, lid), arr in self.arrays.items()]

    def poison(self) -> None:
        for arr in self.arrays.values():
            arr[:] = POISON

    def snapshot(self) -> dict:
        return {k: v.copy() for k, v in self.arrays.items()}


def areas(p: Pair, num_slots: int, slot_bytes: int) -> tuple[StagingArea, int, StagingArea, int]:
    send = register(p, p.a, np.zeros(num_slots * slot_bytes, np.uint8))
    recv = register(p, p.b, np.zeros(num_slots * slot_bytes, np.uint8))
    return (StagingArea(num_slots, slot_bytes, rank="p0"), send.ctypes.data,
            StagingArea(num_slots, slot_bytes, rank="d0"), recv.ctypes.data)


def writer(p: Pair, num_slots: int, slot_bytes: int) -> StagedWriter:
    send_area, send_base, recv_area, recv_base = areas(p, num_slots, slot_bytes)
    return StagedWriter(p.a, p.b.session_id, send_stager=HostStager(), send_area=send_area, send_base=send_base,
                        recv_stager=HostStager(), recv_area=recv_area, recv_base=recv_base)


class ProducerEvent:
    """Stands for a CUDA event recorded after the source pages were written (``synchronize()``)."""

    waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def staged_vs_direct(p: Pair, dst: Side, plans: list[TransferPlan], w: StagedWriter, room: int = 1) -> list:
    """Run ``plans`` staged, then direct on fresh poison; the two destinations must be equal."""
    stats = [w.write(stage_plan(plan, w.send.area.slot_bytes, max_piece_bytes=w.send.area.slot_bytes // 3),
                     room + i) for i, plan in enumerate(plans)]
    staged = dst.snapshot()
    dst.poison()
    for plan in plans:
        p.a.write(p.b.session_id, plan.src, plan.dst, plan.length)
    for key, arr in dst.arrays.items():
        assert (staged[key] == arr).all(), f"{key} differs between staged and direct"
    assert w.send.area.num_free == w.send.area.num_slots and w.recv.area.num_free == w.recv.area.num_slots
    return stats


def test_random_pages_partial_index_page_three_pools_room_larger_than_staging(pair: Pair) -> None:
    page_size, capacity = 16, 48
    specs = deepseek_pools(num_layers=3, page_size=page_size, kv_dtype="fp8", index=True, draft_layers=1)
    src = Side(specs, capacity, None, seed=1)
    dst = Side(specs, capacity, POISON)
    for arr in src.arrays.values():
        register(pair, pair.a, arr)
    for arr in dst.arrays.values():
        register(pair, pair.b, arr)
    num_tokens = 37 * page_size + 5  # 38 pages, the last with 5 valid rows of 16
    rng = np.random.default_rng(7)
    logical = np.arange(38)
    sp, dp = rng.permutation(capacity)[:38], rng.permutation(capacity)[:38]
    plan = plan_transfer(specs, src.descs, dst.descs, logical, sp, dp, num_tokens)
    w = writer(pair, 2, 64 << 10)
    assert plan.num_bytes > 4 * w.send.area.nbytes  # streams through the two slots several times
    (stats,) = staged_vs_direct(pair, dst, [plan], w)
    assert stats.chunks >= -(-plan.num_bytes // (64 << 10))
    assert w.send.area.counters["acquired"] == w.recv.area.counters["acquired"] == stats.chunks  # 2 slots, reused
    assert stats.wire_pieces <= 4 * stats.chunks and 6 * stats.chunks < plan.num_slices  # pieces of slot/3
    # padding never written: the partial page's tails and every page outside the room stay poisoned
    last = int(dp[-1])
    idx = specs["index"]
    for lid in idx.layer_ids:
        page = dst.arrays[("index", lid)][last]
        assert (page[5 * 128 : idx.scale_offset] == POISON).all() and (page[idx.scale_offset + 20 :] == POISON).all()
    for lid in specs["target"].layer_ids:
        assert (dst.arrays[("target", lid)][last][5 * 656 :] == POISON).all()
    outside = np.setdiff1d(np.arange(capacity), dp)
    assert all((arr[outside] == POISON).all() for arr in dst.arrays.values())


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1)], ids=["p1-d2", "p2-d1"])
def test_heterogeneous_tp_heads_sliced_through_staging(pair: Pair, src_tp: int, dst_tp: int) -> None:
    geom = HeadGeometry(num_heads=4, head_dim=128, abi="uint8")  # numpy has no bfloat16: bytes
    page_size, capacity, num_tokens = 16, 24, 16 * 11 + 9
    num_pages = 12

    def specs_of(tp: int, rank: int) -> dict:
        return {n: geom.spec(n, page_size, (0, 1), tp, rank) for n in ("k", "v")}

    srcs = [Side(specs_of(src_tp, r), capacity, None, seed=r) for r in range(src_tp)]
    dsts = [Side(specs_of(dst_tp, r), capacity, POISON) for r in range(dst_tp)]
    for s in srcs:
        for arr in s.arrays.values():
            register(pair, pair.a, arr)
    for d in dsts:
        for arr in d.arrays.values():
            register(pair, pair.b, arr)
    rng = np.random.default_rng(3)
    sp, dp = rng.permutation(capacity)[:num_pages], rng.permutation(capacity)[:num_pages]
    w = writer(pair, 3, 16 << 10)
    for j, d in enumerate(dsts):
        plans = [plan_head_transfer(srcs[hs.src_rank].specs, d.specs, hs, srcs[hs.src_rank].descs, d.descs,
                                    np.arange(num_pages), sp, dp, num_tokens)
                 for hs in head_slices(geom, src_tp, dst_tp, j)]
        stats = staged_vs_direct(pair, d, plans, w, room=10 * j + 1)
        for plan, st in zip(plans, stats):
            assert st.wire_pieces * 10 < plan.num_slices  # per-row head ranges, whole pieces on the wire
        outside = np.setdiff1d(np.arange(capacity), dp)
        assert all((arr[outside] == POISON).all() for arr in d.arrays.values())
        last = d.arrays[("k", 0)][int(dp[-1])].reshape(page_size, -1)
        assert (last[9:] == POISON).all()  # rows past the last valid token


def test_a_corrupted_chunk_is_caught_by_the_page_digests() -> None:
    fabric = LocalFabric()
    p = Pair(create_engine("local", fabric=fabric), create_engine("local", fabric=fabric), [])
    try:
        page_size, capacity, num_tokens = 16, 20, 16 * 15 + 3
        specs = deepseek_pools(num_layers=2, page_size=page_size, kv_dtype="fp8", index=True, draft_layers=1)
        src, dst = Side(specs, capacity, None, seed=5), Side(specs, capacity, POISON)
        for arr in src.arrays.values():
            register(p, p.a, arr)
        rng = np.random.default_rng(11)
        logical = np.arange(16)
        sp, dp = rng.permutation(capacity)[:16], rng.permutation(capacity)[:16]
        plan = plan_transfer(specs, src.descs, dst.descs, logical, sp, dp, num_tokens)
        w = writer(p, 2, 32 << 10)
        staged = stage_plan(plan, 32 << 10)
        p.a.faults.corrupt_batches = {2}  # chunk 2's write lands with one byte flipped and reports DONE
        ready = ProducerEvent()
        w.write(staged, room=5, after=ready)
        assert ready.waited == 1  # the host stager waited for the source pages before gathering
        pools = list(specs)
        sent = page_digests(specs, src.arrays, pools, logical, sp, num_tokens)
        got = page_digests(specs, dst.arrays, pools, logical, dp, num_tokens)
        bad = np.flatnonzero(sent != got)
        assert len(bad) == 1  # exactly the page that held the chunk's first staged byte
        first_src = int(staged.gather(2)[0][0])
        owner = [k for k, arr in src.arrays.items() if arr.ctypes.data <= first_src < arr.ctypes.data + arr.nbytes]
        page = (first_src - src.arrays[owner[0]].ctypes.data) // specs[owner[0][0]].bytes_per_page
        assert sp[bad[0]] == page
    finally:
        for engine, ptr, _ in p.registered:
            engine.unregister(ptr)
        p.a.close()
        p.b.close()


def test_a_failed_write_fails_the_room_and_frees_its_slots_once_quiet() -> None:
    fabric = LocalFabric()
    p = Pair(create_engine("local", fabric=fabric), create_engine("local", fabric=fabric), [])
    try:
        src = register(p, p.a, np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8))
        dst = np.full(1 << 20, POISON, np.uint8)
        n = 256
        perm = np.random.default_rng(1).permutation(n)
        plan = TransferPlan(src.ctypes.data + np.arange(n, dtype=np.uint64) * 4096,
                            dst.ctypes.data + perm.astype(np.uint64) * 4096, np.full(n, 4096))
        w = writer(p, 2, 64 << 10)
        p.a.faults.fail_batches = {3}
        with pytest.raises(EngineError, match="chunk 3.*injected failure"):
            w.write(stage_plan(plan, 64 << 10), room=9)
        for area in (w.send.area, w.recv.area):  # every write of the room is final: nothing can land
            assert [area.state(i) for i in range(2)] == [SlotState.FREE, SlotState.FREE]
            assert area.counters["quarantined"] >= 1 and area.counters["acknowledged"] >= 1
        # chunks 0-2 landed and were scattered: pages from chunk 3 on never saw a byte
        chunk_pages = (64 << 10) // 4096
        got = dst.reshape(n, 4096)[perm]
        assert (got[: 3 * chunk_pages] == src.reshape(n, 4096)[: 3 * chunk_pages]).all()
        assert (got[3 * chunk_pages :] == POISON).all()
    finally:
        for engine, ptr, _ in p.registered:
            engine.unregister(ptr)
        p.a.close()
        p.b.close()


@pytest.mark.parametrize("size", [1, 7, 132, 656, 4096, 8448, 41984, 200_000])
def test_copy_slices_moves_any_length_anywhere(size: int) -> None:
    rng = np.random.default_rng(size)
    n = max(2, min(64, (4 << 20) // size))
    a = rng.integers(0, 256, n * size + 37, dtype=np.uint8)
    b = np.full(n * size + 91, POISON, np.uint8)
    perm = rng.permutation(n)
    src = a.ctypes.data + 37 + np.arange(n, dtype=np.uint64) * size
    dst = b.ctypes.data + 91 + perm.astype(np.uint64) * size
    mixed = np.full(n, size, np.uint64)
    mixed[::2] = max(1, size // 2)  # two lengths in one call
    copy_slices(src, dst, mixed, batch_bytes=3 * size)
    for i in range(n):
        k = int(mixed[i])
        assert (b[91 + perm[i] * size : 91 + perm[i] * size + k] == a[37 + i * size : 37 + i * size + k]).all()
        assert (b[91 + perm[i] * size + k : 91 + (perm[i] + 1) * size] == POISON).all()
    assert (b[:91] == POISON).all()


def test_an_abort_mid_chunk_frees_the_pages_at_once_and_quarantines_the_slot_until_quiet() -> None:
    """A chunk's write held in flight (the local engine's gate) when the room aborts: the decode
    pages are free at once (remote writes land only in staging, never in them), the slot stays
    QUARANTINED while the write may land, and is FREE only once the sender acknowledged."""
    fabric = LocalFabric()
    p = Pair(create_engine("local", fabric=fabric), create_engine("local", fabric=fabric), [])
    try:
        n, size = 64, 4096
        src = register(p, p.a, np.random.default_rng(0).integers(0, 256, n * size, dtype=np.uint8))
        dst = np.full(n * size, POISON, np.uint8)  # decode pages: never registered for staged rooms
        perm = np.random.default_rng(1).permutation(n)
        plan = TransferPlan(src.ctypes.data + np.arange(n, dtype=np.uint64) * size,
                            dst.ctypes.data + perm.astype(np.uint64) * size, np.full(n, size))
        send_area, send_base, recv_area, recv_base = areas(p, 2, 64 << 10)
        staged = stage_plan(plan, 64 << 10)
        gate = threading.Event()
        p.a.faults.gate = gate
        slot = recv_area.acquire(3, 0).slot
        send_slot = send_area.acquire(3, 0).slot
        HostStager().gather(staged, 0, send_base + send_area.offset(send_slot))
        handle = p.a.submit_write(p.b.session_id, *staged.wire(0, send_base + send_area.offset(send_slot),
                                                                recv_base + recv_area.offset(slot)))
        assert recv_area.fail_room(3, free_at=float("inf")) == []  # abort: nothing landed yet
        assert recv_area.state(slot) is SlotState.QUARANTINED
        assert recv_area.acquire(4, 0).slot != slot  # the next room gets the other slot
        assert recv_area.acquire(4, 1) is None  # and waits rather than reuse the quarantined one
        gate.set()  # the held write lands now: into the slot, never into the pages
        p.a.wait(handle, 10)
        assert (dst == POISON).all()
        assert recv_area.state(slot) is SlotState.QUARANTINED  # landing is not an acknowledgement
        grants = recv_area.room_acknowledged(3)
        assert [(g.room, g.chunk, g.slot) for g in grants] == [(4, 1, slot)]
    finally:
        for engine, ptr, _ in p.registered:
            engine.unregister(ptr)
        p.a.close()
        p.b.close()


@pytest.mark.parametrize("size", [656, 4096, 100_000])
def test_copy_slices_between_far_apart_regions(size: int) -> None:
    # a small array (the heap) and a large one (its own mapping): the window spans the gap
    # between them, and each length takes its path (void items, 2-D rows, one memmove per run)
    small = np.random.default_rng(size).integers(0, 256, 4 * size, dtype=np.uint8)
    large = np.full(64 << 20, POISON, np.uint8)
    src = small.ctypes.data + np.arange(4, dtype=np.uint64) * size
    dst = large.ctypes.data + np.array([9, 2, 40, 7], dtype=np.uint64) * size
    copy_slices(src, dst, np.full(4, size, np.uint64))
    got = large[: 41 * size].reshape(41, size)
    assert (got[[9, 2, 40, 7]] == small.reshape(4, size)).all()
    assert (np.delete(got, [9, 2, 40, 7], axis=0) == POISON).all()
