"""``MemoryStore``: the registry's state in this process only (the embedded default:
``kvbridge bootstrap`` with no ``--store``, ``make demo``, most tests).

Leases run on this process's monotonic clock. Expired ranks are dropped lazily on
every access (cheap: only once the earliest lease has passed) and by the app's
periodic sweep. A daemon that did not run for a while (SIGSTOP, a suspended VM)
could not take the heartbeats sent meanwhile: every lease is lengthened by the gap
rather than all expiring at once on resume. (Longer, never shorter: decode ranks
free a dead rank's pages only after its lease is gone, so this errs on the safe
side of hard rule 6.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvbridge.bootstrap.mismatches import MismatchLog
from kvbridge.bootstrap.records import InstanceRecord, RankRecord
from kvbridge.bootstrap.schemas import MismatchRecord
from kvbridge.bootstrap.store import RegistryStore, StoreHealth

__all__ = ["MemoryStore"]

log = logging.getLogger(__name__)


class MemoryStore(RegistryStore):
    kind = "memory"
    remote = False

    def __init__(self, *, max_refusals: int = 100, pause_grace_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self.pause_grace_s = pause_grace_s  # a gap between two sweeps longer than this is a pause (None: off)
        self.pauses = 0
        self._last_tick = clock()
        self._next_expiry = float("inf")
        self._refusals = MismatchLog(max_refusals)
        self._health = StoreHealth(kind="memory")

    def add_rank(self, inst: InstanceRecord, rec: RankRecord, replaces: str | None) -> None:
        rec.expires_at = self.clock() + rec.lease_ttl_s
        if replaces is not None:
            self.index.drop(replaces)
        self.index.put(inst, rec)
        self._next_expiry = min(self._next_expiry, rec.expires_at)

    def renew(self, rec: RankRecord) -> None:
        rec.expires_at = self.clock() + rec.lease_ttl_s

    def remove_rank(self, rank_id: str) -> None:
        self.index.drop(rank_id)

    def expire(self, now: float) -> list[RankRecord]:
        self._forgive_pause(now)
        if now < self._next_expiry:
            return []
        dropped = [r for r in self.index.all_ranks() if r.expires_at <= now]
        for rec in dropped:
            self.index.drop(rec.rank_id)
        self._next_expiry = min((r.expires_at for r in self.index.all_ranks()), default=float("inf"))
        return dropped

    def _forgive_pause(self, now: float) -> None:
        gap, self._last_tick = now - self._last_tick, now
        if self.pause_grace_s is None or gap <= self.pause_grace_s:
            return
        ranks = self.index.all_ranks()
        for r in ranks:
            r.expires_at += gap
        self._next_expiry += gap
        self.pauses += 1
        log.warning("the daemon did not run for %.1fs: %d lease(s) lengthened by that much", gap, len(ranks))

    def add_refusal(self, rec: MismatchRecord) -> None:
        self._refusals.append(rec)

    def refusals(self, limit: int | None = None) -> list[MismatchRecord]:
        return self._refusals.recent(limit)

    def health(self) -> StoreHealth:
        return self._health
