"""Staged transfers over real Mooncake (TCP) between real processes: prefill CP ranks are child
processes whose pages are scattered at random; the decode rank (this process) takes every page
through its staging area (``staging="always"``) into random pages, poisoned first. Every byte of
every pool and the aux row is checked, and no byte outside the room's pages changes.

The pools' place is the ``device`` fixture: host memory here; ``tests/transfer/test_gpu.py`` runs
these same tests with GPU pools on both sides (the gather and scatter by the slice kernel, the
aux rows in host memory by plain copies).

    prefill proc (gather buffer, 2 slots) --SlotRequest/ChunkLanded--> decode (staging area, slots)
                                          ==== wire pieces ====>       slot --scatter--> pages
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final, wait_until
from _timing import scaled
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.staging.area import SlotState
from kvbridge.transfer.poll import KVPoll
from kvbridge.worker.synthetic import as_bytes

from _engines import ENGINES, needs_mooncake, needs_nixl

mooncake_only = pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")

SLOT = 16 << 10  # a few pages per chunk: rooms stream through many slots
PREFILL_STAGED = ("--staging", "always", "--staging-bytes", str(2 * SLOT), "--staging-slot-bytes", str(SLOT),
                  "--random-local", "7")
DECODE_STAGED = dict(staging="always", staging_bytes=4 * SLOT, staging_slot_bytes=SLOT)
LENGTHS = (1, 9, 22, 150)  # a lone partial page, partial last pages, a room of ~20 chunks


@pytest.fixture(scope="module")
def device() -> str:
    """Where both sides' pools live (test_gpu.py overrides it with a GPU)."""
    return "cpu"


def room_base(device: str) -> int:
    """Room ids of one device's run, apart from the other's (one daemon may serve both)."""
    return 0 if device == "cpu" else 1_000_000


def start(daemon, instance: str, cp: int, *extra: str, device: str = "cpu", **kw) -> list[PrefillProc]:
    procs = []
    try:
        for rank in range(cp):
            procs.append(PrefillProc(daemon.url, rank, cp, *PREFILL_STAGED, *extra, instance=instance,
                                     device=device, **kw))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


@pytest.fixture(scope="module", params=[pytest.param((1, "mooncake"), id="cp1", marks=needs_mooncake),
                                        pytest.param((2, "mooncake"), id="cp2", marks=needs_mooncake),
                                        pytest.param((1, "nixl"), id="nixl-cp1", marks=needs_nixl),
                                        pytest.param((2, "nixl"), id="nixl-cp2", marks=needs_nixl)])
def staged_prefill(request, daemon, device):
    cp, engine = request.param
    instance = f"staged-p-{engine}-cp{cp}-{device}"
    procs = start(daemon, instance, cp, device=device, engine=engine)
    yield procs, instance
    for p in procs:
        p.stop()


