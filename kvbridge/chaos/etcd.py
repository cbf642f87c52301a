"""A local etcd cluster on loopback for chaos runs, tests and benchmarks:
``EtcdCluster(workdir, members=3).start()``, member faults (``kill``, ``restart``),
``stop()``.

Ports: each member takes a client and a peer port that were free a moment before, below
the kernel's ephemeral range (``ports.private_ports``), so a member restarted on its ports
finds them free; a member that cannot bind fails its health wait and the cluster start
raises with its log. Stopping: SIGTERM with a
deadline, then SIGKILL (the last member of a cluster whose peers are gone may ignore
SIGTERM for seconds while it looks for them).

Data: each member's data directory lives on a memory-backed filesystem (``/dev/shm``)
where the host has one, else under ``workdir``. etcd fsyncs its log on every write; on
a host whose disk is busy with other work (a venv being installed beside a test
suite) one fsync can take seconds, longer than the daemon's per-request timeout, and
a test then sees "quorum lost" that is only the disk. These clusters hold test and
benchmark state only, so nothing is lost by keeping it in memory; ``stop`` removes it.
Heartbeat and election timeouts are twice etcd's defaults (200 ms / 2 s) so that a
member starved of CPU for a second on a loaded host does not start an election.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from kvbridge.chaos.ports import private_ports
from kvbridge.errors import ConfigError

__all__ = ["EtcdCluster", "etcd_binary"]

HOST = "127.0.0.1"
HEARTBEAT_MS = 200
ELECTION_MS = 2000


def etcd_binary() -> str:
    """The etcd server binary (Debian's ``etcd-server``), or ConfigError naming the fix."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if found is None:
        raise ConfigError("no etcd binary on PATH: install Debian's etcd-server (scripts/setup.sh does)", field="etcd")
    return found


class EtcdCluster:
    def __init__(self, workdir: Path, members: int = 3, *, stop_deadline_s: float = 3.0) -> None:
        if members < 1:
            raise ConfigError(f"an etcd cluster needs at least one member, not {members}", field="members")
        self.workdir = Path(workdir)
        self.members = members
        self.stop_deadline_s = stop_deadline_s
        ports = private_ports(2 * members, HOST)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.token = f"kvbridge-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self.data_root = self._data_root()

    def _data_root(self) -> Path:
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            return Path(tempfile.mkdtemp(prefix="kvbridge-etcd-", dir=shm))
        return self.workdir

    # -- addresses -------------------------------------------------------------

    def name(self, i: int) -> str:
        return f"m{i}"

    def client_url(self, i: int) -> str:
        return f"http://{HOST}:{self.client_ports[i]}"

    @property
    def store_url(self) -> str:
        """What ``kvbridge bootstrap --store`` takes."""
        return "etcd://" + ",".join(f"{HOST}:{p}" for p in self.client_ports)

    def log_text(self, i: int) -> str:
        path = self.workdir / f"{self.name(i)}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    # -- life --------------------------------------------------------------------

    def _launch(self, i: int) -> None:
        peers = ",".join(f"{self.name(j)}=http://{HOST}:{self.peer_ports[j]}" for j in range(self.members))
        data = self.data_root / f"{self.name(i)}.etcd"
        cmd = [
            etcd_binary(), "--name", self.name(i), "--data-dir", str(data),
            "--listen-client-urls", self.client_url(i), "--advertise-client-urls", self.client_url(i),
            "--listen-peer-urls", f"http://{HOST}:{self.peer_ports[i]}",
            "--initial-advertise-peer-urls", f"http://{HOST}:{self.peer_ports[i]}",
            "--initial-cluster", peers, "--initial-cluster-token", self.token,
            "--initial-cluster-state", "new", "--log-level", "warn", "--logger", "zap",
            "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
        ]
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / f"{self.name(i)}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        for i in range(self.members):
            self._launch(i)
        try:
            self.wait_healthy(range(self.members), timeout_s)
        except Exception:
            self.stop()
            raise
        return self

    def healthy(self, i: int) -> bool:
        try:
            r = httpx.get(f"{self.client_url(i)}/health", timeout=1.0, trust_env=False)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json().get("health") in ("true", True)

    def wait_healthy(self, members: range | list[int], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(members)
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"etcd member {self.name(i)} exited {proc.returncode}:\n{self.log_text(i)}")
                if self.healthy(i):
                    waiting.remove(i)
            if waiting:
                time.sleep(0.1)
        if waiting:
            raise RuntimeError(f"etcd members {[self.name(i) for i in waiting]} not healthy within {timeout_s}s:\n"
                               + self.log_text(waiting[0]))

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (a crash); its data stays for ``restart``."""
        proc, self.procs[i] = self.procs[i], None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its data (it rejoins the cluster)."""
        if self.procs[i] is not None:
            raise RuntimeError(f"etcd member {self.name(i)} is running")
        self._launch(i)

    def running(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def stop(self) -> None:
        """SIGTERM every member, then SIGKILL those still running at the deadline."""
        live = [(i, p) for i, p in enumerate(self.procs) if p is not None]
        for _, p in live:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + self.stop_deadline_s
        for i, p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            self.procs[i] = None
        if self.data_root != self.workdir:  # every member is stopped by now
            shutil.rmtree(self.data_root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
