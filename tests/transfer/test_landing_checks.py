"""Decode's check of a staged chunk's scatter list (``DecodeStaging.request``, wire 16: the list
comes with the chunk's SlotRequest and is used when it lands): the per-room unit
table gives the verdicts of the per-landing check it replaced, on many random lists; the table
follows the room's inputs and is dropped with the room; the entries it proves inside the
stager's device memory reach ``CudaStager.copy`` as ``Scatter.unproven``'s complement, and only
the rest is looked up there."""

from __future__ import annotations

import numpy as np
import pytest

import kvbridge as kvb
from _local import RecordingCopier
from kvbridge.errors import LedgerError
from kvbridge.layout import BufferDesc
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode import staging as decode_staging
from kvbridge.transfer.decode.staging import DecodeStaging, Scatter
from kvbridge.transfer.staging.area import StagingArea
from kvbridge.transfer.staging.stagers import AddressRanges, CudaStager

SLOT = 1 << 16
AREA = 1 << 44
CAP = 200  # units per buffer (past 127: the tables count beyond int8)
U = np.uint64

RING = kvb.window_pool("ring", [0], 16, window=8, page_size=4, ring_stride=8)  # unit: a row of 8 x 16 B
COMP = kvb.compressed_pool("comp", [0, 1], 32, ratio=4, page_size=4)
KINDS = {"ring": RING, "comp": COMP}
# the room's pages: two pools (a gap between their buffers, two of them adjacent in memory), and the kind pools
DESCS = [BufferDesc("kv", 0, 1 << 20, CAP, 640), BufferDesc("kv", 1, (1 << 20) + CAP * 640, CAP, 640),
         BufferDesc("idx", 0, 1 << 24, CAP, 96), BufferDesc("ring", 0, 1 << 26, CAP, RING.bytes_per_page),
         BufferDesc("comp", 0, 1 << 27, CAP, COMP.bytes_per_page),
         BufferDesc("comp", 1, (1 << 27) + 4 * CAP * COMP.bytes_per_page, CAP, COMP.bytes_per_page)]
AUX_AT = 1 << 30  # aux rows: host memory far from the pages; and one range inside a page buffer (odd, but checked alike)


def aux_ranges(slot: int) -> list[tuple[int, int]]:
    row = AUX_AT + slot * 512
    return [(row, row + 200), (row + 256, row + 512), (1 << 24, (1 << 24) + 100)]


