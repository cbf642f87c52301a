"""Transfer engines: the same behaviour tests against real Mooncake (TCP, loopback), real NIXL
(UCX on loopback) and the local engine, then what only one of them can show (faults; a second
process)."""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbridge.errors import ConfigError, EngineError, TransferTimeout
from kvbridge.transfer.engine import (
    Faults,
    LocalFabric,
    TransferEngine,
    WriteState,
    WriteStatus,
    create_engine,
    mooncake_available,
    nixl_available,
    tensor_region,
)

PAGE = 4096
needs_mooncake = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")]
# never skipped in CI: without NIXL there the tests run and fail (create_engine says what to install)
needs_nixl = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available() and os.environ.get("CI") != "true",
                                                   reason="NIXL not importable (pip install kvbridge[nixl])")]
KINDS = [pytest.param("local", id="local"), pytest.param("ipc", id="ipc"),
         pytest.param("mooncake", id="mooncake", marks=needs_mooncake),
         pytest.param("auto", id="auto", marks=needs_mooncake),
         pytest.param("nixl", id="nixl", marks=needs_nixl)]


@dataclass
class Pair:
    kind: str
    a: TransferEngine  # writer
    b: TransferEngine  # target
    fabric: LocalFabric | None

    def new_engine(self) -> TransferEngine:
        return create_engine(self.kind, fabric=self.fabric)

    @property
    def target(self) -> str:
        """b's session, with b's metadata as it is now loaded into a (what a registration carries:
        NIXL needs it, after b registered its memory; the other engines need none)."""
        self.a.add_peer(self.b.session_id, self.b.metadata)
        return self.b.session_id


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    fabric = LocalFabric() if request.param == "local" else None
    cap = 1024 if request.param in ("ipc", "auto", "nixl") else None  # one batch per kernel launch; the split test needs a cap
    a = create_engine(request.param, fabric=fabric, max_slices_per_call=cap)
    b = create_engine(request.param, fabric=fabric, max_slices_per_call=cap)
    yield Pair(request.param, a, b, fabric)
    a.close()
    b.close()


