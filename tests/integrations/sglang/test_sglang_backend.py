"""kvbridge as SGLang's PD backend, driven like SGLang 0.5.23's schedulers drive a backend.

Three processes of SGLang ranks (``_sgl_host.py``; their pools, metadata buffers and
``KVArgs`` are SGLang's own classes on the CPU, see ``_sgl_sched.py``) and kvbridge
bootstrap daemons, all on loopback, with real Mooncake TCP between them:

    prefill host   cp1    attention CP 1, TP 2 (TP rank 1 sends nothing)   its own daemon
                   rep    CP 2, SGLang's default (CP rank 0 sends)        its own daemon  lane rule replicated
                   bal    CP 2, all CP ranks transfer                       its own daemon  lane rule balanced
                   shard  TP 2, KV cache sharding over the TP group         its own daemon  lane rule interleaved
    victim host    solo   CP 1, registered with the cluster daemon (killed by a test)
    decode host    d1     one daemon per prefill instance (at the request's bootstrap address)
                   d2     the cluster daemon (KVBRIDGE_BOOTSTRAP_URL)

The cache is DeepSeek V3.2's (MLA latent bf16, NSA index K, a NextN draft layer;
page size 64); every request also carries logprobs, the draft's hidden state and
top-k, and DSA top-k indices in its metadata row. Decode pools start poisoned;
every byte of every pool and layer of a room is checked, padding rows of a
partial last page must keep the poison, and so must every page no transfer was
given (``untouched``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from _sgl_procs import Host, free_port  # noqa: E402

PREFILL = {"cp1": (1, 2, "replicated"), "rep": (2, 1, "replicated"), "bal": (2, 1, "balanced"),
           "shard": (1, 2, "interleaved")}  # fmt: skip
ROOM = iter(range(2**62 + 11, 2**62 + 100_000, 7))  # 63-bit ids as a router draws them


@pytest.fixture(scope="module")
def hosts(daemon, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sglang-hosts")
    ports = {name: free_port() for name in [*PREFILL, "solo"]}
    started = []
    try:
        prefill = Host({"role": "prefill", "servers": [
            {"name": n, "cp": cp, "tp": tp, "mode": mode, "port": ports[n]} for n, (cp, tp, mode) in PREFILL.items()]},
            logs / "prefill.log")  # fmt: skip
        started.append(prefill)
        victim = Host({"role": "prefill", "servers": [{"name": "solo", "cp": 1, "tp": 1, "mode": "replicated",
                                                       "port": ports["solo"], "cluster": daemon.url}]},
                      logs / "victim.log")  # fmt: skip
        started.append(victim)
        decode = Host({"role": "decode", "servers": [{"name": "d1"}, {"name": "d2", "cluster": daemon.url}]},
                      logs / "decode.log")
        started.append(decode)
        yield {"prefill": prefill, "victim": victim, "decode": decode, "ports": ports}
        for server in ("d1", "d2"):
            assert decode.untouched(server) == [], f"{server}: a write landed outside the rooms' pages"
    finally:
        for h in reversed(started):
            h.stop()


def transfer(h, server: str, n: int, chunk: int, *, prefix: int = 0, decode: str = "d1", optimistic: bool = False,
             **prefill_kw) -> tuple[int, dict, dict]:
    """One request through prefill ``server`` and decode ``decode``; (room, prefill event, decode event)."""
    room = next(ROOM)
    p = h["victim"] if server == "solo" else h["prefill"]
    p.command("add", server=server, room=room, n=n, chunk=chunk, optimistic=optimistic, **prefill_kw)
    if optimistic:  # decode asks only once prefill has computed it all: SGLang's handle_pending_bootstrap path
        p.event(server, room, "computed")
    h["decode"].command("add", server=decode, room=room, n=n, prefix=prefix, addr=f"127.0.0.1:{h['ports'][server]}")
    return room, p.event(server, room), h["decode"].event(decode, room)


def assert_success(pe: dict, de: dict) -> None:
    assert de["state"] == "Success", de["reasons"]
    assert de["errors"] == [], de["errors"]
    assert pe["state"] == "Success", pe["reasons"]
    sent = [m for m in pe["metrics"] if m["transfer_total_bytes"]]  # SGLang's per-request transfer metric
    assert sent and all(m["transfer_latency_s"] is not None and m["transfer_latency_s"] >= 0 for m in sent)


def test_cp1_chunked_prefill_with_a_silent_tp_rank(hosts):
    """150 tokens in chunks of 100: the scheduler holds the partial page of chunk 1 back, the last
    page carries 22 valid rows. TP rank 1 sends nothing and reports what rank 0 does (MIN)."""
    room, pe, de = transfer(hosts, "cp1", 150, 100)
    assert_success(pe, de)
    assert pe["metrics"][1]["transfer_total_bytes"] is None  # the silent TP rank


def test_decode_prefix_and_prefill_before_bootstrap(hosts):
    """Decode holds the first page (its radix cache): pop_decode_prefix_len() gives it to SGLang,
    which sends only pages 1..; the prefix page keeps its content. TP rank 1 (no endpoint, asked
    by nobody) says 0: that value reaches nothing (sender.py). Prefill computed the whole request
    before decode asked (optimistic prefill: SGLang asks the prefix then, and sends it all at once)."""
    _, pe, de = transfer(hosts, "cp1", 200, 64, prefix=64)
    assert_success(pe, de)
    assert pe["prefix"] == [64, 0]
    _, pe, de = transfer(hosts, "cp1", 330, 50, prefix=128, optimistic=True)
    assert_success(pe, de)
    assert pe["prefix"] == [128, 0]


@pytest.mark.parametrize("server", ["rep", "bal", "shard"])
def test_cp2_in_each_cp_mode(hosts, server):
    assert_success(*transfer(hosts, server, 330, 100)[1:])
    _, pe, de = transfer(hosts, server, 300, 128, prefix=128)
    assert_success(pe, de)
    assert pe["prefix"] == [128, 128]  # every rank has an endpoint, and every decode rank asked each


def test_kv_sharding_with_pages_off_their_lane_fails_clearly(hosts):
    """SGLang puts page id p on shard rank p % N; kvbridge's interleaved lanes put position l on
    l % N. A request whose pages are shifted by one lane is refused, not misrouted."""
    _, pe, de = transfer(hosts, "shard", 200, 100, bad_pages=True)
    assert pe["state"] == de["state"] == "Failed"
    assert any("KV cache sharding: page id" in r and "not the position's lane" in r for r in pe["reasons"])
    assert "KV cache sharding" in de["reasons"][0] and "KVTransferError" in de["reasons"][0]
    assert de["releasable"]


def test_decode_aborts_mid_transfer(hosts):
    """Decode aborts after prefill sent its first chunk. Decode reads Transferring until no write
    can land (hard rule 6), then Failed; prefill fails with decode's reason."""
    h = hosts
    room = next(ROOM)
    h["prefill"].command("add", server="rep", room=room, n=330, chunk=100, hold_after=1)
    h["decode"].command("add", server="d1", room=room, n=330, prefix=0, addr=f"127.0.0.1:{h['ports']['rep']}")
    h["prefill"].event("rep", room, "held")  # decode asked, the first chunk went out
    h["decode"].command("abort", server="d1", room=room)
    de = h["decode"].event("d1", room)
    h["prefill"].command("resume", server="rep", room=room)  # its remaining chunks run; the sender is failed
    pe = h["prefill"].event("rep", room)
    assert de["state"] == "Failed" and de["releasable"]
    assert "aborted by SGLang (AbortReq)" in de["reasons"][0] and "kvbridge decode rank" in de["reasons"][0]
    assert pe["state"] == "Failed" and any("aborted" in r for r in pe["reasons"])


