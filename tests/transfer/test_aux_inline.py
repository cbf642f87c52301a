"""The aux row in the report that carries it (issue 33, wire 14): a decode rank whose aux rows
kvbridge can write (one packed store, host or CUDA) asks for it inline (``TransferRequest.
aux_inline``); the prefill rank then puts the row's bytes in a report (``PagesDone.aux_row``)
instead of writing them into decode's aux rows: the report of the write that would have carried
them, or (``aux_ahead``, wire 15: decode's rows are device memory) a report of its own sent
right after that write is posted, or, for a room's last send after its pages went, the only
thing that send does. Decode checks the row when the report comes (asked for, one
whole row, this room's echo: hard rule 4), then writes it into the room's slot: at once when
pages are still to land (``WriteAuxRow``), else at the commit. Sans-I/O on both sides, then
real endpoints over the local engine and Mooncake."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import KVBridgeError, PageRangeError
from kvbridge.layout import AuxSchema, deepseek_pools
from kvbridge.transfer.aux_rows import AuxBuffers
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.events import ReadForCommit, WriteAuxRow
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.events import AuxFrom, PostWrite
from _machines import decode_machine
from test_decode_room import INSTANCE, SCHEMA, booted, done, of, sends
from test_prefill_room import AUX, AUXF, D, DONE, Shell, _packed, msgs, opened_and_asked
from test_prefill_room import m as m  # noqa: F401  (the prefill machine fixture)
from test_prefill_room import request as prefill_request


# -- prefill: what goes in the write, what goes in the report ----------------------------------------

def asked_inline(m, room: int = 1, num_tokens: int = 7, ahead: bool = False):
    """A room whose decode rank asked for the aux row inline (``ahead``: in a report of its own)."""
    r = m.open(room, 1.0)
    m.engine_init(r, num_tokens, None, 1.0)
    req = prefill_request(room, num_tokens)
    m.message(D, wire.TransferRequest(**{**{f: getattr(req, f) for f in req.__struct_fields__}, "aux_inline": True,
                                         "aux_ahead": ahead}), 1.0)
    return r


def row_bytes(room: int) -> bytes:
    return _packed(room).tobytes()


def aux_from(room: int) -> AuxFrom:
    """Where the shell staged the row, and its bytes (``send(aux=...)``: final when given)."""
    return AuxFrom(AUXF.regions, AUXF.slot, row=row_bytes(room))


def test_a_whole_send_writes_the_pages_alone_and_its_report_carries_the_row(m):
    sh, r = Shell(m), asked_inline(m)
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(1), None)
    acts = sh.run(m.post(r, 1.1, aux_from(1)), 1.1)
    (w,) = of(acts, PostWrite)
    assert not msgs(acts, wire.PagesDone)  # no report before the write's
    assert not (w.dst >= 1 << 50).any()  # nothing lands in decode's aux rows (registered at 1 << 50)
    (handle, _), = sh.posted
    (report,) = msgs(m.write_final(handle, DONE, 1.2), wire.PagesDone)
    assert report.aux and report.aux_row == row_bytes(1) and report.num_tokens == 7 and report.logical_pages
    assert r.state.state == KVPoll.Success


def test_a_whole_send_to_a_rank_that_asks_ahead_reports_the_row_on_its_own_after_the_post(m):
    """``aux_ahead`` (decode's rows in device memory): the row's report leaves right after the
    pages' write is posted, long before they land (decode writes the row into its slot
    meanwhile); the pages' report carries no row, and the room ends with it."""
    sh, r = Shell(m), asked_inline(m, ahead=True)
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(1), None)
    acts = sh.run(m.post(r, 1.1, aux_from(1)), 1.1)
    (ahead,) = msgs(acts, wire.PagesDone)
    (w,) = of(acts, PostWrite)
    assert acts.index(w) < next(i for i, a in enumerate(acts) if getattr(a, "msg", None) is ahead)  # the write first
    assert ahead.aux and ahead.aux_row == row_bytes(1) and ahead.num_tokens == 7 and not ahead.logical_pages
    assert not (w.dst >= 1 << 50).any()  # nothing lands in decode's aux rows (registered at 1 << 50)
    assert r.state.state == KVPoll.Transferring
    (handle, _), = sh.posted
    (report,) = msgs(m.write_final(handle, DONE, 1.2), wire.PagesDone)
    assert not report.aux and report.aux_row is None and report.logical_pages
    assert r.state.state == KVPoll.Success


