"""Layer-range sends (``KVSender.send(..., layers=(start, end))``) in prefill's machine, driven
by events alone (the test plays the shell, as ``test_prefill_room.py`` does): which layers of
which pools each write carries, that a page reaches decode's ledger only once every layer's
write to it is final (in any completion order), and every refusal by name with nothing
queued. The same sends between real processes over Mooncake TCP: ``test_layer_sends_mooncake.py``."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import LayerRangeError, LayoutError
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import WriteStatus
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.machine import PostWrite, PrefillRooms

from test_prefill_room import AUX, AUXF, D, DONE, HELLO, ME, SPECS, Shell, _packed, bufs, msgs, of, peer, request

POOL_INDEX = {name: i for i, name in enumerate(SPECS)}  # bufs(): base = shift + 10**6 * (pool index * 10 + layer)
DECODE_BASE = 1 << 40


@pytest.fixture
def m():
    machine = PrefillRooms(PrefillConfig(instance="p", peer_timeout=5.0, target_timeout=60.0), SPECS, bufs(0), AUX,
                           "x", hello_of=lambda ident: HELLO.get(ident), endpoint=lambda: ME, target_layers=2)
    machine.peers.entries["r1"] = peer()
    machine.admission.prove(D, "r1")
    return machine


def layers_written(w: PostWrite) -> set[tuple[str, int]]:
    """The (pool, layer id) buffers a write lands in, read off its destination addresses."""
    names = {i: n for n, i in POOL_INDEX.items()}
    keys = ((w.dst.astype(np.int64) - DECODE_BASE) // 10**6).tolist()
    return {(names[k // 10], k % 10) for k in keys if k // 10 in names}  # (the aux row's slices lie far above)


def asked(m, room: int, num_tokens: int = 7):
    r = m.open(room, 1.0)
    m.engine_init(r, num_tokens, None, 1.0)
    m.message(D, request(room, num_tokens), 1.0)
    assert r.state.state == KVPoll.WaitingForInput
    return r


def send(m, sh, r, logical, local, *, layers=None, is_last=False, aux=False, ready=7):
    m.chunk(r, logical, np.asarray(local), None if is_last else ready, is_last, _packed(r.room) if aux else None,
            None, None, layers)
    return of(sh.run(m.post(r, 1.1, AUXF if aux else None), 1.1), PostWrite)


def test_each_range_writes_its_layers_only_index_k_by_the_target_ids_the_draft_with_the_last(m):
    sh = Shell(m)
    r = asked(m, 1)
    (w0,) = send(m, sh, r, [0, 1], [5, 6], layers=(0, 1))
    (w1,) = send(m, sh, r, [0, 1], [5, 6], layers=(1, 2))
    (w2,) = send(m, sh, r, [], [], is_last=True, aux=True)
    assert layers_written(w0) == {("target", 0), ("index", 0)}
    assert layers_written(w1) == {("target", 1), ("index", 1), ("draft", 2)}
    # the two ranges carry exactly the bytes of one whole-request write, split by layer
    valid = {"target": 7 * SPECS["target"].bytes_per_token, "index": 7 * SPECS["index"].bytes_per_token,
             "draft": 7 * SPECS["draft"].bytes_per_token}
    assert int(w0.length.sum()) == valid["target"] + valid["index"]
    assert int(w1.length.sum()) == valid["target"] + valid["index"] + valid["draft"]
    assert int(w2.length.sum()) == AUX.row_bytes  # the aux row alone
    # the second range completes first: no page counts until the first is final too
    handles = {a.write: h for h, a in sh.posted}
    (rep1,) = msgs(m.write_final(handles[w1.write], DONE, 1.2), wire.PagesDone)
    assert rep1.status == "ok" and rep1.logical_pages == b"" and not rep1.aux
    (rep0,) = msgs(m.write_final(handles[w0.write], DONE, 1.3), wire.PagesDone)
    assert np.frombuffer(rep0.logical_pages, "<i4").tolist() == [0, 1] and rep0.pools
    assert r.state.state == KVPoll.Transferring
    acts = m.write_final(handles[w2.write], DONE, 1.4)
    (rep2,) = msgs(acts, wire.PagesDone)
    assert rep2.aux and rep2.num_tokens == 7 and r.state.state == KVPoll.Success


def test_the_last_range_may_carry_is_last_and_the_aux_row(m):
    sh = Shell(m)
    r = asked(m, 2)
    send(m, sh, r, [0, 1], [5, 6], layers=(0, 1))
    (w,) = send(m, sh, r, [0, 1], [5, 6], layers=(1, 2), is_last=True, aux=True)
    assert int(w.length.sum()) > AUX.row_bytes  # pages and the aux row in one write
    for h, _ in list(sh.posted):
        m.write_final(h, DONE, 1.2)
    assert r.state.state == KVPoll.Success


def test_a_failed_layer_write_fails_the_room_and_no_page_is_reported(m):
    sh = Shell(m)
    r = asked(m, 3)
    send(m, sh, r, [0, 1], [5, 6], layers=(0, 1))
    send(m, sh, r, [0, 1], [5, 6], layers=(1, 2))
    send(m, sh, r, [], [], is_last=True, aux=True)
    (h0, _), (h1, _), (h2, _) = sh.posted
    reports = msgs(m.write_final(h0, WriteStatus.failed("peer gone"), 1.2), wire.PagesDone)
    reports += msgs(m.write_final(h1, DONE, 1.3), wire.PagesDone)
    reports += msgs(m.write_final(h2, DONE, 1.4), wire.PagesDone)
    assert all(not x.logical_pages for x in reports) and reports[-1].status == "failed"
    assert r.state.state == KVPoll.Failed and "peer gone" in r.state.reason


def _refused(m, r, match, *args, **kw):
    n_chunks = len(r.chunks)
    with pytest.raises(LayerRangeError, match=match) as info:
        m.chunk(r, *args, **kw)
    assert info.value.field in ("layers", "local_pages") and "room=" in str(info.value) and "rank=cp0" in str(info.value)
    assert len(r.chunks) == n_chunks  # nothing queued
    return info.value


def test_bad_ranges_are_refused_by_name_and_queue_nothing(m):
    sh = Shell(m)
    r = asked(m, 4, num_tokens=7)
    for bad in [(0, 3), (1, 1), (-1, 1), (0,), "0:1", (True, 2)]:
        _refused(m, r, r"layers .* must be a range", [0], np.array([5]), 4, False, None, None, None, bad)
    # a page the chunk ends inside travels with a send of every layer
    _refused(m, r, "ends past the 6 tokens ready", [0, 1], np.array([5, 6]), 6, False, None, None, None, (0, 1))
    send(m, sh, r, [0], [5], layers=(0, 1), ready=4)
    _refused(m, r, "layer 0 of logical page 0 was sent twice", [0], np.array([5]), 4, False, None, None, None, (0, 2))
    _refused(m, r, "handed in at local page 5, now at 9", [0], np.array([9]), 4, False, None, None, None, (1, 2))
    with pytest.raises(LayoutError, match="logical page 0 was sent twice .some of its layers"):
        m.chunk(r, [0], np.array([5]), 4, False, None, None)
    err = _refused(m, r, r"leaves 1 pages with layers unsent: logical page 0 misses layers \[1, 2\)", [1],
                   np.array([6]), None, True, _packed(4), None)
    assert err.field == "layers"
    # the room goes on: the missing layer, then the last send
    send(m, sh, r, [0, 1], [5, 6], layers=(1, 2), ready=7)
    send(m, sh, r, [1], [6], layers=(0, 1), ready=7, is_last=True, aux=True)
    for h, _ in list(sh.posted):
        m.write_final(h, DONE, 1.2)
    assert r.state.state == KVPoll.Success


def test_a_held_page_goes_with_a_send_of_every_layer(m):
    sh = Shell(m)
    r = asked(m, 5, num_tokens=7)
    send(m, sh, r, [0, 1], [5, 6], ready=6)  # page 1 held: rows 6 not computed
    assert r.held[0].tolist() == [1]
    _refused(m, r, "held from an earlier chunk", [], np.array([], dtype=np.int64), None, True, _packed(5), None,
             None, (0, 2))
    (w,) = send(m, sh, r, [], [], is_last=True, aux=True)  # the held page, every layer, with the aux row
    assert layers_written(w) == {("target", 0), ("target", 1), ("index", 0), ("index", 1), ("draft", 2)}
    for h, _ in list(sh.posted):
        m.write_final(h, DONE, 1.2)
    assert r.state.state == KVPoll.Success
