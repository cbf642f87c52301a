"""Real ``vllm serve`` processes and a real ``kvbridge vllm-proxy`` for the end-to-end tests.

Every server runs in a session of its own (vLLM starts an engine-core and a worker process under
the API server), so ``kill()`` (SIGKILL, the crash being tested) and ``stop()`` (SIGTERM, then
SIGKILL after a bound) reach the whole tree. Every wait is bounded; a server that exits or stays
unhealthy raises with the tail of its log. What a killed tree cannot clean up is removed after it:
its ZMQ socket folder, and the /dev/shm files its processes had mapped (vLLM's message queues,
160-240 MiB each; those of no other process). Python's named semaphores that a spawned process
opened and closed again (32 bytes each) are mapped by no one by then and stay.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from _vllm_model import words

from kvbridge.chaos.ports import spare_port

HOST = "127.0.0.1"
VLLM = str(Path(sys.executable).parent / "vllm")
# Measured on the shared 2-core machine: one server alone is healthy ~50 s after start, four
# started together ~2-3 min; the bound leaves room for a loaded CI host.
START_TIMEOUT_S = 420.0
STOP_TIMEOUT_S = 30.0
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
# What every server of the tests shares: no compilation (-O0, eager), a small KV cache (1 GiB),
# OpenMP threads unbound so that several servers share the 2 cores.
COMMON_ARGS = ("--max-model-len", "512", "--block-size", str(BLOCK_SIZE), "--served-model-name", "tiny",
               "--max-num-seqs", "8", "--enforce-eager", "-O0", "--seed", "0")  # fmt: skip
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1",
              "DO_NOT_TRACK": "1",
              # a kvbridge loop turn past 10 s dumps every thread's stack into the server's log (CI has seen a
              # worker stand still ~30 s: conftest.py puts the dumps into a failed test's report)
              "KVBRIDGE_STALL_DUMP": "10"}  # fmt: skip


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (``private_ports``), never one given
    before: ``vllm serve`` binds it only after its start-up (minutes when several start together), and
    meanwhile the kernel hands no one such a port."""
    return spare_port(HOST)


def transfer_config(role: str, extra: dict[str, Any]) -> str:
    """The ``--kv-transfer-config`` value a user types (docs/vllm.md), with a peer timeout of 30 s
    unless ``extra`` names one: under make test's load a CPU ``vllm serve``'s forward passes
    starve its kvbridge threads past the default 5 s (a fresh-clone run: prefill presumed a live
    decode rank dead and the batch's rooms failed), and in round 13's ci19 past 15 s (a live decode
    "sent nothing for 15.0s"). Every killed-peer test here allows 90 s (``ERROR_BOUND_S``)."""
    extra = {"peer_timeout": 30, **extra}
    return json.dumps({"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
                       "kv_role": role, "kv_connector_extra_config": extra})  # fmt: skip


STARTED: dict[str, Proc] = {}  # every process started in this test process, by name (the latest): their
# logs' tails are added to a failed test's report (tests/integrations/vllm/conftest.py)


class Proc:
    """A process in a session of its own, logging to ``workdir/<name>.log``."""

    def __init__(self, name: str, workdir: Path, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.name, self.workdir, self.cmd = name, workdir, cmd
        self.env = {**os.environ, **SERVER_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._rpc_dir: str | None = None
        self._shm: set[Path] = set()  # /dev/shm files the tree mapped, removed once it is gone

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def start(self) -> Proc:
        # vLLM's ZMQ IPC sockets (VLLM_RPC_BASE_PATH, default /tmp) in a short folder of this
        # process's own, removed by stop(): a killed server leaves its socket files behind
        # (a socket path must stay under 108 bytes, which a pytest tmp_path may not)
        self._rpc_dir = self._rpc_dir or tempfile.mkdtemp(prefix="kvb-vllm-")
        self.env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, cwd=self.workdir)  # fmt: skip
        STARTED[self.name] = self
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.name} still running after {timeout:.0f}s:\n{self.log_tail()}") from None

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _group_shm(self) -> set[Path]:
        """The /dev/shm files mapped by any process of the server's session (its group)."""
        assert self.proc is not None
        found: set[Path] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self.proc.pid:
                    continue
                maps = (entry / "maps").read_text()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            for line in maps.splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    found.add(Path(fields[5].removesuffix(" (deleted)")))
        return found

    def _unlink_shm(self, files: set[Path]) -> None:
        for f in files:
            f.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL to the whole tree: the crash under test."""
        if self.proc is not None:
            self._shm |= self._group_shm()
            self._signal_group(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)
            self._unlink_shm(self._shm)

    def stop(self) -> None:
        if self.proc is None:
            return
        self._shm |= self._group_shm()
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self._shm |= self._group_shm()  # what the tree mapped while it shut down, if any of it is left
        self._signal_group(signal.SIGKILL)  # the engine core and workers too, whatever the parent did
        self.proc.wait(STOP_TIMEOUT_S)
        self._unlink_shm(self._shm)
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None


class VllmServer(Proc):
    def __init__(self, name: str, workdir: Path, model: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        cmd = [VLLM, "serve", str(model), "--host", HOST, "--port", str(self.port), *COMMON_ARGS, *args]
        super().__init__(name, workdir, cmd, {"VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), **(env or {})})

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"{self.name} not healthy within {timeout:.0f}s:\n{self.log_tail()}")


class Proxy(Proc):
    def __init__(self, workdir: Path, prefills: list[str], decodes: list[str], timeout: float = 60.0) -> None:
        self.port_file = workdir / "proxy.port"
        cmd = [sys.executable, "-m", "kvbridge.cli.main", "vllm-proxy", "--port", "0", "--port-file",
               str(self.port_file), "--timeout", str(timeout)]  # fmt: skip
        for url in prefills:
            cmd += ["--prefill", url]
        for url in decodes:
            cmd += ["--decode", url]
        super().__init__("proxy", workdir, cmd)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> Proxy:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(f"proxy exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.port_file.exists():
                self.port = int(self.port_file.read_text())
                return self
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"proxy not listening within {timeout:.0f}s:\n{self.log_tail()}")


def complete(url: str, prompt: str, max_tokens: int, timeout: float = 120.0, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True,
            "ignore_eos": True, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False)


def tokens_of(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, (resp.status_code, resp.text[:2000])
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    return choice["token_ids"]


def prompt(n: int, salt: int) -> str:
    return words([3 + (i * 37 + salt * 101) % 500 for i in range(n)])


def sources(url: str) -> dict[str, float]:
    """decode's vllm:prompt_tokens_by_source_total counters: local_compute, local_cache_hit,
    external_kv_transfer."""
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^vllm:prompt_tokens_by_source_total\{.*source="(\w+)"\} (\S+)$', text, re.M)}  # fmt: skip


def start_all(servers: list[VllmServer]) -> None:
    for s in servers:
        s.start()
    try:
        with cf.ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.wait_ready(), servers))
    except BaseException:
        for s in servers:
            s.stop()
        raise