def test_the_last_send_after_the_pages_posts_no_write_and_reports_the_row_at_once(m):
    """A layer-wise room's shape: the pages go with a chunk that is not the last; the last send
    carries the row alone. No write for it: its report is in the send's own actions."""
    sh, r = Shell(m), asked_inline(m)
    m.chunk(r, [0, 1], np.array([5, 6]), 7, False, None, None)
    (pages,) = of(sh.run(m.post(r, 1.1), 1.1), PostWrite)
    m.chunk(r, [], np.array([], np.int64), None, True, _packed(1), None)
    acts = sh.run(m.post(r, 1.2, aux_from(1)), 1.2)
    assert not of(acts, PostWrite)
    (report,) = msgs(acts, wire.PagesDone)
    assert report.aux and report.aux_row == row_bytes(1) and not report.logical_pages
    assert r.state.state == KVPoll.Transferring  # the pages' write is still in flight
    (handle, _), = sh.posted
    (pages_report,) = msgs(m.write_final(handle, DONE, 1.3), wire.PagesDone)
    assert not pages_report.aux and pages_report.aux_row is None and r.state.state == KVPoll.Success


def test_a_decode_rank_that_does_not_ask_gets_the_row_written_as_before(m):
    sh, r = Shell(m), opened_and_asked(m)
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(1), None)
    (w,) = of(sh.run(m.post(r, 1.1, aux_from(1)), 1.1), PostWrite)
    assert int(w.dst[-1]) >> 50 == 1  # the write's last slice is the row, into decode's aux rows
    (handle, _), = sh.posted
    (report,) = msgs(m.write_final(handle, DONE, 1.2), wire.PagesDone)
    assert report.aux and report.aux_row is None


def test_a_row_only_in_memory_is_written_even_to_a_rank_that_asks(m):
    """``send(aux_slot=...)``: the engine's own row, in its registered memory (maybe not final
    until its ready event): the shell has no bytes of it (AuxFrom.row None), so it is written."""
    sh, r = Shell(m), asked_inline(m)
    m.chunk(r, [0, 1], np.array([5, 6]), None, True, _packed(1), None)
    (w,) = of(sh.run(m.post(r, 1.1, AUXF), 1.1), PostWrite)
    assert int(w.dst[-1]) >> 50 == 1
    (handle, _), = sh.posted
    (report,) = msgs(m.write_final(handle, DONE, 1.2), wire.PagesDone)
    assert report.aux and report.aux_row is None


# -- decode: the row checked when its report comes, written at the commit -----------------------------

@pytest.fixture
def d():
    def read(slot):
        raise AssertionError("a row its report carried is never read back from memory")

    return decode_machine(DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, transfer_timeout=100.0),
                          deepseek_pools(num_layers=2, page_size=4, index=False, draft_layers=0), SCHEMA,
                          read_aux_row=read, page_digests=lambda *a: np.zeros(0, np.uint64), rank_id=lambda: "dec-id",
                          aux_inline=True)


def schema_row(room: int, schema: AuxSchema = SCHEMA) -> bytes:
    row = np.zeros(schema.row_bytes, dtype=np.uint8)
    at = schema.offsets["room"]
    row[at : at + 8] = np.frombuffer(np.uint64(room).tobytes(), np.uint8)
    return row.tobytes()


def asked(d, room: int = 7):
    r = booted(d, room)
    (_, req), = sends(d.init(r, np.arange(3, dtype=np.int64) + 10, 1, 10, 0, 1.0), wire.TransferRequest)
    assert req.aux_inline
    return r


