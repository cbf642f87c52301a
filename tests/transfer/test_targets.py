"""A decode rank's TransferRequest becomes a checked Target before anything is posted,
against what that decode rank registered (hard rule 5); its registered buffers are
paired with ours once per pool set."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvbridge.errors import LayoutError, PageRangeError, PairingError
from kvbridge.layout import AuxSchema, BufferDesc, OwnerLanes, preset_pools
from kvbridge.transfer.channel import wire
from kvbridge.transfer.aux_rows import RegionAddr
from kvbridge.transfer.prefill.targets import DecodePeer
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.prefill.targets import target_from_request

SPECS = preset_pools("deepseek-v3.2-fp8", num_layers=2, page_size=4)
AUX = AuxSchema.standard(16, "bfloat16", 1)


def bufs(shift: int, capacity: int = 16) -> list[BufferDesc]:
    return [BufferDesc(p, layer, shift + 10**6 * (i * 10 + layer), capacity, s.bytes_per_page)
            for i, (p, s) in enumerate(SPECS.items()) for layer in s.layer_ids]


def peer(buffers=None, aux_rows: int = 4, regions=None) -> DecodePeer:
    aux = {r.name: RegionAddr(r.name, (1 << 50) + AUX.offsets[r.name], aux_rows, AUX.row_bytes) for r in AUX.regions}
    if regions is not None:
        aux = {k: v for k, v in aux.items() if k in regions}
    return DecodePeer(rank_id="r1", label="d/dp0/cp0/tp0/pp0", session="127.0.0.1:1", fingerprint="x",
                      buffers=buffers or bufs(1 << 40), aux=aux)


def request(pages, room: int = 1, aux_slot: int = 0, first_page: int = 0, num_pages: int = 2) -> wire.TransferRequest:
    return wire.TransferRequest(
        room=room, decode_rank="d/dp0/tp0", decode_rank_id="r1", page_ids=wire.pack_pages(np.array(pages)),
        first_page=first_page, pools=sorted(SPECS), aux_slot=aux_slot, num_tokens=4 * num_pages, deadline_ms=1000,
        want_digest=False, fingerprint="x", num_decode_ranks=1)


def send_room(num_pages: int = 2, cp_size: int = 1, cp_rank: int = 0) -> PrefillRoom:
    r = PrefillRoom(1, cp_rank, OwnerLanes(cp_size), 4)
    r.set_num_tokens(4 * num_pages, "test")
    return r


def test_a_peer_is_paired_once_and_writes_go_where_it_registered():
    p, src = peer(), bufs(0)
    a = target_from_request(request([0, 1]), b"i", SPECS, src, AUX, send_room(), p)
    b = target_from_request(request([2, 3], room=2), b"i", SPECS, src, AUX, send_room(), p)
    assert a.parts is b.parts and a.session == "127.0.0.1:1"
    assert a.aux_dst["room"].at(a.aux_slot) == 1 << 50
    other = target_from_request(request([0, 1]), b"i", SPECS, src, AUX, send_room(), peer(bufs(1 << 41)))
    assert other.parts is not a.parts  # another registration is another pairing


def test_a_decode_prefix_skips_pages_and_counts_only_the_rest():
    """cp 2, 6 pages, first_page 3: cp0 owns 0, 2, 4 and sends only 4; cp1 owns 1, 3, 5 and sends 3, 5."""
    t0 = target_from_request(request([7, 8, 9], first_page=3, num_pages=6), b"i", SPECS, bufs(0), AUX,
                             send_room(6, 2, 0), peer())
    t1 = target_from_request(request([7, 8, 9], first_page=3, num_pages=6), b"i", SPECS, bufs(0), AUX,
                             send_room(6, 2, 1), peer())
    assert (t0.first_page, t0.num_expected, t1.num_expected) == (3, 1, 2)


@pytest.mark.parametrize(
    "req, dest, error, message",
    [
        (request([0, 16]), peer(), PageRangeError,
         "destination page 16 outside pool 'draft' layer 2's 16 registered pages"),
        (request([0, 1]), peer(bufs(1 << 40, capacity=1)), PageRangeError, "outside pool .* 1 registered pages"),
        (request([0, 1], aux_slot=4), peer(), PageRangeError, "aux slot 4 outside the 4 rows decode rank"),
        (request([0, 1], aux_slot=-1), peer(), PageRangeError, "aux slot -1 outside"),  # issue 10 bug 1
        (request([0, 1]), peer(bufs(1 << 40)[1:]), PairingError, "no destination buffer"),
        (request([0, 1]), peer(regions={"room"}), LayoutError, "registered no aux region 'first_token'"),
        (request([0, 1, 2]), peer(), LayoutError, r"3 destination pages for pages \[0, 2\)"),
        (request([0], first_page=3), peer(), LayoutError, "first_page 3 outside a request of 2 pages"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(req, dest, error, message):
    with pytest.raises(error, match=message):
        target_from_request(req, b"i", SPECS, bufs(0), AUX, send_room(), dest)


def test_a_decode_tp_rank_gets_its_head_slice_and_only_from_the_ranks_of_its_route():
    """Head-sharded k/v (4 heads of 8 float32), prefill tp 2, decode tp 4: decode rank 3
    takes head 3 from tp 1 (offset 32 B of its 64 B row), nothing from tp 0; one range per
    valid row; tp 1 is its first source (aux row); two decode ranks ask tp 1."""
    from kvbridge.layout import HeadGeometry, tp_spec
    from kvbridge.transfer.prefill.targets import plan_target

    geom = HeadGeometry(4, 8, "float32")
    full = {n: geom.spec(n, 4, (0, 1)) for n in ("k", "v")}
    mine = {n: tp_spec(s, 2, 1) for n, s in full.items()}
    theirs = {n: tp_spec(s, 4, 3) for n, s in full.items()}
    src = [BufferDesc(n, layer, 10**6 * (i * 10 + layer), 16, s.bytes_per_page)
           for i, (n, s) in enumerate(mine.items()) for layer in s.layer_ids]
    dst = [BufferDesc(n, layer, (1 << 40) + 10**6 * (i * 10 + layer), 16, s.bytes_per_page)
           for i, (n, s) in enumerate(theirs.items()) for layer in s.layer_ids]
    p = DecodePeer(rank_id="r1", label="d/dp0/cp0/tp3/pp0", session="127.0.0.1:1", fingerprint="x", buffers=dst,
                   aux={r.name: RegionAddr(r.name, (1 << 50) + AUX.offsets[r.name], 4, AUX.row_bytes)
                        for r in AUX.regions}, tp_size=4, tp_rank=3)
    req = msgspec.structs.replace(request([5, 6], num_pages=2), pools=["k", "v"], num_tokens=6, num_decode_ranks=4)
    t = target_from_request(req, b"i", mine, src, AUX, send_room(), p, tp=(2, 1))
    assert t.aux_source and t.num_decode_targets == 2 and [part.pools for part in t.parts] == [("k", "v")]
    plan = plan_target(mine, src, t, np.array([0, 1]), np.array([2, 3]), 6, room=1, rank="p/tp1")
    assert plan.num_slices == 2 * 2 * 6 and set(plan.length.tolist()) == {32}  # pools x layers x valid rows
    assert int(plan.src[0]) == 2 * 4 * 64 + 32 and int(plan.dst[0]) == (1 << 40) + 5 * 4 * 32
    with pytest.raises(LayoutError, match=r"its TP route takes \[\] from it") as err:
        target_from_request(req, b"i", {n: tp_spec(s, 2, 0) for n, s in full.items()}, src, AUX, send_room(), p,
                            tp=(2, 0))
    assert err.value.field == "pools"
