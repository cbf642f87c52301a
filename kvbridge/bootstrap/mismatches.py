"""The recent refusals kept for diagnostics (hard rule 7: the diff is kept).

A bounded log, newest last inside, newest first out; each record names both
sides (instance, rank, fingerprint) and carries the field diff."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

from kvbridge.bootstrap.diff import FieldDiff
from kvbridge.bootstrap.metrics import Metrics
from kvbridge.bootstrap.schemas import MismatchRecord, MismatchSide

__all__ = ["MismatchLog"]

log = logging.getLogger(__name__)


class MismatchLog:
    def __init__(self, metrics: Metrics, maxlen: int = 100, wall_clock: Callable[[], float] = time.time) -> None:
        self._metrics = metrics
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._records: deque[MismatchRecord] = deque(maxlen=maxlen)

    def record(
        self,
        kind: Literal["lookup", "register"],
        reason: Literal["contract", "topology"],
        message: str,
        left: MismatchSide,
        right: MismatchSide,
        diff: list[FieldDiff],
    ) -> MismatchRecord:
        rec = MismatchRecord(time=self._wall(), kind=kind, reason=reason, message=message, left=left, right=right, diff=diff)
        with self._lock:
            self._records.append(rec)
        self._metrics.inc("kvbridge_bootstrap_mismatches_total", kind=kind, reason=reason)
        log.warning("refused (%s, %s): %s", kind, reason, message)
        return rec

    def recent(self, limit: int | None = None) -> list[MismatchRecord]:
        """Newest first."""
        with self._lock:
            items = list(reversed(self._records))
        return items[:limit] if limit is not None else items
