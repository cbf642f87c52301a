"""What a host charges a room's hand-offs and its Python for having been idle: waking a thread (or a
process) that sleeps on another CPU right after the pair ran and after each idle time, and the
time of a slice of ``send()``'s own work run back to back and right after the same idle time.
Issue 33, round 19 (docs/performance.md): a room's fixed cost is a few such hand-offs (the
engine's pump, decode's loop) and about a millisecond of Python, and the GPU bench starts every
room after 200 ms or more of idle time while it checks the last one's bytes. No GPU needed.
``scripts/wake_probe.py`` (round 14, standard library only) is the older probe: processes over
loopback TCP, and what spinning before blocking saves.

    python3 scripts/device/idle_probe.py [--rounds 40] [--gaps 0 200] [--qos]
    python3 scripts/device/idle_probe.py --hold -- COMMAND ...   (COMMAND run with the CPUs kept polling)

``--qos`` repeats every probe while this process holds ``/dev/cpu_dma_latency`` at 0 (the kernel's
PM QoS request: CPUs idle by polling instead of halting where the kernel has a cpuidle driver,
released when the file is closed; root only): the share of the cold cost that is the CPUs' idle
state. ``--hold`` runs a command under the same request.

Rows: ``thread`` and ``process`` are one byte sent and echoed back over a socket pair (us, p50),
the echoing side pinned to another CPU than the sender (``sched_setaffinity``); ``first`` is the
first exchange after the gap, ``next`` the median of the five after it. ``work`` is the p50 of one
call of a fixed workload made of what ``send()`` does (an aux row packed by kvbridge's
``AuxSchema``, then 20 times: 128 page ids checked, sorted, their runs found and their slices
over 62 layers computed with numpy) run right after the gap.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np



def _cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[0], cpus[-1]


def _echo(sock: socket.socket, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})  # this thread (or process) only
    while True:
        data = sock.recv(64)
        if not data:
            return
        sock.sendall(data)


def _pair(kind: str) -> tuple[socket.socket, Callable[[], None]]:
    a, b = socket.socketpair()
    me, other = _cpus()
    if kind == "thread":
        t = threading.Thread(target=_echo, args=(b, other), daemon=True)
        t.start()

        def stop() -> None:
            a.close()
            t.join(5)
            b.close()
    else:
        pid = os.fork()
        if pid == 0:
            a.close()
            try:
                _echo(b, other)
            finally:
                os._exit(0)
        b.close()

        def stop() -> None:
            a.close()
            os.waitpid(pid, 0)
    os.sched_setaffinity(0, {me})
    return a, stop


def ping(kind: str, gap_ms: float, rounds: int) -> tuple[float, float]:
    """p50 us of the first exchange after ``gap_ms`` idle, and of the five after it."""
    a, stop = _pair(kind)
    first, after = [], []
    try:
        for _ in range(3):  # connections warm
            a.send(b"x")
            a.recv(64)
        for _ in range(rounds):
            time.sleep(gap_ms / 1e3)
            times = []
            for _ in range(6):
                t = time.perf_counter()
                a.send(b"x")
                a.recv(64)
                times.append(time.perf_counter() - t)
            first.append(times[0])
            after.append(statistics.median(times[1:]))
    finally:
        stop()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return statistics.median(first) * 1e6, statistics.median(after) * 1e6


def _workload() -> Callable[[], None]:
    """A slice of send()'s own work, as kvbridge does it: the aux row packed, a chunk's page ids
    checked and its slices planned (the vectorised calls that add_chunk and plan_chunk make)."""
    from kvbridge.layout.aux import AuxSchema
    from kvbridge.worker.synthetic import make_aux

    schema = AuxSchema.standard(7168)  # DeepSeek's row: 14,368 bytes
    aux = make_aux(schema, 7, 8192)
    rng = np.random.default_rng(0)
    pages = np.arange(128, dtype=np.int64)
    dst = rng.permutation(4096)[:128].astype(np.int64)
    base = np.arange(62, dtype=np.uint64) * np.uint64(1 << 30)

    def work() -> None:
        schema.pack_row(aux, 7)
        for _ in range(20):
            ok = (pages >= 0).all() and (pages < 4096).all() and np.unique(dst).size == dst.size
            order = np.argsort(dst, kind="stable")
            runs = np.flatnonzero(np.diff(dst[order]) != 1)
            src = (base[:, None] + pages[order][None, :].astype(np.uint64) * np.uint64(656)).ravel()
            length = np.full(src.size, 656, np.uint64)
            assert ok and runs.size >= 0 and int(length.sum()) > 0

    return work


def work(gap_ms: float, rounds: int, fn: Callable[[], None]) -> float:
    for _ in range(5):
        fn()
    out = []
    for _ in range(rounds):
        time.sleep(gap_ms / 1e3)
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


@contextlib.contextmanager
def qos_zero() -> Iterator[bool]:
    """Hold the CPU latency request at 0 while inside (False when the file cannot be written)."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError as exc:
        print(f"# /dev/cpu_dma_latency: {exc.strerror or exc}: no --qos rows")
        yield False
        return
    try:
        os.write(fd, struct.pack("i", 0))
        yield True
    finally:
        os.close(fd)


def host() -> None:
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "-"

    idle = "/sys/devices/system/cpu/cpuidle"
    model = next((ln.split(":", 1)[1].strip() for ln in read("/proc/cpuinfo").splitlines()
                  if ln.startswith("model name")), "-")
    states = [read(f"/sys/devices/system/cpu/cpu0/cpuidle/state{i}/name") for i in range(8)]
    print(f"# cpus {os.cpu_count()} ({model}); cpuidle driver {read(idle + '/current_driver')}, "
          f"governor {read(idle + '/current_governor_ro')}; states {[s for s in states if s != '-']}; "
          f"haltpoll guest_halt_poll_ns {read('/sys/module/haltpoll/parameters/guest_halt_poll_ns')}")
    words = [w for w in read("/proc/cmdline").split() if "poll" in w or "idle" in w or "pvm" in w]
    print(f"# kernel cmdline (idle words): {' '.join(words) or '-'}")


def probe(label: str, rounds: int, gaps: list[float], fn: Callable[[], None]) -> None:
    for gap in gaps:
        row = [f"{label:8s} gap {gap:5.0f} ms"]
        for kind in ("thread", "process"):
            first, after = ping(kind, gap, rounds)
            row.append(f"{kind} first {first:6.1f} us next {after:6.1f} us")
        row.append(f"work {work(gap, rounds, fn):.3f} ms")
        print(" | ".join(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.0, 200.0], help="idle times to probe (ms)")
    ap.add_argument("--qos", action="store_true", help="repeat the probes holding /dev/cpu_dma_latency at 0")
    ap.add_argument("--hold", action="store_true",
                    help="run the command after -- holding /dev/cpu_dma_latency at 0; exits with its status")
    argv = sys.argv[1:]
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.hold:
        if not command:
            ap.error("--hold needs a command after --")
        with qos_zero() as held:
            print(f"# cpu_dma_latency 0 {'held' if held else 'NOT held'} while: {' '.join(command)}", flush=True)
            sys.exit(subprocess.call(command))
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("wake_probe needs two CPUs")
    host()
    fn = _workload()
    probe("as is", args.rounds, args.gaps, fn)
    if args.qos:
        with qos_zero() as held:
            if held:
                probe("qos 0", args.rounds, args.gaps, fn)


if __name__ == "__main__":
    main()