@contextmanager
def registered(engine: TransferEngine, *arrays: np.ndarray) -> Iterator[None]:
    for arr in arrays:
        engine.register(*tensor_region(arr))
    try:
        yield
    finally:
        for arr in arrays:
            engine.unregister(tensor_region(arr)[0])


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def scatter(src: np.ndarray, dst: np.ndarray, num: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Slices moving page i of src to page perm[i] of dst, and perm."""
    perm = np.random.default_rng(seed).permutation(num)
    offsets = np.arange(num, dtype=np.uint64) * PAGE
    return (
        src.ctypes.data + offsets,
        dst.ctypes.data + offsets[perm],
        np.full(num, PAGE, dtype=np.uint64),
        perm,
    )


def landed(src: np.ndarray, dst: np.ndarray, perm: np.ndarray) -> bool:
    num = perm.size
    return bool((dst[: num * PAGE].reshape(-1, PAGE)[perm] == src[: num * PAGE].reshape(-1, PAGE)).all())


def poll_until_final(engine: TransferEngine, handle: int, timeout: float = 20.0) -> WriteStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = engine.poll(handle)
        if status.is_final:
            return status
        time.sleep(0.001)
    raise AssertionError(f"write {handle} still pending after {timeout}s")


# ---- both engines -------------------------------------------------------------------------------
def test_sync_write_moves_scattered_pages(pair: Pair) -> None:
    src, dst = random_bytes(64 * PAGE), np.zeros(64 * PAGE, np.uint8)
    with registered(pair.a, src), registered(pair.b, dst):
        s, d, n, perm = scatter(src, dst, 64)
        pair.a.write(pair.target, s, d, n)
        assert landed(src, dst, perm)


def test_async_write_is_polled_then_released(pair: Pair) -> None:
    src, dst = random_bytes(32 * PAGE, 1), np.zeros(32 * PAGE, np.uint8)
    with registered(pair.a, src), registered(pair.b, dst):
        s, d, n, perm = scatter(src, dst, 32, 1)
        handle = pair.a.submit_write(pair.target, s, d, n)
        assert poll_until_final(pair.a, handle) == WriteStatus.DONE
        assert landed(src, dst, perm)
        with pytest.raises(EngineError, match="unknown write handle"):
            pair.a.poll(handle)


def test_a_write_over_the_slice_cap_is_split(pair: Pair) -> None:
    num = 3000  # one Mooncake call of this many slices wedges the peer's TCP lane
    assert pair.a.max_slices_per_call < num
    src, dst = random_bytes(num * PAGE, 2), np.zeros(num * PAGE, np.uint8)
    with registered(pair.a, src), registered(pair.b, dst):
        s, d, n, perm = scatter(src, dst, num, 2)
        pair.a.write(pair.target, s, d, n, timeout=20)
        assert landed(src, dst, perm)


def test_many_writes_in_flight_are_collected_by_one_thread(pair: Pair) -> None:
    # 40 rooms x 100 slices posted back to back: 4,000 slices to one peer at once, more than its
    # TCP lane queue takes; the engine keeps the in-flight count under the cap.
    rooms, per_room = 40, 100
    src, dst = random_bytes(rooms * per_room * PAGE, 3), np.zeros(rooms * per_room * PAGE, np.uint8)
    woken = threading.Semaphore(0)
    pair.a.set_notify(woken.release)
    try:
        with registered(pair.a, src), registered(pair.b, dst):
            s, d, n, perm = scatter(src, dst, rooms * per_room, 3)
            session = pair.target
            handles = {
                pair.a.submit_write(session, s[r::rooms], d[r::rooms], n[r::rooms]): r for r in range(rooms)
            }
            deadline = time.monotonic() + 20
            while handles and time.monotonic() < deadline:
                woken.acquire(timeout=1.0)  # no busy polling: completions wake us
                for handle in list(handles):
                    status = pair.a.poll(handle)
                    if status.is_final:
                        assert status == WriteStatus.DONE, status.reason
                        del handles[handle]
            assert not handles
            assert landed(src, dst, perm)
    finally:
        pair.a.set_notify(None)


def test_write_outside_registered_memory_fails_and_touches_nothing_outside(pair: Pair) -> None:
    src = random_bytes(4 * PAGE, 4)
    dst = np.full(8 * PAGE, 0xAB, np.uint8)  # only the first 4 pages are registered
    region = dst[: 4 * PAGE]
    with registered(pair.a, src), registered(pair.b, region):
        s = src.ctypes.data + np.arange(4, dtype=np.uint64) * PAGE
        d = dst.ctypes.data + np.array([0, 5, 6, 7], dtype=np.uint64) * PAGE  # slice 0 inside, 1-3 outside
        handle = pair.a.submit_write(pair.target, s, d, np.full(4, PAGE, np.uint64))
        status = poll_until_final(pair.a, handle)
        assert status.state is WriteState.FAILED
        assert pair.b.session_id in status.reason and "4 slices" in status.reason
        assert (dst[4 * PAGE :] == 0xAB).all()
        with pytest.raises(EngineError, match=pair.b.session_id):
            pair.a.write(pair.target, s[1:], d[1:], np.full(3, PAGE, np.uint64))
        assert (dst[4 * PAGE :] == 0xAB).all()


def test_dead_peer_fails_within_bounded_time(pair: Pair) -> None:
    peer = pair.new_engine()
    buf = np.zeros(PAGE, np.uint8)
    peer.register(*tensor_region(buf))
    pair.a.add_peer(peer.session_id, peer.metadata)
    session = peer.session_id
    peer.close()
    src = random_bytes(PAGE)
    with registered(pair.a, src):
        start = time.monotonic()
        handle = pair.a.submit_write(session, [src.ctypes.data], [buf.ctypes.data], [PAGE])
        status = poll_until_final(pair.a, handle, timeout=10)
        assert status.state is WriteState.FAILED and session in status.reason
        assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("src", "dst", "length", "match"),
    [
        ([1, 2], [1], [1], "differ in size"),
        ([1], [1], [0], "length 0"),
        ([1], [-1], [1], "negative"),
        ([[1]], [1], [1], "1-D"),
        ([1.5], [1], [1], "integers"),
        ([1], [2**64 - 2], [8], "passes 2\\*\\*64"),
        (np.array([1, 2**64 - 4], np.uint64), np.array([1, 1], np.uint64), np.array([1, 8], np.uint64),
         "slice 1: src \\+ length passes 2\\*\\*64"),  # uint64 arrays (a planner's) are checked as well
        (np.array([1], np.uint64), np.array([1], np.uint64), np.array([0], np.uint64), "length 0"),
    ],
)
def test_bad_slice_arrays_are_refused_before_posting(pair: Pair, src: list, dst: list, length: list, match: str) -> None:
    with pytest.raises(EngineError, match=match):
        pair.a.submit_write(pair.target, np.array(src), np.array(dst), np.array(length))


def test_regions_name_the_first_slice_not_inside_one_region() -> None:
    """first_outside: a slice must lie inside one registered region, whole (pure, no engine)."""
    from kvbridge.transfer.engine.jobs import Regions

    regions = Regions()
    assert regions.first_outside(np.array([64], np.uint64), np.array([1], np.uint64)) == 0  # nothing registered
    regions.add(1000, 100, "test")
    regions.add(5000, 50, "test")

    def first(*slices: tuple[int, int]) -> int:
        addr, length = (np.array(col, np.uint64) for col in zip(*slices))
        return regions.first_outside(addr, length)

    assert first((1000, 100), (5000, 50), (1050, 1), (5049, 1)) == -1  # exact bounds are inside
    assert first((1000, 101)) == 0  # runs one byte past the region's end
    assert first((999, 1)) == 0  # before the first region
    assert first((1000, 10), (1099, 2)) == 1  # from one region into the gap
    assert first((1000, 10), (1100, 3900), (5000, 1)) == 1  # in the gap
    assert first((5000, 10), (5050, 1)) == 1  # past the last region
    assert first((1050, 4000)) == 0  # spans two regions: not inside one


def test_source_outside_registered_memory_is_refused(pair: Pair) -> None:
    src = random_bytes(PAGE)
    with pytest.raises(EngineError, match="source .* not inside memory registered"):
        pair.a.submit_write(pair.target, [src.ctypes.data], [1 << 40], [PAGE])


def test_registering_twice_or_unregistering_unknown_is_an_error(pair: Pair) -> None:
    buf = np.zeros(2 * PAGE, np.uint8)
    with registered(pair.b, buf):
        with pytest.raises(EngineError, match="already registered"):
            pair.b.register(*tensor_region(buf))
        with pytest.raises(EngineError, match="overlaps"):
            pair.b.register(buf.ctypes.data + PAGE, 2 * PAGE)
    with pytest.raises(EngineError, match="no registered region"):
        pair.b.unregister(buf.ctypes.data)
    with pytest.raises(EngineError, match="must be integers"):
        pair.b.register(float(buf.ctypes.data), 16)
    pair.b.register(np.uint64(buf.ctypes.data), np.int64(16))  # numpy integers are fine
    pair.b.unregister(np.uint64(buf.ctypes.data))


def test_an_empty_write_is_done_at_once(pair: Pair) -> None:
    handle = pair.a.submit_write(pair.target, np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    assert pair.a.poll(handle) == WriteStatus.DONE


def test_torch_cpu_tensors_register_and_receive(pair: Pair) -> None:
    torch = pytest.importorskip("torch")
    src = torch.arange(2 * PAGE // 2, dtype=torch.int16)
    dst = torch.zeros(4, PAGE // 2, dtype=torch.bfloat16)
    (sp, sn), (dp, dn) = tensor_region(src), tensor_region(dst)
    assert (sn, dn) == (2 * PAGE, 4 * PAGE)
    pair.a.register(sp, sn)
    pair.b.register(dp, dn)
    try:
        pair.a.write(pair.target, [sp, sp + PAGE], [dp + 3 * PAGE, dp], [PAGE, PAGE])
        got = dst.view(torch.int16).reshape(-1)
        assert torch.equal(got[3 * PAGE // 2 :], src[: PAGE // 2]) and torch.equal(got[: PAGE // 2], src[PAGE // 2 :])
    finally:
        pair.a.unregister(sp)
        pair.b.unregister(dp)


# ---- local engine: faults -----------------------------------------------------------------------
@pytest.fixture(params=["local", "ipc"])
def local_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Engines with fault injection: the local engine, and the IPC engine (host memory, one process)."""
    fabric = LocalFabric() if request.param == "local" else None
    a = create_engine(request.param, fabric=fabric, max_slices_per_call=4)
    b = create_engine(request.param, fabric=fabric, max_slices_per_call=4)
    yield Pair(request.param, a, b, fabric)
    a.close()
    b.close()


def local_buffers(p: Pair, num: int) -> tuple[np.ndarray, np.ndarray]:
    src, dst = random_bytes(num * PAGE, 9), np.zeros(num * PAGE, np.uint8)
    p.a.register(*tensor_region(src))
    p.b.register(*tensor_region(dst))
    return src, dst


def test_local_fail_nth_batch_writes_part_and_skips_the_rest(local_pair: Pair) -> None:
    src, dst = local_buffers(local_pair, 12)  # 3 batches of 4
    local_pair.a.faults = Faults(fail_batches={1})
    s, d, n, perm = scatter(src, dst, 12)
    handle = local_pair.a.submit_write(local_pair.b.session_id, s, d, n)
    status = poll_until_final(local_pair.a, handle)
    assert status.state is WriteState.FAILED and "injected failure of batch 1" in status.reason
    pages_landed = [bool((dst.reshape(-1, PAGE)[perm[i]] == src.reshape(-1, PAGE)[i]).all()) for i in range(12)]
    # the local engine skips the batches after a failed one; the IPC engine launched them at submit
    after = [True] * 4 if local_pair.kind == "ipc" else [False] * 4
    assert pages_landed == [True] * 4 + [True, True, False, False] + after


def test_local_corrupt_batch_reports_done_with_a_flipped_byte(local_pair: Pair) -> None:
    src, dst = local_buffers(local_pair, 4)
    local_pair.a.faults = Faults(corrupt_batches={0})
    s, d, n, perm = scatter(src, dst, 4)
    local_pair.a.write(local_pair.b.session_id, s, d, n)
    assert not landed(src, dst, perm)
    assert int(np.count_nonzero(dst.reshape(-1, PAGE)[perm] != src.reshape(-1, PAGE))) == 1


def test_local_delay_and_gate_hold_writes_in_flight(local_pair: Pair) -> None:
    src, dst = local_buffers(local_pair, 4)
    gate = threading.Event()
    local_pair.a.faults = Faults(delay_s=0.05, gate=gate)
    s, d, n, perm = scatter(src, dst, 4)
    handle = local_pair.a.submit_write(local_pair.b.session_id, s, d, n)
    with pytest.raises(TransferTimeout, match="still in flight"):
        local_pair.a.wait(handle, 0.1)
    assert local_pair.a.poll(handle) == WriteStatus.PENDING and not dst.any()
    gate.set()
    local_pair.a.wait(handle, 5)
    assert landed(src, dst, perm)


def test_local_close_fails_held_writes(local_pair: Pair) -> None:
    src, dst = local_buffers(local_pair, 8)
    local_pair.a.faults = Faults(gate=threading.Event())
    s, d, n, _ = scatter(src, dst, 8)
    handle = local_pair.a.submit_write(local_pair.b.session_id, s, d, n)
    local_pair.a.close()
    status = local_pair.a.poll(handle)
    assert status.state is WriteState.FAILED and "closed" in status.reason
    assert not dst.any()
    with pytest.raises(EngineError, match="closed"):
        local_pair.a.submit_write(local_pair.b.session_id, s, d, n)


def test_local_engines_reach_only_their_own_fabric() -> None:
    a, b = create_engine("local"), create_engine("local")  # a fresh fabric each
    try:
        src, dst = random_bytes(PAGE), np.zeros(PAGE, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        with pytest.raises(EngineError, match="no engine with session"):
            a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [PAGE])
    finally:
        a.close()
        b.close()


# ---- Mooncake across processes ------------------------------------------------------------------
PEER = Path(__file__).with_name("_transfer_peer.py")


def line_reader(stream) -> tuple[queue.Queue, threading.Thread]:
    lines: queue.Queue = queue.Queue()
    thread = threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True)
    thread.start()
    return lines, thread


