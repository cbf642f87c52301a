"""Wall-clock timers around the functions on a room's send, post and commit path, in every process
that imports this (put this folder first on PYTHONPATH, set ``KVBRIDGE_TIMERS=1``): each process
writes ``timers-<pid>.txt`` (p50 / p90 / mean / max ms and call counts per function) into
``KVBRIDGE_TIMERS_DIR`` (default /tmp) when it exits. Diagnostics only: the wrappers add about a
microsecond per call. Issue 33, round 18 (docs/performance.md), on a device host:

    KVBRIDGE_TIMERS=1 KVBRIDGE_TIMERS_DIR=$OUT/timers PYTHONPATH=/tmp/site:$PWD/scripts/device/send_timers:$PWD \\
        python3 scripts/gpu_bench.py --groups mooncake-nvlink ipc --alloc contiguous --tokens 8192 --reps 10 --ask-first
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import sys
import time

TIMED = (
    ("kvbridge.transfer.prefill.sender", "KVSender.send"),
    ("kvbridge.transfer.prefill.endpoint", "PrefillEndpoint.send_chunk"),
    ("kvbridge.transfer.prefill.endpoint", "PrefillEndpoint._post"),
    ("kvbridge.transfer.prefill.endpoint", "PrefillEndpoint._carry"),
    ("kvbridge.transfer.prefill.machine", "PrefillRooms.feed"),
    ("kvbridge.transfer.prefill.machine", "PrefillRooms._post_room"),
    ("kvbridge.transfer.prefill.room", "PrefillRoom.add_chunk"),
    ("kvbridge.transfer.prefill.writes", "Writes.post"),
    ("kvbridge.transfer.prefill.writes", "Writes._post_chunk"),
    ("kvbridge.transfer.prefill.writes", "plan_chunk"),
    ("kvbridge.transfer.prefill.staged", "StagedWrites.group_size"),
    ("kvbridge.transfer.prefill.staged", "StagedWrites.path"),
    ("kvbridge.transfer.shell", "EndpointShell._feed_event"),
    ("kvbridge.transfer.shell", "EndpointShell._feed"),
    ("kvbridge.transfer.aux_rows", "AuxStaging.stage"),
    ("kvbridge.layout.aux", "AuxSchema.pack_row"),
    ("kvbridge.transfer.engine.mooncake", "MooncakeEngine.submit_write"),
    ("kvbridge.transfer.engine.mooncake", "check_write"),
    ("kvbridge.transfer.engine.ipc.engine", "IpcEngine._submit"),
    ("kvbridge.transfer.engine.ipc.engine", "IpcEngine._translate"),
    ("kvbridge.transfer.engine.ipc.engine", "IpcEngine._post"),
    ("kvbridge.transfer.engine.ipc.engine", "IpcEngine._launch"),
    ("kvbridge.transfer.engine.ipc.engine", "check_slices"),
    ("kvbridge.transfer.engine.slicecopy", "CudaCopier.launch"),
    ("kvbridge.transfer.engine.slicecopy", "CudaCopier._table"),
    ("kvbridge.transfer.engine.slicecopy", "CudaCopier.wait_for"),
    ("kvbridge.transfer.engine.slicecopy", "CudaCopier.record"),
    ("kvbridge.transfer.engine.slicecopy", "plan_pieces"),
    ("kvbridge.transfer.decode.endpoint", "DecodeEndpoint._read_for_commit"),
    ("kvbridge.transfer.decode.machine", "DecodeRooms.feed"),
)


def _install(stats: dict[str, list[float]]) -> None:
    for module, name in TIMED:
        try:
            owner = importlib.import_module(module)
            *path, leaf = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            fn = getattr(owner, leaf)
        except Exception as exc:  # noqa: BLE001 (a function renamed since: said, the rest still timed)
            print(f"send_timers: {module}.{name} not timed: {exc}", file=sys.stderr)
            continue

        def timed(*a, _fn=fn, _name=name, **k):
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                stats.setdefault(_name, []).append(time.perf_counter() - start)

        setattr(owner, leaf, functools.wraps(fn)(timed))


def _dump(stats: dict[str, list[float]]) -> None:
    import numpy as np

    folder = os.environ.get("KVBRIDGE_TIMERS_DIR", "/tmp")
    with open(os.path.join(folder, f"timers-{os.getpid()}.txt"), "w") as f:
        for name, seconds in stats.items():
            ms = np.array(seconds) * 1e3
            f.write(f"{name:45s} n={ms.size:5d} p50={np.median(ms):.3f} p90={np.percentile(ms, 90):.3f} "
                    f"mean={ms.mean():.3f} max={ms.max():.3f} ms\n")


if os.environ.get("KVBRIDGE_TIMERS") == "1":
    _stats: dict[str, list[float]] = {}
    atexit.register(_dump, _stats)
    _install(_stats)
