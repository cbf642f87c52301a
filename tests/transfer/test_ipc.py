"""The IPC engine on the CPU: its slice copy (the CPU fallback of the GPU kernel), its side
channel (region tables, refresh on a miss, withdrawal while a write is in flight), and a
peer in another process. The behaviour every engine shares is in test_engine.py; GPU
memory and CUDA IPC between processes are in test_gpu.py."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np
import pytest

from _transfer_peer import peer_process
from kvbridge.errors import EngineError
from kvbridge.transfer.engine import Faults, WriteState, create_engine, tensor_region
from kvbridge.transfer.engine.slicecopy import copy_slices, plan_pieces

PAGE = 4096


def random_slices(rng: np.random.Generator, nbytes: int, num: int, aligned: bool) -> tuple[np.ndarray, ...]:
    """``num`` disjoint slices inside ``[0, nbytes)`` on both sides (offsets), lengths 1 B .. 20 KB."""
    lengths = rng.integers(1, 20_000, num)
    if aligned:
        lengths = (lengths // 16 + 1) * 16
    span = nbytes // num
    lengths = np.minimum(lengths, span - 16)
    slots = rng.permutation(num)
    src = np.arange(num) * span + (0 if aligned else rng.integers(0, 16, num))
    dst = slots * span + (0 if aligned else rng.integers(0, 16, num))
    return src.astype(np.uint64), dst.astype(np.uint64), lengths.astype(np.uint64)


def reference_copy(src_buf: np.ndarray, dst_buf: np.ndarray, src, dst, length) -> np.ndarray:
    out = dst_buf.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
        out[d:d + n] = src_buf[s:s + n]
    return out


# ---- the slice copy ------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [16, 4096, 128 * 1024])
def test_pieces_cover_every_slice_exactly_and_keep_alignment(chunk):
    rng = np.random.default_rng(chunk)
    src, dst, length = random_slices(rng, 1 << 22, 200, aligned=False)
    ps, pd, pn = plan_pieces(src + 1000, dst + 5000, length, chunk)
    assert int(pn.max()) <= chunk and int(pn.min()) > 0 and int(pn.sum()) == int(length.sum())
    assert np.array_equal(ps - np.uint64(1000) - (pd - np.uint64(5000)), (src - dst)[np.repeat(
        np.arange(src.size), ((length + np.uint64(chunk - 1)) // np.uint64(chunk)).astype(np.int64))])
    a16 = (src % 16 == 0) & (dst % 16 == 0) & (length % 16 == 0)
    pa, pb, pc = plan_pieces(src[a16], dst[a16], length[a16], chunk)
    assert ((pa % 16 == 0) & (pb % 16 == 0) & (pc % 16 == 0)).all()


def test_the_copiers_piece_table_holds_every_piece_as_offsets_from_its_base(monkeypatch):
    """``CudaCopier.launch``'s host side on the CPU (torch's contexts, the CUDA calls and the
    Triton launch stand-ins): the table rows are the pieces as signed offsets from the copier's
    base (below it too), slices of ``direct_min_bytes`` and more go as plain copies, and the
    counts say so. A slice of exactly one chunk is one piece."""
    import contextlib
    import types

    from kvbridge.transfer.engine import slicecopy

    calls, launches = [], []
    cuda = types.SimpleNamespace(memcpy_async=lambda d, s, n, h: calls.append((d, s, n)),
                                 event_record=lambda *a: None, event_synchronize=lambda *a: None)
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device=lambda d: contextlib.nullcontext(),
                                                              stream=lambda s: contextlib.nullcontext()))
    monkeypatch.setattr(slicecopy, "_kernel", lambda: _Grid(launches))
    rows = 1 << 12
    tables = [slicecopy._Table(None, np.zeros((rows, 3), np.int64), None, 7, rows, 0)
              for _ in range(slicecopy.TABLE_SLOTS)]
    copier = object.__new__(slicecopy.CudaCopier)
    base = 1 << 36
    vars(copier).update(_torch=torch, _cuda=cuda, device=None, stream=types.SimpleNamespace(cuda_stream=0),
                        chunk=4096, words=2048, num_warps=4, direct_min_bytes=1 << 20, _base_addr=np.uint64(base),
                        _base=None, _base_b=None, _tables=tables, _next_table=0, _lock=threading.Lock(),
                        max_programs=8, few_slices=0, _stream_handle=0)
    src = np.array([base - 8192, base + 64, base + (1 << 30), base + (1 << 31)], np.uint64)
    dst = np.array([base + 4096, base - 100_000, base + 8192, base + (1 << 32)], np.uint64)
    length = np.array([4096, 10_000, 1 << 20, 16], np.uint64)  # one chunk; three pieces; direct; one piece
    counts = copier.launch(src, dst, length)
    assert counts == {"kernel_slices": 3, "kernel_pieces": 5, "kernel_launches": 1, "direct_slices": 1}
    assert calls[-1] == (base + 8192, base + (1 << 30), 1 << 20) and len(launches) == 1
    keep = np.array([0, 1, 3])
    ps, pd, pn = plan_pieces(src[keep], dst[keep], length[keep], 4096)
    got = tables[0].host[:5]
    assert got[:, 0].tolist() == [int(a) - base for a in ps.tolist()]  # (negative: below the base)
    assert got[:, 1].tolist() == [int(a) - base for a in pd.tolist()]
    assert got[:, 2].tolist() == pn.tolist() == [4096, 4096, 4096, 1808, 16]
    copier.direct_min_bytes = 0  # none direct
    assert copier.launch(src[:1], dst[:1], length[:1])["kernel_pieces"] == 1 and tables[1].host[0, 0] == -8192


def test_a_launch_of_a_few_slices_is_plain_copies_on_the_stream_without_torch(monkeypatch):
    """``CudaCopier.launch`` of at most ``few_slices`` slices (an aux row, a last layer-wise write):
    one cudaMemcpyAsync per slice on the copier's stream handle, in order, with its own bytes; no
    piece table, no kernel, and no torch context entered (the stand-ins raise if one is). One more
    slice takes the kernel path."""
    import types

    from kvbridge.transfer.engine import slicecopy

    calls, launches = [], []
    cuda = types.SimpleNamespace(memcpy_async=lambda d, s, n, h: calls.append((d, s, n, h)),
                                 event_record=lambda *a: None, event_synchronize=lambda *a: None)

    def no_context(*_):
        raise AssertionError("a torch context was entered")

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device=no_context, stream=no_context))
    monkeypatch.setattr(slicecopy, "_kernel", lambda: _Grid(launches))
    copier = object.__new__(slicecopy.CudaCopier)
    vars(copier).update(_torch=torch, _cuda=cuda, device=None, stream=None, _stream_handle=0xABC, chunk=4096,
                        direct_min_bytes=0, few_slices=3)
    src = np.array([1 << 36, (1 << 36) + 100_000, 5 << 30], np.uint64)
    dst = np.array([7 << 30, (7 << 30) + 64, 9 << 30], np.uint64)
    length = np.array([14_368, 0, 1 << 20], np.uint64)  # an aux row, an empty slice (skipped), a long one
    counts = copier.launch(src, dst, length)
    assert counts == {"kernel_slices": 0, "kernel_pieces": 0, "kernel_launches": 0, "direct_slices": 3}
    assert calls == [(7 << 30, 1 << 36, 14_368, 0xABC), (9 << 30, 5 << 30, 1 << 20, 0xABC)] and not launches
    with pytest.raises(AssertionError, match="torch context"):  # four slices: the kernel path, in a context
        copier.launch(np.append(src, src[:1]), np.append(dst, dst[:1]), np.append(length, length[:1]))


class _Grid:
    """The Triton kernel's stand-in: ``kernel[grid](...)`` records the launch."""

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *a, **k: self.launches.append((grid, a[3]))


