"""The hard rules for the pool kinds in the rooms, sans I/O: prefill's kind book
(``prefill/kinds.py``: what each write carries) and decode's room machine with its kind books
(``decode/kind_rooms.py``: what it accepts and when it commits)."""

from __future__ import annotations

import numpy as np
import pytest

import kvbridge as kvb
from _kind_rooms import AUX, CAP, PAGE, decode_pages, decode_units, model_specs, prefill_units
from _machines import decode_machine
from kvbridge.bootstrap.schemas import LookupResponse, SenderRank
from kvbridge.bootstrap.topology import OwnerLanePlan, Topology
from kvbridge.errors import KVBridgeError, LayoutError, PageRangeError
from kvbridge.layout import BufferDesc
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode import events as de
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.events import LookUp
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.kinds import KindWrites


def fake_descs(specs, base: int = 1 << 20) -> list[BufferDesc]:
    out, at = [], base
    for name, spec in specs.items():
        for lid in spec.layer_ids:
            out.append(BufferDesc(name, lid, at, CAP, spec.bytes_per_page))
            at += CAP * spec.bytes_per_page
    return out


def request(specs, n: int, *, room: int = 9, slot: int = 3, **kw) -> wire.TransferRequest:
    units = {k: v.astype("<i4").tobytes() for k, v in decode_units(specs, n, slot).items()}
    fields = dict(room=room, decode_rank="d0", decode_rank_id="dec-id", page_ids=wire.pack_pages(decode_pages(n)),
                  first_page=0, pools=sorted(specs), aux_slot=0, num_tokens=n, deadline_ms=1000, want_digest=False,
                  fingerprint="fp", num_decode_ranks=1, kind_units=units)
    fields.update(kw)
    return wire.TransferRequest(**fields)


