"""Prometheus text exposition (format 0.0.4) for one daemon, written by hand:
counters and histograms live on this object (on ``app.state``), never in a
process-global registry, so two apps in one process do not share numbers."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable

__all__ = ["Metrics", "CONTENT_TYPE", "LATENCY_BUCKETS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

Labels = tuple[tuple[str, str], ...]

# name -> (type, help)
_FAMILIES = {
    "kvbridge_bootstrap_registrations_total": ("counter", "Rank registrations by outcome."),
    "kvbridge_bootstrap_heartbeats_total": ("counter", "Lease heartbeats by outcome (unknown: the rank must re-register)."),
    "kvbridge_bootstrap_deregistrations_total": ("counter", "Ranks deregistered by their worker."),
    "kvbridge_bootstrap_leases_expired_total": ("counter", "Ranks dropped because their lease expired."),
    "kvbridge_bootstrap_lookups_total": ("counter", "Decode lookups (handshakes) by outcome."),
    "kvbridge_bootstrap_mismatches_total": ("counter", "Refusals recorded for diagnostics, by kind and reason."),
    "kvbridge_bootstrap_rejected_requests_total": ("counter", "Requests refused before routing, by reason."),
    "kvbridge_bootstrap_http_requests_total": ("counter", "HTTP requests by route, method and status code."),
    "kvbridge_bootstrap_request_duration_seconds": ("histogram", "HTTP request latency by route and method."),
    "kvbridge_bootstrap_registered_ranks": ("gauge", "Ranks holding a live lease, by role."),
    "kvbridge_bootstrap_instances": ("gauge", "Instances with at least one live rank, by role and completeness."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    items = (*labels, *extra)
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}" if items else ""


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Metrics:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self._lock = threading.Lock()
        self._buckets = tuple(sorted(buckets))
        self._counters: dict[tuple[str, Labels], float] = {}
        # (name, labels) -> [bucket counts..., sum, count]
        self._hist: dict[tuple[str, Labels], list[float]] = {}

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if name not in _FAMILIES:
            raise KeyError(f"unknown metric {name!r}")
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + amount

    def observe(self, name: str, value: float, **labels: str) -> None:
        if name not in _FAMILIES:
            raise KeyError(f"unknown metric {name!r}")
        key = (name, tuple(sorted(labels.items())))
        n = len(self._buckets)
        i = bisect.bisect_left(self._buckets, value)  # first bound >= value ("le")
        with self._lock:
            h = self._hist.setdefault(key, [0.0] * (n + 2))
            if i < n:
                h[i] += 1
            h[n] += value
            h[n + 1] += 1

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def render(self, gauges: dict[str, list[tuple[dict[str, str], float]]]) -> str:
        """The exposition text; ``gauges`` are computed by the caller at scrape time."""
        with self._lock:
            counters = dict(self._counters)
            hist = {k: list(v) for k, v in self._hist.items()}
        lines: list[str] = []
        for name, (kind, text) in _FAMILIES.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            if kind == "counter":
                for (n, labels), v in sorted(counters.items()):
                    if n == name:
                        lines.append(f"{name}{_labels(labels)} {_num(v)}")
            elif kind == "gauge":
                for labels_d, v in gauges.get(name, []):
                    lines.append(f"{name}{_labels(tuple(sorted(labels_d.items())))} {_num(v)}")
            else:
                for (n, labels), h in sorted(hist.items()):
                    if n != name:
                        continue
                    cumulative = 0.0
                    for bound, count in zip(self._buckets, h):
                        cumulative += count
                        lines.append(f"{name}_bucket{_labels(labels, (('le', repr(bound)),))} {_num(cumulative)}")
                    lines.append(f"{name}_bucket{_labels(labels, (('le', '+Inf'),))} {_num(h[-1])}")
                    lines.append(f"{name}_sum{_labels(labels)} {repr(h[-2])}")
                    lines.append(f"{name}_count{_labels(labels)} {_num(h[-1])}")
        return "\n".join(lines) + "\n"
