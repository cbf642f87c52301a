"""Per-rank Prometheus metrics of a worker, on a port of its own (``--metrics-port``).

One ``CollectorRegistry`` per worker (never the process-global one: in-process workers
share a process). Counters and histograms are updated by the worker loop when a room
ends; gauges are read at scrape time.

    kvbridge_worker_rooms_total{outcome}            rooms that ended, ok / failed
    kvbridge_worker_room_failures_total{reason}     failed rooms by reason class (REASON_CLASSES: bounded)
    kvbridge_worker_rooms{state}                    rooms in flight by poll state; decode: "held" =
                                                    failed rooms whose pages a write may still reach
    kvbridge_worker_bytes_total                     KV bytes moved (prefill: posted by this rank;
                                                    decode: received and committed)
    kvbridge_worker_slices_total                    prefill: transfer slices posted
    kvbridge_worker_phase_seconds{phase}            per-phase latency of rooms that succeeded, below
    kvbridge_worker_peers{state}                    decode: prefill ranks alive / dead
    kvbridge_worker_writes_in_flight                prefill: engine writes posted, not yet complete
    kvbridge_worker_pages{state}                    pool pages free / owned / held
    kvbridge_worker_control_messages_total{kind}    control channel: malformed / unauthenticated / error replies
    kvbridge_worker_late_writes_total               decode with --poison-pages: pages written after release
    kvbridge_worker_staging_targets_total{path}     prefill: targets by path chosen, direct / staged
    kvbridge_worker_staging_total{kind}             staged transfers: prefill chunks, bytes_staged, plan_slices,
                                                    gather_waits; decode slot_requests, slot_waits (back-pressure),
                                                    chunks_scattered, bytes_scattered, scatter_slices,
                                                    granted_with_request (_used, _unused: slots granted
                                                    with a room's request, --staging-granted-slots)
    kvbridge_worker_staging_slots{state}            decode: staging slots free / assigned / landed / quarantined
    kvbridge_worker_staging_waiting                 decode: chunks waiting for a staging slot now
    kvbridge_worker_info{rank,role,instance}        1

Phases, from what the endpoints expose today (the KVSender exposes bytes and slices
only, the KVReceiver its state durations; the worker stamps what it sees on its
5 ms loop):

    prefill  handshake        room started -> the decode ranks' requests arrived (WaitingForInput seen)
             first_write      requests arrived -> the first chunk posted (``send()`` posts at once
                              when decode already asked)
             last_completion  last chunk handed over -> every write completed and reported (Success)
    decode   handshake        the bootstrap look-up (state Bootstrapping)
             commit           TransferRequests sent -> every page and the aux row in, committed
                              (state Transferring)

Not measurable yet: when the *first* and *last* PagesDone reached decode (the receiver
keeps no per-report timestamps), so decode's commit phase includes the writes themselves.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, make_server, make_wsgi_app
from prometheus_client.registry import Collector

from kvbridge.errors import ConfigError

if TYPE_CHECKING:
    from kvbridge.worker.ops import RoomResult


class Task(Protocol):
    """What the metrics read of a worker's room: its phase marks (seconds since its start)."""

    marks: dict[str, float]


class WorkerBase(Protocol):
    """What the metrics read of a worker, at scrape time from the HTTP thread (reads only).
    A protocol, not the worker class: the worker owns its metrics, not the other way round."""

    role: str
    cfg: Any
    tasks: Mapping[int, Any]
    pages: Any
    endpoint: Any
    engine: Any

__all__ = ["WorkerMetrics", "reason_class", "REASON_CLASSES", "PHASES"]

PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
PHASES = ("handshake", "first_write", "last_completion", "commit")

# A failure reason is free text naming room, rank and field; its label is one of these
# classes (first match wins), so the label set stays bounded whatever the text.
REASON_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        ("contract", r"contract|fingerprint"),
        ("shutdown", r"shutting down|shut down"),
        ("timeout", r"timeout|timed out|within [0-9.]+s|exceeded"),
        ("peer_lost", r"silent|dead|lease|not connected|unreachable|peer lost|killed"),
        ("aborted", r"abort"),
        ("engine", r"engine|mooncake|transfer failed|write .*failed|batch"),
        ("bootstrap", r"bootstrap|look-?up|topology|instance"),
        ("verify", r"mismatch|verify|expected|corrupt"),
        ("refused", r"refused|outside|invalid|must|already"),
    )
)


