"""``FaultyEngine``: a transfer engine that fails writes on demand (``kvbridge chaos``, fault tests).

It wraps a real engine (Mooncake in the chaos cluster). A worker started with
``--chaos-failed-writes N`` wraps its engine in one and arms it on SIGUSR1: the next N
``submit_write`` calls fail as a failing Mooncake batch would (``FAILED`` with a reason,
nothing written), every other call goes to the real engine untouched.

``arm_kill`` (SIGUSR2 in such a worker) makes the process SIGKILL itself right after its
next write is posted to the real engine, with that write (and any other it posted and has
not yet seen final) in flight. ``kvbridge chaos`` aims its "prefill SIGKILL" fault this way:
sampling the rank's writes-in-flight gauge and then signalling from outside missed every
time on a loaded host, where a small room's writes finish between two scrapes. The kill
is the kernel's SIGKILL, not an exit path: nothing of the process runs after it. Before it,
one line goes to stderr (``KILL_LINE``, the count of writes in flight) for the harness.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.errors import EngineError
from kvbridge.transfer.engine.base import TransferEngine, WriteStatus
from kvbridge.transfer.engine.registry import entry_of

__all__ = ["FaultyEngine", "INJECTED", "KILL_LINE", "killed_with_writes"]

INJECTED = "injected transfer-engine error (kvbridge chaos)"
KILL_LINE = "kvbridge chaos: SIGKILL with {n} write(s) in flight"
_KILL_RE = re.compile(r"kvbridge chaos: SIGKILL with (\d+) write\(s\) in flight")


def killed_with_writes(log_text: str) -> int:
    """Writes in flight when an armed kill fired, from the process's log (0: it did not fire)."""
    found = _KILL_RE.findall(log_text)
    return int(found[-1]) if found else 0


class FaultyEngine(TransferEngine):
    def __init__(self, inner: TransferEngine, failures_per_arm: int) -> None:
        self.inner = inner
        self.failures_per_arm = failures_per_arm
        self.max_slices_per_call = inner.max_slices_per_call
        self.direct_only = inner.direct_only
        self.injected = 0  # writes failed so far
        self._armed = 0
        self._lock = threading.Lock()
        self._failed: set[int] = set()
        self._ids = itertools.count(-1, -1)  # the real engines' handles are positive
        self._notify: Callable[[], None] | None = None
        self._kill_armed = False
        self._posted: set[int] = set()  # real handles posted and not yet seen final through poll/wait

    @property
    def transport(self) -> str:
        return self.inner.transport

    def route(self, session: str) -> str:
        """The registry name of the engine a write to ``session`` goes through: the inner engine's."""
        route = getattr(self.inner, "route", None)
        return route(session) if route is not None else entry_of(self.inner).name

    def arm(self) -> None:
        """Fail the next ``failures_per_arm`` writes (signal-safe: no I/O, one lock)."""
        with self._lock:
            self._armed = self.failures_per_arm

    def arm_kill(self) -> None:
        """SIGKILL this process right after its next write is posted (signal-safe: one flag)."""
        self._kill_armed = True

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    @property
    def metadata(self) -> bytes:
        return self.inner.metadata

    def add_peer(self, session: str, metadata: bytes) -> None:
        self.inner.add_peer(session, metadata)

    def register(self, ptr: int, nbytes: int) -> None:
        self.inner.register(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)

    def submit_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
                     after: Any = None) -> int:
        with self._lock:
            fail = self._armed > 0
            if fail:
                self._armed -= 1
                self.injected += 1
                handle = next(self._ids)
                self._failed.add(handle)
        if not fail:
            handle = self.inner.submit_write(session, src, dst, length, after=after)
            with self._lock:
                self._posted.add(handle)
                in_flight = len(self._posted)
            if self._kill_armed:
                os.write(2, (KILL_LINE.format(n=in_flight) + "\n").encode())
                os.kill(os.getpid(), signal.SIGKILL)
            return handle
        if self._notify is not None:
            self._notify()  # final at once: wake whoever collects completions
        return handle

    def probe_write(self, session: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
                    timeout: float = 5.0) -> None:
        self.inner.probe_write(session, src, dst, length, timeout)  # armed failures are for KV writes

    def reads(self, session: str) -> bool:
        return self.inner.reads(session)

    def probe_read(self, session: str, dst: np.ndarray, src: np.ndarray, length: np.ndarray,
                   timeout: float = 5.0) -> None:
        self.inner.probe_read(session, dst, src, length, timeout)

    def poll(self, handle: int) -> WriteStatus:
        if handle < 0:
            with self._lock:
                self._failed.discard(handle)
            return WriteStatus.failed(f"{INJECTED}: write of handle {handle} refused")
        status = self.inner.poll(handle)
        if status.is_final:
            self._seen_final(handle)
        return status

    def wait(self, handle: int, timeout: float) -> None:
        if handle < 0:
            self.poll(handle)
            raise EngineError(f"{INJECTED}: write of handle {handle} refused")
        try:
            self.inner.wait(handle, timeout)
        except EngineError:  # failed: final (a TransferTimeout leaves it in flight)
            self._seen_final(handle)
            raise
        self._seen_final(handle)

    def _seen_final(self, handle: int) -> None:
        with self._lock:
            self._posted.discard(handle)

    def set_notify(self, callback: Callable[[], None] | None) -> None:
        self._notify = callback
        self.inner.set_notify(callback)

    def close(self) -> None:
        self.inner.close()
