"""The peer benches' child processes (``sglang_peer_bench.py``, ``vllm_peer_bench.py``): a child
runs its script with ``--child <config JSON>``, reads one JSON command a line on stdin and
answers JSON lines on stdout; its stderr goes to a log file. A child that does not answer in
time, or exits, raises with the tail of that log (the log lies in a temp folder, which a CI
run does not keep)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from kvbridge.worker.launch import tail_lines

TAIL_LINES = 40  # the log lines an error carries
TAIL_BYTES = 64 * 1024  # read from the log's end at most (a line longer than that is cut)


def log_tail(path: Path, lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of the log at ``path`` under a header that names it, each indented;
    or one line saying that it is empty or why it could not be read (``launch.tail_lines``: only the
    file's last ``max_bytes``, the child may still be writing it)."""
    try:
        tail = tail_lines(path, lines, max_bytes)
    except OSError as exc:
        return f"log {path} unreadable: {exc}"
    if not tail:
        return f"log {path} is empty"
    return f"last {len(tail)} lines of {path}:\n" + "\n".join(f"    {line}" for line in tail)


def _status(code: int | None) -> str:
    if code is None:
        return "closed its stdout, still running"
    if code < 0:
        try:
            return f"exited: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exited: killed by signal {-code}"
    return f"exited with status {code}"


class Child:
    """One child process; ``name`` names it in errors."""

    def __init__(self, argv: list[str], cfg: dict, log: Path, env: dict[str, str], name: str) -> None:
        self.name = name
        self.log_path = Path(log)
        # the child's stderr (its fd, inherited): written by the child alone, read back by log_tail()
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = subprocess.Popen([*argv, "--child", json.dumps(cfg)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.log, text=True,
                                         env={**os.environ, **env})  # fmt: skip
        except BaseException:
            self.log.close()
            raise
        self.lines: queue.Queue = queue.Queue()
        self.stray = ""  # the last stdout line that began like an answer but was not JSON
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.lines.put(json.loads(line))
                except ValueError:  # a stray line that only looks like an answer: kept for the error, not fatal
                    self.stray = line.strip()[:300]
        try:  # stdout closed: the child is exiting (reaped here, for its status)
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        self.lines.put({"exited": code})

    def _tail(self) -> str:
        stray = f"; its stdout's last line that was not JSON: {self.stray!r}" if self.stray else ""
        return log_tail(self.log_path) + stray

    def next(self, timeout: float) -> dict:
        try:
            out = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"no answer from {self.name} (pid {self.proc.pid}) within {timeout:.0f}s; {self._tail()}"
            ) from None
        if "exited" in out:
            raise RuntimeError(f"{self.name} (pid {self.proc.pid}) {_status(out['exited'])}; {self._tail()}")
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