@pytest.mark.parametrize("kind", [pytest.param("mooncake", marks=needs_mooncake), pytest.param("nixl", marks=needs_nixl)])
def test_write_into_another_process_then_it_dies(tmp_path: Path, kind: str) -> None:
    num = 256
    stderr = (tmp_path / "peer.err").open("w")
    child = subprocess.Popen(
        [sys.executable, str(PEER), str(num * PAGE), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    lines, reader = line_reader(child.stdout)
    engine = None
    try:
        engine = create_engine(kind)
        info = json.loads(lines.get(timeout=20))
        engine.add_peer(info["session"], base64.b64decode(info["metadata"]))
        expected = np.random.default_rng(7).integers(0, 256, num * PAGE, dtype=np.uint8)
        perm = np.random.default_rng(8).permutation(num)
        src = np.ascontiguousarray(expected.reshape(num, PAGE)[perm]).reshape(-1)  # page i goes to perm[i]
        engine.register(*tensor_region(src))
        offsets = np.arange(num, dtype=np.uint64) * PAGE
        engine.write(info["session"], src.ctypes.data + offsets, info["addr"] + offsets[perm], np.full(num, PAGE), 20)
        child.stdin.write("check 7\n")
        child.stdin.flush()
        assert lines.get(timeout=20).strip() == "ok"

        child.kill()
        child.wait(10)
        start = time.monotonic()
        handle = engine.submit_write(info["session"], src.ctypes.data + offsets[:4], info["addr"] + offsets[:4], np.full(4, PAGE))
        status = poll_until_final(engine, handle, timeout=15)
        assert status.state is WriteState.FAILED and info["session"] in status.reason
        assert time.monotonic() - start < 5
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5)
        reader.join(5)  # EOF once the child is gone
        child.stdin.close()
        child.stdout.close()
        stderr.close()
        if engine is not None:
            engine.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_mooncake_posts_a_small_write_itself_and_queues_the_rest_behind_the_pump() -> None:
    """Over TCP (these engines) a post only queues slices: the caller posts up to
    DIRECT_MAX_SLICES_TCP slices of any size to an idle session."""
    from kvbridge.transfer.engine.mooncake import DIRECT_MAX_SLICES_TCP as DIRECT_MAX_SLICES

    a, b = create_engine("mooncake"), create_engine("mooncake")
    num = 3 * DIRECT_MAX_SLICES
    src, dst = random_bytes(num * PAGE, 11), np.zeros(num * PAGE, np.uint8)
    try:
        with registered(a, src), registered(b, dst):
            s, d, n, perm = scatter(src, dst, num, 11)
            small = slice(0, DIRECT_MAX_SLICES)
            assert a.direct_posts == 0
            a.write(b.session_id, s[small], d[small], n[small])  # idle session: the caller posts it
            assert a.direct_posts == 1
            big = slice(DIRECT_MAX_SLICES, num)
            h_big = a.submit_write(b.session_id, s[big], d[big], n[big])  # too many slices: the pump
            h_next = a.submit_write(b.session_id, s[:1], d[:1], n[:1])  # small, but the session is busy
            assert a.direct_posts == 1
            assert poll_until_final(a, h_big) == WriteStatus.DONE and poll_until_final(a, h_next) == WriteStatus.DONE
            assert landed(src, dst, perm)
            # a refused direct post fails its own write, names the peer, and the engine goes on
            bad = a.submit_write(b.session_id, s[:2], np.array([d[0], d[0] + num * PAGE], np.uint64), n[:2])
            status = poll_until_final(a, bad)
            assert status.state is WriteState.FAILED and b.session_id in status.reason
            assert a.direct_posts == 2
            a.write(b.session_id, s[:4], d[:4], n[:4])
            assert a.direct_posts == 3
            # source events: completed ones (an aux row's copy by the room's last send) still let the
            # caller post; one not yet completed sends the write to the pump, which waits for it
            done, pending = threading.Event(), threading.Event()
            done.set()
            done.query = done.is_set  # an event as engines see one: query() and synchronize()
            done.synchronize = done.wait
            pending.query = pending.is_set
            pending.synchronize = pending.wait
            dst[:] = 0
            assert poll_until_final(a, a.submit_write(b.session_id, s[:4], d[:4], n[:4], after=done)) == WriteStatus.DONE
            assert a.direct_posts == 4
            h = a.submit_write(b.session_id, s[:4], d[:4], n[:4], after=pending)
            assert a.direct_posts == 4 and a.poll(h) == WriteStatus.PENDING
            pending.set()
            assert poll_until_final(a, h) == WriteStatus.DONE
    finally:
        a.close()
        b.close()


# ---- factory, lazy import, GPU ------------------------------------------------------------------
@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_mooncake_trace_lines_name_each_batch_posted_and_final(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """With KVBRIDGE_TRACE=1 (read at construction) each batch's post and end is a line carrying the
    write's handle (``scripts/staged_cycle.py`` joins a staged chunk's write by it), a failed one too."""
    monkeypatch.setenv("KVBRIDGE_TRACE", "1")
    a, b = create_engine("mooncake", max_slices_per_call=4), create_engine("mooncake")
    src, dst = random_bytes(6 * PAGE, 5), np.zeros(6 * PAGE, np.uint8)
    try:
        with registered(a, src), registered(b, dst), caplog.at_level(logging.INFO, "kvbridge.transfer.engine.mooncake"):
            s, d, n, perm = scatter(src, dst, 6, 5)
            h = a.submit_write(b.session_id, s, d, n)  # two batches: 4 + 2 slices
            assert poll_until_final(a, h) == WriteStatus.DONE and landed(src, dst, perm)
            bad = a.submit_write(b.session_id, s[:1], np.array([d[0] + 6 * PAGE], np.uint64), n[:1])
            assert poll_until_final(a, bad).state is WriteState.FAILED
        lines = [r.getMessage() for r in caplog.records if "trace engine=mooncake" in r.getMessage()]
        for batch, slices in ((0, 4), (1, 2)):
            assert any(f"write={h} batch={batch} -> {b.session_id} slices={slices} " in x and " posted @" in x
                       for x in lines), lines
            assert any(f"write={h} batch={batch} done +" in x for x in lines), lines
        assert any(f"write={bad} batch=0 failed +" in x for x in lines), lines
    finally:
        a.close()
        b.close()


def test_import_does_not_load_mooncake() -> None:
    code = (
        "import sys, kvbridge, kvbridge.transfer.engine as e; e.create_engine('local').close(); "
        "print('mooncake' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_mooncake_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    assert mooncake_available() is False
    with pytest.raises(EngineError, match="not importable"):
        create_engine("mooncake")


def test_unknown_engine_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown transfer engine 'nccl'"):
        create_engine("nccl")
    with pytest.raises(ConfigError, match="LocalFabric"):
        create_engine("mooncake", fabric=LocalFabric())


def test_tensor_region_refuses_non_contiguous_views() -> None:
    arr = np.zeros((4, 4), np.uint8)
    assert tensor_region(arr) == (arr.ctypes.data, 16)
    with pytest.raises(EngineError, match="non-contiguous"):
        tensor_region(arr[:, ::2])


@pytest.mark.gpu
def test_tensor_region_of_a_cuda_tensor() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = torch.zeros(3, 5, dtype=torch.bfloat16, device="cuda")
    assert tensor_region(t) == (t.data_ptr(), 30)
    with pytest.raises(EngineError, match="non-contiguous"):
        tensor_region(t.t())
