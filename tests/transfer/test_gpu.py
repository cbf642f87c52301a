"""kvbridge on CUDA memory: pool buffers on the GPU, a real bootstrap daemon
process, CP=2 prefill, over real Mooncake (TCP on loopback) and over the IPC
engine (the slice kernel; in one process its peers' pointers are used as they
are, across processes through CUDA IPC: the engine tests at the end).

Two PrefillEndpoints (CP ranks 0 and 1, pools on cuda:0) and one
DecodeEndpoint (pools on cuda:1 when there are two GPUs, else cuda:0) live in
this process, each with its own engine. Synthetic KV is built on the
host (numpy) and copied to the GPU; decode pools are poisoned on the GPU with
SENTINEL_BYTE; after the rooms commit, the decode pools are copied back to the
host and every byte of every room is checked (valid rows, untouched padding
tails of partial last pages, untouched pages outside the rooms, the aux row).

Aux rows are parametrised: host (the default: prefill staging rows in host
memory, decode aux buffer a CPU tensor) and cuda (both in GPU memory, what a
device-memory-only transport such as Mooncake's NVLink one needs).

Skipped, at collection and in well under a second, without a CUDA device (CI
has no GPU); the Mooncake cases also without Mooncake.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from _transfer_peer import peer_process
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.layout import OwnerLanes
from kvbridge.layout.aux import owner_of_last_token
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.digest import page_digests
from kvbridge.transfer.engine import Faults, WriteState, create_engine, mooncake_available, nixl_available, tensor_region
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs
from kvbridge.worker.synthetic import SENTINEL_BYTE, fill_pages, make_aux, verify_aux, verify_pages

_HAVE_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _HAVE_CUDA, reason="no CUDA device")]
_MOONCAKE = [pytest.mark.mooncake,
             pytest.mark.skipif(_HAVE_CUDA and not mooncake_available(), reason="Mooncake not installed")]

PRESET = "deepseek-v3.2-fp8"
LAYERS = 3  # + 1 draft layer; index-K pool too (values-then-scales pages)
PAGE = 64  # the real page size: partial last pages are 1..63 rows
CP = 2
PREFILL_PAGES = 64  # per CP rank
DECODE_PAGES = 160
FINAL = (KVPoll.Success, KVPoll.Failed)
# several rooms per test, most with a partial last page (1, 63, 65, 488 rows ...)
LENGTHS = (1, 63, 3 * PAGE + 1, 7 * PAGE + 40, 10 * PAGE, 5 * PAGE + 63)


def _prefill_device() -> str:
    return "cuda:0"


def _decode_device() -> str:
    return "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class GpuPrefill:
    """CP=2 prefill ranks of one instance, in this process, pools on the GPU."""

    def __init__(self, bootstrap: str, instance: str, aux_device: str, engine: str = "mooncake") -> None:
        self.instance = instance
        self.specs = build_specs(PRESET, LAYERS, PAGE, 1)
        self.contract = build_contract(PRESET, LAYERS, PAGE, 1, "interleaved")
        self.aux_schema = aux_schema_of(self.contract)
        self.lanes = OwnerLanes(CP)
        self.device = _prefill_device()
        self.buffers = [allocate_buffers(self.specs, PREFILL_PAGES, device=self.device) for _ in range(CP)]
        # host mirrors: synthetic KV is made with numpy, then copied to the GPU
        self.mirrors = [allocate_buffers(self.specs, PREFILL_PAGES) for _ in range(CP)]
        self.free = [list(range(PREFILL_PAGES)) for _ in range(CP)]
        self.engines, self.eps, self.clients = [], [], []
        try:
            for rank in range(CP):
                self.engines.append(create_engine(engine))
                engine_ = self.engines[-1]
                client = BootstrapClient(bootstrap)
                self.clients.append(client)
                cfg = PrefillConfig(instance=instance, cp_rank=rank, cp_size=CP, lease_ttl=5.0,
                                    housekeeping_interval=0.2, aux_device=aux_device)
                ep = PrefillEndpoint(cfg, engine_, self.specs, self.buffers[rank], self.contract, client,
                                     self.aux_schema)
                ep.start()
                self.eps.append(ep)
        except BaseException:
            self.close()
            raise

    def stage(self, rng: np.random.Generator, rooms: list[tuple[int, int]]) -> dict[tuple[int, int], tuple]:
        """Pick scattered local pages for each room's owned pages, write their synthetic KV
        (PAD_BYTE in compute-padding rows) on the host, copy the pools to the GPU."""
        plan = {}
        for room, n in rooms:
            num_pages = -(-n // PAGE)
            for rank in range(CP):
                owned = self.lanes.owned_pages(rank, num_pages)
                pick = set(rng.choice(len(self.free[rank]), size=owned.size, replace=False).tolist())
                local = np.array([p for i, p in enumerate(self.free[rank]) if i in pick], dtype=np.int64)
                rng.shuffle(local)
                self.free[rank] = [p for i, p in enumerate(self.free[rank]) if i not in pick]
                for (pool, layer), buf in self.mirrors[rank].items():
                    fill_pages(self.specs[pool], buf, room, layer, owned, local, n)
                plan[(room, rank)] = (owned, local)
        for rank in range(CP):
            for key, gpu in self.buffers[rank].items():
                gpu.copy_(self.mirrors[rank][key])
        torch.cuda.synchronize()
        return plan

    def close(self) -> None:
        for ep in self.eps:
            ep.close(timeout=3)
        for engine in self.engines:
            engine.close()
        for client in self.clients:
            client.close()


class GpuDecode:
    """One decode rank in this process: pools on the GPU, poisoned with SENTINEL_BYTE."""

    def __init__(self, bootstrap: str, instance: str, aux_device: str, engine: str = "mooncake", **cfg) -> None:
        self.specs = build_specs(PRESET, LAYERS, PAGE, 1)
        self.contract = build_contract(PRESET, LAYERS, PAGE, 1, "interleaved")
        self.aux_schema = aux_schema_of(self.contract)
        self.device = _decode_device()
        self.buffers = allocate_buffers(self.specs, DECODE_PAGES, device=self.device)
        for buf in self.buffers.values():
            _u8(buf).fill_(SENTINEL_BYTE)
        self.aux = torch.zeros((16, self.aux_schema.row_bytes), dtype=torch.uint8, device=aux_device)
        torch.cuda.synchronize()
        self.engine = create_engine(engine)
        self.client = BootstrapClient(bootstrap)
        config = DecodeConfig(instance=instance, peer_timeout=10.0, ping_interval=0.2, lease_ttl=5.0,
                              transfer_timeout=60.0, **cfg)
        self.ep = DecodeEndpoint(config, self.engine, self.specs, self.buffers, self.contract, self.client, self.aux,
                                 self.aux_schema)
        try:
            self.ep.start()
        except BaseException:
            self.close()
            raise

    def host_pools(self) -> dict[tuple[str, int], torch.Tensor]:
        torch.cuda.synchronize()
        return {key: buf.cpu() for key, buf in self.buffers.items()}

    def close(self) -> None:
        self.ep.close(timeout=3)
        self.engine.close()
        self.client.close()


def run_rooms(prefill: GpuPrefill, decode: GpuDecode, rooms: list[tuple[int, int]], seed: int, timeout: float = 60):
    """Drive ``rooms`` [(room, num_tokens)] end to end: decode receivers with scattered
    page ids, both CP ranks sending their owned pages in two chunks (the partial last
    page with the last one, the aux row from the owner of the last token)."""
    rng = np.random.default_rng(seed)
    staged = prefill.stage(rng, rooms)
    total_pages = sum(-(-n // PAGE) for _, n in rooms)
    dst = rng.choice(DECODE_PAGES, size=total_pages, replace=False)
    receivers, page_ids, at = {}, {}, 0
    for slot, (room, n) in enumerate(rooms):
        pages = dst[at: at + -(-n // PAGE)]
        at += pages.size
        page_ids[room] = pages
        receivers[room] = decode.ep.receiver(room, prefill.instance)
        receivers[room].init(pages, slot, n)
    senders = []
    for room, n in rooms:
        aux_owner = owner_of_last_token(n, PAGE, prefill.lanes)
        for rank, ep in enumerate(prefill.eps):
            s = ep.sender(room)
            s.init(n)
            owned, local = staged[(room, rank)]
            half = owned.size // 2
            s.send(owned[:half], local[:half], num_tokens_ready=n)  # every row is staged already
            s.send(owned[half:], local[half:], is_last=True,
                   aux=make_aux(prefill.aux_schema, room, n) if rank == aux_owner else None)
            senders.append(s)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(r.poll() not in FINAL for r in receivers.values()):
        time.sleep(0.005)
    while time.monotonic() < deadline and any(s.poll() not in FINAL for s in senders):
        time.sleep(0.005)
    return receivers, page_ids, senders


def check_rooms(decode: GpuDecode, rooms, receivers, page_ids) -> None:
    for room, _ in rooms:
        r = receivers[room]
        assert r.poll() == KVPoll.Success, f"room {room}: {r.failure_reason}"
    host = decode.host_pools()  # byte-for-byte, on the host
    errors = []
    for room, n in rooms:
        for (pool, layer), buf in host.items():
            v = verify_pages(decode.specs[pool], buf, room, layer, page_ids[room], n)
            if not v.ok:
                errors.append(v.first_error)
        err = verify_aux(decode.aux_schema, receivers[room].aux, room, n)
        if err:
            errors.append(err)
    assert errors == []
    touched = np.concatenate([page_ids[room] for room, _ in rooms])
    untouched = np.setdiff1d(np.arange(DECODE_PAGES), touched)
    for key, buf in host.items():
        assert bool((buf.view(torch.uint8)[untouched] == SENTINEL_BYTE).all()), f"stray write into {key}"


ENGINES = [pytest.param(("mooncake", "host"), id="mooncake-aux-host", marks=_MOONCAKE),
           pytest.param(("mooncake", "cuda"), id="mooncake-aux-cuda", marks=_MOONCAKE),
           pytest.param(("ipc", "host"), id="ipc-aux-host"), pytest.param(("ipc", "cuda"), id="ipc-aux-cuda"),
           pytest.param(("auto", "cuda"), id="auto-aux-cuda", marks=_MOONCAKE)]


@pytest.fixture(scope="module", params=ENGINES)
def prefill(request, daemon):
    engine, placement = request.param
    aux_device = "cpu" if placement == "host" else _prefill_device()
    p = GpuPrefill(daemon.url, f"gpu-prefill-{engine}-aux-{placement}", aux_device, engine)
    p.aux_placement = placement
    p.engine = engine
    p.room_base = (0 if placement == "host" else 10_000) + {"mooncake": 0, "ipc": 100_000, "auto": 200_000}[engine]
    try:
        yield p
    finally:
        p.close()


def _decode(prefill: GpuPrefill, daemon, name: str, **cfg) -> GpuDecode:
    return GpuDecode(daemon.url, f"gpu-decode-{name}-{prefill.engine}-{prefill.aux_placement}",
                     _decode_aux_device(prefill), prefill.engine, **cfg)


def _decode_aux_device(prefill: GpuPrefill) -> str:
    return "cpu" if prefill.aux_placement == "host" else _decode_device()


def test_rooms_land_byte_exact_in_gpu_pools(prefill, daemon):
    """CP=2, several rooms in flight together, partial last pages, scattered pages on
    both sides; decode pools on another GPU when there are two."""
    base = prefill.room_base + 1_000
    rooms = [(base + i, n) for i, n in enumerate(LENGTHS)]
    decode = _decode(prefill, daemon, "rooms")
    try:
        receivers, page_ids, senders = run_rooms(prefill, decode, rooms, seed=base)
        check_rooms(decode, rooms, receivers, page_ids)
        assert all(s.poll() == KVPoll.Success for s in senders), [s.failure_reason for s in senders]
        assert {str(t.device) for t in decode.buffers.values()} == {_decode_device()}
        if prefill.engine == "ipc":  # the pages went through the slice kernel
            stats = sum((e.stats for e in prefill.engines), __import__("collections").Counter())
            assert stats["kernel_launches"] > 0 and stats["kernel_slices"] > 0 and not stats["refused"], stats
    finally:
        decode.close()


def test_digest_check_on_gpu_pools(prefill, daemon):
    """DecodeConfig(verify_digest=True): both sides digest CUDA pages (only the pages
    concerned cross to the host) and agree; the digest of a CUDA pool equals that of
    its host copy."""
    base = prefill.room_base + 2_000
    rooms = [(base + i, n) for i, n in enumerate((5, 2 * PAGE + 17, 4 * PAGE))]
    decode = _decode(prefill, daemon, "digest", verify_digest=True)
    try:
        receivers, page_ids, _ = run_rooms(prefill, decode, rooms, seed=base)
        check_rooms(decode, rooms, receivers, page_ids)
        host = decode.host_pools()
        pools = sorted(decode.specs)
        for room, n in rooms:
            logical = np.arange(-(-n // PAGE))
            on_gpu = page_digests(decode.specs, decode.buffers, pools, logical, page_ids[room], n)
            on_host = page_digests(decode.specs, host, pools, logical, page_ids[room], n)
            assert np.array_equal(on_gpu, on_host)
    finally:
        decode.close()


def test_abort_while_a_copy_is_in_flight_waits_for_it(prefill, daemon):
    """Hard rule 6 on the GPU: copies held before launch (gate); decode aborts; its pages are not
    releasable, and the prefill room not final, until the held copies ran and completed."""
    if prefill.engine != "ipc":
        pytest.skip("holding writes is fault injection: the IPC engine's (the local engine's on the CPU)")
    gate = threading.Event()
    for engine in prefill.engines:
        engine.faults = Faults(gate=gate)
    decode = _decode(prefill, daemon, "abort")
    room, n = prefill.room_base + 3_000, 6 * PAGE + 9
    try:
        rng = np.random.default_rng(room)
        staged = prefill.stage(rng, [(room, n)])
        receiver = decode.ep.receiver(room, prefill.instance)
        receiver.init(rng.choice(DECODE_PAGES, size=-(-n // PAGE), replace=False), 0, n)
        senders = []
        for rank, ep in enumerate(prefill.eps):
            s = ep.sender(room)
            s.init(n)
            s.send(*staged[(room, rank)], is_last=True,
                   aux=make_aux(prefill.aux_schema, room, n) if rank == owner_of_last_token(n, PAGE, prefill.lanes)
                   else None)
            senders.append(s)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(s.poll() == KVPoll.Transferring for s in senders):
            time.sleep(0.005)
        receiver.abort("user cancelled")
        time.sleep(0.3)
        assert not receiver.pages_releasable, "pages releasable while copies were held"
        assert all(s.poll() == KVPoll.Transferring for s in senders)
        gate.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not receiver.pages_releasable:
            time.sleep(0.005)
        assert receiver.pages_releasable
        while time.monotonic() < deadline and any(s.poll() not in FINAL for s in senders):
            time.sleep(0.005)
        assert all(s.poll() == KVPoll.Failed and "user cancelled" in s.failure_reason for s in senders)
    finally:
        gate.set()
        for engine in prefill.engines:
            engine.faults = Faults()
        decode.close()


def test_a_corrupted_slice_is_caught_by_the_digest(prefill, daemon):
    """One byte of a landed batch flipped on the GPU (fault injection): the room commits without
    the digest check and fails with it."""
    if prefill.engine != "ipc":
        pytest.skip("fault injection is the IPC engine's (the local engine's on the CPU)")
    outcome = {}
    for checked in (False, True):
        decode = _decode(prefill, daemon, f"corrupt-{checked}", verify_digest=checked)
        room = prefill.room_base + 4_000 + int(checked)
        try:
            for engine in prefill.engines:  # the next batch each engine posts is corrupted
                engine.faults = Faults(corrupt_batches={engine.batches_posted})
            receivers, page_ids, _ = run_rooms(prefill, decode, [(room, 3 * PAGE + 5)], seed=room)
            outcome[checked] = receivers[room]
        finally:
            for engine in prefill.engines:
                engine.faults = Faults()
            decode.close()
    assert outcome[False].poll() == KVPoll.Success
    assert outcome[True].poll() == KVPoll.Failed and "digest mismatch" in outcome[True].failure_reason


# ---- the IPC engine across processes: CUDA IPC --------------------------------------------------
SLICE = 41_984  # one fp8 MLA page


def _pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_ipc_engine_writes_into_another_process_then_it_withdraws_then_dies(tmp_path):
    """Scattered pages plus unaligned slices from cuda:0 into a CUDA buffer of another process
    (decode's GPU); the peer's unregister waits for a held copy; afterwards writes fail; a dead
    peer fails writes."""
    num = 512
    nbytes = num * SLICE
    engine = create_engine("ipc")
    try:
        with peer_process(nbytes, "ipc", _decode_device(), tmp_path / "peer.err") as (child, info, ask):
            expected = _pattern(11, nbytes)
            perm = np.random.default_rng(12).permutation(num)
            src = torch.from_numpy(np.ascontiguousarray(expected.reshape(num, SLICE)[perm]).reshape(-1)).to("cuda:0")
            torch.cuda.synchronize()
            engine.register(*tensor_region(src))
            base = tensor_region(src)[0]
            offsets = np.arange(num, dtype=np.uint64) * SLICE
            # pages whole, except the last 8 split into an unaligned head and tail (byte path of the kernel)
            s_off, d_off, length = offsets[:-8], offsets[perm][:-8], np.full(num - 8, SLICE, np.uint64)
            cut = np.uint64(SLICE // 2 + 3)
            tail_s, tail_d = offsets[-8:], offsets[perm][-8:]
            s_off = np.concatenate([s_off, tail_s, tail_s + cut])
            d_off = np.concatenate([d_off, tail_d, tail_d + cut])
            length = np.concatenate([length, np.full(8, cut), np.full(8, np.uint64(SLICE) - cut)])
            engine.write(info["session"], base + s_off, info["addr"] + d_off, length, 30)
            assert ask("check 11") == "ok"
            assert engine.stats["kernel_launches"] >= 1 and engine.stats["kernel_slices"] == length.size

            gate = threading.Event()
            engine.faults = Faults(gate=gate)
            handle = engine.submit_write(info["session"], base + offsets[:4], info["addr"] + offsets[:4],
                                         np.full(4, SLICE, np.uint64))
            child.stdin.write("unregister\n")
            child.stdin.flush()
            time.sleep(0.3)
            assert engine.poll(handle).state is WriteState.PENDING
            gate.set()
            assert child.stdout.readline().strip() == "unregistered"
            assert engine.poll(handle).state is WriteState.DONE
            engine.faults = Faults()
            status = engine.poll(engine.submit_write(info["session"], base + offsets[:4], info["addr"] + offsets[:4],
                                                     np.full(4, SLICE, np.uint64)))
            assert status.state is WriteState.FAILED and "outside the memory registered" in status.reason

            child.kill()
            child.wait(10)
            status = engine.poll(engine.submit_write(info["session"], base + offsets[:1], [info["addr"]], [SLICE]))
            assert status.state is WriteState.FAILED and info["session"] in status.reason
    finally:
        engine.close()


def test_the_copy_waits_for_the_producers_event_on_the_gpu():
    """send(ready_event=) / submit_write(after=): the pages are written by work still queued on
    another stream (a long sleep, then the write); the copy must not read them before it ends."""
    nbytes = 64 * SLICE
    a, b = create_engine("ipc"), create_engine("ipc")
    try:
        src = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=_decode_device())
        torch.cuda.synchronize()
        a.register(*tensor_region(src))
        b.register(*tensor_region(dst))
        expected = torch.from_numpy(_pattern(21, nbytes)).to("cuda:0")
        producer = torch.cuda.Stream("cuda:0")
        with torch.cuda.stream(producer):
            torch.cuda._sleep(200_000_000)  # a long kernel: the writes below land long after submit_write
            src.copy_(expected)
            ready = torch.cuda.Event()
            ready.record(producer)
        offsets = np.arange(64, dtype=np.uint64) * SLICE
        handle = a.submit_write(b.session_id, tensor_region(src)[0] + offsets, tensor_region(dst)[0] + offsets[::-1],
                                np.full(64, SLICE, np.uint64), after=ready)
        assert not ready.query()  # submit_write returned while the producer still ran: the GPU waits, not the host
        a.wait(handle, 60)
        got = dst.view(64, SLICE).flip(0).reshape(-1).cpu()
        assert torch.equal(got, expected.cpu())
    finally:
        a.close()
        b.close()


@pytest.mark.mooncake
@pytest.mark.skipif(_HAVE_CUDA and not mooncake_available(), reason="Mooncake not installed")
def test_auto_engine_reaches_a_gpu_peer_in_another_process_over_ipc(tmp_path):
    num = 256
    nbytes = num * SLICE
    engine = create_engine("auto")
    try:
        with peer_process(nbytes, "auto", _decode_device(), tmp_path / "peer.err") as (_, info, ask):
            src = torch.from_numpy(_pattern(13, nbytes)).to("cuda:0")
            torch.cuda.synchronize()
            engine.register(*tensor_region(src))
            offsets = np.arange(num, dtype=np.uint64) * SLICE
            engine.write(info["session"], tensor_region(src)[0] + offsets, info["addr"] + offsets,
                         np.full(num, SLICE, np.uint64), 30)
            assert ask("check 13") == "ok"
            assert engine.route(info["session"]) == "ipc"
            assert engine.stats["slices_ipc"] == num and not engine.stats["slices_mooncake"]
            assert engine.stats["ipc_kernel_launches"] >= 1
    finally:
        engine.close()


# ---- staged rooms on GPU pages: test_staged_rooms.py's matrix, both sides' pools on the GPU ----------
# Prefill CP ranks are processes, decode this process, over Mooncake TCP (as the rooms above); staging
# "always" on decode, so every page goes through the slots: the slice kernel gathers and scatters,
# the aux rows (host memory) ride in the same chunks by plain copies. The local engine moves host
# memory only and is not in this matrix.
from test_staged_rooms import staged_prefill  # noqa: E402,F401 - the module's fixture, run with the GPU device
from test_staged_rooms import (  # noqa: E402
    test_abort_mid_chunk_over_mooncake as test_staged_abort_mid_chunk,
    test_heterogeneous_tp_through_staging as test_staged_heterogeneous_tp,
    test_prefill_death_mid_chunk_frees_pages_at_once_slots_after_the_quarantine as test_staged_prefill_death,
    test_random_pages_every_pool_through_staging as test_staged_random_pages_every_pool,
    test_raw_buffer_rooms_under_auto_stage_what_the_thresholds_say as test_staged_raw_buffer_rooms_under_auto,
    test_slots_granted_with_the_request_between_processes as test_staged_slots_granted_with_the_request,
    test_staging_full_under_many_concurrent_rooms_none_fails as test_staged_many_rooms_few_slots,
)


@pytest.fixture(scope="module", params=[pytest.param(_prefill_device(), id="staged-gpu")])
def device(request) -> str:
    """The staged tests' pools: on the GPU (test_staged_rooms.py's fixture of the same name: the host).
    Each test's engine parameter skips it where that engine is missing (a device call may carry
    NIXL's wheel without Mooncake's); with neither, nothing here can run."""
    if not (mooncake_available() or nixl_available()):
        pytest.skip("neither Mooncake nor NIXL installed")
    return request.param


def test_aux_staging_on_the_device_copies_each_row_after_its_producer_on_its_side_stream():
    """``AuxStaging`` on a GPU: the row goes through its pinned host row and one copy on the side
    stream (the runtime's C calls, no torch stream context), after the producer's event, queued
    when the room's event is first waited on; a room staged twice keeps its slot; a freed slot is
    reused only after its last copy (its event) passed; a row nobody waits on is never copied."""
    from kvbridge.transfer.aux_rows import AuxStaging

    contract = build_contract("deepseek-v3.2-fp8", 2, 64, 1, "interleaved")
    schema = aux_schema_of(contract)
    staging = AuxStaging(schema, 2, rank="t", device="cuda:0")
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # the producer is still busy when the row is staged
        done = torch.cuda.Event()
        done.record(producer)
    rows = [np.full(schema.row_bytes, 7 + i, np.uint8) for i in range(3)]
    a = staging.stage(11, rows[0], after=done)
    assert staging.stage(11, rows[1]) == a  # once per room
    b = staging.stage(12, rows[1])
    staging.ready_event(11).synchronize()
    staging.ready_event(12).synchronize()
    assert done.query()  # the first copy waited for the producer's event
    assert bytes(staging.storage[a].cpu().numpy()) == rows[0].tobytes()
    assert bytes(staging.storage[b].cpu().numpy()) == rows[1].tobytes()
    staging.release(11)
    c = staging.stage(13, rows[2])
    assert c == a
    staging.ready_event(13).synchronize()
    assert bytes(staging.storage[c].cpu().numpy()) == rows[2].tobytes()
    staging.release(12)  # a room no write asks the row of (its decode ranks took it inline): never copied
    assert staging.stage(14, rows[0]) == b and not staging.ready_event(14).queued
    torch.cuda.synchronize()
    assert bytes(staging.storage[b].cpu().numpy()) == rows[1].tobytes()


def test_a_row_written_into_device_rows_is_there_when_the_write_returns():
    """A decode rank with packed aux rows on the GPU takes the row inline (``aux_inline``) and
    writes it itself at the commit: through its pinned row, the copy waited for, so the engine
    reads the row once the room is Success; the other rows are untouched; a read gives it back."""
    from kvbridge.transfer.aux_rows import AuxBuffers

    contract = build_contract("deepseek-v3.2-fp8", 2, 64, 1, "interleaved")
    schema = aux_schema_of(contract)
    rows = torch.zeros((4, schema.row_bytes), dtype=torch.uint8, device="cuda:0")
    aux = AuxBuffers(schema, rows, rank="t")
    assert aux.writable and aux.on_device  # (its decode rank asks for the row ahead: aux_ahead)
    row = np.arange(schema.row_bytes, dtype=np.uint8)
    aux.write_row(2, row)
    assert bytes(rows[2].cpu().numpy()) == row.tobytes() and not rows[[0, 1, 3]].any()
    assert aux.read_row(2).tobytes() == row.tobytes()


def test_a_row_written_without_waiting_is_there_once_its_write_says_done_and_later_writes_land_after():
    """``write_row_async`` (decode's write of a row ahead of the room's last pages): the copy is
    queued from a pinned ring row and its event polled; once ``done()`` the row reads back. Two
    writes of the same row, the second before the first is polled, leave the second (one stream:
    in order); three rounds of the ring leave every row as its last write said; a bad slot is
    refused by name before anything is queued."""
    from kvbridge.errors import KVBridgeError
    from kvbridge.transfer.aux_rows import RING_ROWS, AuxBuffers

    contract = build_contract("deepseek-v3.2-fp8", 2, 64, 1, "interleaved")
    schema = aux_schema_of(contract)
    rows = torch.zeros((4, schema.row_bytes), dtype=torch.uint8, device="cuda:0")
    aux = AuxBuffers(schema, rows, rank="t")
    first = np.full(schema.row_bytes, 7, dtype=np.uint8)
    second = np.arange(schema.row_bytes, dtype=np.uint8)
    w1 = aux.write_row_async(1, first)
    w2 = aux.write_row_async(1, second)
    w3 = aux.write_row_async(3, first)
    for w in (w1, w2, w3):
        for _ in range(100_000):  # (bounded: a copy of one row takes microseconds)
            if w.done():
                break
        assert w.done()
    assert bytes(rows[1].cpu().numpy()) == second.tobytes() and bytes(rows[3].cpu().numpy()) == first.tobytes()
    assert not rows[[0, 2]].any() and aux.read_row(1).tobytes() == second.tobytes()
    for k in range(3 * RING_ROWS):  # round the ring three times: no ring row refilled before its copy ran
        aux.write_row_async(k % 4, np.full(schema.row_bytes, k % 251, dtype=np.uint8))
    last = aux.write_row_async(0, second)
    for _ in range(100_000):
        if last.done():
            break
    assert last.done() and aux.read_row(0).tobytes() == second.tobytes()
    assert [int(rows[s, 0]) for s in (1, 2, 3)] == [(3 * RING_ROWS - 4 + s) % 251 for s in (1, 2, 3)]
    with pytest.raises(KVBridgeError, match="aux slot 4 outside"):
        aux.write_row_async(4, first)
