"""Issue 31 through SGLang's real classes: with KVBRIDGE_ROOM_KEY every ``bootstrap_room`` must be
a signed room id (``kvbridge.signed_room_id``: expiry, nonce and tag in the 63-bit id itself).

One prefill and one decode server of SGLang ranks in this process (``_sgl_inproc.Pair``, SGLang's
queue methods and kvbridge's patch of them), over real Mooncake TCP on loopback, both with the
cluster's room key. A forged id (one tag bit flipped), an expired id and an unsigned id are refused
by name on the side they reach (prefill before it opens the room, decode before it claims it):
the room never opened there (decode: before SGLang gave the request pages), the refusal counted. A valid
signed id is served.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from _sgl_inproc import Pair  # noqa: E402
from _sgl_sched import prompt  # noqa: E402
from kvbridge import signed_room_id  # noqa: E402
from kvbridge.integrations.sglang.metrics import REFUSED  # noqa: E402
from kvbridge.transfer.binding import ROOM_ID_BITS  # noqa: E402

KEY = "signed-rooms-test-key"
N, CHUNK = 150, 100  # 3 pages of 64: the last one partial


@pytest.fixture(scope="module")
def pair(daemon):
    p = Pair(daemon.url, "signed", env={"KVBRIDGE_ROOM_KEY": KEY})
    yield p
    p.close()


def signed(ttl: float = 600.0, key: str = KEY) -> int:
    return signed_room_id(key.encode(), time.time() + ttl)


def forged() -> int:
    return signed() ^ (1 << (ROOM_ID_BITS["nonce"] + 7))  # one bit of the tag flipped


def done(pair: Pair, server: str, room: int) -> list[dict]:
    return [e for e in pair.events() if e["room"] == room and e["event"] == "done" and e["server"] == server]


def test_a_valid_signed_room_is_served(pair):
    room = signed()
    pair.prefill.add(room, N, CHUNK)
    pair.decode.add(room, N, 0, pair.addr, tokens=prompt(room, N))
    pair.run(lambda: bool(done(pair, pair.decode.name, room)) and bool(done(pair, pair.prefill.name, room)))
    (d,), (p,) = done(pair, pair.decode.name, room), done(pair, pair.prefill.name, room)
    assert d["state"] == "Success" and d["errors"] == [], d
    assert p["state"] == "Success", p


@pytest.mark.parametrize(("make", "says", "field"), [
    (forged, "unsigned or forged tag", "room_tag"),
    (lambda: signed(ttl=-120), "expired", "room_expiry"),
    (lambda: signed(key="another cluster"), "unsigned or forged tag", "room_tag"),
    (lambda: 2**62 + 31_500, "unsigned or forged tag", "room_tag"),  # SGLang's router: a random id
], ids=["forged", "expired", "other-key", "unsigned"])
def test_decode_refuses_before_its_claim(pair, make, says, field):
    room = make()
    d_mgr, p_mgr = pair.decode.w.mgr, pair.prefill.worlds[0].mgr
    before = d_mgr.counters.value(REFUSED, "unsigned_room")
    pair.decode.add(room, N, 0, pair.addr, tokens=prompt(room, N))
    r = pair.decode.reqs[room]
    pair.run(lambda: bool(done(pair, pair.decode.name, room)))
    (d,) = done(pair, pair.decode.name, room)
    assert d["state"] == "Failed" and any(f"room id {room}" in x and says in x and "nothing opened, written or read"
                                          in x for x in d["reasons"]), d
    assert r.pages.size == 0  # failed before SGLang's queue gave it decode pages: nothing to write into
    assert room not in p_mgr.endpoint.machine.rooms  # the claim never reached prefill
    assert d_mgr.counters.value(REFUSED, "unsigned_room") == before + 1


@pytest.mark.parametrize("make", [forged, lambda: signed(ttl=-120)], ids=["forged", "expired"])
def test_prefill_refuses_before_it_opens_the_room(pair, make):
    room = make()
    p_mgr = pair.prefill.worlds[0].mgr
    before = p_mgr.counters.value(REFUSED, "unsigned_room")
    pair.prefill.add(room, N, CHUNK)
    pair.run(lambda: bool(done(pair, pair.prefill.name, room)))
    (p,) = done(pair, pair.prefill.name, room)
    assert p["state"] == "Failed" and any(f"room id {room}" in x for x in p["reasons"]), p
    assert room not in p_mgr.endpoint.machine.rooms
    assert p_mgr.counters.value(REFUSED, "unsigned_room") == before + 1
