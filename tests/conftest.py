"""Shared fixtures: a real bootstrap daemon process on loopback.

``BootstrapDaemon`` starts ``python -m kvbridge.cli.main bootstrap --port P`` (the daemon
writes it to a port file), waits for ``/healthz`` with a bounded loop, and on ``stop()``
terminates and reaps the process and checks that nothing listens on the port any more.

P is a free port *below* the kernel's ephemeral range (``kvbridge.chaos.ports``), not ``--port 0``: a
daemon restarted on its port (``restart()``) must find it free, and a port the kernel hands out
(to another suite's listener or to any outbound connection, the suites run side by side) could be
taken in between. That happened once in CI: a restart refused with "Address already in use", the
port answering after the daemon had stopped. No process is handed a port below that range
unless it asks for it by number.

Start-up waits are readiness waits: they end when the process answers, fail at once when it
exits, and call it hung only after ``STARTUP_TIMEOUT_S`` (kvbridge's own bound, long because a
host loaded to several times its cores takes tens of seconds to start an interpreter). The
clean-exit promise (SIGTERM -> exit 0) is asserted only of a daemon that became ready: before
that it may not have installed its handler yet. ``KVBRIDGE_TEST_TIMEOUT_SCALE`` (default 1)
scales the tests' own deadlines (``tests/_timing.py``) on a slow or loaded host.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from _timing import scaled

from kvbridge.bootstrap.starter import STARTUP_TIMEOUT_S
from kvbridge.chaos.ports import private_ports

HOST = "127.0.0.1"
START_TIMEOUT_S = scaled(STARTUP_TIMEOUT_S)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


class BootstrapDaemon:
    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.args = args
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0
        self.ready = False  # answered /healthz since its last start: its SIGTERM handler is in

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def log_text(self) -> str:
        path = self.workdir / f"daemon-{self.starts}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, port: int = 0) -> BootstrapDaemon:
        """Start on ``port`` (0: a free private port, another one if the daemon finds it taken)."""
        if port:
            return self._start(port)
        for attempt in range(3):
            try:
                return self._start(private_ports(1, HOST)[0])
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start(self, port: int) -> BootstrapDaemon:
        self.starts += 1
        self.ready = False
        port_file = self.workdir / f"port-{self.starts}"
        env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_BOOTSTRAP_TOKEN"}
        env.update(self.env)
        cmd = [sys.executable, "-m", "kvbridge.cli.main", "--log-level", "WARNING", "bootstrap",
               "--host", HOST, "--port", str(port), "--port-file", str(port_file), *self.args]
        with open(self.workdir / f"daemon-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text}")
            if port_file.exists():
                self.port = int(port_file.read_text())
                try:
                    if httpx.get(f"{self.url}/healthz", timeout=1.0, trust_env=False).status_code == 200:
                        self.ready = True
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"daemon not healthy within {START_TIMEOUT_S}s:\n{self.log_text}")

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        clean = True
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                clean = False
            # a graceful SIGTERM shutdown exits 0 (not 143): promised once the daemon was ready
            assert not (clean and self.ready) or proc.returncode == 0, \
                f"daemon exited {proc.returncode} on SIGTERM:\n{self.log_text}"
        self.ready = False

        if self.port:
            assert not _port_open(self.port), f"port {self.port} still accepts connections after the daemon stopped"

    def restart(self) -> BootstrapDaemon:
        port = self.port
        self.stop()
        return self.start(port=port)


def _factory(workdir: Callable[[], Path]) -> Iterator[Callable[..., BootstrapDaemon]]:
    started: list[BootstrapDaemon] = []

    def start(*args: str, env: dict[str, str] | None = None) -> BootstrapDaemon:
        d = BootstrapDaemon(workdir(), list(args), env)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def start_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., BootstrapDaemon]]:
    """Factory: ``start_daemon(*args, env={...})``; every daemon is stopped at teardown."""
    yield from _factory(lambda: tmp_path_factory.mktemp("daemon"))


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., BootstrapDaemon]]:
    """The same factory, for daemons shared by a test module."""
    yield from _factory(lambda: tmp_path_factory.mktemp("daemon"))


@pytest.fixture(scope="module")
def daemon(module_daemons: Callable[..., BootstrapDaemon]) -> BootstrapDaemon:
    """One open daemon (no token) shared by a test module; tests use unique instance names."""
    return module_daemons("--lease-ttl", "30")


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a command in-process (``main([...])``) configures the root logger; put it
    back, so that later tests' background threads (lease heartbeats, look-ups) do not print."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers



# The vLLM suite (tests/integrations/vllm) runs in .venv-vllm. Under `make test` KVBRIDGE_REQUIRE_VLLM=1
# is set, and there a skip in that suite is a failure: a CI run whose vLLM, Mooncake or model build went
# missing says so instead of passing with nothing tested. Tests marked `gpu` may still skip (CI has none).
_VLLM_SUITE = Path(__file__).parent / "integrations" / "vllm"
_REQUIRE_VLLM = os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1"


def _refuse_vllm_skip(report: pytest.CollectReport | pytest.TestReport, path: Path, gpu: bool) -> None:
    if not (_REQUIRE_VLLM and report.skipped and not gpu and not hasattr(report, "wasxfail")):
        return
    if not Path(path).resolve().is_relative_to(_VLLM_SUITE.resolve()):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under KVBRIDGE_REQUIRE_VLLM=1 (make test): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _refuse_vllm_skip(outcome.get_result(), collector.path, gpu=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _refuse_vllm_skip(outcome.get_result(), item.path, gpu=item.get_closest_marker("gpu") is not None)


# -- the suite's own exit --------------------------------------------------------------------------
# Two fresh-clone runs of the whole main suite (every test passed) ended "terminate called without
# an active exception" and exit code 134: a native library's thread (a transfer engine's, or
# torch's) was still joinable when the interpreter ran C++ static destructors at exit, after the
# last test and the summary. Neither a leaked kvbridge Mooncake engine alone (tried: exits 0) nor
# any single suspect file alone reproduces it; it is intermittent (a third run of the same tree
# exited cleanly). Until it is found, the test process leaves with pytest's own exit status once
# everything is reported, without running the interpreter's teardown: the native threads that
# crash it then are never destroyed. What is still alive at that point is printed, for the hunt.
_EXIT_STATUS: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not _EXIT_STATUS or os.environ.get("KVBRIDGE_TEST_NORMAL_EXIT") == "1":
        return  # KVBRIDGE_TEST_NORMAL_EXIT=1: the normal teardown (to reproduce the crash)
    import threading

    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if alive:
        print(f"\nconftest: leaving with {len(alive)} Python thread(s) alive: {', '.join(alive[:20])}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])