def reason_class(reason: str) -> str:
    for name, pattern in REASON_CLASSES:
        if pattern.search(reason):
            return name
    return "other"


def phases_of(role: str, task: Task, stats: dict[str, Any]) -> dict[str, float]:
    """Phase durations of a finished room, from the worker's marks and the receiver's stats."""
    m = task.marks
    out: dict[str, float] = {}
    if role == "prefill":
        if "decode_ready" in m:
            out["handshake"] = m["decode_ready"] - m.get("filled", 0.0)
        if "first_write" in m and "decode_ready" in m:
            out["first_write"] = m["first_write"] - m["decode_ready"]
        if "done" in m and "sent" in m:
            out["last_completion"] = m["done"] - m["sent"]
    else:
        seconds = stats.get("seconds") or {}
        if "Bootstrapping" in seconds:
            out["handshake"] = seconds["Bootstrapping"]
        if "Transferring" in seconds and stats.get("state") == "Success":
            out["commit"] = seconds["Transferring"]
    return {k: max(0.0, v) for k, v in out.items()}


class _Live(Collector):
    """Gauges read from the worker at scrape time (from the HTTP thread: reads only)."""

    def __init__(self, worker: WorkerBase) -> None:
        self.w = worker

    def collect(self) -> Iterator[Metric]:
        w = self.w
        info = GaugeMetricFamily("kvbridge_worker_info", "This worker.", labels=["rank", "role", "instance"])
        info.add_metric([w.cfg.rank_name, w.role, w.cfg.instance], 1)
        yield info
        states: dict[str, int] = {}
        for task in list(w.tasks.values()):
            handle = getattr(task, "sender", None) or getattr(task, "receiver", None)
            state = handle.poll().name if handle is not None else "Starting"
            states[state] = states.get(state, 0) + 1
        states["held"] = len(getattr(w, "held", {}))
        rooms = GaugeMetricFamily("kvbridge_worker_rooms", "Rooms in flight by poll state (held: failed, pages "
                                  "kept until no write can reach them).", labels=["state"])
        for state in ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed", "held"):
            rooms.add_metric([state], states.get(state, 0))
        yield rooms
        pages = GaugeMetricFamily("kvbridge_worker_pages", "Pool pages by state.", labels=["state"])
        pages.add_metric(["free"], w.pages.num_free)
        pages.add_metric(["held"], w.pages.num_held)
        pages.add_metric(["owned"], w.pages.capacity - w.pages.num_free - w.pages.num_held)
        yield pages
        poison = getattr(w, "poison", None)
        if poison is not None:
            late = CounterMetricFamily("kvbridge_worker_late_writes", "Released pages found written after release "
                                       "(--poison-pages; hard rule 6).")
            late.add_metric([], poison.late_writes)
            yield late
        yield from self._endpoint(w)

    @staticmethod
    def _endpoint(w: WorkerBase) -> Iterator[Metric]:
        """What the endpoint's health() snapshot and the engine tell (an engine without a
        count of writes in flight just lacks that metric)."""
        health = w.endpoint.health()
        in_flight = getattr(getattr(w.engine, "inner", w.engine), "writes_in_flight", None)  # (a chaos FaultyEngine)
        if w.role == "prefill" and in_flight is not None:
            fam = GaugeMetricFamily("kvbridge_worker_writes_in_flight", "Engine writes posted and not yet complete.")
            fam.add_metric([], in_flight())
            yield fam
        if w.role == "decode":
            fam = GaugeMetricFamily("kvbridge_worker_peers", "Prefill ranks this decode rank talks to, by liveness.",
                                    labels=["state"])
            for state in ("alive", "dead"):
                fam.add_metric([state], health["peers"][state])
            yield fam
        yield from _staging(w.role, health["staging"])
        if health["control"]:
            fam = CounterMetricFamily("kvbridge_worker_control_messages", "Control-channel messages by kind.",
                                      labels=["kind"])
            for kind, value in health["control"].items():
                fam.add_metric([kind], value)
            yield fam


