"""What an engine that hands out pointers and page counts needs (SGLang's PD backend,
issue 9), over the local engine against a real daemon:

- pools and aux regions given as raw addresses (``RawBuffer``) on both sides;
- a room started from its page count: the last chunk says the token count, the
  partial last page waits for it and carries only its valid rows, and decode,
  which knows only pages, learns the count with the aux row;
- ``RoomInUse.draining`` and ``sender(room, wait=)`` / ``receiver(room, wait=)``;
- timings in the sender's stats;
- the ``balanced`` lane rule end to end;
- ``PrefillInfo``: a prefill instance's sizes and lane rule before a room opens;
- hard rule 6 across a decode instance's TP ranks, which free pages together: a
  failure report or abort ack to one of them waits until no write of the room is in
  flight to any of them.
"""

from __future__ import annotations

import threading

import time

import numpy as np
import pytest

import kvbridge as kvb
from _cluster import wait_final, wait_until
from _local import ProvingPeers, replies
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import LocalFabric
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes, fill_pages, make_aux, verify_aux, verify_pages
from kvbridge.transfer.actions import AbortRoom

PAGE, LAYERS, PAGES = 4, 2, 32


class Mini:
    """CP prefill ranks and ``decode_tp`` decode ranks on one LocalFabric; buffers as RawBuffers
    over numpy memory this object keeps alive (``raw=False``: the numpy arrays themselves)."""

    def __init__(self, url: str, name: str, *, cp: int = 1, decode_tp: int = 1, lane_rule: str = "interleaved",
                 raw: bool = True) -> None:
        self.specs = kvb.preset_pools("deepseek-v3.2-fp8", num_layers=LAYERS, page_size=PAGE, draft_layers=1)
        self.schema = kvb.AuxSchema((kvb.AuxRegion("output_ids", "int32", (16,)), kvb.AuxRegion("room", "uint64", (8,)),
                                     kvb.AuxRegion("hidden", "bfloat16", (32,))))
        self.contract = kvb.contract_for(self.specs, model="tiny", aux=self.schema, lane_rule=lane_rule)
        self.lanes, self.name, self.raw = kvb.OwnerLanes(cp, lane_rule), name, raw
        self.fabric, self.clients, self.memory = LocalFabric(), [], []
        self.prefill = [self._endpoint(url, "prefill", rank, cp) for rank in range(cp)]
        self.decode = [self._endpoint(url, "decode", rank, decode_tp) for rank in range(decode_tp)]
        for ep in self.prefill + self.decode:
            ep.start()

    def _pools(self) -> tuple[dict, dict]:
        arrays = {(p, layer): np.full(PAGES * s.bytes_per_page, SENTINEL_BYTE, np.uint8)
                  for p, s in self.specs.items() for layer in s.layer_ids}
        aux = {r.name: np.zeros(16 * r.nbytes, np.uint8) for r in self.schema.regions}
        self.memory += [*arrays.values(), *aux.values()]
        if not self.raw:
            return arrays, {r.name: np.zeros((16, *r.shape), r.storage) for r in self.schema.regions}
        as_raw = {k: kvb.RawBuffer(a.ctypes.data, a.nbytes) for k, a in arrays.items()}
        return as_raw, {k: kvb.RawBuffer(a.ctypes.data, a.nbytes) for k, a in aux.items()}

    def _endpoint(self, url: str, role: str, rank: int, size: int):
        client = kvb.BootstrapClient(url)
        self.clients.append(client)
        engine = kvb.create_engine("local", fabric=self.fabric)
        bufs, aux = self._pools()
        if role == "prefill":
            cfg = kvb.PrefillConfig(instance=f"{self.name}-p", cp_rank=rank, cp_size=size, lane_rule=self.lanes.rule,
                                    lease_ttl=2.0, target_timeout=5.0, housekeeping_interval=0.1)
            return kvb.PrefillEndpoint(cfg, engine, self.specs, bufs, self.contract, client, self.schema, aux_buffer=aux)
        cfg = kvb.DecodeConfig(instance=f"{self.name}-d", tp_rank=rank, tp_size=size, lease_ttl=2.0, ping_interval=0.1)
        return kvb.DecodeEndpoint(cfg, engine, self.specs, bufs, self.contract, client, aux, self.schema)

    def fill(self, room: int, n: int) -> None:
        """Every prefill rank holds every page (a replicated cache) at local page = logical page + 3."""
        logical = np.arange(-(-n // PAGE))
        for ep in self.prefill:
            for (pool, layer), buf in ep.buffers.tensors.items():
                fill_pages(self.specs[pool], buf, room, layer, logical, logical + 3, n)

    def write_aux(self, ep, slot: int, room: int, n: int) -> None:
        row = self.schema.unpack_regions(make_aux(self.schema, room, n))
        for name, buf in ep.aux_buffers.tensors.items():  # typed tensors, or uint8 views of raw rows
            buf[slot] = np.ascontiguousarray(row[name]).reshape(-1).view(buf.dtype)

    def verify(self, dep, room: int, n: int, pages: np.ndarray, slot: int) -> list[str]:
        """Every byte of the room's pages (poison in padding rows) and its aux row in ``slot``."""
        errors = [v.first_error for (pool, layer), buf in dep.buffers.tensors.items()
                  if not (v := verify_pages(self.specs[pool], buf, room, layer, pages, n)).ok]
        err = verify_aux(self.schema, dep.aux.read_row(slot), room, n)
        return errors + ([err] if err else [])

    def close(self) -> None:
        for ep in self.decode + self.prefill:
            ep.close(timeout=2)
        for c in self.clients:
            c.close()


@pytest.fixture
def mini(daemon, request):
    made = []

    def make(**kw) -> Mini:
        m = Mini(daemon.url, f"{request.node.name[:36]}-{len(made)}", **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_raw_buffers_are_validated_like_tensors():
    spec = kvb.preset_pools("deepseek-v3.2-fp8", num_layers=1, page_size=PAGE, draft_layers=0)["target"]
    mem = np.zeros(3 * spec.bytes_per_page, np.uint8)
    assert spec.validate_buffer(0, kvb.RawBuffer(mem.ctypes.data, mem.nbytes)) == 3
    with pytest.raises(kvb.BufferSpecError, match="not a whole number of 2624-byte items"):
        spec.validate_buffer(0, kvb.RawBuffer(mem.ctypes.data, mem.nbytes - 1))
    with pytest.raises(kvb.BufferSpecError, match="non-null"):
        kvb.RawBuffer(0, 64)
    with pytest.raises(kvb.BufferSpecError, match="device 'tpu'"):
        kvb.RawBuffer(mem.ctypes.data, 64, "tpu")
    with pytest.raises(kvb.BufferSpecError, match="cuda:0 memory: kvbridge can read back host memory only"):
        kvb.RawBuffer(mem.ctypes.data, 64, "cuda:0").host_view()
    view = kvb.RawBuffer(mem.ctypes.data, mem.nbytes).host_view()
    view[5] = 7
    assert mem[5] == 7  # the same bytes, no copy


def test_aux_regions_as_raw_addresses_are_checked(mini, daemon):
    m = mini(cp=1)
    ep = m.prefill[0]
    short = {r.name: kvb.RawBuffer(a.ctypes.data, a.nbytes) for r, a in
             zip(m.schema.regions, (np.zeros(64, np.uint8), np.zeros(64 * 3, np.uint8), np.zeros(65, np.uint8)))}
    bufs, _ = m._pools()
    with pytest.raises(kvb.ConfigError, match="aux region 'hidden' .* not a whole number of 64-byte rows"):
        kvb.PrefillEndpoint(ep.config, kvb.create_engine("local"), m.specs, bufs, m.contract,
                            m.clients[0], m.schema, aux_buffer=short)
    mem = np.zeros(16 * m.schema.row_bytes, np.uint8)
    device_aux = {r.name: kvb.RawBuffer(mem.ctypes.data, 16 * r.nbytes, "cuda:0") for r in m.schema.regions}
    with pytest.raises(kvb.ConfigError, match="device-memory RawBuffers: a decode rank reads each room's aux row"):
        kvb.DecodeEndpoint(kvb.DecodeConfig(instance="x"), kvb.create_engine("local"), m.specs, bufs, m.contract,
                           m.clients[0], device_aux, m.schema)


def test_a_room_started_from_its_page_count_moves_only_valid_rows(mini):
    """The engine knows 4 pages and chunk ends; the last chunk says 13 tokens. Page 3 (rows
    12 of 12..15) waits for it; decode, which gave pages only, learns 13 with the aux row."""
    m = mini(cp=2)
    n, room, pages = 13, 700, np.array([20, 7, 9, 30])
    m.fill(room, n)
    dep = m.decode[0]
    r = dep.receiver(room, f"{m.name}-p")
    r.init(pages, 2)  # no num_tokens
    senders = []
    for rank, ep in enumerate(m.prefill):
        s = ep.sender(room)
        s.init(num_pages=4)
        assert s.num_tokens is None and s.writes_aux == (rank == 1)  # the last page's owner
        owned = s.owned_pages
        if s.writes_aux:
            m.write_aux(ep, 5, room, n)
        first, rest = owned[owned < 2], owned[owned >= 2]
        s.send(first, first + 3, num_tokens_ready=8)
        with pytest.raises(kvb.LayoutError, match="must lie in \\[13, 16\\] \\(inside the last of 4 pages"):
            s.send(rest, rest + 3, num_tokens_ready=12, is_last=True, aux_slot=5 if s.writes_aux else None)
        with pytest.raises(kvb.LayoutError, match="started from its page count: the last chunk must say"):
            s.send(rest, rest + 3, is_last=True, aux_slot=5 if s.writes_aux else None)
        s.send(rest, rest + 3, num_tokens_ready=n, is_last=True, aux_slot=5 if s.writes_aux else None)
        assert s.num_tokens == n
        senders.append(s)
    wait_final([r, *senders])
    assert r.poll() == kvb.KVPoll.Success and r.stats["num_tokens"] == n
    assert m.verify(dep, room, n, pages, 2) == []  # the tail rows of page 3 kept the poison


def test_a_non_last_chunk_ending_in_the_last_page_holds_it(mini):
    m = mini(cp=1)
    n, room, pages = 10, 701, np.array([4, 5, 6])
    m.fill(room, n)
    r = m.decode[0].receiver(room, f"{m.name}-p")
    r.init(pages, 0)
    s = m.prefill[0].sender(room)
    s.init(num_pages=3)
    logical = np.arange(3)
    s.send(logical, logical + 3, num_tokens_ready=9)  # pages 0, 1 complete; page 2 (rows 8..) held
    assert wait_until(lambda: r.stats["pages_by_rank"].get(0) == 2, 30)
    m.write_aux(m.prefill[0], 1, room, n)
    s.send([], [], num_tokens_ready=n, is_last=True, aux_slot=1)
    wait_final([r, s])
    assert r.poll() == kvb.KVPoll.Success and m.verify(m.decode[0], room, n, pages, 0) == []


def test_room_in_use_says_draining_and_wait_waits_for_the_drain(mini, daemon):
    m = mini(cp=1, raw=False)
    ep, dep = m.prefill[0], m.decode[0]
    gate = threading.Event()
    ep.engine.faults.gate = gate  # writes stay in flight
    m.fill(702, 8)
    r = dep.receiver(702, f"{m.name}-p")
    r.init(np.array([1, 2]), 0, 8)
    s = ep.sender(702)
    with pytest.raises(kvb.RoomInUse) as held:
        ep.sender(702, wait=5)  # open: waiting would not help, so it does not wait
    assert held.value.draining is False
    s.init(8)
    m.write_aux(ep, 0, 702, 8)
    s.send([0, 1], [3, 4], is_last=True, aux_slot=0)
    assert wait_until(lambda: s.poll() == kvb.KVPoll.Transferring, 30)
    s.close()
    r.close()
    with pytest.raises(kvb.RoomInUse, match="draining") as err:
        ep.sender(702)
    assert err.value.draining is True
    with pytest.raises(kvb.RoomInUse, match="draining"):
        ep.sender(702, wait=0.05)
    with pytest.raises(kvb.RoomInUse) as derr:
        dep.receiver(702, f"{m.name}-p")
    assert derr.value.draining is True
    threading.Timer(0.2, gate.set).start()
    again = ep.sender(702, wait=30)  # opens once the last write of the old room is over
    again.close()
    dep.receiver(702, f"{m.name}-p", wait=30).close()


def test_sender_stats_time_the_transfer(mini):
    m = mini(cp=1, raw=False)
    m.fill(703, 6)
    r = m.decode[0].receiver(703, f"{m.name}-p")
    s = m.prefill[0].sender(703)
    assert s.stats["transfer_s"] is None and s.stats["bytes"] == 0
    r.init(np.array([3, 4]), 0, 6)
    s.init(6)
    m.write_aux(m.prefill[0], 0, 703, 6)
    s.send([0, 1], [3, 4], is_last=True, aux_slot=0)
    wait_final([r, s])
    st = s.stats
    assert s.poll() == kvb.KVPoll.Success and st["bytes"] > 0 and st["slices"] > 0
    assert 0 <= st["transfer_s"] <= st["total_s"]
    assert {"Bootstrapping", "WaitingForInput", "Transferring"} <= set(st["seconds"])


def test_the_balanced_lane_rule_end_to_end(mini):
    """SGLang's all-CP-ranks split: 5 pages over 2 ranks are 3 + 2 (contiguous would be 3 + 2
    too; 4 pages over 3 ranks tell them apart, see tests/layout)."""
    m = mini(cp=2, lane_rule="balanced")
    n, room, pages = 19, 704, np.array([11, 12, 13, 2, 3])
    m.fill(room, n)
    r = m.decode[0].receiver(room, f"{m.name}-p")
    r.init(pages, 1, n)
    senders = []
    for ep in m.prefill:
        s = ep.sender(room)
        s.init(n)
        if s.writes_aux:
            m.write_aux(ep, 2, room, n)
        s.send(s.owned_pages, s.owned_pages + 3, is_last=True, aux_slot=2 if s.writes_aux else None)
        senders.append(s)
    assert [list(s.owned_pages) for s in senders] == [[0, 1, 2], [3, 4]]
    wait_final([r, *senders])
    assert r.poll() == kvb.KVPoll.Success and r.stats["pages_by_rank"] == {0: 3, 1: 2}
    assert m.verify(m.decode[0], room, n, pages, 1) == []


def test_prefill_info_before_a_room_opens(mini, start_daemon):
    d = start_daemon()
    m = mini(cp=2, lane_rule="balanced")
    client = m.clients[0]
    info = kvb.PrefillInfo.lookup(client, f"{m.name}-p")
    assert (info.dp_size, info.cp_size, info.lane_rule, info.complete) == (1, 2, "balanced", True)
    assert info.dp_rank_of(12345) == 0 and info.fingerprint == kvb.fingerprint(m.prefill[0].contract)  # on its engine's transport
    with pytest.raises(kvb.UnknownInstance, match="no prefill instance 'nope'"):
        kvb.PrefillInfo.lookup(client, "nope")
    with kvb.BootstrapClient(d.url) as empty:
        with pytest.raises(kvb.UnknownInstance, match="no prefill instance registered"):
            kvb.PrefillInfo.lookup(empty)
        lone = Mini(d.url, "lone", cp=1)
        try:
            assert kvb.PrefillInfo.lookup(empty).instance == "lone-p"  # one prefill instance per daemon
        finally:
            lone.close()


def test_a_refusal_to_one_decode_rank_waits_for_writes_to_the_others(mini):
    """Decode TP ranks free a request's pages together (SGLang: a MIN all-reduce of their poll
    states), so an abort ack or failure report to one must mean no write of the room is in
    flight to any: rank 1 aborts while rank 0's writes are held; rank 1 is quiet only after."""
    m = mini(cp=1, decode_tp=2, raw=False)
    ep = m.prefill[0]
    gate = threading.Event()
    ep.engine.faults.gate = gate
    n, room = 8, 705
    m.fill(room, n)
    receivers = [dep.receiver(room, f"{m.name}-p") for dep in m.decode]
    for i, rcv in enumerate(receivers):
        rcv.init(np.array([2 * i, 2 * i + 1]), i, n)
    s = ep.sender(room)
    s.init(n)
    m.write_aux(ep, 0, room, n)
    s.send([0, 1], [3, 4], is_last=True, aux_slot=0)
    assert wait_until(lambda: s.poll() == kvb.KVPoll.Transferring, 30)
    receivers[1].abort("client went away")
    assert not wait_until(lambda: receivers[1].pages_releasable or receivers[0].pages_releasable, 0.5)
    gate.set()
    assert wait_until(lambda: all(rcv.pages_releasable for rcv in receivers), 10)
    assert all(rcv.poll() == kvb.KVPoll.Failed for rcv in receivers) and s.poll() == kvb.KVPoll.Failed
    assert "client went away" in receivers[0].failure_reason and "client went away" in s.failure_reason


def test_an_abort_from_a_decode_rank_without_a_target_fails_the_room_acked_when_quiet(mini):
    m = mini(cp=1, raw=False)
    ep = m.prefill[0]
    gate = threading.Event()
    ep.engine.faults.gate = gate
    m.fill(706, 8)
    r = m.decode[0].receiver(706, f"{m.name}-p")
    r.init(np.array([5, 6]), 0, 8)
    s = ep.sender(706)
    s.init(8)
    m.write_aux(ep, 0, 706, 8)
    s.send([0, 1], [3, 4], is_last=True, aux_slot=0)
    assert wait_until(lambda: s.poll() == kvb.KVPoll.Transferring, 30)
    peers = ProvingPeers(m.decode[0])  # another rank of the decode instance that holds the room
    try:
        peers.send(ep.endpoint, wire.Abort(room=706, decode_rank="other/dp0/tp1", reason="gone",
                                           decode_rank_id=m.decode[0].rank_id))
        assert replies(peers, 1, timeout=0.5) == []  # writes to the asking rank are still in flight
        gate.set()
        (ack,) = replies(peers, 1)
        assert isinstance(ack, wire.AbortAck) and ack.room == 706
    finally:
        gate.set()
        peers.close()
    wait_final([r, s])
    assert r.poll() == kvb.KVPoll.Failed and "other/dp0/tp1 aborted: gone" in r.failure_reason
    assert wait_until(lambda: r.pages_releasable, 30)


def test_a_decode_room_failing_before_its_request_aborts_every_sender(mini):
    """Its pages are assigned but no TransferRequest went out yet (another TP rank of the
    instance may already have asked): the failure aborts every CP rank and waits for acks."""
    m = mini(cp=2, raw=False)
    dep = m.decode[0]
    r = dep.receiver(707, f"{m.name}-p")
    r.wait_bootstrapped(10)
    with dep._lock:  # between init() and the loop's TransferRequest
        room = dep.machine.rooms[707]
        room.page_ids, room.aux_slot = np.array([1, 2]), 0  # init() without its request: the loop would send it
        dep._feed_event(AbortRoom(room, "aborted by the engine", time.monotonic()))
        assert room.requested == set(room.senders) and not room.pages_releasable
    assert wait_until(lambda: r.pages_releasable, 10)  # both CP ranks acked (no room there: at once)
