"""Exclusive nested timers for ``scripts/decode_split.py`` and ``scripts/prefill_split.py``: a
function wrapped by :meth:`Timers.timed` adds, to the part named for it in the turn being recorded,
the time spent inside it less the wrapped parts inside it, so a turn's parts sum to the turn. Only
on the thread that feeds the turn (``owner``) and only while one is recorded (``cur``); anywhere
else a wrapper only passes the call through."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

P = time.perf_counter


class Timers:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []  # one per turn recorded
        self.stack: list[list[Any]] = []  # [name, start, inner] of the open timers
        self.cur: dict[str, Any] | None = None  # the turn being recorded: its "parts" are summed into
        self.owner = 0  # the thread feeding it

    def timed(self, name: str, fn: Any) -> Any:
        split = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if split.cur is None or threading.get_ident() != split.owner:
                return fn(*args, **kwargs)
            frame = [name, P(), 0.0]
            split.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                split.stack.pop()
                took = P() - frame[1]
                parts = split.cur["parts"]
                parts[name] = parts.get(name, 0.0) + took - frame[2]
                if split.stack:
                    split.stack[-1][2] += took

        wrapper.__wrapped__ = fn
        return wrapper

    def time_kernel(self, slicecopy: Any, name: str = "kernel") -> None:
        """Time the copier's Triton kernel launches (``slicecopy._kernel()[grid](...)``) as ``name``."""
        kernel = slicecopy._kernel
        timers = self

        class _Launch:
            def __init__(self, k: Any) -> None:
                self.k = k

            def __getitem__(self, grid: Any) -> Any:
                return timers.timed(name, self.k[grid])

        slicecopy._kernel = lambda: _Launch(kernel())

    def time_copier(self, launch: str, memcpy: str) -> bool:
        """Time the GPU copier's steps where its modules import (False where they do not): its
        launch (as ``launch``), the piece table's wait or growth, the pieces' numpy, the runtime's
        copies (as ``memcpy``) and event records, the completion event, the kernel's launch."""
        try:
            from kvbridge.transfer.engine import _cuda, slicecopy
        except ImportError:
            return False
        copier = slicecopy.CudaCopier
        copier.launch = self.timed(launch, copier.launch)
        copier._table = self.timed("table", copier._table)
        copier.record = self.timed("record", copier.record)
        slicecopy.plan_pieces = self.timed("plan", slicecopy.plan_pieces)
        _cuda.Cuda.memcpy_async = self.timed(memcpy, _cuda.Cuda.memcpy_async)
        _cuda.Cuda.event_record = self.timed("ev_record", _cuda.Cuda.event_record)
        self.time_kernel(slicecopy)
        return True

    def dump_at_exit(self, role: str) -> None:
        """Write the records to ``$KVBRIDGE_SPLIT_DIR/<role>-<pid>.json`` when the process exits."""
        folder = os.environ["KVBRIDGE_SPLIT_DIR"]

        def dump() -> None:
            if self.records:
                with open(os.path.join(folder, f"{role}-{os.getpid()}.json"), "w") as f:
                    json.dump(self.records, f)

        atexit.register(dump)
