"""What kvbridge's SGLang backend counts: every request a rank refused or failed, by reason, as
``prometheus-client`` counters that SGLang's own ``/metrics`` shows.

    kvbridge_sglang_refusals_total{role, reason}         a room this rank would not serve: the
                                                         request failed, nothing written or read
    kvbridge_sglang_failed_transfers_total{role, reason} a room that failed after it opened

A request counts once on each rank that failed it itself (SGLang asks each rank's
``failure_exception()``; a rank that only saw a peer's failure counts nothing). Reasons are a bounded set (``REFUSALS``, ``FAILURES``: first match of the failure's text wins,
else ``other``), so the label set stays small whatever the text; the text itself is logged.

Where the numbers go. With ``--enable-metrics`` SGLang's scheduler processes write their
counters into ``PROMETHEUS_MULTIPROC_DIR`` and the HTTP server's ``/metrics`` reads them all;
kvbridge's counters are made in the same process, in prometheus-client's default registry, so
they join SGLang's. Without it (or for a second manager in one process: tests) they live in a
registry of their own (``Counters.registry``), read by the tests.
"""

from __future__ import annotations

import re
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter

REFUSED, FAILED = "kvbridge_sglang_refusals_total", "kvbridge_sglang_failed_transfers_total"

REFUSALS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in (
    ("unsigned_room", r"not a signed room id|unsigned or forged tag|signed room id \d+ expired"),
    ("room_in_use", r"room \d+ is (open|draining)|still draining"),
    ("bound_to_another_request", r"bound to another request|claim is another request's|was bound to"),
    ("token_count", r"tokens, but|tokens are \d+ pages"),
    ("claimed_by_another_instance", r"is claimed by decode instance|asked twice"),
    ("wrong_dp_rank", r"came to prefill DP rank"),
    ("memory_released", r"released this rank's KV memory"),
    ("contract", r"contract|fingerprint"),
    ("unsupported", r"not supported"),
))  # fmt: skip
FAILURES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(pattern, re.IGNORECASE)) for name, pattern in (
    ("aborted", r"abort"),
    ("timeout", r"timeout|timed out|within [0-9.]+s|still draining after"),
    ("peer_lost", r"silent|dead|lease|not connected|unreachable|peer lost|shut"),
    ("bootstrap", r"bootstrap|look-?up|topology|no kvbridge prefill instance"),
    ("engine", r"engine|mooncake|nixl|write .*failed|batch"),
    ("layout", r"page|layout|index"),
))  # fmt: skip


def classify(reason: str) -> tuple[str, str]:
    """``(counter, reason label)`` of a failure's text: a refusal when it names one."""
    for name, pattern in REFUSALS:
        if pattern.search(reason):
            return REFUSED, name
    for name, pattern in FAILURES:
        if pattern.search(reason):
            return FAILED, name
    return FAILED, "other"


class Counters:
    """One rank's counters (see the module docstring for the registry they join)."""

    def __init__(self, role: str, shared: bool) -> None:
        self.role = role
        try:
            self.registry, self._counters = REGISTRY if shared else CollectorRegistry(), {}
            self._counters = _make(self.registry)
        except ValueError:  # made already in this process's registry (a second manager): its own then
            self.registry = CollectorRegistry()
            self._counters = _make(self.registry)

    def count(self, reason: str) -> tuple[str, str]:
        """Count one failed request of this rank by the text of its reason; returns what was counted."""
        name, label = classify(reason)
        self._counters[name].labels(role=self.role, reason=label).inc()
        return name, label

    def value(self, name: str, reason: str) -> float:
        got = self.registry.get_sample_value(name, {"role": self.role, "reason": reason})
        return 0.0 if got is None else got


def _make(registry: CollectorRegistry) -> dict[str, Counter]:
    return {name: Counter(name.removesuffix("_total"), text, ("role", "reason"), registry=registry) for name, text in (
        (REFUSED, "Requests a kvbridge rank refused a room (nothing written or read), by role and reason."),
        (FAILED, "kvbridge rooms that failed after they opened, by role and reason."))}  # fmt: skip
