"""The test side of ``_sgl_host.py``: start a host process, send it commands, read its events."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvbridge.chaos.ports import spare_port
from kvbridge.worker.launch import _die_with_parent

HERE = Path(__file__).parent
CHILD_ENV = {
    "KVBRIDGE_HOST": "127.0.0.1",  # loopback only
    "KVBRIDGE_LEASE_TTL": "3",
    "KVBRIDGE_PEER_TIMEOUT": "1",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
    "PYTHONUNBUFFERED": "1",
}


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (``private_ports``), never one given
    before: a host binds it only after SGLang's imports, and meanwhile the kernel hands no one such a port."""
    return spare_port()


class Host:
    """One ``_sgl_host.py`` process; ``stop()`` it (or ``kill()``)."""

    def __init__(self, config: dict, log_path: Path, start_timeout: float = 240) -> None:
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **CHILD_ENV}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_sgl_host.py"), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=HERE, preexec_fn=_die_with_parent)  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self.events: dict[tuple[str, int, str], dict] = {}
        threading.Thread(target=self._read, daemon=True).start()
        first = self._next(start_timeout)
        if not first.get("ready"):
            raise RuntimeError(f"host did not start: {first}\n{log_path.read_text()[-3000:]}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass
        self.lines.put({"exited": self.proc.poll()})

    def _next(self, timeout: float) -> dict:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no line from the host within {timeout:.0f}s") from None

    def command(self, op: str, **kw: Any) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def event(self, server: str, room: int, kind: str = "done", timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while (server, room, kind) not in self.events:
            line = self._next(max(0.01, deadline - time.monotonic()))
            if "exited" in line:
                raise RuntimeError(f"host exited ({line['exited']}) before {server}/{room} {kind}")
            if "event" in line:
                self.events[(line["server"], line["room"], line["event"])] = line
        return self.events[(server, room, kind)]

    def untouched(self, server: str, timeout: float = 60) -> list[str]:
        self.command("untouched", server=server)
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(max(0.01, deadline - time.monotonic()))
            if "untouched" in line:
                return line["untouched"]
            if "event" in line:
                self.events[(line["server"], line["room"], line["event"])] = line

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.log.close()
