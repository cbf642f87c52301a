"""The peer benches' child processes (``sglang_peer_bench.py``, ``vllm_peer_bench.py``): a child
runs its script with ``--child <config JSON>``, reads one JSON command a line on stdin and
answers JSON lines on stdout; its stderr goes to a log file."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any


class Child:
    """One child process; ``name`` names it in errors."""

    def __init__(self, argv: list[str], cfg: dict, log: Path, env: dict[str, str], name: str) -> None:
        self.name = name
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*argv, "--child", json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **env})  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put({"exited": self.proc.poll()})

    def next(self, timeout: float) -> dict:
        try:
            out = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer from {self.name} within {timeout:.0f}s; see {self.log.name}") from None
        if "exited" in out:
            raise RuntimeError(f"{self.name} exited ({out['exited']}); see {self.log.name}")
        return out

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float = 180, **cmd: Any) -> dict:
        self.send(**cmd)
        return self.next(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