def test_pieces_refuse_a_chunk_that_breaks_alignment():
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_pieces(np.zeros(1), np.zeros(1), np.ones(1), chunk=100)


@pytest.mark.parametrize("aligned", [True, False])
def test_copy_slices_equals_a_slice_by_slice_copy(aligned):
    rng = np.random.default_rng(int(aligned))
    nbytes = 1 << 21
    src_buf = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst_buf = np.full(nbytes, 0xAB, np.uint8)
    src, dst, length = random_slices(rng, nbytes, 300, aligned)
    expected = reference_copy(src_buf, dst_buf, src, dst, length)
    # small batches: many vectorised steps, one slice larger than a batch on its own
    copy_slices(src_buf.ctypes.data + src, dst_buf.ctypes.data + dst, length, batch_bytes=50_000)
    assert np.array_equal(dst_buf, expected)


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture()
def engines():
    a, b = create_engine("ipc"), create_engine("ipc")
    yield a, b
    a.close()
    b.close()


def scattered(src: np.ndarray, dst: np.ndarray, num: int, seed: int = 0):
    perm = np.random.default_rng(seed).permutation(num)
    offsets = np.arange(num, dtype=np.uint64) * PAGE
    return src.ctypes.data + offsets, dst.ctypes.data + offsets[perm], np.full(num, PAGE, np.uint64), perm


