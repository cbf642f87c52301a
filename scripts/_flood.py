"""What the two flood scripts share (``preauth_flood.py``, ``postauth_flood.py``): a ControlServer
with a cluster secret and the default limits serving from its loop thread in a child process (as
a prefill rank does), answering Pings; the child's RSS; a real rank (a PeerSet with the secret)
pinging through the flood; loopback source addresses 127.0.0.2, 127.0.0.3, ..."""

from __future__ import annotations

import multiprocessing as mp
import resource
import time
from typing import Any

from kvbridge.transfer.channel import ControlServer, PeerSet
from kvbridge.transfer.channel.wire import Heartbeat, Ping


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def raise_nofile(need: int) -> None:
    """Enough file descriptors for ``need`` sockets (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, need)), hard))


def source_address(i: int, addresses: int) -> str:
    """The ``i``-th connection's loopback source address, ``addresses`` of them in turn."""
    n = i % addresses + 2
    return f"127.0.{n // 256}.{n % 256}"


def _serve(secret: bytes, ready: Any, stop: Any) -> None:
    server = ControlServer(secret=secret)
    ready.put(server.port)
    peak_buffered = peak_peers = 0
    while not stop.is_set():
        for peer, msg in server.recv_ready(50):
            if isinstance(msg, Ping):
                server.send(peer, Heartbeat(cp_rank=0, seq=msg.seq))
        peak_buffered = max(peak_buffered, server.buffered_bytes)
        peak_peers = max(peak_peers, server.num_peers)
    ready.put({"stats": vars(server.stats), "pending": server.num_pending, "peers": server.num_peers,
               "peers_peak": peak_peers, "buffered_peak_mib": round(peak_buffered / (1 << 20), 1),
               "limits": vars(server.limits)})
    server.close()


class ServerChild:
    """The flooded server in its own process: ``start()`` gives its port, ``stop()`` what it counted."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._ready, self._stop = mp.Queue(), mp.Event()
        self.proc = mp.Process(target=_serve, args=(secret, self._ready, self._stop), daemon=True)

    def start(self) -> int:
        self.proc.start()
        port = self._ready.get(timeout=30)
        time.sleep(0.5)
        return port

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        summary = self._ready.get(timeout=60)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        return summary

    def real_rank_ping(self, port: int, timeout: float) -> float | None:
        """Seconds until a real rank's Ping is answered, or None."""
        peers = PeerSet(secret=self.secret, name="decode-rank-0")
        try:
            t0 = time.monotonic()
            peers.send(f"tcp://127.0.0.1:{port}", Ping(decode_rank="d0", seq=1))
            while time.monotonic() - t0 < timeout:
                if any(isinstance(m, Heartbeat) for _, m in peers.recv_ready(50)):
                    return time.monotonic() - t0
            return None
        finally:
            peers.close()


def ping_line(ping_s: float | None) -> str:
    return "real rank answered through the flood in " + (f"{ping_s * 1000:.0f} ms" if ping_s is not None else "NEVER")