def _staging(role: str, staging: Any) -> Iterator[Metric]:
    """Staged transfers (docs/staging.md): the paths chosen, what was staged, and decode's slots."""
    if role == "prefill":
        counters = dict(staging)
        paths = CounterMetricFamily("kvbridge_worker_staging_targets", "Targets by the path chosen.", labels=["path"])
        for path in ("direct", "staged"):
            paths.add_metric([path], counters.pop(f"{path}_targets", 0))
        yield paths
    elif staging is not None:
        from kvbridge.transfer.staging.area import SlotState

        counters = staging["counters"]
        slots = GaugeMetricFamily("kvbridge_worker_staging_slots", "Staging slots by state.", labels=["state"])
        for state in SlotState:
            slots.add_metric([state.value], sum(1 for s in staging["slots"] if s is state))
        yield slots
        queue = GaugeMetricFamily("kvbridge_worker_staging_waiting", "Chunks waiting for a staging slot "
                                  "(back-pressure).")
        queue.add_metric([], staging["waiting"])
        yield queue
    else:
        return
    fam = CounterMetricFamily("kvbridge_worker_staging", "Staged transfers by kind.", labels=["kind"])
    for kind, value in sorted(counters.items()):
        fam.add_metric([kind], value)
    yield fam


class WorkerMetrics:
    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker
        self.registry = CollectorRegistry()
        r = self.registry
        self.rooms = Counter("kvbridge_worker_rooms_total", "Rooms that ended, by outcome.", ["outcome"], registry=r)
        self.failures = Counter("kvbridge_worker_room_failures_total", "Failed rooms by reason class.", ["reason"],
                                registry=r)
        self.bytes = Counter("kvbridge_worker_bytes_total", "KV bytes moved (prefill: posted; decode: received).",
                             registry=r)
        # slices are what the writer posts: prefill only (decode sees pages, not slices)
        self.slices = (Counter("kvbridge_worker_slices_total", "Transfer slices posted.", registry=r)
                       if worker.role == "prefill" else None)
        self.phase = Histogram("kvbridge_worker_phase_seconds", "Room phase latency.", ["phase"],
                               buckets=PHASE_BUCKETS, registry=r)
        for outcome in ("ok", "failed"):
            self.rooms.labels(outcome=outcome)
        r.register(_Live(worker))
        self._server: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._slices_seen = 0

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns its URL."""
        try:
            self._server = make_server(host, port, make_wsgi_app(self.registry), ThreadingWSGIServer,
                                       handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}", field="metrics_port") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvb-metrics", daemon=True)
        self._thread.start()
        return f"http://{host}:{self._server.server_port}/metrics"

    def room_finished(self, task: Task, result: RoomResult) -> None:
        self.rooms.labels(outcome="ok" if result.ok else "failed").inc()
        if not result.ok:
            self.failures.labels(reason=reason_class(result.reason)).inc()
        self.bytes.inc(result.num_bytes)
        stats: dict[str, Any] = {}
        if self.slices is None:
            stats = dict(getattr(getattr(task, "receiver", None), "stats", None) or {})
        else:  # the endpoint counts the slices it posted
            posted = int(getattr(self.worker.endpoint, "counters", {}).get("slices", 0))
            self.slices.inc(max(0, posted - self._slices_seen))
            self._slices_seen = max(self._slices_seen, posted)
        if result.ok:  # a failed room's phases measure its failure, not the path: not mixed in
            for phase, seconds in phases_of(self.worker.role, task, stats).items():
                self.phase.labels(phase=phase).observe(seconds)

    def room_refused(self, reason: str) -> None:
        """A room that failed before it started (no pages, bad op)."""
        self.rooms.labels(outcome="failed").inc()
        self.failures.labels(reason=reason_class(reason)).inc()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: no access log
        pass