def with_row(msg: wire.PagesDone, row: bytes) -> wire.PagesDone:
    return wire.PagesDone(**{**{f: getattr(msg, f) for f in msg.__struct_fields__}, "aux_row": row})


def test_decode_asks_for_the_row_inline_and_writes_what_the_report_carried_into_the_rooms_slot(d):
    r = asked(d)
    d.message("tcp://p1", done(7, 1, [1]), 2.0)
    d.message("tcp://p0", with_row(done(7, 0, [0, 2], aux=True, num_tokens=10), schema_row(7)), 2.1)
    assert r.state.state == KVPoll.Success and r.aux.room == 7
    ((slot, row),) = d.written
    assert slot == 1 and row.tobytes() == schema_row(7)


def test_the_row_may_come_before_the_pages_and_waits_for_them(d):
    """The row alone, ahead of the pages (a prefill rank reports it when it posts them): written
    into the room's slot at once, while they land; the commit writes nothing more."""
    r = asked(d)
    acts = d.message("tcp://p0", with_row(done(7, 0, [], aux=True, num_tokens=10), schema_row(7)), 2.0)  # the row alone
    assert r.state.state == KVPoll.Transferring and [(s, w.tobytes()) for s, w in d.written] == [(1, schema_row(7))]
    assert r.row_written is not None and not of(acts, ReadForCommit)
    d.message("tcp://p0", done(7, 0, [0, 2]), 2.1)
    assert r.state.state == KVPoll.Transferring  # cp1's page 1 is not reported yet
    d.message("tcp://p1", done(7, 1, [1]), 2.2)
    assert r.state.state == KVPoll.Success and r.aux.room == 7 and len(d.written) == 1  # no second write


def test_the_row_in_the_report_that_completes_the_room_is_written_once_at_the_commit(d):
    """A row in the room's last report (a layer-wise room's last send): no write ahead, the
    commit's write."""
    r = asked(d)
    d.message("tcp://p0", done(7, 0, [0, 2]), 2.0)
    d.message("tcp://p1", done(7, 1, [1]), 2.1)
    acts = d.message("tcp://p0", with_row(done(7, 0, [], aux=True, num_tokens=10), schema_row(7)), 2.2)
    assert not of(acts, WriteAuxRow) and r.row_written is None
    assert r.state.state == KVPoll.Success and [(s, w.tobytes()) for s, w in d.written] == [(1, schema_row(7))]


def test_a_row_that_cannot_be_written_ahead_fails_the_room_by_name(d):
    r = asked(d)
    d.write_error = "cudaMemcpyAsync failed: CUDA error 700"
    d.message("tcp://p0", with_row(done(7, 0, [], aux=True, num_tokens=10), schema_row(7)), 2.0)
    assert r.state.state == KVPoll.Failed and not d.written
    assert r.state.reason == ("the aux row its report carried could not be written into slot 1: cudaMemcpyAsync "
                              "failed: CUDA error 700")


@pytest.mark.parametrize("bad, why", [
    (lambda: schema_row(8), "the aux row in its report carries room 8, expected 7"),
    (lambda: schema_row(7)[:-1], f"sent an aux row of {SCHEMA.row_bytes - 1} bytes in its report; the schema's row "
                                 f"is {SCHEMA.row_bytes}"),
    (lambda: schema_row(7) + b"\0", "the schema's row"),
], ids=["another-room", "short", "long"])
def test_a_bad_row_in_a_report_fails_the_room_by_name_and_is_never_written(d, bad, why):
    r = asked(d)
    d.message("tcp://p1", done(7, 1, [1]), 2.0)
    d.message("tcp://p0", with_row(done(7, 0, [0, 2], aux=True, num_tokens=10), bad()), 2.1)
    assert r.state.state == KVPoll.Failed and why in r.state.reason and "cp0" in r.state.reason
    assert not d.written


