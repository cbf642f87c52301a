"""Per-rank metrics: every worker process serves Prometheus on its own port; a test
scrapes a running prefill and decode worker after real rooms over Mooncake."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.transfer.engine import mooncake_available
from kvbridge.worker import ops
from kvbridge.worker.cluster import Cluster, ClusterSpec
from kvbridge.worker.metrics import PHASES, reason_class

needs_mooncake = pytest.mark.skipif(not mooncake_available(), reason="needs the Mooncake transfer engine")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=5.0, trust_env=False).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def wait_all(cluster: Cluster, pending: list, timeout: float = 60.0) -> list[ops.Reply]:
    deadline = time.monotonic() + timeout
    out = []
    for worker, request_id in pending:
        out.append(worker.client.wait(request_id, max(0.1, deadline - time.monotonic())))
    return out


@needs_mooncake
def test_scrape_a_running_prefill_and_decode_worker() -> None:
    spec = ClusterSpec(cp=1, decode_ranks=1, layers=2, pages=64)
    with Cluster(spec) as cluster:
        results = []
        for room in range(3):
            results += wait_all(cluster, cluster.submit_room(room + 1, 300, chunk_tokens=128))
        assert all(isinstance(r, ops.RoomResult) and r.ok for r in results), results
        decode = cluster.decode[0]
        bad = decode.client.call(ops.Decode(99, 64, "no-such-prefill"), timeout=60)  # fails at the look-up
        assert isinstance(bad, ops.RoomResult) and not bad.ok

        prefill_url, decode_url = cluster.prefill[0].ready["metrics"], decode.ready["metrics"]
        assert prefill_url.startswith("http://127.0.0.1:") and prefill_url != decode_url
        p, d = scrape(prefill_url), scrape(decode_url)

    assert p[("kvbridge_worker_rooms_total", (("outcome", "ok"),))] == 3
    assert d[("kvbridge_worker_rooms_total", (("outcome", "ok"),))] == 3
    assert d[("kvbridge_worker_rooms_total", (("outcome", "failed"),))] == 1
    assert d[("kvbridge_worker_room_failures_total", (("reason", "bootstrap"),))] == 1
    per_token = 2 * (656 + 132) + 656  # target + index (2 layers) + draft (1 layer), fp8
    assert p[("kvbridge_worker_bytes_total", ())] == d[("kvbridge_worker_bytes_total", ())] == 3 * 300 * per_token
    assert p[("kvbridge_worker_slices_total", ())] > 0 and ("kvbridge_worker_slices_total", ()) not in d
    for phase in ("handshake", "first_write", "last_completion"):
        assert p[("kvbridge_worker_phase_seconds_count", (("phase", phase),))] == 3, phase
    for phase in ("handshake", "commit"):
        assert d[("kvbridge_worker_phase_seconds_count", (("phase", phase),))] == 3, phase
    assert d[("kvbridge_worker_peers", (("state", "alive"),))] == 1
    assert p[("kvbridge_worker_writes_in_flight", ())] == 0
    assert p[("kvbridge_worker_rooms", (("state", "Transferring"),))] == 0
    assert d[("kvbridge_worker_pages", (("state", "free"),))] == 64
    assert d[("kvbridge_worker_control_messages_total", (("kind", "unauthenticated"),))] == 0
    assert ("kvbridge_worker_info", (("instance", "demo-prefill"), ("rank", "demo-prefill/dp0cp0tp0"),
                                     ("role", "prefill"))) in p


@needs_mooncake
def test_staged_rooms_show_in_both_workers_metrics() -> None:
    """--staging always (flags of both workers): the path chosen, the chunks and bytes staged, and
    decode's slots (all free after the rooms) and back-pressure, on each side's /metrics."""
    spec = ClusterSpec(cp=1, decode_ranks=1, layers=2, pages=64, prefill_instance="staged-prefill",
                       extra_args=("--staging", "always", "--staging-bytes", str(256 << 10),
                                   "--staging-slot-bytes", str(64 << 10)))
    with Cluster(spec) as cluster:
        results = []
        for room in range(2):
            results += wait_all(cluster, cluster.submit_room(room + 1, 300, chunk_tokens=128))
        assert all(isinstance(r, ops.RoomResult) and r.ok for r in results), results
        p, d = scrape(cluster.prefill[0].ready["metrics"]), scrape(cluster.decode[0].ready["metrics"])
    per_token = 2 * (656 + 132) + 656
    assert p[("kvbridge_worker_staging_targets_total", (("path", "staged"),))] == 2
    assert p[("kvbridge_worker_staging_targets_total", (("path", "direct"),))] == 0
    assert p[("kvbridge_worker_staging_total", (("kind", "bytes_staged"),))] >= 2 * 300 * per_token
    assert p[("kvbridge_worker_staging_total", (("kind", "chunks"),))] > 2
    assert d[("kvbridge_worker_staging_total", (("kind", "chunks_scattered"),))] == \
        p[("kvbridge_worker_staging_total", (("kind", "chunks"),))]
    assert d[("kvbridge_worker_staging_slots", (("state", "free"),))] == 4
    assert d[("kvbridge_worker_staging_waiting", ())] == 0


@pytest.mark.parametrize(
    "reason, cls",
    [
        ("contract fingerprint sha256:ab differs from prefill rank p/dp0's; nothing transferred (hard rule 7)", "contract"),
        ("no prefill topology for instance 'p' within 30.0s (bootstrap timeout); last answer: ...", "timeout"),
        ("prefill rank p/cp1 silent for 5.0s: declared dead [room=3]", "peer_lost"),
        ("decode rank d/dp0tp0 aborted: worker shutting down", "shutdown"),
        ("aborted by decode", "aborted"),
        ("engine write to 127.0.0.1:1234 failed: injected failure", "engine"),
        ("bootstrap look-up failed: no prefill instance 'x' is registered (HTTP 404)", "bootstrap"),
        ("pool 'target' layer 0 page 3: byte mismatch at 17", "verify"),
        ("something nobody foresaw", "other"),
    ],
)
def test_failure_reasons_fall_into_bounded_classes(reason: str, cls: str) -> None:
    assert reason_class(reason) == cls


def test_every_phase_is_named() -> None:
    assert PHASES == ("handshake", "first_write", "last_completion", "commit")
