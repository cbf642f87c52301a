"""Running a worker as a process: signals, the ready file, a clean exit.

SIGTERM and SIGINT only set a flag; the loop notices it between steps, drains
(in-flight rooms finish or fail with a reason), closes the endpoint (the rank
deregisters from the bootstrap daemon) and returns 0.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

STEP_SECONDS = 0.005


def write_ready_file(path: str, record: dict[str, Any]) -> None:
    """Atomically write ``record`` as one JSON line (readers never see half a file)."""
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)


def quiet_http_logs() -> None:
    """httpx logs every request at INFO (heartbeats every few seconds): keep that for DEBUG."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def serve(worker: Any) -> int:
    quiet_http_logs()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        worker.log.info("signal %s: draining", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ready = worker.start()
        if hasattr(worker.engine, "arm"):  # --chaos-failed-writes: SIGUSR1 makes the next writes fail,
            previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: worker.engine.arm())
            # SIGUSR2 makes the process SIGKILL itself right after it posts its next write
            previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, lambda *_: worker.engine.arm_kill())
        if worker.cfg.ready_file:
            write_ready_file(worker.cfg.ready_file, ready)
        while not stop.is_set() and not worker.shutdown_requested:
            worker.step(STEP_SECONDS)
        worker.drain(worker.cfg.drain_timeout)
    finally:
        worker.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    worker.log.info("%s stopped", worker.cfg.rank_name)
    return 0