def test_a_row_from_the_rank_that_does_not_own_the_last_token_fails_the_room(d):
    r = asked(d)
    d.message("tcp://p1", with_row(done(7, 1, [1], aux=True, num_tokens=10), schema_row(7)), 2.0)
    assert r.state.state == KVPoll.Failed and "cp rank 0 owns the last valid token" in r.state.reason
    assert not d.written


def test_a_row_nobody_asked_for_fails_the_room():
    """A decode rank whose rows kvbridge cannot write (or that turned it off) asked for a write:
    a row in the report is refused by name, not written."""
    mem = np.zeros((4, SCHEMA.row_bytes), np.uint8)
    d = decode_machine(DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, transfer_timeout=100.0),
                       deepseek_pools(num_layers=2, page_size=4, index=False, draft_layers=0), SCHEMA,
                       read_aux_row=lambda slot: (mem[slot].copy(), 0.0), page_digests=lambda *a: np.zeros(0),
                       rank_id=lambda: "dec-id")
    r = booted(d, 7)
    (_, req), = sends(d.init(r, np.arange(3, dtype=np.int64) + 10, 1, 10, 0, 1.0), wire.TransferRequest)
    assert not req.aux_inline
    d.message("tcp://p1", done(7, 1, [1]), 2.0)
    d.message("tcp://p0", with_row(done(7, 0, [0, 2], aux=True, num_tokens=10), schema_row(7)), 2.1)
    assert r.state.state == KVPoll.Failed and "which this rank did not ask for" in r.state.reason
    assert not d.written


def test_a_report_that_says_aux_without_the_row_is_read_from_memory_as_before():
    """A prefill rank with the row only in memory (``send(aux_slot=...)``) writes it even to a rank
    that asked: decode then reads it back, as it always did."""
    mem = np.zeros((4, SCHEMA.row_bytes), np.uint8)
    mem[1] = np.frombuffer(schema_row(7), np.uint8)
    reads = []
    d = decode_machine(DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, transfer_timeout=100.0),
                       deepseek_pools(num_layers=2, page_size=4, index=False, draft_layers=0), SCHEMA,
                       read_aux_row=lambda slot: (reads.append(slot) or mem[slot].copy(), 0.0),
                       page_digests=lambda *a: np.zeros(0), rank_id=lambda: "dec-id", aux_inline=True)
    r = asked(d)
    d.message("tcp://p1", done(7, 1, [1]), 2.0)
    d.message("tcp://p0", done(7, 0, [0, 2], aux=True, num_tokens=10), 2.1)
    assert r.state.state == KVPoll.Success and reads == [1] and not d.written


def test_the_wire_refuses_a_row_in_a_report_that_carries_none_or_failed():
    for kw in (dict(status="ok", aux=False), dict(status="failed", aux=True)):
        with pytest.raises(KVBridgeError, match="aux_row"):
            wire.PagesDone(room=1, cp_rank=0, reason="", pools=[], logical_pages=b"", digests=None,
                           aux_row=b"x", **kw)
    too_long = wire.encode(wire.PagesDone(room=1, cp_rank=0, status="ok", reason="", pools=[], logical_pages=b"",
                                          digests=None, aux=True, aux_row=bytes(wire.MAX_AUX_ROW_BYTES)))
    assert wire.decode(too_long).aux_row == bytes(wire.MAX_AUX_ROW_BYTES)
    bigger = wire.encode(wire.PagesDone(room=1, cp_rank=0, status="ok", reason="", pools=[], logical_pages=b"",
                                        digests=None, aux=True, aux_row=bytes(wire.MAX_AUX_ROW_BYTES + 1)))
    with pytest.raises(KVBridgeError, match="aux_row"):
        wire.decode(bigger)


# -- the rows kvbridge writes ----------------------------------------------------------------------------

