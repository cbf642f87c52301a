"""Starting and stopping kvbridge processes on one host (demo, bench, tests).

Every process the group starts is stopped by it: ``stop_all`` sends SIGTERM to
the workers, then to the bootstrap daemon they deregister from, waits, and
SIGKILLs what is left. Use it as a context manager so Ctrl-C and
failures stop everything too. Output goes to one log file per process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvbridge.bootstrap.starter import STARTUP_TIMEOUT_S, start_bootstrap
from kvbridge.errors import KVBridgeError

__all__ = ["HOST", "STARTUP_TIMEOUT_S", "LaunchError", "Proc", "ProcessGroup", "kvbridge_argv", "spawn_bootstrap",
           "start_bootstrap"]


class LaunchError(KVBridgeError):
    """A process did not start, or did not become ready in time."""


def kvbridge_argv(*args: str) -> list[str]:
    """``kvbridge ARGS`` run with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "kvbridge.cli.main", *args]


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the parent dies, even by SIGKILL or a
    crash, so no daemon outlives the demo, bench or test that started it. Elsewhere: nothing.
    (Linux ties this to the spawning *thread*: keep a ProcessGroup on a thread that outlives it.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def tail_lines(path: str | Path, lines: int, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``lines`` lines of the file at ``path``, reading only its last ``max_bytes`` (a line
    longer than that is cut), through a handle of its own: a process may still be writing it.
    Raises OSError where it cannot be read."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - max_bytes))
        text = f.read(max_bytes).decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and len(text) > 1:
        text = text[1:]  # the first line read began before the window
    return text[-lines:] if lines > 0 else []


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    ready_file: Path | None = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(tail_lines(self.log_path, lines))
        except OSError:
            return ""


class ProcessGroup:
    def __init__(self, workdir: str | Path, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.procs: list[Proc] = []

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()

    def spawn(self, name: str, argv: list[str], ready_file: bool = False) -> Proc:
        log_path = self.workdir / f"{name}.log"
        ready = self.workdir / f"{name}.ready.json" if ready_file else None
        if ready is not None:
            ready.unlink(missing_ok=True)
            argv = [*argv, "--ready-file", str(ready)]
        log = open(log_path, "wb")
        try:
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        finally:
            log.close()
        proc = Proc(name, popen, log_path, ready)
        self.procs.append(proc)
        return proc

    def wait_ready(self, proc: Proc, timeout: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        """The JSON record the worker wrote to its ready file."""
        if proc.ready_file is None:
            raise LaunchError(f"{proc.name} was started without a ready file")
        return json.loads(self.wait_file(proc, proc.ready_file, timeout))

    def wait_file(self, proc: Proc, path: Path, timeout: float = STARTUP_TIMEOUT_S) -> str:
        """The non-empty content of ``path`` once ``proc`` wrote it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = path.read_text() if path.exists() else ""
            if text.strip():
                return text
            self._check_alive(proc)
            time.sleep(0.05)
        raise LaunchError(f"{proc.name}: no {path.name} after {timeout:.0f}s; log tail:\n{proc.log_tail()}")

    def wait_http(self, proc: Proc, url: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive(proc)
            try:
                if httpx.get(url, timeout=1.0).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise LaunchError(f"{proc.name}: {url} not answering after {timeout:.0f}s; log tail:\n{proc.log_tail()}")

    def _check_alive(self, proc: Proc) -> None:
        if proc.popen.poll() is not None:
            raise LaunchError(f"{proc.name} exited with {proc.popen.returncode}; log tail:\n{proc.log_tail()}")

    def stop_all(self, timeout: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every worker at once (their drains overlap), then the bootstrap daemon, so that
        workers can deregister first; SIGKILL whatever outlives ``timeout``. Exit code per process."""
        daemons = [p for p in self.procs if p.name.startswith("bootstrap")]
        workers = [p for p in self.procs if p not in daemons]
        codes: dict[str, int | None] = {}
        for batch in (workers, daemons):
            for p in batch:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in batch:
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait(5)
                codes[p.name] = p.popen.returncode
        return codes


HOST = "127.0.0.1"


def spawn_bootstrap(group: ProcessGroup, timeout: float = STARTUP_TIMEOUT_S, extra_args: Sequence[str] = (),
                    host: str = HOST, port: int = 0) -> str:
    """Start ``kvbridge bootstrap`` in ``group`` (port 0: the kernel picks one, the daemon reports
    it); returns its URL once ``/healthz`` answers."""
    port_file = group.workdir / "bootstrap.port"
    port_file.unlink(missing_ok=True)
    boot = group.spawn("bootstrap", kvbridge_argv("bootstrap", "--host", host, "--port", str(port), "--port-file",
                                                  str(port_file), *extra_args))
    url = f"http://{host}:{group.wait_file(boot, port_file, timeout).strip()}"
    group.wait_http(boot, f"{url}/healthz", timeout)
    return url