def test_a_region_registered_after_the_first_write_is_found(engines):
    a, b = engines
    src = np.random.default_rng(1).integers(0, 256, 8 * PAGE, dtype=np.uint8)
    first, later = np.zeros(8 * PAGE, np.uint8), np.zeros(8 * PAGE, np.uint8)
    a.register(*tensor_region(src))
    b.register(*tensor_region(first))
    s, d, n, _ = scattered(src, first, 8)
    a.write(b.session_id, s, d, n)  # a now holds b's table
    b.register(*tensor_region(later))
    s, d, n, perm = scattered(src, later, 8, seed=2)
    a.write(b.session_id, s, d, n)  # a miss: the table is fetched again
    assert (later.reshape(-1, PAGE)[perm] == src.reshape(-1, PAGE)).all()


def test_a_peers_regions_are_mapped_when_its_table_is_learnt(engines):
    """Mapping a peer's regions (``cudaIpcOpenMemHandle`` on a GPU) happens when the writer learns
    the table (``reaches``, the first write, a miss), not inside a room's first write; a region
    registered later is mapped when the table is fetched again."""
    a, b = engines
    first, later = np.zeros(4 * PAGE, np.uint8), np.zeros(4 * PAGE, np.uint8)
    b.register(*tensor_region(first))
    assert a.reaches(b.session_id)
    peer = a._peers[b.session_id]
    assert [r.local for r in peer.regions] == [first.ctypes.data]  # one process: mapped as itself
    b.register(*tensor_region(later))
    a._peer(b.session_id, refresh=True)
    assert sorted(r.local for r in a._peers[b.session_id].regions) == sorted([first.ctypes.data, later.ctypes.data])


