"""Rooms under faults, with real prefill processes and real Mooncake TCP:
malformed control messages, a mismatched contract, a prefill rank killed with
SIGKILL mid-transfer, a corrupted page caught by the digest check."""

from __future__ import annotations

import signal
import time

import httpx
import msgpack
import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc, wait_final, wait_until
from _raw_control import RawControl
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import mooncake_available
from kvbridge.transfer.poll import KVPoll

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]

PAGE = 4


def raw_exchange(endpoint: str, frames: list[bytes], timeout_ms: int = 5000) -> list:
    """Send raw frames from a bare TCP client; return the decoded replies."""
    with RawControl(endpoint) as sock:
        for f in frames:
            sock.send(f)
        replies = []
        deadline = time.monotonic() + timeout_ms / 1000
        while len(replies) < len(frames) and time.monotonic() < deadline:
            body = sock.recv(0.05)
            if body is not None:
                replies.append(wire.decode(body))
        return replies


def test_malformed_messages_get_errors_and_the_loop_keeps_serving(daemon):
    p = PrefillProc(daemon.url, 0, 1, instance="prefill-malformed")
    d = DecodeRank(daemon.url, instance="decode-malformed")
    try:
        seal = wire.codec().seal
        good = wire.encode(wire.Ping(decode_rank="x", seq=1))
        frames = [
            seal(b"\xc1 not msgpack"),
            seal(msgpack.packb([1, 2, 3])),
            wire.codec().with_version(99).seal(msgpack.packb({"t": "ping", "decode_rank": "x", "seq": 1})),
            seal(msgpack.packb({"t": "launch_missiles"})),
            seal(msgpack.packb({"t": "abort", "room": 5})),
            seal(msgpack.packb({"t": "ping", "decode_rank": "x", "seq": "one"})),
            good,
        ]
        replies = raw_exchange(p.endpoint, frames)
        reasons = [r.reason for r in replies if isinstance(r, wire.ErrorReply)]
        assert len(reasons) == 6, replies
        for needle in ("not msgpack", "not a map", "unsupported wire version", "unknown message type",
                       "missing field 'decode_rank'", "field 'seq' of ping has wrong type"):
            assert any(needle in r for r in reasons), (needle, reasons)
        assert any(isinstance(r, wire.Heartbeat) for r in replies), "a good ping still gets its heartbeat"
        # and a real room still goes through
        recv = d.receive(9001, 10, np.array([3, 4, 5]), prefill="prefill-malformed")
        p.send(9001, 10)
        wait_final([recv])
        assert recv.poll() == KVPoll.Success and d.verify(recv) == []
    finally:
        d.close()
        p.stop()


def test_mismatched_contract_is_refused_before_any_transfer(daemon):
    p = PrefillProc(daemon.url, 0, 1, "--kernel-abi", "mla-paged-v2", "--target-timeout", "2",
                    instance="prefill-other-abi")
    d = DecodeRank(daemon.url, instance="decode-mismatch")
    try:
        recv = d.receive(9101, 10, np.array([0, 1, 2]), prefill="prefill-other-abi")
        p.send(9101, 10)
        wait_final([recv])
        assert recv.poll() == KVPoll.Failed
        assert "contract mismatch" in recv.failure_reason and "kernel.abi" in recv.failure_reason
        assert any(getattr(f, "path", "") == "kernel.abi" for f in recv.mismatch)
        assert recv.pages_releasable, "no TransferRequest went out, so nothing can land"
        assert d.untouched_except(np.array([], dtype=np.int64)) and not d.aux.any()
        mismatches = httpx.get(f"{daemon.url}/v1/diagnostics/mismatches", trust_env=False).json()
        assert any("prefill-other-abi" in str(m) and "kernel.abi" in str(m) for m in mismatches)
        res = p.result(9101, timeout=30)  # nobody asked for the room: it times out on prefill
        assert res["state"] == "Failed" and "no decode ranks asked" in res["reason"]
    finally:
        d.close()
        p.stop()


