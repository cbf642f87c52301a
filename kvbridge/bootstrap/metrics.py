"""The daemon's Prometheus metrics (``prometheus-client``), one ``CollectorRegistry``
per app (on ``app.state``), never the process-global one, so two apps in one process
do not share numbers. Counters and the latency histogram are updated as requests
happen; the gauges (ranks and instances) are read from the registry at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["Metrics", "CONTENT_TYPE", "LATENCY_BUCKETS", "GaugeSource"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# name -> (help, label names)
_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvbridge_bootstrap_registrations_total": ("Rank registrations by outcome.", ("outcome",)),
    "kvbridge_bootstrap_heartbeats_total": ("Lease heartbeats by outcome (unknown: the rank must re-register).", ("outcome",)),
    "kvbridge_bootstrap_deregistrations_total": ("Ranks deregistered by their worker or an operator.", ()),
    "kvbridge_bootstrap_leases_expired_total": ("Ranks dropped because their lease expired.", ()),
    "kvbridge_bootstrap_lookups_total": ("Decode lookups (handshakes) by outcome.", ("outcome",)),
    "kvbridge_bootstrap_mismatches_total": ("Refusals recorded for diagnostics, by kind and reason.", ("kind", "reason")),
    "kvbridge_bootstrap_contract_refusals_total": ("Contract refusals by differing field (its first two path "
                                                   "segments, e.g. model.weights), one per field per refusal.",
                                                   ("kind", "field")),
    "kvbridge_bootstrap_rejected_requests_total": ("Requests refused before routing or by a limit, by reason.", ("reason",)),
    "kvbridge_bootstrap_http_requests_total": ("HTTP requests by route, method and status code.", ("code", "method", "route")),
}
_HISTOGRAM = ("kvbridge_bootstrap_request_duration_seconds", "HTTP request latency by route and method.", ("method", "route"))
_GAUGES = {
    "kvbridge_bootstrap_registered_ranks": ("Ranks holding a live lease, by role.", ("role",)),
    "kvbridge_bootstrap_instances": ("Instances with at least one live rank, by role and completeness.", ("role", "complete")),
    "kvbridge_bootstrap_store_up": ("1 when the store takes writes and new look-ups (etcd: quorum reached), else 0.",
                                    ("kind", "replica")),
    "kvbridge_bootstrap_store_requests": ("Requests this replica made to its store since it started (etcd).",
                                          ("kind", "replica")),
    "kvbridge_bootstrap_store_watch_restarts": ("Times this replica reloaded its cache from a fresh etcd snapshot.",
                                                ("kind", "replica")),
    "kvbridge_bootstrap_replicas": ("Daemon replicas the store knows (the same from every replica).", ("replica",)),
}

# what the daemon's registry reports at scrape time: gauge name -> [(labels, value)]
GaugeSource = Callable[[], dict[str, list[tuple[dict[str, str], float]]]]


class _Gauges(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        source = self._metrics.gauge_source
        values = source() if source is not None else {}
        for name, (text, labels) in _GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=list(labels))
            for label_values, v in values.get(name, []):
                family.add_metric([label_values[k] for k in labels], v)
            yield family


class Metrics:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.registry = CollectorRegistry()
        self.gauge_source: GaugeSource | None = None
        self._counters = {
            name: Counter(name, text, labels, registry=self.registry) for name, (text, labels) in _COUNTERS.items()
        }
        name, text, labels = _HISTOGRAM
        self._histogram = Histogram(name, text, labels, buckets=tuple(sorted(buckets)), registry=self.registry)
        self.registry.register(_Gauges(self))

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        counter = self._counters.get(name)
        if counter is None:
            raise KeyError(f"unknown metric {name!r}")
        (counter.labels(**labels) if labels else counter).inc(amount)

    def observe(self, name: str, value: float, **labels: str) -> None:
        if name != _HISTOGRAM[0]:
            raise KeyError(f"unknown metric {name!r}")
        self._histogram.labels(**labels).observe(value)

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> bytes:
        """The exposition text; gauges are read from ``gauge_source`` now."""
        return generate_latest(self.registry)
