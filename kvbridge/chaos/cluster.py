"""The chaos cluster: a bootstrap daemon, a CP prefill instance and a decode rank as
separate processes on loopback, each one restartable with the same command line
(workers keep their lease secret in a lease file, so a restarted rank takes its
coordinates back at once; the daemon comes back on the same port). Every process
is stopped by ``close()``.

Store mode (``replicas > 0``): a three-member etcd cluster (``chaos/etcd.py``) and that
many daemon replicas on it; the workers get every replica's URL (``--bootstrap a,b,c``).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx

from kvbridge.chaos.etcd import EtcdCluster
from kvbridge.chaos.ports import private_ports
from kvbridge.worker import ops
from kvbridge.worker.cluster import HOST, spawn_bootstrap
from kvbridge.worker.launch import STARTUP_TIMEOUT_S, LaunchError, Proc, ProcessGroup, kvbridge_argv

__all__ = ["ChaosCluster", "Member", "proc_resources"]


def proc_resources(pid: int) -> dict[str, float] | None:
    """Open fds, threads and resident MiB of a live process (Linux /proc), or None."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"fds": fds, "threads": int(fields["Threads"].strip()),
            "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1)}


@dataclass
class Member:
    """One process of the cluster and what it takes to start it again."""

    name: str  # "bootstrap", "prefill-cp1", "decode-tp0"
    role: str  # "daemon", "prefill", "decode"
    argv: list[str]
    proc: Proc | None = None
    ready: dict[str, Any] | None = None
    client: ops.OpsClient | None = None
    starts: int = 0

    @property
    def pid(self) -> int | None:
        return self.proc.popen.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None


