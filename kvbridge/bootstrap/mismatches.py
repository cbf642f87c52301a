"""The recent refusals kept for diagnostics (hard rule 7: the diff is kept).

A bounded log, newest last inside, newest first out; each record names both
sides (instance, rank, fingerprint) and carries the field diff. The registry
builds the records (registry.py); a store keeps them here (in memory, or as the
cache of what etcd holds)."""

from __future__ import annotations

import threading
from collections import deque

from kvbridge.bootstrap.schemas import MismatchRecord

__all__ = ["MismatchLog"]


class MismatchLog:
    def __init__(self, maxlen: int = 100) -> None:
        self._lock = threading.Lock()
        self._records: deque[MismatchRecord] = deque(maxlen=maxlen)

    @property
    def maxlen(self) -> int:
        return self._records.maxlen or 0

    def append(self, rec: MismatchRecord) -> None:
        with self._lock:
            self._records.append(rec)

    def replace(self, records: list[MismatchRecord]) -> None:
        """Oldest first (a store's full reload)."""
        with self._lock:
            self._records.clear()
            self._records.extend(records)

    def recent(self, limit: int | None = None) -> list[MismatchRecord]:
        """Newest first."""
        with self._lock:
            items = list(reversed(self._records))
        return items[:limit] if limit is not None else items

    def __len__(self) -> int:
        return len(self._records)