def test_prefill_rank_killed_mid_transfer(daemon):
    procs = [PrefillProc(daemon.url, r, 2, instance="prefill-killed") for r in range(2)]
    d = DecodeRank(daemon.url, instance="decode-killed", peer_timeout=3.0, lease_quarantine=0.5)
    try:
        room, n = 9201, 20 * PAGE + 3
        recv = d.receive(room, n, np.arange(300, 321), prefill="prefill-killed")
        for p in procs:
            p.send(room, n, chunks=[n // 2, n], pause=60)
        assert wait_until(lambda: 1 in recv.stats.get("pages_by_rank", {}), 30)
        procs[1].kill()
        assert wait_until(lambda: recv.poll() == KVPoll.Failed, 20)
        assert "prefill-killed/cp1" in recv.failure_reason and "sent nothing" in recv.failure_reason
        # cp0 acks the abort at once; cp1 is quiet only once its 2 s bootstrap lease has expired
        # and the (here short) quarantine after it has passed
        assert wait_until(lambda: recv.pages_releasable, 20)
        res = procs[0].result(room)
        assert res["state"] == "Failed" and "aborted" in res["reason"]
        # the dead rank's connection is closed and forgotten once nothing of it is pending
        assert wait_until(lambda: procs[1].endpoint not in d.ep._peers.endpoints(), 10)
    finally:
        d.close()
        for p in procs:
            p.stop()


def test_a_frozen_prefill_rank_keeps_its_pages_held_past_its_lease(daemon):
    """Hard rule 6 against a frozen process (found by kvbridge chaos): a prefill rank stopped
    (SIGSTOP) mid-room past its lease resumes with its writes still queued, so an expired lease
    alone must not free the room's pages; they go once the rank, resumed, acknowledges the abort."""
    p = PrefillProc(daemon.url, 0, 1, instance="prefill-frozen")
    d = DecodeRank(daemon.url, instance="decode-frozen", peer_timeout=1.0, lease_quarantine=3600.0)
    try:
        room, n = 9251, 12 * PAGE + 1
        recv = d.receive(room, n, np.arange(100, 113), prefill="prefill-frozen")
        p.send(room, n, chunks=[n // 2, n], pause=60)
        assert wait_until(lambda: 0 in recv.stats.get("pages_by_rank", {}), 30)
        p.proc.send_signal(signal.SIGSTOP)
        assert wait_until(lambda: recv.poll() == KVPoll.Failed, 20)
        assert "prefill-frozen/cp0" in recv.failure_reason
        peer = d.ep.machine.peers[p.endpoint]
        assert wait_until(lambda: peer.lease_gone, 20), "its 2 s lease runs out while it is stopped"
        assert not wait_until(lambda: recv.pages_releasable, 1.0), "pages freed at lease expiry: a resumed rank writes into them"
        p.proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: recv.pages_releasable, 20), "the resumed rank acknowledges the re-sent abort"
    finally:
        p.proc.send_signal(signal.SIGCONT)
        d.close()
        p.stop()


def test_digest_check_catches_a_corrupted_page(daemon):
    p = PrefillProc(daemon.url, 0, 1, instance="prefill-digest")
    d = DecodeRank(daemon.url, instance="decode-digest", verify_digest=True)
    try:
        ok = d.receive(9301, 9, np.array([10, 11, 12]), prefill="prefill-digest")
        p.send(9301, 9)
        wait_final([ok])
        assert ok.poll() == KVPoll.Success and d.verify(ok) == []
        # corrupt a page that has landed while the room is still in flight
        bad = d.receive(9302, 9, np.array([20, 21, 22]), prefill="prefill-digest")
        p.send(9302, 9, chunks=[4, 9], pause=1.0)
        assert wait_until(lambda: bad.stats.get("pages_by_rank"), 20)
        d.buffers[("index", 0)].view(-1)[20 * d.specs["index"].bytes_per_page + 3] ^= 0xFF
        wait_final([bad])
        assert bad.poll() == KVPoll.Failed and "digest mismatch on logical page 0" in bad.failure_reason
    finally:
        d.close()
        p.stop()
