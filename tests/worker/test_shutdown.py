"""SIGTERM on a worker: in-flight rooms finish or fail with a reason, the rank deregisters, exit 0."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from kvbridge.transfer.engine import mooncake_available
from kvbridge.worker import ops
from kvbridge.worker.cluster import Cluster, ClusterSpec

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="needs the Mooncake transfer engine")


def wait_reply(worker, request_id: int, timeout: float) -> ops.Reply:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.client.poll(0.05)
        reply = worker.client.take(request_id)
        if reply is not None:
            return reply
    raise AssertionError(f"no reply within {timeout}s")


def registered_ranks(cluster: Cluster, instance: str) -> int:
    resp = httpx.get(f"{cluster.bootstrap_url}/v1/instances/{instance}", timeout=2.0, trust_env=False,
                     headers={"Authorization": f"Bearer {cluster.spec.token}"})  # reads need the write token
    return 0 if resp.status_code == 404 else len(resp.json()["ranks"])


def test_sigterm_drains_deregisters_and_exits_zero():
    spec = ClusterSpec(cp=1, decode_ranks=1, layers=2, pages=256, drain_timeout=1.5)
    with Cluster(spec) as cluster:
        (prefill,), (decode,) = cluster.prefill, cluster.decode
        assert registered_ranks(cluster, spec.prefill_instance) == 1
        # both rooms are in flight on the prefill rank when SIGTERM lands; only room A gets a decode side
        a = prefill.client.submit(ops.Prefill(101, 3000, 1024))
        b = prefill.client.submit(ops.Prefill(102, 1000))
        assert prefill.client.call(ops.Stats(), timeout=10).stats["rooms_in_flight"] == 2
        prefill.proc.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = prefill.client.submit(ops.Prefill(103, 1000))
        decode_a = decode.client.submit(ops.Decode(101, 3000, spec.prefill_instance))

        reply_a, reply_decode = wait_reply(prefill, a, 20), wait_reply(decode, decode_a, 20)
        assert reply_a.ok, reply_a  # the in-flight room finished during the drain
        assert reply_decode.ok and reply_decode.bytes_verified > 0, reply_decode
        reply_b = wait_reply(prefill, b, 20)
        assert isinstance(reply_b, ops.RoomResult) and not reply_b.ok
        assert "shutting down" in reply_b.reason
        reply_late = wait_reply(prefill, late, 20)
        assert isinstance(reply_late, (ops.OpError, ops.RoomResult)) and "shutting down" in str(reply_late)

        assert prefill.proc.popen.wait(20) == 0, prefill.proc.log_tail()
        deadline = time.monotonic() + 5
        while registered_ranks(cluster, spec.prefill_instance) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert registered_ranks(cluster, spec.prefill_instance) == 0

        stats = decode.client.call(ops.Stats(), timeout=10)
        assert stats.stats["rooms_ok"] == 1 and stats.stats["pages_free"] == spec.pages and stats.stats["pages_held"] == 0
        assert decode.client.call(ops.Shutdown(), timeout=10) == ops.Ack()  # the other way to stop a worker
        assert decode.proc.popen.wait(20) == 0, decode.proc.log_tail()
        assert registered_ranks(cluster, spec.decode_instance) == 0


def test_workers_on_the_auto_engine_move_a_room_and_ipc_is_refused_with_the_reason():
    """auto on host pools: the peers' side channels answer but cannot reach host memory of another
    process, so the bytes go over Mooncake; ipc alone cannot reach them at all: refused at start."""
    from kvbridge.errors import ConfigError
    from kvbridge.worker.config import load_config
    from kvbridge.worker.prefill import PrefillWorker

    spec = ClusterSpec(cp=1, decode_ranks=1, layers=2, pages=64, engine="auto")
    with Cluster(spec) as cluster:
        (prefill,), (decode,) = cluster.prefill, cluster.decode
        a = prefill.client.submit(ops.Prefill(201, 500))
        d = decode.client.submit(ops.Decode(201, 500, spec.prefill_instance))
        reply_a, reply_d = wait_reply(prefill, a, 30), wait_reply(decode, d, 30)
        assert reply_a.ok and reply_d.ok and reply_d.bytes_verified > 0, (reply_a, reply_d)
    worker = PrefillWorker(load_config("prefill", {"instance": "p", "engine": "ipc"}, environ={}))
    with pytest.raises(ConfigError, match="use --engine auto") as err:
        worker.start()
    assert err.value.field == "engine"