def test_unregister_waits_for_a_write_in_flight_then_writes_fail(engines):
    """Withdrawal: the owner's unregister returns only after the writer's copy into the
    region landed; afterwards the writer refuses the region and writes nothing into it."""
    a, b = engines
    src = np.random.default_rng(3).integers(0, 256, 16 * PAGE, dtype=np.uint8)
    dst = np.zeros(16 * PAGE, np.uint8)
    a.register(*tensor_region(src))
    b.register(*tensor_region(dst))
    gate = threading.Event()
    a.faults = Faults(gate=gate)
    s, d, n, perm = scattered(src, dst, 16)
    handle = a.submit_write(b.session_id, s, d, n)
    order: list[str] = []
    withdraw = threading.Thread(target=lambda: (b.unregister(dst.ctypes.data), order.append("unregistered")))
    withdraw.start()
    withdraw.join(0.3)
    assert withdraw.is_alive() and not dst.any(), "unregister returned while a write into the region was held"
    order.append("gate")
    gate.set()
    withdraw.join(10)
    assert order == ["gate", "unregistered"]
    assert a.poll(handle).state is WriteState.DONE
    assert (dst.reshape(-1, PAGE)[perm] == src.reshape(-1, PAGE)).all()
    a.faults = Faults()
    dst[:] = 0
    h2 = a.submit_write(b.session_id, s, d, n)
    status = a.poll(h2)
    assert status.state is WriteState.FAILED and "outside the memory registered by session" in status.reason
    assert "nothing written" in status.reason and not dst.any()


def test_close_withdraws_everything_and_the_session_goes_away(engines):
    a, _ = engines
    b = create_engine("ipc")
    src, dst = np.ones(PAGE, np.uint8), np.zeros(PAGE, np.uint8)
    a.register(*tensor_region(src))
    b.register(*tensor_region(dst))
    a.write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [PAGE])
    b.close()
    status = a.poll(a.submit_write(b.session_id, [src.ctypes.data], [dst.ctypes.data], [PAGE]))
    assert status.state is WriteState.FAILED and b.session_id in status.reason