def test_random_pages_every_pool_through_staging(staged_prefill, daemon, device):
    procs, instance = staged_prefill
    d = DecodeRank(daemon.url, instance=f"staged-d-{procs[0].engine}-{len(procs)}-{device}", pages=128, device=device,
                   engine=procs[0].engine, **DECODE_STAGED)
    try:
        rng = np.random.default_rng(len(procs))
        table = rng.permutation(d.pages)
        used, receivers = 0, []
        for i, n in enumerate(LENGTHS):
            room = room_base(device) + 90_000 + 100 * len(procs) + i
            m = -(-n // 4)
            receivers.append(d.receive(room, n, table[used: used + m], prefill=instance))
            used += m
            for p in procs:
                p.send(room, n, chunks=sorted({max(1, n // 2), n}))
        wait_final(receivers)
        for r in receivers:
            assert r.poll() == KVPoll.Success, r.failure_reason
            assert d.verify(r) == []
        assert d.untouched_except(table[:used])
        results = [p.result(r.room) for r in receivers for p in procs]
        assert all(res["state"] == "Success" for res in results), results
        assert all(set(res["paths"].values()) <= {"staged"} for res in results)
        assert sum(res["chunks"] for res in results) > 4 * len(LENGTHS), "rooms larger than the area streamed"
        area = d.ep.staging.area
        assert area.num_free == area.num_slots
    finally:
        d.close()


@pytest.mark.mooncake
@mooncake_only
def test_staging_full_under_many_concurrent_rooms_none_fails(daemon, device):
    """Two decode slots, two CP ranks asking for two each, eight rooms at once: rooms wait for
    slots (back-pressure, counted), none fails, the area never grows."""
    procs = start(daemon, f"staged-burst-p-{device}", 2, device=device)
    d = DecodeRank(daemon.url, instance=f"staged-burst-d-{device}", pages=256, staging="always",
                   staging_bytes=2 * SLOT, staging_slot_bytes=SLOT, device=device)
    try:
        n, rooms = 40, list(range(room_base(device) + 91_000, room_base(device) + 91_008))
        receivers = [d.receive(room, n, np.arange(10) + 10 * i + 20, prefill=f"staged-burst-p-{device}")
                     for i, room in enumerate(rooms)]
        for p in procs:
            p.command(op="burst", rooms=rooms, num_tokens=n)
        wait_final(receivers)
        assert all(r.poll() == KVPoll.Success for r in receivers), [r.failure_reason for r in receivers]
        assert all(d.verify(r) == [] for r in receivers)
        area = d.ep.staging.area
        assert area.counters["waits"] > 0, "staging was never full"
        assert area.num_slots == 2 and area.num_free == 2
    finally:
        d.close()
        for p in procs:
            p.stop()


@pytest.mark.mooncake
@mooncake_only
def test_slots_granted_with_the_request_between_processes(daemon, device):
    """Wire 18 over Mooncake TCP between processes: decode keeps one of its three slots for grants
    sent with the rooms' requests; eight rooms of two CP ranks at once, the first ones' first chunks
    written into the kept slot with no SlotGrant, the rest asking. None fails, every byte checked,
    nothing outside the rooms' pages touched, every slot free at the end."""
    instance = f"staged-kept-p-{device}"
    procs = start(daemon, instance, 2, device=device)
    d = DecodeRank(daemon.url, instance=f"staged-kept-d-{device}", pages=256, staging="always",
                   staging_bytes=3 * SLOT, staging_slot_bytes=SLOT, staging_granted_slots=1, device=device)
    try:
        n, rooms = 40, list(range(room_base(device) + 92_000, room_base(device) + 92_008))
        receivers = [d.receive(room, n, np.arange(10) + 10 * i + 20, prefill=instance) for i, room in enumerate(rooms)]
        for p in procs:
            p.command(op="burst", rooms=rooms, num_tokens=n)
        wait_final(receivers)
        assert all(r.poll() == KVPoll.Success for r in receivers), [r.failure_reason for r in receivers]
        assert all(d.verify(r) == [] for r in receivers)
        assert d.untouched_except(np.arange(20, 20 + 10 * len(rooms)))
        book = d.ep.machine.staging.counters
        assert book["granted_with_request_used"] >= 1, book
        assert book["granted_with_request_used"] + book["granted_with_request_unused"] == book["granted_with_request"]
        area = d.ep.staging.area
        assert wait_until(lambda: d.ep.locked(lambda: (area.num_free, area.num_free_reserved)) == (2, 1), 10)
    finally:
        d.close()
        for p in procs:
            p.stop()


@pytest.mark.mooncake
@mooncake_only
def test_prefill_death_mid_chunk_frees_pages_at_once_slots_after_the_quarantine(daemon, device):
    """A prefill rank killed while its chunks are in flight: the room fails, its pages are free at
    once (nothing lands in them), and its slots stay QUARANTINED until its lease is gone plus the
    quarantine (a frozen process could still write into them)."""
    (p,) = start(daemon, f"staged-death-p-{device}", 1, device=device)
    d = DecodeRank(daemon.url, instance=f"staged-death-d-{device}", pages=256, lease_quarantine=1.0, device=device,
                   **DECODE_STAGED)
    try:
        room, n, pages = room_base(device) + 92_000, 600, np.arange(150) + 50
        r = d.receive(room, n, pages, prefill=f"staged-death-p-{device}")
        p.send(room, n)
        area = d.ep.staging.area
        assert wait_until(lambda: d.ep.locked(lambda: area.counters["acquired"]) >= 2, scaled(60)), \
            f"no chunk started: room {r.poll().name} {r.failure_reason}"
        p.kill()
        wait_final([r])
        assert r.poll() == KVPoll.Failed
        assert r.pages_releasable
        states = d.ep.locked(lambda: [area.state(i) for i in range(area.num_slots)])
        assert SlotState.LANDED not in states and SlotState.SCATTERED not in states
        # the lease (2 s) expires, then the quarantine: every slot is free again
        assert wait_until(lambda: d.ep.locked(lambda: area.num_free) == area.num_slots, 30)
    finally:
        d.close()
        p.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_abort_mid_chunk_over_mooncake(daemon, device, engine):
    """Abort with writes in flight (over Mooncake, and NIXL): no write lands after it."""
    (p,) = start(daemon, f"staged-abort-p-{engine}-{device}", 1, device=device, engine=engine)
    d = DecodeRank(daemon.url, instance=f"staged-abort-d-{engine}-{device}", pages=256, device=device, engine=engine,
                   **DECODE_STAGED)
    try:
        room, n, pages = room_base(device) + 93_000 + (10 if engine == "nixl" else 0), 600, np.arange(150) + 50
        r = d.receive(room, n, pages, prefill=f"staged-abort-p-{engine}-{device}")
        p.send(room, n)
        area = d.ep.staging.area
        assert wait_until(lambda: d.ep.locked(lambda: area.counters["acquired"]) >= 2, scaled(60)), \
            f"no chunk started: room {r.poll().name} {r.failure_reason}"
        r.abort("user cancelled")
        assert r.poll() == KVPoll.Failed
        # free without prefill's word (its writes land in slots only): at once on the CPU, where this
        # rank's own copies are done when queued; on a GPU once those queued before the abort have run
        # (a slot's scatter or the aux row's write into its slot, each an event the loop polls)
        assert r.pages_releasable if device == "cpu" else wait_until(lambda: r.pages_releasable, scaled(5)), \
            "the room's pages are not releasable"
        at_abort = {k: as_bytes(b, d.bytes_per_page[k])[pages].copy() for k, b in d.host_buffers().items()}
        assert p.result(room)["state"] == "Failed"
        assert wait_until(lambda: d.ep.locked(lambda: area.num_free) == area.num_slots, 10), \
            "the slots are free once prefill acknowledged the abort"
        time.sleep(0.2)
        assert all((as_bytes(b, d.bytes_per_page[k])[pages] == at_abort[k]).all()
                   for k, b in d.host_buffers().items()), \
            "a write reached the room's pages after the abort"
        assert d.untouched_except(pages)
    finally:
        d.close()
        p.stop()


@pytest.mark.parametrize("p, d, engine", [pytest.param(1, 2, "mooncake", id="p1-d2", marks=needs_mooncake),
                                          pytest.param(2, 1, "mooncake", id="p2-d1-cp2", marks=needs_mooncake),
                                          pytest.param(1, 2, "nixl", id="nixl-p1-d2", marks=needs_nixl)])
def test_heterogeneous_tp_through_staging(daemon, device, p, d, engine):
    """Head slicing for heterogeneous TP happens in the gather (prefill packs only the heads a
    decode rank takes); the wire carries whole pieces; each decode rank checks its head slice."""
    from test_hetero_tp import run_rooms

    instance = f"staged-heads-{engine}-p{p}-{device}"
    procs = []
    try:
        for c in range(p):  # p=2: CP 2 x TP 2 prefill ranks
            for t in range(p):
                procs.append(PrefillProc(daemon.url, c, p, "--model", "kv-heads", *PREFILL_STAGED,
                                         instance=instance, tp_rank=t, tp_size=p, device=device, engine=engine))
        decodes = [DecodeRank(daemon.url, model="kv-heads", tp_rank=j, tp_size=d, pages=64, engine=engine,
                              instance=f"staged-heads-{engine}-d{d}-p{p}-{device}", device=device, **DECODE_STAGED)
                   for j in range(d)]
        try:
            base = room_base(device) + 94_000 + 100 * p + (10 if engine == "nixl" else 0)
            run_rooms(procs, instance, decodes, base=base)
            paths = [set(proc.result(base + i)["paths"].values()) for proc in procs for i in range(3)]
            assert all(ps <= {"staged"} for ps in paths) and {"staged"} in paths, paths
        finally:
            for dr in decodes:
                dr.close()
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_offering_another_staging_area_is_refused_over_mooncake(daemon, engine):
    """Hard rule 5 for staging over Mooncake TCP between processes: the decode rank's staging area
    is in its registration; a request on its own proven connection offering its page buffer as the
    area is refused by the prefill process naming the field, and not a byte lands on decode."""
    from _local import ProvingPeers, replies
    from kvbridge.bootstrap.contract import fingerprint
    from kvbridge.transfer.channel import wire

    (p,) = start(daemon, f"staged-alias-p-{engine}", 1, engine=engine)
    d = DecodeRank(daemon.url, instance=f"staged-alias-d-{engine}", pages=64, engine=engine, **DECODE_STAGED)
    peers = ProvingPeers(d.ep)
    try:
        assert d.client.rank(d.ep.rank_id).staging == d.ep.staging.descriptor
        n = 8
        p.send(96_000, n)
        request = wire.TransferRequest(
            room=96_000, decode_rank=d.ep.config.rank_label, decode_rank_id=d.ep.rank_id,
            page_ids=wire.pack_pages(np.arange(n // 4)), first_page=0, pools=sorted(d.specs), aux_slot=0,
            num_tokens=n, deadline_ms=10_000, want_digest=False, fingerprint=fingerprint(d.ep.contract),
            num_decode_ranks=1, staging_slots=4, staging_slot_bytes=SLOT,
            staging_base=min(b.base for b in d.ep.buffers.descs), staging_only=True)
        peers.send(p.endpoint, request)
        (failed,) = [m for m in replies(peers, 1, timeout=30) if isinstance(m, wire.PagesDone)]
        assert failed.status == "failed" and "field=staging_base" in failed.reason, failed
        assert p.result(96_000)["state"] == "Failed"
        assert failed.room == 96_000
    finally:
        peers.close()
        d.close()
        p.stop()
    assert d.untouched_except(np.array([], dtype=np.int64))


def test_raw_buffer_rooms_under_auto_stage_what_the_thresholds_say(daemon, device):
    """Pools handed as ``RawBuffer`` addresses on both sides (what the SGLang backend hands
    kvbridge; on a GPU the addresses name it, and the staging buffers go beside them), staging
    "auto" on both sides: a room of a few scattered pages goes direct, one of thousands of
    page-sized slices takes the path ``choose_path`` gives under the thresholds of the route
    (Mooncake TCP, the pages' device): staged, for host pages (Mooncake TCP's own rule, from 64
    slices of at most 48 KiB mean or 1,024 of at most 72 KiB: registry.py) and GPU pages (Mooncake's
    GPU rule) alike, and both land byte-exact."""
    from kvbridge.layout import choose_path
    from kvbridge.transfer.engine.registry import route_key, staging_thresholds

    instance = f"staged-raw-p-{device}"
    (p,) = start(daemon, instance, 1, "--staging", "auto", "--raw-buffers", "--pages", "1024", device=device)
    d = DecodeRank(daemon.url, instance=f"staged-raw-d-{device}", pages=1024, device=device, raw_buffers=True,
                   staging="auto", staging_bytes=4 * SLOT, staging_slot_bytes=SLOT)
    try:
        assert d.ep.staging is not None and d.ep.staging.on_gpu == (device != "cpu")
        rng = np.random.default_rng(11)
        table = rng.permutation(d.pages)
        small, large = room_base(device) + 95_000, room_base(device) + 95_001
        rooms = {small: 9, large: 2000}  # 3 pages x 5 buffers = 15 slices; 500 pages x 5 = 2,500 slices
        receivers, used = [], 0
        for room, n in rooms.items():
            m = -(-n // 4)
            receivers.append(d.receive(room, n, table[used: used + m], prefill=instance))
            used += m
            p.send(room, n)
        wait_final(receivers)
        for r in receivers:
            assert r.poll() == KVPoll.Success, r.failure_reason
            assert d.verify(r) == []
        assert d.untouched_except(table[:used])
        paths = {room: set(p.result(room)["paths"].values()) for room in rooms}
        rule = staging_thresholds(route_key("mooncake/tcp", on_gpu=device != "cpu"))
        want = choose_path(2500, rule, mean_slice_bytes=41_984)  # 2,500 slices of at most a page each
        assert want == "staged" and choose_path(15, rule, mean_slice_bytes=41_984) == "direct"
        assert paths == {small: {"direct"}, large: {want}}, paths
        assert (p.result(large)["chunks"] > 1) == (want == "staged")
    finally:
        d.close()
        p.stop()
