"""Workers as threads of one process, for the ``local`` transfer engine.

The local engine moves bytes between regions of one ``LocalFabric``, so its
ranks must share a process. Each worker runs the same loop as a worker process
(start, step until stopped, drain, close) in its own thread, and is still
reached through its ops channel on loopback.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from kvbridge.worker.base import WorkerBase
from kvbridge.worker.launch import STARTUP_TIMEOUT_S, LaunchError
from kvbridge.worker.runtime import STEP_SECONDS


class ThreadWorker:
    def __init__(self, worker: WorkerBase) -> None:
        self.worker = worker
        self.name = worker.cfg.rank_name
        self.exit_code: int | None = None
        self._stop = threading.Event()
        self._ready: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kvb-worker-{self.name}", daemon=True)

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        self._thread.start()
        try:
            ready = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise LaunchError(f"{self.name} not ready after {timeout:.0f}s") from None
        if isinstance(ready, BaseException):
            raise LaunchError(f"{self.name} failed to start: {ready}") from ready
        return ready

    def _run(self) -> None:
        try:
            self._ready.put(self.worker.start())
            while not self._stop.is_set() and not self.worker.shutdown_requested:
                self.worker.step(STEP_SECONDS)
            self.worker.drain(self.worker.cfg.drain_timeout)
            self.exit_code = 0
        except BaseException as exc:  # reported to start() or through exit_code; logged here
            self.worker.log.exception("%s stopped on an error", self.name)
            self._ready.put(exc)
            self.exit_code = 1
        finally:
            self.worker.close()

    def stop(self, timeout: float = 30.0) -> int | None:
        """Like SIGTERM: drain, close, join."""
        self._stop.set()
        self._thread.join(timeout)
        return self.exit_code if not self._thread.is_alive() else None