def test_the_request_asks_for_the_row_ahead_only_with_inline_rows_in_device_memory():
    """The decode machine asks ``aux_ahead`` when its shell says its rows are device memory, and
    never without ``aux_inline``; host rows are not on a device (a real endpoint's rows here)."""
    for inline, ahead, asked in ((True, True, True), (True, False, False), (False, True, False)):
        m = decode_machine(DecodeConfig(instance="dec", transfer_timeout=100.0),
                           deepseek_pools(num_layers=2, page_size=4, index=False, draft_layers=0), SCHEMA,
                           read_aux_row=lambda slot: (None, 0.0), page_digests=lambda *a: np.zeros(0),
                           rank_id=lambda: "dec-id", aux_inline=inline, aux_ahead=ahead)
        r = booted(m)
        (_, req), = sends(m.init(r, np.arange(3, dtype=np.int64) + 10, 1, 10, 0, 1.0), wire.TransferRequest)
        assert (req.aux_inline, req.aux_ahead) == (inline, asked)
    rows = AuxBuffers(SCHEMA, np.zeros((4, SCHEMA.row_bytes), np.uint8), rank="t")
    assert rows.writable and not rows.on_device


def test_host_packed_rows_are_writable_and_a_written_row_reads_back():
    rows = np.zeros((4, SCHEMA.row_bytes), np.uint8)
    aux = AuxBuffers(SCHEMA, rows, rank="d")
    assert aux.writable
    aux.write_row(2, np.frombuffer(schema_row(9), np.uint8))
    assert aux.read_room(2) == 9 and rows[2].tobytes() == schema_row(9) and not rows[[0, 1, 3]].any()
    with pytest.raises(KVBridgeError, match="packed bytes"):
        aux.write_row(2, np.zeros(SCHEMA.row_bytes - 1, np.uint8))
    for slot in (4, -1):  # past the rows, or one numpy would wrap into the last row: refused, nothing written
        for write in (aux.write_row, aux.write_row_async):
            with pytest.raises(PageRangeError, match=rf"aux slot {slot} outside \[0, 4\)"):
                write(slot, np.frombuffer(schema_row(7), np.uint8))
    assert rows[3].tobytes() == bytes(SCHEMA.row_bytes) and aux.read_room(2) == 9


def test_rows_by_region_are_not_writable_and_their_rank_asks_for_a_write():
    by_region = {r.name: np.zeros((4, *r.shape), dtype=np.uint16 if r.dtype == "bfloat16" else r.dtype)
                 for r in SCHEMA.regions}
    aux = AuxBuffers(SCHEMA, by_region, rank="d")
    assert aux.readable and not aux.writable
    with pytest.raises(KVBridgeError, match="not writable"):
        aux.write_row(0, np.frombuffer(schema_row(1), np.uint8))


