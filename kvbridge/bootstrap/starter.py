"""``start_bootstrap``: a bootstrap daemon process for a ``with`` block (embedding, tests,
the SGLang adapter). It runs ``python -m kvbridge.cli.main bootstrap`` with this
interpreter, so it needs no console script on PATH; nothing of the layers above
bootstrap is imported (the process is started by module name).

    start: port 0 -> the daemon binds a free port and writes it to a port file ->
           /healthz answers -> yield (url, token)
    stop:  SIGTERM -> wait up to 10 s -> SIGKILL
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from kvbridge.errors import BootstrapUnavailable

__all__ = ["STARTUP_TIMEOUT_S", "start_bootstrap"]

HOST = "127.0.0.1"
# How long a start-up wait gives a process that is alive but not yet ready before it is called
# hung. A process that exits fails the wait at once, so this bound only costs time when a process
# hangs; it is long because an interpreter importing its stack on a host loaded to several times
# its cores takes tens of seconds to answer, and that is slowness, not failure.
STARTUP_TIMEOUT_S = 120.0


def _wait_ready(proc: subprocess.Popen[bytes], port_file: Path, host: str, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BootstrapUnavailable(f"bootstrap daemon exited with {proc.returncode} before it was ready:\n"
                                       + log.read_text(errors="replace")[-2000:])
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            url = f"http://{host if ':' not in host else f'[{host}]'}:{text}"
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0, trust_env=False).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    raise BootstrapUnavailable(f"bootstrap daemon not ready within {timeout}s:\n" + log.read_text(errors="replace")[-2000:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def start_bootstrap(
    *,
    host: str = HOST,
    port: int = 0,
    lease_ttl: float | None = None,
    with_token: bool = True,
    timeout: float = STARTUP_TIMEOUT_S,
    extra_args: Sequence[str] = (),
) -> Iterator[tuple[str, str]]:
    """A bootstrap daemon process for the ``with`` block, for embedding and tests::

        with kvbridge.start_bootstrap() as (url, token):
            client = kvbridge.BootstrapClient(url, token=token)

    Yields ``(url, token)``: the token is fresh (writes need it), or "" when ``with_token`` is
    False (an open daemon). ``port`` 0 lets the kernel pick; ``lease_ttl`` is the default
    lease of ranks that ask for none; ``extra_args`` go to ``kvbridge bootstrap`` as they are
    (``["--store", "etcd://..."]`` for a replica on etcd). The daemon is stopped (SIGTERM,
    then SIGKILL) when the block ends, however it ends."""
    token = secrets.token_hex(16) if with_token else ""
    args = [*extra_args, *(("--lease-ttl", str(lease_ttl)) if lease_ttl is not None else ())]
    env = dict(os.environ)
    env.pop("KVBRIDGE_BOOTSTRAP_TOKEN", None)
    if token:
        env["KVBRIDGE_BOOTSTRAP_TOKEN"] = token
    with tempfile.TemporaryDirectory(prefix="kvbridge-bootstrap-") as tmp:
        port_file, log = Path(tmp) / "bootstrap.port", Path(tmp) / "bootstrap.log"
        cmd = [sys.executable, "-m", "kvbridge.cli.main", "bootstrap", "--host", host, "--port", str(port),
               "--port-file", str(port_file), *args]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            yield _wait_ready(proc, port_file, host, log, timeout), token
        finally:
            _stop(proc)
