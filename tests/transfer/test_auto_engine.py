"""The ``auto`` engine's route choice, and the ``after`` contract every engine keeps (a write
reads nothing before the producer's events completed). On CPU: the IPC part moves host
memory of this process, so two auto engines of one process meet over IPC and two processes
meet over Mooncake; the GPU cases are in test_gpu.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from _local import HostEvent
from _transfer_peer import peer_process
from kvbridge.transfer.engine import LocalFabric, WriteState, create_engine, mooncake_available, tensor_region
from kvbridge.transfer.engine.auto import IPC, MOONCAKE

needs_mooncake = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")]
PAGE = 4096


def pages(num: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num * PAGE, dtype=np.uint8)


def slices(src: np.ndarray, dst: np.ndarray, num: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    offsets = np.arange(num, dtype=np.uint64) * PAGE
    return src.ctypes.data + offsets, dst.ctypes.data + offsets[::-1].copy(), np.full(num, PAGE, np.uint64)


@pytest.mark.parametrize("kind", ["local", "ipc", pytest.param("mooncake", marks=needs_mooncake),
                                  pytest.param("auto", marks=needs_mooncake)])
def test_a_write_reads_nothing_before_its_events_complete(kind: str) -> None:
    fabric = LocalFabric() if kind == "local" else None
    a, b = create_engine(kind, fabric=fabric), create_engine(kind, fabric=fabric)
    try:
        src, dst = pages(8, 1), np.zeros(8 * PAGE, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        first, second = HostEvent(), HostEvent()
        handle = a.submit_write(b.session_id, *slices(src, dst, 8), after=[first, None, second])
        first.set()
        time.sleep(0.2)  # one event still open: nothing may have been read, let alone written
        assert a.poll(handle).state is WriteState.PENDING and not dst.any()
        second.set()
        a.wait(handle, 10)
        assert (dst.reshape(8, PAGE)[::-1] == src.reshape(8, PAGE)).all()
        done = HostEvent()
        done.set()  # complete before the call: posted at once
        a.write(b.session_id, *slices(src, dst, 8), after=done, timeout=10)
    finally:
        a.close()
        b.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_auto_engines_of_one_process_meet_over_ipc_and_say_so() -> None:
    a, b = create_engine("auto"), create_engine("auto")
    try:
        assert a.session_id.startswith("127.0.0.1:")  # Mooncake's session: peers need not know the route
        src, dst = pages(16, 2), np.zeros(16 * PAGE, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        a.write(b.session_id, *slices(src, dst, 16), timeout=10)
        assert (dst.reshape(16, PAGE)[::-1] == src.reshape(16, PAGE)).all()
        assert a.route(b.session_id) == IPC
        assert a.stats["writes_ipc"] == 1 and a.stats["slices_ipc"] == 16 and a.stats["writes_mooncake"] == 0
        assert a.stats["ipc_host_slices"] == 16  # the IPC engine's own counts ride along
    finally:
        a.close()
        b.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_a_plain_mooncake_peer_is_written_over_mooncake() -> None:
    a, b = create_engine("auto"), create_engine("mooncake")
    try:
        src, dst = pages(4, 3), np.zeros(4 * PAGE, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        a.write(b.session_id, *slices(src, dst, 4), timeout=10)
        assert (dst.reshape(4, PAGE)[::-1] == src.reshape(4, PAGE)).all()
        assert a.stats["writes_mooncake"] == 1 and not a.stats["writes_ipc"]
        # the route names the transport, whose staging thresholds apply (registry.staging_thresholds)
        assert a.route(b.session_id) == b.route(a.session_id) == f"{MOONCAKE}/tcp"
    finally:
        a.close()
        b.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_one_write_split_over_both_routes_is_one_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host memory of another process is out of IPC's reach (on a GPU host: the aux rows of a
    decode rank kept on the host): those slices go over Mooncake, the rest over IPC, and the
    handle is final once both parts are, failed if either part failed."""
    a, b = create_engine("auto"), create_engine("auto")
    try:
        src, dst = pages(8, 4), np.zeros(8 * PAGE, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        near = np.arange(8) % 2 == 0
        monkeypatch.setattr(a._ipc, "reachable", lambda session, d, n: near[: d.size].copy())
        a.write(b.session_id, *slices(src, dst, 8), timeout=10)
        assert (dst.reshape(8, PAGE)[::-1] == src.reshape(8, PAGE)).all()
        assert (a.stats["slices_ipc"], a.stats["slices_mooncake"]) == (4, 4)
        gate = threading.Event()
        a._ipc.faults.gate = gate  # the IPC part is held in flight: the handle stays pending
        handle = a.submit_write(b.session_id, *slices(src, dst, 8))
        time.sleep(0.2)
        assert a.poll(handle).state is WriteState.PENDING
        gate.set()
        a.wait(handle, 10)
        a._ipc.faults.gate = None
        a._ipc.faults.fail_batches = {a._ipc.batches_posted}  # the next IPC part fails: so does the write
        handle = a.submit_write(b.session_id, *slices(src, dst, 8))
        deadline = time.monotonic() + 10
        while (status := a.poll(handle)).state is WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert status.state is WriteState.FAILED and "injected failure" in status.reason
    finally:
        a.close()
        b.close()


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="Mooncake not importable")
def test_auto_to_another_process_on_cpu_goes_over_mooncake(tmp_path: Path) -> None:
    """The peer's side channel answers (same host), but its memory is host memory of another
    process: every slice goes over Mooncake."""
    num = 32
    engine = create_engine("auto")
    try:
        with peer_process(num * PAGE, "auto", log_path=tmp_path / "peer.err") as (_, info, ask):
            src = np.random.default_rng(9).integers(0, 256, num * PAGE, dtype=np.uint8)
            engine.register(*tensor_region(src))
            offsets = np.arange(num, dtype=np.uint64) * PAGE
            engine.write(info["session"], src.ctypes.data + offsets, info["addr"] + offsets, np.full(num, PAGE), 20)
            assert ask("check 9") == "ok"
            assert engine.route(info["session"]) == IPC  # the side channel answered ...
            assert engine.stats["slices_mooncake"] == num and not engine.stats["slices_ipc"]  # ... IPC cannot reach
    finally:
        engine.close()