def test_prefill_aborts_mid_transfer(hosts):
    h = hosts
    room = next(ROOM)
    h["prefill"].command("add", server="bal", room=room, n=330, chunk=100, hold_after=1)
    h["decode"].command("add", server="d1", room=room, n=330, prefix=0, addr=f"127.0.0.1:{h['ports']['bal']}")
    h["prefill"].event("bal", room, "held")  # its first chunk went out
    h["prefill"].command("abort", server="bal", room=room)
    pe, de = h["prefill"].event("bal", room), h["decode"].event("d1", room)
    assert pe["state"] == "Failed" and any("aborted by SGLang (AbortReq)" in r for r in pe["reasons"])
    assert de["state"] == "Failed" and de["releasable"] and "aborted by SGLang (AbortReq)" in de["reasons"][0]


def test_a_dead_prefill_rank(hosts):
    """The prefill process dies after its first chunk (cluster daemon, decode d2). Decode keeps
    reporting in progress until the rank's lease is gone, then Failed naming the rank and why."""
    h = hosts
    room = next(ROOM)
    h["victim"].command("add", server="solo", room=room, n=330, chunk=100, hold_after=1)
    h["decode"].command("add", server="d2", room=room, n=330, prefix=0, addr=f"127.0.0.1:{h['ports']['solo']}")
    h["victim"].event("solo", room, "held")  # decode asked and the first chunk went out
    h["victim"].kill()
    de = h["decode"].event("d2", room, timeout=60)
    assert de["state"] == "Failed" and de["releasable"]
    assert de["held_polls"] > 0, "Failed must wait for the dead rank's lease to expire"
    reason = de["reasons"][0]
    assert f"prefill rank 127.0.0.1:{h['ports']['solo']}/cp0" in reason and "sent nothing" in reason
    assert reason.startswith("KVTransferError") and "kvbridge decode rank sglang-decode-" in reason