def book(model: str, n: int, cp: int = 1, cp_rank: int = 0):
    specs = model_specs(model)
    kw = KindWrites(specs, fake_descs(specs), lanes=kvb.OwnerLanes(cp, "interleaved"), cp_rank=cp_rank, tp_size=1,
                    rank="p0")
    kw.engine_units(9, prefill_units(specs))
    req = request(specs, n)
    kw.accept(req, fake_descs(specs, 1 << 30), decode_pages(n), n)
    local_of = np.arange(-(-n // PAGE)) + 1
    return specs, kw, local_of


def chunks(kw, n: int, cuts, local_of, owns_last: bool = True):
    """The reports and plans of each chunk ``[done, end)`` (the last one's ``last`` set)."""
    out = []
    for end in (*cuts, n):
        plan, write = kw.plan(9, "d0", n, end, end == n, local_of, decode_pages(n), owns_last)
        report, _ = kw.landed(9, "d0", write)  # (the write landed: its units are reported)
        out.append((plan, {p: np.frombuffer(u, "<i4").tolist() for p, u in report.items()}))
    return out


def test_state_travels_once_and_only_with_the_last_chunk():
    specs, kw, local_of = book("hybrid", 22)
    (_, first), (_, second) = chunks(kw, 22, (9,), local_of)
    assert "mamba_conv" not in first and "mamba_ssm" not in first
    assert second["mamba_conv"] == [0] and second["mamba_ssm"] == [0]
    assert not kw.wants(9, "d0")
    plan, write = kw.plan(9, "d0", 22, 22, True, local_of, decode_pages(22), True)
    assert not write and not plan.num_slices  # never twice


def test_state_is_written_by_the_owner_of_the_last_valid_token_only():
    specs, kw, local_of = book("hybrid", 22)
    (_, report), = chunks(kw, 22, (), local_of, owns_last=False)
    assert "mamba_conv" not in report and "mamba_ssm" not in report


def test_a_window_pool_sends_the_windows_pages_only_with_their_valid_rows():
    """22 tokens, window 6: rows [16, 22) -> pages 4 and 5 (page 5: rows 20, 21 only)."""
    specs, kw, local_of = book("hybrid", 22)
    reports = chunks(kw, 22, (5, 9, 17), local_of)
    sent = sorted(u for _, r in reports for u in r.get("swa", []))
    assert sent == [4, 5]
    assert sum(p.num_bytes for p, _ in reports) == sum(kvb.needed_bytes(s, 22) for s in specs.values())


def test_a_window_on_pages_of_its_own_given_later_travels_from_those_pages_and_waits_for_them():
    """A paged window on pages of its own (SGLang's SWA pool): prefill says at init its pages come
    later (None), decode gives its own window pages in the request. 22 tokens, window 6: pages 4
    and 5. A chunk ending at 21 completes page 4, but its page id is not known yet: it waits, and
    travels with the last chunk, read from the engine's pages (30, 31) into decode's (20, 21),
    never from the room's pages."""
    specs = model_specs("hybrid")
    kw = KindWrites(specs, fake_descs(specs), lanes=kvb.OwnerLanes(1, "interleaved"), cp_rank=0, tp_size=1,
                    rank="p0")
    kw.engine_units(9, {**prefill_units(specs), "swa": None})
    req = request(specs, 22, kind_units={**request(specs, 22).kind_units,
                                         "swa": np.array([20, 21]).astype("<i4").tobytes()})
    kw.accept(req, fake_descs(specs, 1 << 30), decode_pages(22), 22)
    local_of = np.arange(6) + 1
    plan, write = kw.plan(9, "d0", 22, 21, False, local_of, decode_pages(22), True)
    assert "swa" not in write.parts  # page 4 is complete, its page id is not known yet
    with pytest.raises(LayoutError, match="window pool 'swa': the engine's kind_units name 0 pages") as err:
        kw.plan(9, "d0", 22, 22, True, local_of, decode_pages(22), True)  # the last chunk without them
    assert err.value.field == "kind_units"

    kw = KindWrites(specs, fake_descs(specs), lanes=kvb.OwnerLanes(1, "interleaved"), cp_rank=0, tp_size=1,
                    rank="p0")
    kw.engine_units(9, {**prefill_units(specs), "swa": None})
    kw.accept(req, fake_descs(specs, 1 << 30), decode_pages(22), 22)
    assert "swa" not in kw.plan(9, "d0", 22, 21, False, local_of, decode_pages(22), True)[1].parts
    kw.engine_units(9, {"swa": np.array([30, 31])})  # send(kind_units=) with the last chunk
    plan, write = kw.plan(9, "d0", 22, 22, True, local_of, decode_pages(22), True)
    report, _ = kw.landed(9, "d0", write)
    assert np.frombuffer(report["swa"], "<i4").tolist() == [4, 5]
    spec = specs["swa"]
    src = {d.layer_id: d.base for d in fake_descs(specs) if d.pool == "swa"}
    dst = {d.layer_id: d.base for d in fake_descs(specs, 1 << 30) if d.pool == "swa"}
    rows = np.arange(16, 22)
    want_src = [b + (np.array([30, 31])[rows // PAGE - 4] * PAGE + rows % PAGE) * spec.bytes_per_token
                for b in src.values()]
    want_dst = [b + (np.array([20, 21])[rows // PAGE - 4] * PAGE + rows % PAGE) * spec.bytes_per_token
                for b in dst.values()]
    in_swa = [(s, d, n) for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist())
              if any(b <= s < b + CAP * spec.bytes_per_page for b in src.values())]
    got_src = sorted(s + k * spec.bytes_per_token for s, _, n in in_swa for k in range(n // spec.bytes_per_token))
    got_dst = sorted(d + k * spec.bytes_per_token for _, d, n in in_swa for k in range(n // spec.bytes_per_token))
    assert got_src == sorted(x for arr in want_src for x in arr.tolist())
    assert got_dst == sorted(x for arr in want_dst for x in arr.tolist())


def test_only_complete_compressed_entries_travel_each_once():
    """V4, 131 tokens: CSA (ratio 4) has 32 complete entries -> pages 0-7; HCA (ratio 32) 4 ->
    page 0. A chunk ending at 40 tokens completes 10 CSA entries: pages 0, 1 only (page 2's
    entries 8, 9 are complete, 10, 11 are not); no HCA page (1 entry of 4)."""
    specs, kw, local_of = book("v4", 131)
    reports = chunks(kw, 131, (40, 96), local_of)
    assert reports[0][1]["csa"] == [0, 1] and "hca" not in reports[0][1]
    assert sorted(u for _, r in reports for u in r.get("csa", [])) == list(range(8))
    assert sorted(u for _, r in reports for u in r.get("hca", [])) == [0]
    assert sum(p.num_bytes for p, _ in reports) == sum(kvb.needed_bytes(s, 131) for s in specs.values())


@pytest.mark.parametrize("change, field", [
    (dict(num_tokens=0), "num_tokens"),
    (dict(first_page=1, page_ids=wire.pack_pages(decode_pages(22)[1:])), "first_page"),
    (dict(num_decode_ranks=2), "num_decode_ranks"),
    (dict(kind_units={"mamba_conv": b"\x03\0\0\0"}), "kind_units"),
    (dict(kind_units={"mamba_conv": b"\x03\0\0\0", "mamba_ssm": (CAP).to_bytes(4, "little")}), "kind_units"),
])
def test_a_request_prefill_cannot_serve_is_refused_naming_the_field(change, field):
    specs = model_specs("hybrid")
    kw = KindWrites(specs, fake_descs(specs), lanes=kvb.OwnerLanes(1, "interleaved"), cp_rank=0, tp_size=1, rank="p0")
    req = request(specs, 22, **change)
    with pytest.raises(KVBridgeError) as err:
        kw.accept(req, fake_descs(specs, 1 << 30), decode_pages(22), 22)
    assert err.value.field == field and err.value.room == 9 and err.value.rank == "d0"
    assert not kw.wants(9, "d0")


def test_digests_of_a_state_slot_cut_across_tp_sizes_are_refused_by_name():
    """A sharded Mamba slot sent to a decode TP size of 2 lands in pieces of another rank's slot:
    no unit digest covers that, so a request that wants digests is refused (``want_digest``);
    without digests, or with one TP size, it is served."""
    specs = {k: v for k, v in model_specs("hybrid").items() if k.startswith("mamba")}
    assert all(s.shard_units for s in specs.values())

    def accept(**kw):
        book = KindWrites(specs, fake_descs(specs), lanes=kvb.OwnerLanes(1, "interleaved"), cp_rank=0, tp_size=1,
                          rank="p0")
        req = request(specs, 22, **kw)
        dst = {n: kvb.layout.kinds.state_tp_spec(s, req.num_decode_ranks) for n, s in specs.items()}
        book.accept(req, fake_descs(dst, 1 << 30), decode_pages(22), 22)
        return book

    with pytest.raises(KVBridgeError) as err:
        accept(num_decode_ranks=2, want_digest=True)
    assert err.value.field == "want_digest" and "mamba_conv" in str(err.value)
    assert accept(num_decode_ranks=2).wants(9, "d0") and accept(want_digest=True).wants(9, "d0")


def test_a_window_page_id_outside_decodes_registered_pages_is_refused():
    specs = model_specs("hybrid")
    kw = KindWrites(specs, fake_descs(specs), lanes=kvb.OwnerLanes(1, "interleaved"), cp_rank=0, tp_size=1, rank="p0")
    pages = decode_pages(22).copy()
    pages[5] = CAP  # in the window
    with pytest.raises(PageRangeError):
        kw.accept(request(specs, 22), fake_descs(specs, 1 << 30), pages, 22)


# -- decode's room machine ------------------------------------------------------------------------------


class Memory:
    def __init__(self) -> None:
        self.rows = np.zeros((4, AUX.row_bytes), dtype=np.uint8)

    def land(self, slot: int, room: int) -> None:
        at = AUX.offsets["room"]
        self.rows[slot, at:at + 8] = np.frombuffer(np.uint64(room).tobytes(), np.uint8)

    def read(self, slot: int):
        return self.rows[slot].copy(), 0.0


def topology() -> LookupResponse:
    ranks = [SenderRank(rank_id="rank0", dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0, control_endpoint="tcp://p0",
                        session_id="s0", pools=[])]
    return LookupResponse(instance="pre", room=1, dp_rank=0, fingerprint="fp", ranks=ranks,
                          topology=Topology(role="prefill", dp_size=1, cp_size=1, tp_size=1, pp_size=1),
                          plan=OwnerLanePlan(cp_size=1, rule="interleaved"))


@pytest.fixture
def m():
    specs = model_specs("hybrid")
    mem = Memory()
    machine = decode_machine(DecodeConfig(instance="dec", staging="never", transfer_timeout=100.0), specs, AUX,
                             read_aux_row=mem.read, page_digests=lambda *a: np.zeros(0, np.uint64),
                             rank_id=lambda: "dec-id", kind_buffers=fake_descs(specs))
    machine.memory, machine.specs_ = mem, specs
    return machine


def requested(m, room: int = 7, n: int = 22, slot: int = 3, now: float = 1.0):
    r = m.open(room, "pre", None, now)
    if r.state.state == KVPoll.Bootstrapping:
        ask, = [a for a in m.tick(now) if isinstance(a, LookUp)]
        m.looked_up(room, ask.key, topology(), None, now)
    units = m.kinds.check_units(room, decode_units(m.specs_, n, slot), n, 0)
    m.feed(de.InitKinds(r, units))
    acts = m.init(r, decode_pages(n), 1, n, 0, now)
    req, = [a.msg for a in acts if isinstance(a, Send) and isinstance(a.msg, wire.TransferRequest)]
    assert sorted(req.kind_units) == ["mamba_conv", "mamba_ssm"] and req.kind_units["mamba_conv"] == b"\x03\0\0\0"
    return r


def done(room: int, kinds: dict, last: bool, aux: bool = False) -> wire.PagesDone:
    return wire.PagesDone(room=room, cp_rank=0, status="ok", reason="", pools=[], logical_pages=b"", digests=None,
                          aux=aux, num_tokens=22 if aux else 0, kind_last=last,
                          kind_units={p: np.asarray(u, "<i4").tobytes() for p, u in kinds.items()})


def test_decode_commits_only_once_every_kind_arrived(m):
    """The aux row and the window's page 4 are in; page 5 of the window and the state are not:
    no commit. The last write brings them: Success."""
    r = requested(m)
    m.memory.land(1, 7)
    m.message("tcp://p0", done(7, {"swa": [4]}, False), 2.0)
    m.message("tcp://p0", done(7, {}, False, aux=True), 2.1)
    assert r.state.state == KVPoll.Transferring
    m.message("tcp://p0", done(7, {"swa": [5], "mamba_conv": [0], "mamba_ssm": [0]}, True), 2.2)
    assert r.state.state == KVPoll.Success, r.state.reason


def test_state_reported_before_the_last_chunk_fails_the_room(m):
    r = requested(m)
    m.message("tcp://p0", done(7, {"mamba_conv": [0]}, False), 2.0)
    assert r.state.state == KVPoll.Failed and "last chunk" in r.state.reason


def test_a_window_page_outside_the_window_fails_the_room(m):
    r = requested(m)
    m.message("tcp://p0", done(7, {"swa": [3]}, False), 2.0)
    assert r.state.state == KVPoll.Failed and "outside what decode needs" in r.state.reason


def test_a_unit_reported_twice_fails_the_room(m):
    r = requested(m)
    m.message("tcp://p0", done(7, {"swa": [4]}, False), 2.0)
    m.message("tcp://p0", done(7, {"swa": [4]}, False), 2.1)
    assert r.state.state == KVPoll.Failed and "twice" in r.state.reason


def test_an_aborted_rooms_state_slot_frees_with_its_pages_not_before(m):
    """Room 7 holds slot 3 and is aborted; its prefill rank was asked and has not acknowledged:
    slot 3 is refused to room 8 (a write may still land). The abort ack makes the pages
    releasable, and the slot with them."""
    r = requested(m, 7, slot=3)
    m.abort(r, "decode gave up", 2.0)
    assert r.state.state == KVPoll.Failed and not r.pages_releasable
    r8 = m.open(8, "pre", None, 2.1)
    units = m.kinds.check_units(8, decode_units(m.specs_, 22, 3), 22, 0)
    with pytest.raises(LayoutError, match="state slot 3 is held by room 7"):
        m.feed(de.InitKinds(r8, units))
    m.message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 2.2)
    assert r.pages_releasable
    m.feed(de.InitKinds(r8, units))  # taken back with the pages
    assert m.kinds.slot_of[8] == 3


def test_a_slot_another_live_room_holds_is_refused(m):
    requested(m, 7, slot=3)
    r8 = m.open(8, "pre", None, 2.1)
    with pytest.raises(LayoutError, match="state slot 3"):
        m.feed(de.InitKinds(r8, m.kinds.check_units(8, decode_units(m.specs_, 22, 3), 22, 0)))


def test_decode_checks_the_engines_kind_units(m):
    with pytest.raises(LayoutError) as err:
        m.kinds.check_units(5, decode_units(m.specs_, 22), None, 0)
    assert err.value.field == "num_tokens"
    with pytest.raises(LayoutError) as err:
        m.kinds.check_units(5, {"mamba_conv": [1]}, 22, 0)
    assert err.value.field == "kind_units"
    with pytest.raises(PageRangeError):
        m.kinds.check_units(5, {"mamba_conv": [CAP], "mamba_ssm": [0]}, 22, 0)


def test_a_timed_out_room_names_the_kind_units_it_misses(m):
    r = requested(m)
    m.message("tcp://p0", done(7, {"swa": [4]}, False), 2.0)
    m.running(2.0, 200.0)
    assert r.state.state == KVPoll.Failed and "'swa': [5]" in r.state.reason and "mamba_conv" in r.state.reason


# -- the staged path: chunks land in decode's staging slots and are scattered into the room's units --

SLOT = 4096
AREA = 1 << 44


@pytest.fixture
def ms():
    """The hybrid's decode machine with a staging area of 2 slots, staged only."""
    from kvbridge.layout.kinds import kind_specs
    from kvbridge.transfer.decode.staging import DecodeStaging
    from kvbridge.transfer.staging.area import StagingArea

    specs = model_specs("hybrid")
    mem = Memory()
    descs = fake_descs(specs)
    cfg = DecodeConfig(instance="dec", staging="always", staging_bytes=2 * SLOT, staging_slot_bytes=SLOT,
                       transfer_timeout=100.0, lease_ttl=2.0, lease_quarantine=3.0)
    machine = decode_machine(cfg, specs, AUX, read_aux_row=mem.read, page_digests=lambda *a: np.zeros(0, np.uint64),
                             rank_id=lambda: "dec-id", kind_buffers=descs,
                             staging=DecodeStaging(StagingArea(2, SLOT), AREA, descs, "dec", kind_specs=kind_specs(specs)))
    machine.memory, machine.specs_, machine.descs = mem, specs, {(d.pool, d.layer_id): d for d in descs}
    return machine


def into(m, pool: str, layer: int, unit: int, nbytes: int = 16) -> wire.SlotRequest:
    """Chunk 0 of cp0 asks for a slot: ``nbytes`` for unit ``unit`` of ``pool`` layer ``layer``."""
    d = m.descs[(pool, layer)]
    return ask(scatter=wire.pack_scatter(np.array([0]), np.array([d.base + unit * d.bytes_per_page]),
                                         np.array([nbytes])))


def ask(room: int = 7, scatter: bytes = b"") -> wire.SlotRequest:
    return wire.SlotRequest(room=room, cp_rank=0, chunk=0, num_bytes=SLOT, scatter=scatter)


LANDED = wire.ChunkLanded(room=7, cp_rank=0, chunk=0, slot=0, status="ok", reason="")  # (chunk 0 of cp0, in slot 0)


@pytest.mark.parametrize("pool, layer, unit, why", [
    ("swa", 0, int(decode_pages(22)[0]), "window"),  # the room's page of logical page 0: outside the window
    ("mamba_conv", 1, int(decode_pages(22)[1]), "state"),  # one of the room's pages, not its state slot 3
    ("mamba_ssm", 3, 4, "state"),  # another slot
])
def test_a_staged_chunk_into_a_unit_of_a_kind_pool_the_room_does_not_hold_fails_the_room(ms, pool, layer, unit, why):
    """Hard rule 5 for the kind pools on the staged path: decode checks a chunk's scatter list
    against the room's units of each kind pool (a paged window: the window's pages; a state
    pool: its slot), not against its pages alone."""
    r = requested(ms)
    acts = ms.message("tcp://p0", into(ms, pool, layer, unit), 2.0)
    assert r.state.state == KVPoll.Failed and f"units of pool {pool!r}" in r.state.reason, r.state.reason
    assert not [a for a in acts if type(a).__name__ in ("Scatter", "SlotGrant")] and ms.staging.area.num_free == 2


def test_staged_kind_units_scatter_into_the_rooms_units_and_commit_after_the_scatter(ms):
    from kvbridge.transfer.decode.staging import Scatter

    r = requested(ms)
    swa, conv = ms.descs[("swa", 0)], ms.descs[("mamba_conv", 1)]
    window_page = int(decode_pages(22)[5])  # logical page 5: in the window
    scatter = wire.pack_scatter(np.array([0, 64]), np.array([swa.base + window_page * swa.bytes_per_page,
                                                             conv.base + 3 * conv.bytes_per_page]), np.array([64, 32]))
    ms.message("tcp://p0", ask(scatter=scatter), 2.0)
    acts = ms.message("tcp://p0", LANDED, 2.1)
    (sc,) = [a for a in acts if isinstance(a, Scatter)]
    assert sc.slot == 0 and r.state.state == KVPoll.Transferring
    ms.memory.land(1, 7)
    ms.message("tcp://p0", done(7, {"swa": [4, 5], "mamba_conv": [0], "mamba_ssm": [0]}, True, aux=True), 2.2)
    assert r.state.state == KVPoll.Transferring  # every unit reported, the chunk not yet scattered
    ms.scattered(7, 0, 2.3)
    assert r.state.state == KVPoll.Success, r.state.reason


def test_an_aborted_staged_rooms_state_slot_frees_at_once_its_staging_slot_after_the_ack(ms):
    """Staged only, no scatter running: nothing remote lands in the room's units, so its state
    slot frees with its pages at once; the staging slot granted to its sender stays quarantined
    until that sender acknowledged (hard rule 6)."""
    from kvbridge.transfer.staging.area import SlotState

    r = requested(ms, 7, slot=3)
    ms.message("tcp://p0", ask(), 2.0)
    ms.abort(r, "decode gave up", 2.1)
    assert r.pages_releasable and ms.staging.area.state(0) is SlotState.QUARANTINED
    ms.close(r, 2.2)
    r8 = ms.open(8, "pre", None, 2.3)
    ms.feed(de.InitKinds(r8, ms.kinds.check_units(8, decode_units(ms.specs_, 22, 3), 22, 0)))
    assert ms.kinds.slot_of[8] == 3  # the slot is free for the next room
    assert ms.staging.area.state(0) is SlotState.QUARANTINED  # a write may still land in the staging slot
    ms.message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 2.4)
    assert ms.staging.area.num_free == 2


def test_a_staged_scatter_into_a_ring_window_or_compressed_pool_stays_inside_the_rooms_row_and_entry_pages():
    """A ring window's unit is the request row (``stride`` token rows), a compressed pool's its
    entry page: a scatter into row 2 or entry page 9 passes for a room holding them; row 3, or
    an entry page the room does not hold, though it is one of the room's token pages, fails."""
    from kvbridge.errors import LedgerError
    from kvbridge.transfer.decode.staging import DecodeStaging, Scatter
    from kvbridge.transfer.staging.area import StagingArea

    ring = kvb.window_pool("ring", [0], 16, window=8, page_size=PAGE, ring_stride=8)
    comp = kvb.compressed_pool("comp", [0], 32, ratio=4, page_size=PAGE)
    specs = {"ring": ring, "comp": comp}
    descs = fake_descs(specs)
    base = {d.pool: d.base for d in descs}
    room_units = {"ring": np.array([2]), "comp": np.array([9, 4])}

    def land(pool: str, at: int, n: int):
        st = DecodeStaging(StagingArea(2, SLOT), AREA, descs, "dec", kind_specs=specs)
        out: list = []
        scatter = wire.pack_scatter(np.array([0]), np.array([base[pool] + at]), np.array([n]))
        st.request(7, (0, 0, 0), "tcp://p0", wire.SlotRequest(room=7, cp_rank=0, chunk=0, num_bytes=n, scatter=scatter),
                   np.array([3, 4, 5]), -1, out, kind_units=room_units)
        st.landed(7, (0, 0, 0), LANDED, out)
        return [a for a in out if isinstance(a, Scatter)]

    row = 8 * 16  # a ring row: stride 8 rows of 16 B
    assert land("ring", 2 * row, row) and land("ring", 2 * row + 5 * 16, 3 * 16)  # row 2, whole or wrapped part
    assert land("comp", 9 * comp.bytes_per_page, comp.bytes_per_page)
    for pool, at, n in (("ring", 3 * row, 16), ("ring", 2 * row + 7 * 16, 32),  # row 3; running past row 2
                        ("comp", 5 * comp.bytes_per_page, 16)):  # entry page 5: a token page of the room's, not its
        with pytest.raises(LedgerError, match=f"units of pool '{pool}'"):
            land(pool, at, n)