def test_stats_and_trace_lines_say_how_a_write_went(engines, caplog, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_TRACE", "1")
    a, b = create_engine("ipc"), create_engine("ipc")  # the trace setting is read at construction
    try:
        src, dst = np.ones(4 * PAGE, np.uint8), np.zeros(4 * PAGE, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        with caplog.at_level(logging.INFO, logger="kvbridge.transfer.engine.ipc"):
            a.write(b.session_id, *scattered(src, dst, 4)[:3])
        assert a.stats["writes"] == 1 and a.stats["slices"] == 4 and a.stats["host_slices"] == 4
        lines = [r.getMessage() for r in caplog.records if "trace engine=ipc" in r.getMessage()]
        assert any("slices=4" in line and "host_slices=4" in line for line in lines)
        assert any(" done +" in line for line in lines)
    finally:
        a.close()
        b.close()


def test_the_corrupt_and_fail_faults_apply_per_batch():
    a, b = create_engine("ipc", max_slices_per_call=4), create_engine("ipc")
    try:
        src = np.random.default_rng(5).integers(0, 256, 8 * PAGE, dtype=np.uint8)
        dst = np.zeros(8 * PAGE, np.uint8)
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        a.faults = Faults(corrupt_batches={0}, fail_batches={1})
        s, d, n, perm = scattered(src, dst, 8)
        handle = a.submit_write(b.session_id, s, d, n)
        deadline = time.monotonic() + 10
        while not (status := a.poll(handle)).is_final and time.monotonic() < deadline:
            time.sleep(0.005)
        assert status.state is WriteState.FAILED and "injected failure of batch 1" in status.reason
        moved = dst.reshape(-1, PAGE)[perm] != src.reshape(-1, PAGE)
        assert int(moved[:4].sum()) == 1  # batch 0: one flipped byte
        assert not moved[4:6].any() and (moved[6:].sum(axis=1) > PAGE // 2).all()  # batch 1: first half only
    finally:
        a.close()
        b.close()


# ---- a peer in another process -------------------------------------------------------------
def test_host_memory_of_another_process_is_refused_and_untouched(tmp_path):
    """CUDA IPC reaches device memory only: a host destination in another process fails the
    write with the reason, and the peer's buffer keeps its bytes (checked by the peer)."""
    num = 16
    engine = create_engine("ipc")
    try:
        with peer_process(num * PAGE, "ipc", log_path=tmp_path / "peer.err") as (child, info, ask):
            src = np.random.default_rng(7).integers(0, 256, num * PAGE, dtype=np.uint8)
            engine.register(*tensor_region(src))
            offsets = np.arange(num, dtype=np.uint64) * PAGE
            handle = engine.submit_write(info["session"], src.ctypes.data + offsets, info["addr"] + offsets,
                                         np.full(num, PAGE))
            status = engine.poll(handle)
            assert status.state is WriteState.FAILED
            assert "host memory of process" in status.reason and str(child.pid) in status.reason
            assert ask("zero") == "ok"
            with pytest.raises(EngineError, match="no IPC engine with session"):
                engine.write("ipc:no-such-session", src.ctypes.data + offsets[:1], [info["addr"]], [PAGE])
        assert child.returncode == 0
    finally:
        engine.close()


def test_copy_slices_touches_only_the_slices():
    buf = np.full(64 * PAGE, 0x11, np.uint8)
    copy_slices(np.array([buf.ctypes.data], np.uint64), np.array([buf.ctypes.data + 10 * PAGE], np.uint64),
              np.array([3], np.uint64))
    changed = np.flatnonzero(buf != 0x11)
    assert changed.size == 0  # the source bytes were 0x11 too: nothing else may change
    ctypes.memset(buf.ctypes.data, 0x22, 3)
    copy_slices(np.array([buf.ctypes.data], np.uint64), np.array([buf.ctypes.data + 10 * PAGE], np.uint64),
              np.array([3], np.uint64))
    assert np.array_equal(np.flatnonzero(buf != 0x11), np.r_[0:3, 10 * PAGE:10 * PAGE + 3])


def test_an_ipc_handle_with_zero_bytes_survives_the_ctypes_struct():
    """CUDA IPC handles are 64 raw bytes, zeros included (a c_char field would cut them at the first zero)."""
    from kvbridge.transfer.engine._cuda import _IpcHandle

    raw = bytes([7, 0, 0, 9] * 16)
    assert bytes(_IpcHandle.from_buffer_copy(raw).reserved) == raw


# ---- the side channel on kvbridge's transport and codec --------------------------------------
def test_the_side_channel_checks_each_message_against_its_type_and_answers_requests():
    """Two side channels in one process: a request gets its typed reply (as the dict the tables
    read), a message that does not fit its type is refused at the sender naming the field, and
    closing one side tells the other."""
    import uuid

    from kvbridge.transfer.engine.ipc.channel import Channel

    closed: list[str] = []

    def target_on_message(conn, msg):
        if msg["t"] == "get":
            conn.send({"t": "regions", "id": msg["id"], "regions": [[4096, 8192, "host", -1, b"\x01\x02", 0]]})

    writer_got: list[dict] = []
    target = Channel(f"test-{uuid.uuid4().hex}", target_on_message, lambda conn: closed.append("target"))
    writer = Channel(f"test-{uuid.uuid4().hex}", lambda conn, msg: writer_got.append(msg),
                     lambda conn: closed.append("writer"))
    try:
        conn = writer.connect(target.session, 5.0)
        assert conn.outgoing and conn.same_process
        reply = writer.request(conn, {"t": "get"}, 5.0)
        assert reply["t"] == "regions" and [list(r) for r in reply["regions"]] == [[4096, 8192, "host", -1, b"\x01\x02", 0]]
        assert writer_got == [reply]
        assert len(target.accepted()) == 1 and not target.accepted()[0].outgoing
        with pytest.raises(EngineError, match="bad 'revoke' message.*seq"):
            conn.send({"t": "revoke", "start": 5})
        with pytest.raises(EngineError, match="no IPC engine with session nobody-here"):
            writer.connect("nobody-here", 1.0)
    finally:
        target.close()
        deadline = time.monotonic() + 5
        while "writer" not in closed and time.monotonic() < deadline:
            time.sleep(0.02)
        writer.close()
    assert "writer" in closed and "target" in closed
