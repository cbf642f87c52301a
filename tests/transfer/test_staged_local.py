"""Staged transfers between real endpoints in one process over the local engine (fault
injection), against a real bootstrap daemon: random pages on both sides, rooms larger than
the staging area, back-pressure, aborts mid-chunk, a corrupted chunk. The same over Mooncake
TCP between processes is in test_staged_rooms.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _cluster import wait_final, wait_until
from _local import PAGE, ProvingPeers, RecordingCopier, replies, rogue_request
from kvbridge.transfer.channel import wire
from kvbridge.transfer.staging.area import SlotState
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, fill_pages, make_aux

SLOT = 4096  # a few pages per chunk: every room here streams through several slots
STAGED = dict(staging="always", staging_bytes=4 * SLOT, staging_slot_bytes=SLOT)
GATHER = dict(staging="always", staging_bytes=2 * SLOT, staging_slot_bytes=SLOT)


def staged_cluster(cluster, **kw):
    kw.setdefault("cp", 2)
    return cluster(prefill_cfg=kw.pop("prefill_cfg", GATHER), **{**STAGED, **kw})


def send_random(c, room: int, n: int, rng: np.random.Generator, local_pages: dict | None = None):
    """Every CP rank sends its owned pages of ``room`` from random local pages."""
    num_pages = -(-n // PAGE)
    senders = []
    for rank, ep in enumerate(c.prefill):
        owned = c.lanes.owned_pages(rank, num_pages)
        local = rng.permutation(np.arange(10, 64))[: owned.size] if local_pages is None else local_pages[rank]
        for (pool, layer), buf in ep.buffers.tensors.items():
            fill_pages(c.specs[pool], buf, room, layer, owned, local, n)
        s = ep.sender(room)
        s.init(n)
        owns_last = c.lanes.owner_of_token(n - 1, PAGE, num_pages) == rank
        s.send(owned, local, is_last=True, aux=make_aux(c.aux_schema, room, n) if owns_last else None)
        senders.append(s)
    return senders


def land_room(c, room: int, n: int, seed: int):
    """Room ``room`` of ``n`` tokens from random local pages of every CP rank into random decode
    pages, waited for: it succeeded and landed byte for byte; returns its senders."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(64)[: -(-n // PAGE)]
    r = c.decode.receiver(room, f"{c.name}-p")
    r.init(pages, 1, n)
    senders = send_random(c, room, n, rng)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success, r.failure_reason
    assert c.verified(room, n, pages)
    return senders


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("n", [37, 64])  # 37: a partial last page (index-K as its value and scale ranges)
def test_random_pages_both_sides_through_staging(cluster, cp, n):
    c = staged_cluster(cluster, cp=cp)
    rng = np.random.default_rng(n + cp)
    pages = rng.permutation(64)[: -(-n // PAGE)]
    r = c.decode.receiver(1, f"{c.name}-p")
    r.init(pages, 2, n)
    senders = send_random(c, 1, n, rng)
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Success, r.failure_reason
    assert c.verified(1, n, pages)
    stats = [s.stats for s in senders]
    assert all(set(st["paths"].values()) <= {"staged"} for st in stats)
    assert sum(st["chunks"] for st in stats) > 4 * cp, "the room is larger than the staging area: it streamed"
    assert sum(st["bytes_staged"] for st in stats) == sum(st["bytes"] for st in stats)  # the aux row rode staged too
    area = c.decode.staging.area
    assert area.num_free == area.num_slots, "every slot is free after the room"


def land_many(c, rooms: range, n: int, seed: int) -> None:
    """Every room of ``rooms`` (at most five of ``n`` <= 48 tokens) opened on decode, then sent by both
    CP ranks at once, waited for: each succeeded and landed byte for byte."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(64)
    receivers, senders = [], []
    for i, room in enumerate(rooms):
        r = c.decode.receiver(room, f"{c.name}-p")
        r.init(free[i * 12:(i + 1) * 12], i, n)
        receivers.append((r, free[i * 12:(i + 1) * 12]))
    for i, room in enumerate(rooms):
        local = np.arange(10, 16) + i * 8  # each room its own (scattered) local pages on both CP ranks
        senders += send_random(c, room, n, rng, local_pages={0: local, 1: local})
    wait_final([r for r, _ in receivers] + senders)
    assert all(r.poll() == KVPoll.Success for r, _ in receivers), [r.failure_reason for r, _ in receivers]
    assert all(c.verified(room, n, pages) for room, (_, pages) in zip(rooms, receivers))


def test_staging_full_under_many_rooms_none_fails(cluster):
    """Back-pressure: more chunks than slots at once wait their turn (FIFO); none fails, nothing grows."""
    c = staged_cluster(cluster, staging_bytes=2 * SLOT)  # 2 decode slots, 2 CP ranks x 2 gather slots asking
    land_many(c, range(100, 105), 48, 5)
    area = c.decode.staging.area
    assert area.counters["waits"] > 0 and area.counters["max_waiting"] > 0, "staging was never full"
    assert area.num_free == area.num_slots == 2
    assert c.decode.machine.staging.counters["slot_waits"] > 0


def test_abort_mid_chunk_frees_pages_at_once_and_quarantines_the_slot(cluster):
    """Hard rule 6 for staging: remote writes land only in slots, so an aborted room's pages are free
    at once; the slot a write may still land in stays QUARANTINED until prefill acks the abort."""
    c = staged_cluster(cluster, cp=1)
    gate = threading.Event()
    c.prefill[0].engine.faults.gate = gate  # every write is held in flight until the gate opens
    n, pages = 40, np.arange(20, 30)
    r = c.decode.receiver(3, f"{c.name}-p")
    r.init(pages, 0, n)
    senders = send_random(c, 3, n, np.random.default_rng(3))
    area = c.decode.staging.area
    assert wait_until(lambda: c.decode.locked(lambda: area.num_free) < area.num_slots, 10), "no slot granted"
    r.abort("user cancelled")
    assert r.poll() == KVPoll.Failed
    assert r.pages_releasable, "a staged-only room's pages are free at once"
    held = c.decode.locked(lambda: [area.state(i) for i in range(area.num_slots)])
    assert SlotState.QUARANTINED in held
    for (pool, layer), buf in c.dbufs.items():  # nothing landed in the pages
        view = as_bytes(buf).reshape(64, -1)
        assert (view[pages] == SENTINEL_BYTE).all()
    gate.set()
    wait_final(senders)
    assert senders[0].poll() == KVPoll.Failed
    assert wait_until(lambda: c.decode.locked(lambda: area.num_free) == area.num_slots, 10), \
        "the quarantined slot is free once prefill acknowledged the abort"
    for (pool, layer), buf in c.dbufs.items():
        assert (as_bytes(buf).reshape(64, -1)[pages] == SENTINEL_BYTE).all(), "a late write reached the pages"


def test_corrupted_chunk_is_caught_by_the_digest_check(cluster):
    c = staged_cluster(cluster, cp=1, verify_digest=True)
    ep = c.decode
    real = ep._scatter

    def corrupt_then_scatter(a):  # a byte flipped in the slot after it landed (a bad link, bad memory)
        import ctypes
        addr = int(a.src[0])
        ctypes.memset(addr, ctypes.c_uint8.from_address(addr).value ^ 0xFF, 1)
        real(a)
    ep._scatter = corrupt_then_scatter
    n, pages = 24, np.arange(30, 36)
    r = ep.receiver(4, f"{c.name}-p")
    r.init(pages, 1, n)
    senders = send_random(c, 4, n, np.random.default_rng(4))
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Failed and "digest mismatch" in r.failure_reason


def test_a_failed_chunk_write_fails_the_room_and_frees_its_slots(cluster):
    c = staged_cluster(cluster, cp=1)
    c.prefill[0].engine.faults.fail_batches = {1}
    n, pages = 40, np.arange(0, 10)
    r = c.decode.receiver(5, f"{c.name}-p")
    r.init(pages, 0, n)
    senders = send_random(c, 5, n, np.random.default_rng(5))
    wait_final([r, *senders])
    assert r.poll() == KVPoll.Failed and "injected failure" in r.failure_reason
    area = c.decode.staging.area
    assert wait_until(lambda: c.decode.locked(lambda: area.num_free) == area.num_slots, 10)


def test_the_staging_area_is_registered_and_a_request_naming_another_is_refused(cluster):
    """Hard rule 5 for staging, through the real endpoints: the decode rank's staging area is in
    its registration at the daemon, and a request (authenticated, on a connection that proved its
    registration) offering another area, here the decode rank's own page buffer, is refused by
    the room's decider (cp 0) naming the field, and so granted no RoomTicket: the other CP rank,
    which held the claim for the room's decision (transfer/prefill/tickets.py), fails the room when
    its hold runs out; not a byte lands anywhere on decode."""
    import msgspec

    c = staged_cluster(cluster, cp=2)
    registered = c.clients[0].rank(c.decode.rank_id).staging
    assert registered == c.decode.staging.descriptor and registered.num_slots == 4
    pages_base = min(d.base for d in c.decode.buffers.descs)
    n = 8
    request = msgspec.structs.replace(rogue_request(c, 95, n, rank_id=c.decode.rank_id), staging_slots=4,
                                      staging_slot_bytes=SLOT, staging_base=pages_base, staging_only=True)
    peers = ProvingPeers(c.decode)  # the decode rank's own registration: it proves it holds the memory
    try:
        senders = []
        for ep in c.prefill:
            s = ep.sender(95)
            s.init(n)
            senders.append(s)
            peers.send(ep.endpoint, request)
        got = replies(peers, len(c.prefill))
    finally:
        peers.close()
    failed = [m for m in got if isinstance(m, wire.PagesDone)]
    assert len(failed) == len(c.prefill), got
    assert all(m.status == "failed" for m in failed), failed
    decider = [m for m in failed if "field=staging_base" in m.reason]
    assert len(decider) == 1 and "registered" in decider[0].reason and "room=95" in decider[0].reason, failed
    assert all("room 95" in m.reason for m in failed if m is not decider[0]), failed  # its hold ran out
    assert all(s.poll() == KVPoll.Failed for s in senders)
    assert not any(ep.counters["bytes"] for ep in c.prefill)
    assert all((as_bytes(b) == SENTINEL_BYTE).all() for b in c.dbufs.values())  # nothing landed


def test_a_slot_grant_outside_the_registered_area_writes_nothing(cluster):
    """A request offering exactly the registered area passes; a SlotGrant for a slot past it fails
    the target by name (room, decode rank, field), and no chunk is written anywhere."""
    import msgspec

    c = staged_cluster(cluster, cp=1)
    area = c.decode.staging.descriptor
    n = 8
    request = msgspec.structs.replace(rogue_request(c, 96, n, rank_id=c.decode.rank_id), staging_slots=area.num_slots,
                                      staging_slot_bytes=area.slot_bytes, staging_base=area.base, staging_only=True)
    peers = ProvingPeers(c.decode)
    ep = c.prefill[0]
    try:
        s = ep.sender(96)
        s.init(n)
        peers.send(ep.endpoint, request)
        s.send(np.arange(2), np.arange(2) + 10, is_last=True, aux=make_aux(c.aux_schema, 96, n))
        ask = next(m for m in replies(peers, 1) if isinstance(m, wire.SlotRequest))
        peers.send(ep.endpoint, wire.SlotGrant(room=96, decode_rank=request.decode_rank, chunk=ask.chunk,
                                               slot=area.num_slots))  # one past the registered area
        got = replies(peers, 2)
    finally:
        peers.close()
    landed = [m for m in got if isinstance(m, wire.ChunkLanded)]
    assert landed and all(m.status == "failed" for m in landed), got
    wait_final([s])
    assert s.poll() == KVPoll.Failed and "outside its 4 staging slots (registered area" in s.failure_reason
    assert "field=slot" in s.failure_reason and "room=96" in s.failure_reason
    assert ep.counters["bytes"] == 0
    assert all((as_bytes(b) == SENTINEL_BYTE).all() for b in c.dbufs.values())


def test_cuda_stager_sends_slices_outside_device_memory_to_plain_copies():
    """The slice kernel touches only device memory it was told of (pages, slots): an aux row in
    host memory goes by one plain copy on the same stream, the rest in one launch (a recording
    copier stands in for the GPU)."""
    from kvbridge.transfer.staging.stagers import AddressRanges, CudaStager

    pages, slot, host = (1 << 20, 4096), (1 << 24, 8192), 1 << 30  # device regions; an address outside them
    ranges = AddressRanges([slot, pages])
    assert ranges.hold(np.array([1 << 20, (1 << 20) + 4000, 1 << 24, host], np.uint64),
                       np.array([4096, 200, 8192, 8], np.uint64)).tolist() == [True, False, True, False]
    rec = RecordingCopier()
    stager = CudaStager(copier=rec, device_ranges=[pages, slot])
    src = np.array([1 << 20, (1 << 20) + 1024, host], np.uint64)  # two page slices, the aux row
    dst = np.array([1 << 24, (1 << 24) + 1024, (1 << 24) + 2048], np.uint64)
    stager.copy(src, dst, np.array([1024, 1024, 64], np.uint64))
    assert rec.launches == [([1 << 20, (1 << 20) + 1024], [1 << 24, (1 << 24) + 1024], [1024, 1024])]
    assert rec.copies == [(host, (1 << 24) + 2048, 64)]
    rec.launches.clear()
    stager.copy(src[2:], dst[2:], np.array([64], np.uint64))  # nothing for the kernel: no launch
    assert rec.launches == []


def test_a_gather_looks_up_only_the_sources_its_plan_did_not_prove():
    """Prefill's gather: the page slices the planner checked inside the page buffers go to the
    kernel unasked; only the aux row is looked up, and in host memory it goes by a plain copy.
    A plan that proves nothing is looked up whole, to the same copies."""
    from kvbridge.layout import TransferPlan, stage_plan
    from kvbridge.transfer.staging.stagers import CudaStager

    pages, slot, host = (1 << 20, 1 << 16), (1 << 24, 1 << 16), 1 << 30
    src = np.array([1 << 20, (1 << 20) + 8192, host], np.uint64)  # two pages, the aux row
    plan = TransferPlan(src, np.array([0, 4096, 8192]), np.array([1024, 1024, 64]), np.array([True, True, False]))
    results = []
    for p in (plan, TransferPlan(plan.src, plan.dst, plan.length)):
        rec = RecordingCopier()
        stager = CudaStager(copier=rec, device_ranges=[pages, slot])
        asked = []
        hold = stager.ranges.hold
        stager.ranges.hold = lambda addr, length: (asked.append(addr.tolist()), hold(addr, length))[1]
        stager.gather(stage_plan(p, 1 << 16), 0, slot[0])
        results.append((rec.launches, rec.copies, asked))
    (launches, copies, asked), (launches_all, copies_all, asked_all) = results
    assert launches == launches_all == [([1 << 20, (1 << 20) + 8192], [1 << 24, (1 << 24) + 1024], [1024, 1024])]
    assert copies == copies_all == [(host, (1 << 24) + 2048, 64)]
    assert asked == [[host], [(1 << 24) + 2048]]  # the row's source and its slot offset only
    assert asked_all == [src.tolist(), [1 << 24, (1 << 24) + 1024, (1 << 24) + 2048]]


def test_a_slice_running_from_one_pool_tensor_into_the_next_goes_to_the_kernel():
    """Contiguous pages merge into runs, and a run may cross from one pool's tensor into the next
    one, adjacent in memory: the kernel copies it (a plain copy across two allocations is refused
    by the driver, 'invalid argument', which failed contiguous staged rooms on one H200)."""
    from kvbridge.transfer.staging.stagers import AddressRanges

    a, b, slot = (1 << 20, 4096), ((1 << 20) + 4096, 4096), (1 << 24, 8192)  # a and b adjacent
    ranges = AddressRanges([a, b, slot])
    held = ranges.hold(np.array([(1 << 20) + 2048, (1 << 20) + 6000, 1 << 30, (1 << 24) + 8000], np.uint64),
                       np.array([4096, 4000, 8, 400], np.uint64))
    assert held.tolist() == [True, False, False, False]  # across a|b; past b's end; host; past the slot


def test_the_one_region_shortcut_answers_as_the_per_slice_look_up():
    """``hold`` answers all True at once when every slice lies in one region (a slot's side of a scatter
    list); every other list goes slice by slice. Random lists, inside one region, across regions, at
    and past the edges: the answer equals the per-slice look-up's, entry for entry."""
    from kvbridge.transfer.staging.stagers import AddressRanges

    rng = np.random.default_rng(7)
    regions = [(1 << 20, 1 << 16), ((1 << 20) + (1 << 16), 1 << 12), (1 << 24, 1 << 16), (1 << 28, 4096)]
    ranges = AddressRanges(regions)
    shortcuts = 0
    for trial in range(400):
        base, size = regions[trial % len(regions)] if trial % 3 else regions[rng.integers(len(regions))]
        n = int(rng.integers(1, 40))
        spread = size + 256 if trial % 5 == 0 else size  # some lists run past the region's end
        addr = (base + rng.integers(0, spread, n)).astype(np.uint64)
        length = rng.integers(0, 512, n).astype(np.uint64)  # 0 included: a slice of one byte's check
        if trial % 7 == 0:  # a list over every region and beyond
            addr = rng.integers(1 << 20, (1 << 28) + 8192, n).astype(np.uint64)
        last = addr + np.maximum(length, 1) - 1
        want = ranges._inside(addr) & ranges._inside(last)
        shortcuts += bool(want.all() and ranges._one_region(int(addr.min()), int(last.max())))
        assert ranges.hold(addr, length).tolist() == want.tolist(), (trial, addr, length)
    assert shortcuts > 50  # the shortcut was taken, not only the per-slice path
    assert ranges.hold(np.zeros(0, np.uint64), np.zeros(0, np.uint64)).tolist() == []


def test_decode_set_staging_switches_what_rooms_offer(cluster):
    """DecodeEndpoint.set_staging (the bench compares the paths on one set of ranks): "never" offers
    no area (the room goes direct though prefill stages always), "always" makes the next room staged
    only; a bad mode is a named error."""
    from kvbridge.errors import ConfigError

    c = staged_cluster(cluster, cp=1)
    rng = np.random.default_rng(3)
    paths = {}
    for room, mode in ((11, "never"), (12, "always")):
        c.decode.set_staging(mode)
        pages = rng.permutation(64)[:3]
        r = c.decode.receiver(room, f"{c.name}-p")
        r.init(pages, room % 4, 3 * PAGE)
        senders = send_random(c, room, 3 * PAGE, rng)
        wait_final([r, *senders])
        assert r.poll() == KVPoll.Success, r.failure_reason
        assert c.verified(room, 3 * PAGE, pages)
        paths[mode] = set(senders[0].stats["paths"].values())
    assert paths == {"never": {"direct"}, "always": {"staged"}}
    with pytest.raises(ConfigError, match="staging"):
        c.decode.set_staging("sometimes")


def test_a_staging_buffer_goes_where_the_pages_are():
    """Pages given as RawBuffer addresses stage on the device they name (host here; a GPU's on
    that GPU); pages on several devices or on another accelerator go direct, named in the log;
    sizes left 0 take the role's default for the device."""
    from kvbridge import RawBuffer
    from kvbridge.transfer.staging.buffer import StagingBuffer

    host = np.zeros(4096, dtype=np.uint8)
    raw = RawBuffer(int(host.ctypes.data), host.nbytes, "cpu")
    buf = StagingBuffer.for_buffers({("target", 0): raw}, "auto", 0, 0, rank="r", role="prefill")
    assert buf is not None and not buf.on_gpu and (buf.nbytes, buf.area.slot_bytes) == (16 << 20, 8 << 20)
    assert StagingBuffer.for_buffers({("target", 0): raw}, "never", 0, 0, rank="r", role="prefill") is None
    npu = RawBuffer(int(host.ctypes.data), host.nbytes, "npu:0")
    assert StagingBuffer.for_buffers({("target", 0): npu}, "always", 0, 0, rank="r", role="decode") is None
    gpu = RawBuffer(1 << 40, 4096, "cuda:0")  # never touched: refused before any allocation
    assert StagingBuffer.for_buffers({("target", 0): raw, ("target", 1): gpu}, "always", 0, 0, rank="r",
                                     role="decode") is None


def test_no_room_for_a_gpu_staging_buffer_goes_direct_under_auto_and_is_named_under_always(monkeypatch):
    """An engine's pools may leave no GPU memory for the staging buffer (its allocation raises
    torch's out-of-memory error, a RuntimeError; simulated here): "auto" writes direct and says
    so, "always" refuses the endpoint naming the bytes and the device."""
    from kvbridge import RawBuffer
    from kvbridge.errors import ConfigError
    from kvbridge.transfer.staging.buffer import StagingBuffer

    def no_memory(self, nbytes, slot_bytes, *, rank, device=None, device_pages=(), reserved=0):
        raise RuntimeError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")

    monkeypatch.setattr(StagingBuffer, "__init__", no_memory)
    pages = {("target", 0): RawBuffer(1 << 40, 4096, "cuda:0")}
    assert StagingBuffer.for_buffers(pages, "auto", 0, 0, rank="r", role="decode") is None
    with pytest.raises(ConfigError) as err:
        StagingBuffer.for_buffers(pages, "always", 0, 0, rank="r", role="decode")
    assert "1073741824 bytes of cuda:0" in str(err.value) and err.value.field == "staging_bytes"


@pytest.mark.parametrize("cp", [1, 2])
def test_a_room_planned_group_by_group_lands_byte_exact(cluster, monkeypatch, cp):
    """Real endpoints, a staged chunk of many slot-sized groups (the groups' floor lowered so that
    this geometry's rooms split): each group planned on its own loop turn, its own write and
    report; the room lands byte for byte, the partial last page and the aux row included."""
    import kvbridge.transfer.prefill.staged as staged

    monkeypatch.setattr(staged, "GROUP_MIN_SLICES", 5)
    c = staged_cluster(cluster, cp=cp)
    senders = land_room(c, 5, 61, 61 + cp)  # 16 pages, the last partial
    assert all(set(s.stats["paths"].values()) == {"staged"} for s in senders)
    assert sum(ep.machine.counters["rooms_ok"] for ep in c.prefill) == cp
    assert sum(ep.machine.stage.counters["staged_writes"] for ep in c.prefill) >= 16 // 2, "it went in groups"


@pytest.mark.parametrize("cp", [1, 2])  # CP 1: every chunk beyond the gather slots asks ahead (its grant may come first)
def test_a_chunks_slot_request_goes_before_its_gather_and_the_gather_before_its_post(cluster, cp):
    """Real endpoints, a room streaming through both areas: each prefill rank sends a chunk's
    SlotRequest before it gathers that chunk (the grant's round trip runs while it gathers), and
    gathers each chunk before it posts the chunk's write (at CP 1 grants come ahead of the gather
    slot, and the chunk is gathered and written in one feed). The room lands byte for byte."""
    c = staged_cluster(cluster, cp=cp)
    seen: list[tuple[int, str]] = []  # (rank, what), in the order it happened on any thread
    for rank, ep in enumerate(c.prefill):
        stager, reply, submit = ep.gather.stager, ep._reply, ep.engine.submit_write
        lo, hi = ep.gather.base, ep.gather.base + ep.gather.nbytes

        def gather(staged, chunk, addr, _rank=rank, _gather=stager.gather):
            seen.append((_rank, "gather"))
            return _gather(staged, chunk, addr)

        def sent(ident, msg, _rank=rank, _reply=reply):
            if type(msg) is wire.SlotRequest:
                seen.append((_rank, "ask"))
            _reply(ident, msg)

        def post(session, src, dst, length, *, after=None, _rank=rank, _submit=submit, _lo=lo, _hi=hi):
            if len(src) and _lo <= int(np.min(src)) < _hi:  # a staged chunk's write: from a gather slot
                seen.append((_rank, "post"))
            return _submit(session, src, dst, length, after=after)

        stager.gather, ep._reply, ep.engine.submit_write = gather, sent, post
    senders = land_room(c, 9, 64, 7 + cp)
    for rank, s in enumerate(senders):
        order = [what for who, what in seen if who == rank]
        at = {what: [i for i, w in enumerate(order) if w == what] for what in ("ask", "gather", "post")}
        assert len(at["ask"]) == len(at["gather"]) == len(at["post"]) == s.stats["chunks"] > 2, order
        assert all(a < g < p for a, g, p in zip(at["ask"], at["gather"], at["post"])), order
    if cp == 1:
        assert c.prefill[0].machine.stage.counters["grants_ahead_used"] > 0, "no grant came ahead of its gather slot"