class ChaosCluster:
    def __init__(self, workdir: Path, *, cp: int, layers: int, pages: int, lease_ttl: float, peer_timeout: float,
                 transfer_timeout: float, failed_writes: int, replicas: int = 0, engine: str = "mooncake",
                 claims_file: bool = False, daemon_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.daemon_args = daemon_args  # extra flags of the (in-memory) daemon, e.g. a smaller cap
        # the in-memory daemon keeps its claims in a file, read back when it restarts (``--claims-file``)
        self.claims_file = workdir / "claims.json" if claims_file else None
        self.etcd = EtcdCluster(workdir / "etcd", members=3) if replicas else None
        # prefill ranks run chaos's FaultyEngine (failed_writes > 0): SIGUSR2 kills one at its next write
        self.kills_at_write = failed_writes > 0
        self.replicas = [Member(f"replica-{i}", "daemon", []) for i in range(replicas)]
        self.replica_ports = [0] * replicas
        self.token, self.secret = secrets.token_hex(16), secrets.token_hex(16)
        self.prefill_instance, self.decode_instance = "chaos-p", "chaos-d"
        self.group = ProcessGroup(workdir, env={"KVBRIDGE_BOOTSTRAP_TOKEN": self.token, "KVBRIDGE_SECRET": self.secret,
                                                "GLOG_minloglevel": "2"})
        self.daemon = Member("bootstrap", "daemon", [])
        self.url = ""
        self.port = 0
        common = ["--preset", "deepseek-v3.2-fp8", "--layers", str(layers), "--draft-layers", "1", "--page-size", "64",
                  "--pages", str(pages), "--engine", engine, "--host", HOST, "--lease-ttl", str(lease_ttl),
                  "--drain-timeout", "1", "--transfer-timeout", str(transfer_timeout)]
        self.prefill = [Member(f"prefill-cp{r}", "prefill", kvbridge_argv(
            "prefill-worker", "--instance", self.prefill_instance, "--cp-rank", str(r), "--cp-size", str(cp),
            "--chaos-failed-writes", str(failed_writes), "--lease-file", str(workdir / f"prefill-cp{r}.lease"), *common))
            for r in range(cp)]
        self.decode = [Member("decode-tp0", "decode", kvbridge_argv(
            "decode-worker", "--instance", self.decode_instance, "--peer-timeout", str(peer_timeout), "--poison-pages",
            "--lease-file", str(workdir / "decode-tp0.lease"), *common))]

    @property
    def workers(self) -> list[Member]:
        return [*self.prefill, *self.decode]

    @property
    def members(self) -> list[Member]:
        return [*(self.replicas or [self.daemon]), *self.workers]

    @property
    def urls(self) -> list[str]:
        """Every daemon the workers may ask (the replicas in store mode)."""
        if not self.replicas:
            return [self.url]
        return [f"http://{HOST}:{p}" for p in self.replica_ports]

    # -- starting and stopping ----------------------------------------------------

    def start(self, timeout: float = 90.0) -> None:
        self.start_daemon(timeout)
        for m in self.workers:
            self._spawn(m)
        for m in self.workers:
            self._await(m, timeout)

    def start_daemon(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """The daemon, on the port it had before (a restart) or a free private one (the first start);
        in store mode the etcd cluster and every replica."""
        if self.replicas:
            if self.etcd is not None and not self.etcd.running():
                self.etcd.start()
            for i in range(len(self.replicas)):
                self.start_replica(i, timeout)
            self.daemon = self.replicas[0]
            return
        self.daemon.starts += 1
        claims = () if self.claims_file is None else ("--claims-file", str(self.claims_file))

        def spawn(port: int) -> None:
            self.url = spawn_bootstrap(self.group, timeout, (*self.daemon_args, "--port", str(port), *claims))

        self.port = _on_port(self.port, spawn)  # kept for its restarts (chaos/ports.py: why not 0)
        self.daemon.proc = self.group.procs[-1]
        for m in self.workers:
            m.argv = _with_flag(m.argv, "--bootstrap", self.url)

    def start_replica(self, i: int, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Replica ``i`` on the etcd cluster, on the port it had before or a free private one."""
        assert self.etcd is not None
        m = self.replicas[i]
        m.starts += 1
        store = ("--store", self.etcd.store_url, "--replica-name", m.name)
        self.replica_ports[i] = _on_port(self.replica_ports[i], lambda port: spawn_bootstrap(
            self.group, timeout, (*store, "--port", str(port))))  # (on that port: its URL is self.urls[i])
        m.proc = self.group.procs[-1]
        self.url = self.urls[0]
        for w in self.workers:
            w.argv = _with_flag(w.argv, "--bootstrap", ",".join(self.urls))

    def restart(self, m: Member, timeout: float = 60.0) -> None:
        if m in self.replicas:
            self.start_replica(self.replicas.index(m), timeout)
            return
        if m is self.daemon:
            self.start_daemon(timeout)
            return
        self._spawn(m)
        self._await(m, timeout)

    def _spawn(self, m: Member) -> None:
        m.starts += 1
        m.proc = self.group.spawn(f"{m.name}-{m.starts}", m.argv, ready_file=True)

    def _await(self, m: Member, timeout: float) -> None:
        assert m.proc is not None
        m.ready = self.group.wait_ready(m.proc, timeout)
        if m.client is not None:
            m.client.close()
        m.client = ops.OpsClient(m.ready["ops"], secret=self.secret.encode())

    def signal(self, m: Member, sig: signal.Signals) -> None:
        if m.alive:
            m.proc.popen.send_signal(sig)  # type: ignore[union-attr]

    def wait_exit(self, m: Member, timeout: float) -> int | None:
        try:
            return m.proc.popen.wait(timeout)  # type: ignore[union-attr]
        except Exception:  # subprocess.TimeoutExpired: still alive
            return None

    def close(self) -> dict[str, int | None]:
        """Stop everything; the exit code of each member's current process (those the faults
        killed exited earlier, as the faults meant them to)."""
        for m in self.members:
            if m.alive:
                os.kill(m.pid, signal.SIGCONT)  # type: ignore[arg-type]  # a stopped process cannot drain
            if m.client is not None:
                m.client.close()
        codes = self.group.stop_all(timeout=15)
        if self.etcd is not None:
            self.etcd.stop()
        return {m.name: codes.get(m.proc.name) for m in self.members if m.proc is not None}

    def exit_problems(self, codes: dict[str, int | None]) -> list[str]:
        """One line per member whose last process did not exit 0 at ``close()``: its name, pid, exit
        code (a negative one is the signal that ended it) and the tail of its log."""
        out = []
        for m in self.members:
            code = codes.get(m.name)
            if m.proc is None or code == 0:
                continue
            how = (f"killed by signal {-code}" if code is not None and code < 0 else
                   "did not exit" if code is None else f"exited {code}")
            tail = " | ".join(m.proc.log_tail(6).splitlines())[-600:]
            out.append(f"{m.name} (pid {m.pid}, {m.proc.name}) {how} at close; its log ends: {tail}")
        return out

    # -- looking at the members ----------------------------------------------------

    def resources(self) -> dict[str, dict[str, Any]]:
        out = {}
        for m in self.members:
            if m.alive:
                res = proc_resources(m.pid)  # type: ignore[arg-type]
                if res is not None:
                    out[m.name] = {"pid": m.pid, **res}
        return out

    def scrape(self, m: Member) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The member's Prometheus samples (empty if it does not answer)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = (m.ready or {}).get("metrics")
        if not url or not m.alive:
            return {}
        try:
            text = httpx.get(url, timeout=1.0, trust_env=False).text
        except httpx.HTTPError:
            return {}
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def stats(self, m: Member, timeout: float = 10.0) -> dict[str, Any]:
        if m.client is None or not m.alive:
            return {}
        reply = m.client.call(ops.Stats(), timeout)
        return reply.stats if isinstance(reply, ops.StatsReply) else {}

    def registered(self, instance: str) -> int:
        """Ranks of ``instance`` a daemon lists now (0 when none answers)."""
        for url in self.urls:
            try:
                r = httpx.get(f"{url}/v1/instances/{instance}", timeout=1.0, trust_env=False,
                              headers={"Authorization": f"Bearer {self.token}"})
                return int(r.json()["num_ranks"]) if r.status_code == 200 else 0
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        return 0

    def wait_registered(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        want = {self.prefill_instance: len(self.prefill), self.decode_instance: len(self.decode)}
        while time.monotonic() < deadline:
            if all(self.registered(i) == n for i, n in want.items()):
                return True
            time.sleep(0.1)
        return False


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def _on_port(port: int, spawn: Callable[[int], Any], tries: int = 3) -> int:
    """``spawn(port)`` on the port a process had (a restart: it must come back there), or on a first
    start a free private port, another one when the process finds it taken in the moment between
    the check and its bind (``chaos/ports.py``), up to ``tries`` ports; returns the port."""
    if port:
        spawn(port)
        return port
    for attempt in range(tries):
        port = private_ports(1, HOST)[0]
        try:
            spawn(port)
            return port
        except LaunchError as exc:
            if "Address already in use" not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")