def test_a_row_written_into_device_rows_goes_through_the_pinned_row_and_the_copy_is_waited_for():
    """The CUDA path of ``write_row`` on the CPU, its runtime calls stubbed: the pinned row holds
    the row when the copy is issued, the copy goes to the slot's address on the rows' stream, and
    the stream is synchronised before the write returns (the engine reads the row after Success).
    On a GPU: test_gpu.py ``test_a_row_written_into_device_rows_is_there_when_the_write_returns``."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from kvbridge.transfer import aux_rows

    rb, calls = SCHEMA.row_bytes, []
    rows = object.__new__(aux_rows._DeviceRows)
    rows._host = np.zeros(rb, np.uint8)
    rows._cuda = SimpleNamespace(
        on_device=lambda device: contextlib.nullcontext(),
        memcpy_async=lambda dst, src, n, stream: calls.append(("copy", dst, src, n, stream, rows._host.tobytes())),
        stream_synchronize=lambda stream: calls.append(("sync", stream)))
    rows._device, rows._base, rows._row_bytes = 0, 1 << 40, rb
    rows._stream, rows._lock = SimpleNamespace(cuda_stream=77), threading.Lock()
    row = np.frombuffer(schema_row(5), np.uint8)
    rows.write(3, row)
    assert calls == [("copy", (1 << 40) + 3 * rb, rows._host.ctypes.data, rb, 77, row.tobytes()), ("sync", 77)]


def test_a_staged_only_rank_takes_the_row_ahead_and_still_refuses_pages_that_bypassed_staging():
    """A decode rank that takes staged writes only (its pages free at once on failure) accepts a
    report of the row alone, which wrote nothing into its memory; a report of pages that came
    through no staging slot is still refused by name."""
    from kvbridge.layout import BufferDesc
    from kvbridge.transfer.decode.staging import DecodeStaging, Scatter
    from kvbridge.transfer.staging.area import StagingArea
    from test_decode_room import AREA_BASE, PAGE, PAGES_BASE, SLOT, Memory, ask, landed

    def staged_only():
        specs = deepseek_pools(num_layers=2, page_size=PAGE, index=False, draft_layers=0)
        (pool, spec), = specs.items()
        bufs = [BufferDesc(pool, layer, PAGES_BASE + layer * (1 << 30), 64, spec.bytes_per_page)
                for layer in spec.layer_ids]
        cfg = DecodeConfig(instance="dec", peer_timeout=5.0, ping_interval=0.5, transfer_timeout=100.0,
                           staging="always", staging_bytes=2 * SLOT, staging_slot_bytes=SLOT)
        m = decode_machine(cfg, specs, SCHEMA, read_aux_row=Memory().read, aux_inline=True, aux_ahead=True,
                           page_digests=lambda *a: np.zeros(0, np.uint64), rank_id=lambda: "dec-id",
                           staging=DecodeStaging(StagingArea(2, SLOT), AREA_BASE, bufs, "dec/dp0/tp0"))
        m.page_bytes = spec.bytes_per_page
        r = booted(m, cp=1)
        (_, req), = sends(m.init(r, np.array([10, 11, 12]), 1, 10, 0, 1.0), wire.TransferRequest)
        assert req.staging_only and req.aux_inline and req.aux_ahead
        return m, r

    m, r = staged_only()
    m.message("tcp://p0", with_row(done(7, 0, [], aux=True, num_tokens=10), schema_row(7)), 1.1)  # the row ahead
    assert r.state.state == KVPoll.Transferring and [(s, w.tobytes()) for s, w in m.written] == [(1, schema_row(7))]
    (_, grant), = sends(m.message("tcp://p0", ask(m, 7, 0, 0, 10), 1.2), wire.SlotGrant)
    (sc,) = of(m.message("tcp://p0", landed(7, 0, 0, grant.slot), 1.3), Scatter)
    m.scattered(7, sc.slot, 1.3)
    m.message("tcp://p0", done(7, 0, [0, 1, 2]), 1.4)
    assert r.state.state == KVPoll.Success and r.aux.room == 7 and len(m.written) == 1

    m, r = staged_only()
    m.message("tcp://p0", with_row(done(7, 0, [], aux=True, num_tokens=10), schema_row(7)), 1.1)
    m.message("tcp://p0", done(7, 0, [0, 1, 2]), 1.2)  # pages no staging slot brought
    assert r.state.state == KVPoll.Failed and "came through no staging slot" in r.state.reason


def test_a_room_keeps_its_aux_slot_while_its_rows_write_is_in_flight(d):
    """On a GPU the row's write ahead is a copy the loop polls (``AuxRowWritten`` comes turns
    later). A room that fails meanwhile is not forgotten (its slot is not the engine's again) until
    the copy ran; one that commits meanwhile writes the row at the commit (behind the first copy
    on the same stream) and is forgotten once the first copy ran too."""
    from kvbridge.transfer.actions import FreeRoom

    d.defer_writes = True
    r = asked(d)
    d.message("tcp://p0", with_row(done(7, 0, [], aux=True, num_tokens=10), schema_row(7)), 2.0)
    assert r.row_writing and len(d.deferred) == 1 and not d.written
    d.abort(r, "engine gave up", 2.1)
    d.message("tcp://p0", wire.AbortAck(room=7, cp_rank=0), 2.2)
    d.message("tcp://p1", wire.AbortAck(room=7, cp_rank=1), 2.3)
    d.close(r, 2.4)
    assert r.state.state == KVPoll.Failed and not r.pages_releasable and 7 in d.rooms
    assert not of(d.tick(2.5), FreeRoom)
    assert of(d.complete_writes(2.6), FreeRoom) == [FreeRoom(7)] and 7 not in d.rooms

    d.written.clear()
    r = asked(d, room=8)
    d.message("tcp://p0", with_row(done(8, 0, [], aux=True, num_tokens=10), schema_row(8)), 3.0)
    d.message("tcp://p0", done(8, 0, [0, 2]), 3.1)
    d.message("tcp://p1", done(8, 1, [1]), 3.2)
    assert r.state.state == KVPoll.Success and r.aux.room == 8 and r.row_writing
    assert [(s, w.tobytes()) for s, w in d.written] == [(1, schema_row(8))]  # the commit's write
    d.close(r, 3.3)
    assert 8 in d.rooms and not r.pages_releasable
    assert of(d.complete_writes(3.4), FreeRoom) == [FreeRoom(8)] and 8 not in d.rooms


def test_a_row_written_without_waiting_goes_from_a_ring_row_and_is_polled_by_its_event():
    """The CUDA path of ``write_row_async`` on the CPU, its runtime calls stubbed: the next ring
    row holds the row when the copy is queued, the copy goes to the slot's address on the rows'
    stream, the ring row's event is recorded behind it and nothing waits; ``done()`` asks the event
    until it passed. A ring row is refilled only once its last copy ran: with every ring row's copy
    still queued, the next write waits for the oldest. On a GPU: test_gpu.py
    ``test_a_row_written_without_waiting_is_there_once_its_write_says_done_and_later_writes_land_after``."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from kvbridge.transfer import aux_rows

    rb, calls, ready = SCHEMA.row_bytes, [], {}
    rows = object.__new__(aux_rows._DeviceRows)
    ring = aux_rows.RING_ROWS  # (the ring as write_async makes it on its first call, in host memory here)
    rows._ring, rows._next = np.zeros((ring, rb), np.uint8), 0
    rows._ring_events, rows._ring_used = list(range(900, 900 + ring)), [False] * ring

    def synchronize(event):
        calls.append(("wait", event))
        ready[event] = True

    rows._cuda = SimpleNamespace(
        on_device=lambda device: contextlib.nullcontext(),
        memcpy_async=lambda dst, src, n, stream: calls.append(("copy", dst, src, n, stream)),
        event_record=lambda event, stream: (calls.append(("record", event, stream)), ready.__setitem__(event, False)),
        event_query=lambda event: ready[event],
        event_synchronize=synchronize)
    rows._device, rows._base, rows._row_bytes = 0, 1 << 40, rb
    rows._stream, rows._lock = SimpleNamespace(cuda_stream=77), threading.Lock()
    row = np.frombuffer(schema_row(5), np.uint8)
    w = rows.write_async(3, row)
    assert calls == [("copy", (1 << 40) + 3 * rb, rows._ring[0].ctypes.data, rb, 77), ("record", 900, 77)]
    assert rows._ring[0].tobytes() == row.tobytes()
    assert not w.done()
    ready[900] = True
    assert w.done() and w.done()
    for k in range(1, ring):  # every other ring row in flight
        rows.write_async(k % 4, np.frombuffer(schema_row(k), np.uint8))
    calls.clear()
    rows.write_async(2, row)  # ring row 0 again: its copy ran, nothing waits
    assert calls == [("copy", (1 << 40) + 2 * rb, rows._ring[0].ctypes.data, rb, 77), ("record", 900, 77)]
    calls.clear()
    rows.write_async(1, row)  # ring row 1: its copy is still queued, so this waits for it first
    assert calls[0] == ("wait", 901) and calls[-1] == ("record", 901, 77)
