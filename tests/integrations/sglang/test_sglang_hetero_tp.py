"""G1: an MHA/GQA cache over attention TP > 1, prefill TP != decode TP, through SGLang's classes
(``MHATokenToKVPool`` k/v pools sharded by heads as SGLang shards them, ``KVArgs`` with the
prefill's ``kv_head_num``/``total_kv_head_num``), in separate processes over real Mooncake TCP
with a cluster daemon. The model has 2 KV heads (32 B each per token per layer):

    prefill p2   attention TP 2: rank r holds head r
    prefill p1   attention TP 1: both heads
    decode  d1   TP 1: both heads, from both p2 ranks (two head slices per row)
    decode  d4   TP 4 > KV heads: rank r holds head r*2//4 (each head replicated on two ranks)
    decode  d2   TP 2: head r, from p1's whole rows

Each decode TP rank is its own server in the harness (the MIN over them is not taken: every
rank must succeed on its own); each checks every byte of its heads of every page and layer, the
padding rows of the last page, and its metadata row.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from _sgl_procs import Host, free_port  # noqa: E402

HEADS = 2
ROOM = iter(range(2**61 + 3, 2**61 + 100_000, 5))
DECODE = {"d1": 1, "d4": 4, "d2": 2}  # decode server -> its attention TP size


@pytest.fixture(scope="module")
def hosts(daemon, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sglang-hetero-tp")
    ports = {"p2": free_port(), "p1": free_port()}
    started = []
    try:
        started.append(Host({"role": "prefill", "servers": [
            {"name": n, "cp": 1, "tp": tp, "mode": "replicated", "port": ports[n], "cluster": daemon.url,
             "heads": HEADS} for n, tp in (("p2", 2), ("p1", 1))]}, logs / "prefill.log"))  # fmt: skip
        decode = [{"name": f"{n}r{r}", "cluster": daemon.url, "tp": [r, tp], "heads": HEADS, "http_port": 31000 + tp}
                  for n, tp in DECODE.items() for r in range(tp)]  # fmt: skip
        started.append(Host({"role": "decode", "servers": decode}, logs / "decode.log"))
        yield {"prefill": started[0], "decode": started[1], "ports": ports}
        for cfg in decode:
            assert started[1].untouched(cfg["name"]) == [], f"{cfg['name']}: a write landed outside the rooms' pages"
    finally:
        for h in reversed(started):
            h.stop()


@pytest.mark.parametrize("prefill, decode, n, chunk", [
    ("p2", "d1", 150, 100),   # two prefill ranks -> one decode rank: two head slices per row
    ("p2", "d4", 330, 128),   # decode TP 4 > 2 KV heads: heads replicated on decode
    ("p1", "d2", 200, 64),    # one prefill rank's whole rows -> two decode ranks, a head each
])  # fmt: skip
def test_mha_heads_across_tp_sizes(hosts, prefill, decode, n, chunk):
    room = next(ROOM)
    p, d = hosts["prefill"], hosts["decode"]
    p.command("add", server=prefill, room=room, n=n, chunk=chunk)
    ranks = [f"{decode}r{r}" for r in range(DECODE[decode])]
    for name in ranks:
        d.command("add", server=name, room=room, n=n, prefix=0, addr=f"127.0.0.1:{hosts['ports'][prefill]}")
    pe = p.event(prefill, room)
    for name in ranks:
        de = d.event(name, room)
        assert de["state"] == "Success", de["reasons"]
        assert de["errors"] == [], de["errors"]
    assert pe["state"] == "Success", pe["reasons"]
    assert all(m["transfer_total_bytes"] for m in pe["metrics"])  # every prefill TP rank sent its heads


def test_decode_tp_ranks_holding_different_prefixes_fail_the_room_by_name(hosts):
    """G3: SGLang's prefill takes one decode prefix per request (pop_decode_prefix_len). Decode TP
    ranks whose prefix caches differ (64 and 128 tokens) cannot be told to it as one number: the
    room fails on prefill, naming each decode rank and its first page, and decode hears why."""
    room = next(ROOM)
    p, d = hosts["prefill"], hosts["decode"]
    p.command("add", server="p1", room=room, n=200, chunk=200)
    for name, prefix in (("d2r0", 64), ("d2r1", 128)):
        d.command("add", server=name, room=room, n=200, prefix=prefix, addr=f"127.0.0.1:{hosts['ports']['p1']}")
    pe = p.event("p1", room)
    assert pe["state"] == "Failed"
    (reason,) = pe["reasons"]
    assert f"the decode ranks of room {room} hold different prefixes (" in reason, reason
    assert "/tp0 first page 1, " in reason and "/tp1 first page 2)" in reason, reason
    for name in ("d2r0", "d2r1"):
        de = d.event(name, room)
        assert de["state"] == "Failed" and de["releasable"] and "hold different prefixes" in de["reasons"][0]
