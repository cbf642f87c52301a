"""The ``auto`` engine: CUDA IPC for peers on this host, Mooncake for the rest, chosen per write.

    engine = create_engine("auto")        # on every rank: peers need not know what carries the bytes
    engine.session_id                     # Mooncake's "host:port"; the IPC side channel is named after it

One Mooncake engine and one IPC engine hold the same registered memory. A write to a
peer's session goes

    peer's IPC side channel answers (same host, same user, an ``auto`` engine)
        slices whose destination the IPC engine reaches (device memory; host memory of
        this process)                                        -> IPC (one kernel launch)
        the rest (host memory of another process)            -> Mooncake
    no side channel (another host, or a plain Mooncake peer) -> Mooncake, every slice

and is one handle: final when every part is, FAILED with the first part's reason. The
route of a session is found once (a failed connection is tried again after
``RETRY_S``) and is visible in ``stats`` (writes, slices and bytes per route) and, with
``KVBRIDGE_TRACE=1``, in one ``trace engine=auto`` line per write. Completions are
reported from the part's engine thread (no extra hop). Without CUDA the IPC part moves
host memory of this process only, so on a CPU host two processes always meet over
Mooncake.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from kvbridge.errors import EngineError
from kvbridge.transfer.engine.base import TransferEngine, WriteState
from kvbridge.transfer.engine.jobs import JobEngine, JobTable, Regions, check_write

log = logging.getLogger(__name__)

IPC, MOONCAKE = "ipc", "mooncake"
RETRY_S = 10.0  # a peer without a side channel is asked again after this long
_PREFIX = "auto/"


def ipc_session(mooncake_session: str) -> str:
    """The IPC session (side-channel name) of the auto engine whose Mooncake session is given."""
    return _PREFIX + mooncake_session


class AutoEngine(JobEngine):
    transport = "mooncake"  # its session is its Mooncake engine's: plain Mooncake peers write into it

    @classmethod
    def create(cls, *, host: str, protocol: str, device: str, max_slices_per_call: int) -> AutoEngine:
        """``create_engine("auto")``: a Mooncake engine and an IPC engine named after its session."""
        from kvbridge.transfer.engine.ipc import IpcEngine
        from kvbridge.transfer.engine.mooncake import MooncakeEngine

        mooncake = MooncakeEngine(host=host, protocol=protocol, device=device, max_slices_per_call=max_slices_per_call)
        try:
            ipc = IpcEngine(session=ipc_session(mooncake.session_id))
        except BaseException:
            mooncake.close()
            raise
        return cls(mooncake=mooncake, ipc=ipc)

    def __init__(self, *, mooncake: TransferEngine, ipc: TransferEngine | None) -> None:
        self._mc = mooncake
        self._ipc = ipc
        self.max_slices_per_call = mooncake.max_slices_per_call
        self._who = f"auto engine {mooncake.session_id}"
        self._trace = os.environ.get("KVBRIDGE_TRACE") == "1"
        self._stats: Counter[str] = Counter()
        self._jobs = JobTable(self._who)
        self._lock = threading.Lock()
        self._regions = Regions()  # what both parts hold: sources are checked here, before any part posts
        self._routes: dict[str, tuple[str, float]] = {}  # peer session -> (route, when found)
        self._parts: dict[tuple[int, int], tuple[TransferEngine, Any]] = {}  # (id(engine), handle) -> (engine, job)
        for part in self._engines():
            part.set_notify(lambda part=part: self._settle(part, part.take_final()))

    @property
    def session_id(self) -> str:
        return self._mc.session_id

    @property
    def stats(self) -> Counter[str]:
        """Writes, slices and bytes per route (``writes_ipc``, ``slices_mooncake``, ...), and the
        IPC and Mooncake engines' own counts prefixed ``ipc_`` and ``mooncake_``."""
        out = Counter(self._stats)
        out.update({f"ipc_{k}": v for k, v in getattr(self._ipc, "stats", {}).items()})
        out.update({f"mooncake_{k}": v for k, v in getattr(self._mc, "stats", {}).items()})
        return out

    def _engines(self) -> list[TransferEngine]:
        return [e for e in (self._mc, self._ipc) if e is not None]

    # ---- memory: registered with both -------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._regions.add(ptr, nbytes, self._who)
        try:
            self._mc.register(ptr, nbytes)
            if self._ipc is not None:
                try:
                    self._ipc.register(ptr, nbytes)
                except EngineError:
                    self._mc.unregister(ptr)
                    raise
        except BaseException:
            with self._lock:
                self._regions.remove(ptr, self._who)
            raise

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self._regions.remove(ptr, self._who)
        errors = []
        for part in self._engines():  # both, even when one refuses: a writer must never keep a way in
            try:
                part.unregister(ptr)
            except EngineError as exc:
                errors.append(str(exc))
        if errors:
            raise EngineError("; ".join(errors))

    # ---- routes -----------------------------------------------------------------------------
    def route(self, session: str) -> str:
        """The registry's route of a write to ``session``: "ipc" when the peer's IPC side channel
        answers (this host), else the Mooncake part's (``mooncake/tcp``; its transport's staging
        thresholds apply)."""
        if self._part(session) == IPC:
            return IPC
        inner = getattr(self._mc, "route", None)
        return inner(session) if inner is not None else MOONCAKE

    def _part(self, session: str) -> str:
        """"ipc" when the peer's IPC side channel answers (this host), else "mooncake"."""
        if self._ipc is None:
            return MOONCAKE
        with self._lock:
            known = self._routes.get(session)
        if known is not None and (known[0] == IPC or time.monotonic() - known[1] < RETRY_S):
            return known[0]
        found = IPC if self._ipc.reaches(ipc_session(session)) else MOONCAKE
        with self._lock:
            self._routes[session] = (found, time.monotonic())
        if found != (known or ("", 0.0))[0]:
            log.info("%s: writes to %s go over %s", self._who, session, found)
        return found

    def reads(self, session: str) -> bool:
        return self._mc.reads(session)  # (the session is Mooncake's; IPC reaches only some of it)

    def probe_read(self, session: str, dst: np.ndarray, src: np.ndarray, length: np.ndarray,
                   timeout: float = 5.0) -> None:
        self._mc.probe_read(session, dst, src, length, timeout)

    # ---- writes -----------------------------------------------------------------------------
    def submit_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
                     after: Any = None) -> int:
        src, dst, length = check_write(self._who, session, src, dst, length, self._regions, self._lock)
        parts: list[tuple[str, np.ndarray]] = []
        if src.size and self._part(session) == IPC:
            near = self._ipc.reachable(ipc_session(session), dst, length)
            if near is None:  # the side channel went away meanwhile
                with self._lock:
                    self._routes[session] = (MOONCAKE, time.monotonic())
                parts.append((MOONCAKE, np.ones(src.size, dtype=bool)))
            else:
                parts += [(IPC, near)] if near.all() else [(IPC, near), (MOONCAKE, ~near)]
        elif src.size:
            parts.append((MOONCAKE, np.ones(src.size, dtype=bool)))
        parts = [(route, mask) for route, mask in parts if mask.any()]
        job = self._jobs.open(session, len(parts), int(src.size))
        for route, mask in parts:
            part = self._ipc if route == IPC else self._mc
            target = ipc_session(session) if route == IPC else session
            s, d, n = (src, dst, length) if mask.all() else (src[mask], dst[mask], length[mask])
            self._stats[f"writes_{route}"] += 1
            self._stats[f"slices_{route}"] += int(n.size)
            self._stats[f"bytes_{route}"] += int(n.sum())
            try:
                handle = part.submit_write(target, s, d, n, after=after)
            except EngineError as exc:  # refused before posting: this part fails, the others still land
                self._jobs.batch_finished(job, f"{self._who}: {route} part of write {job.handle}: {exc}")
                continue
            with self._lock:
                self._parts[(id(part), handle)] = (part, job)
            self._settle(part, [handle])  # a part refused at once is final already
        if self._trace:
            log.info("trace engine=auto write=%d -> %s via %s slices=%d bytes=%d @%.6f", job.handle, session,
                     "+".join(r for r, _ in parts) or "-", src.size, int(length.sum()), time.monotonic())
        return job.handle

    def _settle(self, part: TransferEngine, handles: list[int] | None) -> None:
        """Finish the auto jobs whose parts became final (the part's engine thread, or the submitter)."""
        if handles is None:  # an engine that does not track finals: look at every part it holds
            with self._lock:
                handles = [h for (eid, h) in self._parts if eid == id(part)]
        for handle in handles:
            with self._lock:  # whoever removes the entry polls it: a final handle is polled once
                entry = self._parts.get((id(part), handle))
                if entry is None:
                    continue
                status = part.poll(handle)
                if status.state is WriteState.PENDING:
                    continue
                del self._parts[(id(part), handle)]
            job = entry[1]
            self._jobs.batch_finished(job, status.reason if status.state is WriteState.FAILED else "")

    def close(self) -> None:
        for part in self._engines():
            part.close()
        for part in self._engines():  # what the parts failed at close
            self._settle(part, None)