def old_outside(ds, off, dst, length, page_ids, aux_slot, kind_units):
    """The check as it was before the per-room table (one ``_covered`` per pool and landing),
    kept here as the reference: (why refused or None, the entries it took for aux rows)."""
    if not length.size:
        return None, None
    if page_ids is None:
        return "came before the room's pages are known", None
    if int(length.min()) < 1 or int((off + length).max()) > ds.area.slot_bytes:
        return f"reads outside its {ds.area.slot_bytes} B slot", None
    in_aux = np.zeros(len(dst), dtype=bool)
    for start, end in ds.aux_ranges(aux_slot) if aux_slot >= 0 else ():
        in_aux |= (dst >= np.uint64(start)) & (dst + length <= np.uint64(end))
    aux = in_aux
    dst, length = dst[~in_aux], length[~in_aux]
    if not length.size:
        return None, aux
    i = np.searchsorted(ds._base, dst, side="right").astype(np.int64) - 1
    if (i < 0).any():
        return "writes below every registered buffer", None
    base, unit = ds._base[i], ds._unit[i]
    if ((dst + length) > ds._end[i]).any():
        return "writes past a registered buffer's end", None
    first = ((dst - base) // unit).astype(np.int64)
    last = ((dst + length - np.uint64(1) - base) // unit).astype(np.int64)
    pool = ds._pool[i]
    for k in np.unique(pool).tolist():
        sel = pool == k
        held = page_ids if k < 0 else kind_units.get(ds._kinds[k], np.zeros(0, dtype=np.int64))
        held = np.asarray(held, dtype=np.int64)
        f, la = first[sel], last[sel]
        top = int(la.max()) + 1
        mine = np.zeros(top + 1, dtype=np.int64)
        mine[held[(held >= 0) & (held < top)]] = 1
        count = np.concatenate(([0], np.cumsum(mine)))
        if not bool(((count[la + 1] - count[f]) == (la - f + 1)).all()):
            if k < 0:
                return "writes into pages this room does not hold", None
            return f"writes into units of pool {ds._kinds[k]!r} that this room does not hold", None
    return None, aux


def staging(kernel_ranges=None) -> DecodeStaging:
    return DecodeStaging(StagingArea(2, SLOT), AREA, DESCS, "dec", aux_ranges=aux_ranges, kind_specs=KINDS,
                         kernel_ranges=kernel_ranges)


def all_device_memory() -> AddressRanges:
    return AddressRanges([(d.base, d.capacity_pages * d.bytes_per_page) for d in DESCS] + [(AREA, 2 * SLOT)])


def random_list(rng, page_ids, kind_units, aux_slot):
    """Mostly entries into what the room holds (single units, runs, parts of a unit), and with
    some probability each kind of wrong one."""
    descs = {d.pool: [x for x in DESCS if x.pool == d.pool] for d in DESCS}
    unit_of = {"kv": 640, "idx": 96, "ring": 8 * 16, "comp": COMP.bytes_per_page}
    held_of = {"kv": page_ids, "idx": page_ids, **kind_units}
    dst, length = [], []
    for _ in range(int(rng.integers(1, 30))):
        pool = ["kv", "idx", "ring", "comp"][int(rng.integers(0, 4))]
        d = descs[pool][int(rng.integers(0, len(descs[pool])))]
        unit = unit_of[pool]
        held = np.sort(np.asarray(held_of.get(pool, np.zeros(0, np.int64))))
        held = held[(held >= 0) & (held < CAP)]
        roll = rng.random()
        if roll < 0.04:  # below every buffer
            dst.append(int(rng.integers(0, 1 << 20))), length.append(16)
        elif roll < 0.08:  # from a buffer's last unit past its end (into the adjacent one, or a gap)
            dst.append(d.base + CAP * d.bytes_per_page - 8), length.append(int(rng.integers(9, 64)))
        elif roll < 0.14:  # a unit the room may not hold
            u = int(rng.integers(0, CAP))
            dst.append(d.base + u * unit), length.append(unit)
        elif roll < 0.22:  # an aux row range (whole or part), or one running past it
            start, end = aux_ranges(max(aux_slot, 0))[int(rng.integers(0, 3))]
            a = start + int(rng.integers(0, end - start))
            dst.append(a), length.append(int(rng.integers(1, end - a + 1)) + (8 if rng.random() < 0.2 else 0))
        elif held.size:  # inside held units: a part of one, or a run of consecutive held ones
            j = int(rng.integers(0, held.size))
            run = 1
            while j + run < held.size and held[j + run] == held[j] + run and rng.random() < 0.5:
                run += 1
            at = int(rng.integers(0, unit // 2)) if rng.random() < 0.3 else 0
            dst.append(d.base + int(held[j]) * unit + at), length.append(run * unit - at)
        else:
            dst.append(d.base), length.append(8)
    n = len(dst)
    off = rng.integers(0, SLOT // 2, n)
    if rng.random() < 0.03:
        off[0] = SLOT - 4  # reads past the slot
    if rng.random() < 0.03:
        length[0] = 0
    return np.asarray(off, U), np.asarray(dst, U), np.asarray(length, U)


@pytest.mark.parametrize("seed", range(4))
def test_the_room_table_gives_the_old_checks_verdicts_and_names_the_same_problem(seed):
    rng = np.random.default_rng(seed)
    ds = staging(all_device_memory())
    page_ids = rng.permutation(CAP + 4)[:10] - 2  # (a negative and past-capacity id or two: never held)
    kind_units = {"ring": np.array([2, 5]), "comp": rng.permutation(CAP)[:6]}
    verdicts = set()
    for trial in range(700):
        if trial % 100 == 99:  # the room's inputs change: the table follows (same room id)
            page_ids = rng.permutation(CAP)[: int(rng.integers(1, CAP))]
            kind_units = {"comp": rng.permutation(CAP)[:4]} if trial % 200 == 99 else {"ring": np.array([1])}
        aux_slot = int(rng.integers(-1, 3))
        off, dst, length = random_list(rng, page_ids, kind_units, aux_slot)
        want, aux = old_outside(ds, off, dst, length, page_ids, aux_slot, kind_units)
        got, unproven = ds._outside(3, off, dst, length, page_ids, aux_slot, kind_units)
        assert got == want, (trial, dst.tolist(), length.tolist())
        if want is None:  # every entry of a vouched buffer proven; what the old check took for aux not
            if aux is not None and aux.any():
                assert set(unproven.tolist()) <= set(np.flatnonzero(aux).tolist())
                # an aux entry outside every page buffer is never proven (it may be host memory)
                outside = [k for k in np.flatnonzero(aux).tolist() if not (1 << 24) <= int(dst[k]) < (1 << 25)]
                assert set(outside) <= set(unproven.tolist())
            else:
                assert unproven.size == 0
        verdicts.add(want)
    # the lists reached every verdict
    assert {None, "writes below every registered buffer", "writes past a registered buffer's end",
            "writes into pages this room does not hold", f"reads outside its {SLOT} B slot"} <= verdicts
    assert any(v and "units of pool" in v for v in verdicts)


def land(ds, room, dst, length, page_ids, kind_units=None, aux_slot=-1, chunk=0):
    """A chunk of ``room`` asks with this list (checked then), is granted a slot and lands."""
    out: list = []
    scatter = wire.pack_scatter(np.zeros(len(dst), U), np.asarray(dst, U), np.asarray(length, U))
    ds.request(room, (0, 0, 0), "tcp://p0", wire.SlotRequest(room=room, cp_rank=0, chunk=chunk, num_bytes=64,
                                                              scatter=scatter), page_ids, aux_slot, out,
               kind_units=kind_units)
    slot = out[-1].msg.slot
    msg = wire.ChunkLanded(room=room, cp_rank=0, chunk=chunk, slot=slot, status="ok", reason="")
    ds.landed(room, (0, 0, 0), msg, out)
    sc = [a for a in out if isinstance(a, Scatter)]
    ds.scattered(room, slot, [])
    return sc[0]


def test_refusals_through_request_name_the_chunk_and_what_was_wrong():
    ds = staging(all_device_memory())
    kv = DESCS[0]
    pages = np.array([1, 2])
    assert land(ds, 7, [kv.base + 640], [640], pages).unproven.size == 0
    for dst, n, why in (([kv.base + 3 * 640], [640], "writes into pages this room does not hold"),
                        ([kv.base + 2 * 640 + 600], [80], "writes into pages this room does not hold"),
                        ([5], [8], "writes below every registered buffer"),
                        ([DESCS[2].base + CAP * 96 - 8], [16], "writes past a registered buffer's end"),
                        ([DESCS[3].base], [16], "writes into units of pool 'ring' that this room does not hold"),
                        ([2**64 - 8], [16], "writes past the end of the address space")):
        with pytest.raises(LedgerError, match="chunk 1's scatter list " + why) as err:
            land(ds, 7, dst, n, pages, chunk=1)
        assert err.value.field == "scatter" and err.value.room == 7
        assert ds.area.num_free == 2 and not ds.lists and not ds.list_bytes  # no slot granted, no list kept


def test_a_unit_id_past_its_pools_units_holds_nothing_of_the_next_pool():
    """The table puts every pool's units side by side: a page id at (or past) the page buffers'
    capacity must not stand for the first unit of the next pool (nor a kind unit for the next kind's)."""
    ds = staging()
    ring, comp = DESCS[3], DESCS[4]  # (in the table: the pages, then comp's CAP units, then ring's CAP // 2 rows)
    got, _ = ds._outside(7, np.zeros(1, U), np.array([comp.base], U), np.array([16], U), np.array([CAP, CAP + 1]),
                         -1, {})
    assert got == "writes into units of pool 'comp' that this room does not hold"
    got, _ = ds._outside(7, np.zeros(1, U), np.array([ring.base], U), np.array([16], U), np.array([0]), -1,
                         {"comp": np.array([CAP, CAP + 3])})
    assert got == "writes into units of pool 'ring' that this room does not hold"


def test_a_slot_offset_that_wraps_around_is_refused():
    """Offset 2**64 - 8 and length 16 sum to 8 in uint64: the old check let that pass, and the
    copy would have read 8 bytes before the slot."""
    ds = staging()
    got, _ = ds._outside(7, np.array([2**64 - 8], U), np.array([DESCS[0].base], U), np.array([16], U),
                         np.array([0]), -1, {})
    assert got == f"reads outside its {SLOT} B slot"


def test_the_table_follows_the_rooms_page_ids_even_when_the_caller_writes_into_its_array():
    ds = staging()
    kv = DESCS[0]
    pages = np.array([1, 2])
    assert ds._outside(7, np.zeros(1, U), np.array([kv.base + 640], U), np.array([640], U), pages, -1, {})[0] is None
    pages[0] = 5  # the same array object, other content: page 1 is no longer the room's
    got, _ = ds._outside(7, np.zeros(1, U), np.array([kv.base + 640], U), np.array([640], U), pages, -1, {})
    assert got == "writes into pages this room does not hold"
    assert ds._outside(7, np.zeros(1, U), np.array([kv.base + 5 * 640], U), np.array([640], U), pages, -1,
                       {})[0] is None
    # kind units likewise (they are known from the room's request, possibly after its pages)
    ring = DESCS[3]
    assert ds._outside(7, np.zeros(1, U), np.array([ring.base + 2 * 128], U), np.array([16], U), pages, -1,
                       {})[0] == "writes into units of pool 'ring' that this room does not hold"
    assert ds._outside(7, np.zeros(1, U), np.array([ring.base + 2 * 128], U), np.array([16], U), pages, -1,
                       {"ring": np.array([2])})[0] is None


def test_a_rooms_table_is_dropped_when_it_fails_or_is_forgotten_and_the_cache_stays_bounded(monkeypatch):
    ds = staging()
    kv = DESCS[0]
    land(ds, 7, [kv.base + 640], [640], np.array([1]))
    land(ds, 8, [kv.base + 640], [640], np.array([1]))
    assert set(ds._held) == {7, 8} and ds._held_bytes == sum(h.nbytes for h in ds._held.values())
    ds.fail_room(7, 100.0, [])
    assert set(ds._held) == {8}
    ds.forget(8)
    assert not ds._held and ds._held_bytes == 0
    land(ds, 0, [kv.base + 640], [640], np.arange(2))
    budget = 4 * ds._held_bytes
    monkeypatch.setattr(decode_staging, "HELD_CACHE_BYTES", budget)
    for room in range(20):
        land(ds, room, [kv.base + 640], [640], np.arange(room + 2))
        assert ds._held_bytes == sum(h.nbytes for h in ds._held.values()) <= budget
        assert room in ds._held  # the latest landed is kept; the least recently landed go first
    assert 1 < len(ds._held) < 20


def test_only_buffers_inside_one_stager_region_are_proven_and_without_ranges_nothing_is():
    """A buffer whose checked extent is not inside one of the stager's regions (a padded RawBuffer
    whose last page ends with its payload: its extent runs past its region) keeps its entries
    in ``unproven``; so do aux entries; without ranges (a host stager) nothing is proven."""
    kv, idx = DESCS[0], DESCS[2]
    regions = [(d.base, d.capacity_pages * d.bytes_per_page) for d in DESCS if d is not idx]
    short = AddressRanges(regions + [(idx.base, CAP * 96 - 40), (AREA, 2 * SLOT)])
    pages = np.array([1, 2])
    aux = aux_ranges(1)[0][0]
    dst, n = [kv.base + 640, idx.base + 96, aux, idx.base + 2 * 96], [640, 96, 64, 96]
    assert land(staging(short), 7, dst, n, pages, aux_slot=1).unproven.tolist() == [1, 2, 3]
    assert land(staging(short), 7, dst[:2], n[:2], pages).unproven.tolist() == [1]  # (no aux row: one pass)
    assert land(staging(all_device_memory()), 7, dst, n, pages, aux_slot=1).unproven.tolist() == [2]
    assert land(staging(None), 7, dst, n, pages, aux_slot=1).unproven is None
    no_area = AddressRanges([(d.base, d.capacity_pages * d.bytes_per_page) for d in DESCS])  # the slots not vouched
    assert land(staging(no_area), 7, dst, n, pages, aux_slot=1).unproven is None


def test_the_stager_looks_up_only_the_unproven_entries_aux_rows_by_plain_copy():
    pages, slot, host = (1 << 20, 4096), (1 << 24, 8192), 1 << 30
    rec = RecordingCopier()
    stager = CudaStager(copier=rec, device_ranges=[pages, slot])
    asked = []
    hold = stager.ranges.hold
    stager.ranges.hold = lambda addr, length: asked.append(addr.size) or hold(addr, length)
    src = np.array([1 << 24, (1 << 24) + 1024, (1 << 24) + 2048, (1 << 24) + 4096], U)  # the slot
    dst = np.array([1 << 20, host, (1 << 20) + 1024, (1 << 20) + 2048], U)  # pages; an aux row in host memory
    n = np.array([1024, 64, 1024, 512], U)
    stager.copy(src, dst, n, unproven=np.array([1, 3]))
    assert asked == [2, 2]  # the two unproven entries, source and destination; nothing else looked up
    assert rec.copies == [((1 << 24) + 1024, host, 64)]
    assert rec.launches == [([1 << 24, (1 << 24) + 2048, (1 << 24) + 4096],
                             [1 << 20, (1 << 20) + 1024, (1 << 20) + 2048], [1024, 1024, 512])]
    asked.clear(), rec.launches.clear(), rec.copies.clear()
    stager.copy(src[[0, 2]], dst[[0, 2]], n[[0, 2]], unproven=np.zeros(0, np.int64))
    assert asked == [] and rec.copies == [] and len(rec.launches) == 1  # nothing to look up: one launch
    rec.launches.clear()
    stager.copy(src, dst, n)  # no proof (gather on prefill): every entry looked up, as before
    assert asked == [4, 4] and rec.copies == [((1 << 24) + 1024, host, 64)]
    assert rec.launches[0][1] == [1 << 20, (1 << 20) + 1024, (1 << 20) + 2048]


def test_a_landed_chunk_with_its_aux_row_reaches_the_stager_as_one_launch_and_one_plain_copy():
    """The machine's Scatter handed to the stager, as the decode endpoint does (``_scatter``)."""
    ranges = [(d.base, d.capacity_pages * d.bytes_per_page) for d in DESCS] + [(AREA, 2 * SLOT)]
    rec = RecordingCopier()
    stager = CudaStager(copier=rec, device_ranges=ranges)
    ds = staging(stager.ranges)
    aux = aux_ranges(0)[1][0]
    sc = land(ds, 7, [DESCS[0].base + 640, aux, DESCS[1].base], [640, 100, 640], np.array([0, 1]), aux_slot=0)
    assert sc.unproven.tolist() == [1]
    stager.copy(sc.src, sc.dst, sc.length, unproven=sc.unproven)
    assert rec.copies == [(int(sc.src[1]), aux, 100)]
    assert rec.launches == [([int(sc.src[0]), int(sc.src[2])], [DESCS[0].base + 640, DESCS[1].base], [640, 640])]


def test_a_padded_buffers_last_stride_past_its_registered_memory_is_refused():
    """A padded host buffer whose last page ends with its payload counts that page
    (``PoolSpec.validate_buffer``), but the stride after the payload is not registered memory:
    an entry reaching into it would be decode's own stray write, so it is refused as a write past
    the buffer's end, and the payload of that page is still writable; its buffer is then inside
    the stager's region and proven."""
    stride, payload, base = 640, 600, 1 << 20
    nbytes = 2 * stride + payload  # three pages, the last one ending with its payload
    desc = BufferDesc("kv", 0, base, 3, stride)
    region = [(base, nbytes), (AREA, 2 * SLOT)]
    pages = np.arange(3, dtype=np.int64)
    for registered, refused in (((), False), ([(base, nbytes)], True)):
        ds = DecodeStaging(StagingArea(2, SLOT), AREA, [desc], "dec", kernel_ranges=AddressRanges(region),
                           registered=registered)
        last = [base + 2 * stride]
        if refused:
            with pytest.raises(LedgerError, match="writes past a registered buffer's end"):
                land(ds, 1, last, [stride], pages)
            assert land(ds, 2, last, [payload], pages).unproven.tolist() == []  # proven: inside the region
        else:  # without the registered regions (the check as it was): the stride passes, unproven
            assert land(ds, 1, last, [stride], pages).unproven.tolist() == [0]


def test_the_fast_look_ups_answer_as_the_binary_search_and_the_integer_division():
    """``_FastUnits`` (the list check's bucket table and float64 division) against what it replaces,
    on addresses at and around every buffer's base, unit edges and end, and random ones; the cases
    it declines are declined (two buffers on one base, a table past its cap, units near 2**53)."""
    ds = staging()
    fast = ds._fast
    assert fast is not None
    rng = np.random.default_rng(5)
    edges = []
    for d, unit in zip(ds._base.tolist(), ds._unit.tolist()):
        for k in (0, 1, 2, CAP - 1):
            edges += [d + k * unit - 1, d + k * unit, d + k * unit + 1]
    addr = np.concatenate([np.asarray(edges, U), rng.integers(int(ds._base[0]), fast.covered, 20_000).astype(U)])
    addr = addr[(addr >= ds._base[0]) & (addr < U(fast.covered))]
    i = fast.buffer(addr)
    assert (i == np.searchsorted(ds._base, addr, side="right") - 1).all()
    inside = addr + U(1) <= ds._end[i]  # (units is asked only of entries inside their buffer)
    addr, i = addr[inside], i[inside]
    length = np.minimum(rng.integers(1, 3 * 640, addr.size).astype(U), ds._end[i] - addr)
    lo, hi1 = fast.units(addr, length, ds._lo_base, i)
    assert (lo == ((addr - ds._lo_base[i]) // ds._unit[i]).view(np.int64)).all()
    assert (hi1 == ((addr + length - ds._hi_base[i]) // ds._unit[i]).view(np.int64)).all()
    same_base = [BufferDesc("kv", 0, 1 << 20, CAP, 640), BufferDesc("idx", 0, 1 << 20, CAP, 96)]
    assert DecodeStaging(StagingArea(2, SLOT), AREA, same_base, "dec")._fast is None
    far = [BufferDesc("kv", 0, 1 << 45, CAP, 640)]  # two buffers far apart: two buckets
    assert DecodeStaging(StagingArea(2, SLOT), AREA, far + DESCS[:1], "dec")._fast is not None
    # and a third close to one of them: buckets of 2**16 B over 2**45 B, past the cap
    assert DecodeStaging(StagingArea(2, SLOT), AREA, far + DESCS[:2], "dec")._fast is None
    huge = [BufferDesc("kv", 0, 1 << 20, 1 << 40, 1 << 14)]  # 2**54 bytes of units
    assert DecodeStaging(StagingArea(2, SLOT), AREA, huge, "dec")._fast is None
