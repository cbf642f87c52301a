"""``MemoryStore``: the registry's state in this process only (the embedded default:
``kvbridge bootstrap`` with no ``--store``, ``make demo``, most tests).

Leases run on this process's monotonic clock. Expired ranks are dropped lazily on
every access (cheap: only once the earliest lease has passed) and by the app's
periodic sweep. A daemon that did not run for a while (SIGSTOP, a suspended VM)
could not take the heartbeats sent meanwhile: every lease is lengthened by the gap
rather than all expiring at once on resume. (Longer, never shorter: decode ranks
free a dead rank's pages only after its lease is gone, so this errs on the safe
side of hard rule 6.)

Claims outlive leases for their owners (``lapses.py``): an expired rank's claim is kept, lapsed,
for the grace period. With ``claims_file`` every claim (live and lapsed) is also written there
(atomically, on every registration, deregistration and expiry; not on heartbeats), and a
restarted daemon reads them back in ``start()``, before it answers anything: each claim that was
live at the restart is lapsed from then for the grace period, so its owner (the same key) takes
it back when it registers again and nobody else can meanwhile. Without a file a restart forgets
every claim (docs/security.md says what that leaves).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvbridge.bootstrap.claims import Claim
from kvbridge.bootstrap.lapses import DEFAULT_CLAIM_GRACE_S, Lapsed
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
                 clock: Callable[[], float] = time.monotonic, claims_file: str | Path | None = None,
                 claim_grace_s: float = DEFAULT_CLAIM_GRACE_S, wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.clock = clock
        self.wall = wall_clock
        self.claims_file = Path(claims_file) if claims_file is not None else None
        self.claim_grace_s = claim_grace_s
        self.pause_grace_s = pause_grace_s  # a gap between two sweeps longer than this is a pause (None: off)
        self.pauses = 0
        self._last_tick = clock()
        self._next_expiry = float("inf")
        self._refusals = MismatchLog(max_refusals)
        self._health = StoreHealth(kind="memory")

    def start(self) -> None:
        """Read the claims a previous daemon left in ``claims_file`` back, lapsed (lapses.py)."""
        if self.claims_file is None or not self.claims_file.exists():
            return
        try:
            data = json.loads(self.claims_file.read_text())
            until = self.wall() + self.claim_grace_s
            back = [Lapsed.from_json(json.dumps(x)) for x in data.get("lapsed", [])]
            back += [Lapsed(Claim.from_json(json.dumps(x["claim"])), x.get("proof_key"), until)
                     for x in data.get("live", [])]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("claims file %s unreadable (%s): starting with no claims", self.claims_file, exc)
            return
        with self.lock:
            for x in back:
                if x.until > self.wall():
                    self.index.add_lapsed(x)
        log.info("read %d claim(s) back from %s, each held for its owner until its grace ends", len(back),
                 self.claims_file)

    def _save(self) -> None:
        """Every claim to ``claims_file`` (the caller holds ``lock``): write a temporary file, then
        rename it over the old one, so a crash leaves the old file or the new, never half."""
        if self.claims_file is None:
            return
        live = [{"claim": json.loads(r.claim().to_json()), "proof_key": r.proof_key} for r in self.index.all_ranks()]
        lapsed = [json.loads(x.to_json()) for x in self.index.all_lapsed()]
        tmp = self.claims_file.with_name(self.claims_file.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"live": live, "lapsed": lapsed}))
            os.replace(tmp, self.claims_file)
        except OSError as exc:
            log.error("claims not saved to %s: %s", self.claims_file, exc)

    def add_rank(self, inst: InstanceRecord, rec: RankRecord, replaces: str | None, *, retaken: tuple[str, ...] = (),
                 proven: bool = False) -> None:
        rec.expires_at = self.clock() + rec.lease_ttl_s
        if replaces is not None:
            self.index.drop(replaces)
        self.index.drop_lapsed(rec.claim().session, list(retaken))
        self.index.put(inst, rec)
        self._next_expiry = min(self._next_expiry, rec.expires_at)
        self._save()

    def lapse(self, lapsed: list[tuple[RankRecord, float]]) -> None:
        for rec, until in lapsed:
            self.index.add_lapsed(Lapsed(rec.claim(), rec.proof_key, until))
        self.index.expire_lapsed(self.wall())
        self._save()

    def renew(self, rec: RankRecord) -> None:
        rec.expires_at = self.clock() + rec.lease_ttl_s

    def remove_rank(self, rank_id: str) -> None:
        self.index.drop(rank_id)
        self._save()

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
