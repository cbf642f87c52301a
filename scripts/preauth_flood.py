"""What a flood of unauthenticated connections costs a prefill rank's control channel: a
ControlServer with a cluster secret and the default limits, serving from its loop thread in
a child process (as a prefill rank does), against many connections that never authenticate,
each sending a frame that announces the most a Hello may be and then stalls one byte short,
plus connections that announce 8 MiB frames, from ``--addresses`` loopback source addresses
(127.0.0.2, 127.0.0.3, ...: enough to fill every pending slot, not only one address's). The child's RSS is read before and while the
flood holds, and a real rank (a PeerSet with the secret) pings through the flood.

    .venv/bin/python scripts/preauth_flood.py [--connections 2000] [--addresses 64] [--hold-s 1.5]

Prints one line per phase and a JSON summary (RSS in MiB, what the server counted, whether
the real rank got its answer and how long it took).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import socket
import time

from kvbridge.transfer.channel import ControlServer, PeerSet
from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES
from kvbridge.transfer.channel.frames import HEADER
from kvbridge.transfer.channel.wire import Heartbeat, Ping

SECRET = b"preauth-flood-secret"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def serve(ready: mp.Queue, stop: mp.Event) -> None:
    server = ControlServer(secret=SECRET)
    ready.put(server.port)
    while not stop.is_set():
        for peer, msg in server.recv_ready(50):
            if isinstance(msg, Ping):
                server.send(peer, Heartbeat(cp_rank=0, seq=msg.seq))
    ready.put({"stats": vars(server.stats), "pending": server.num_pending, "peers": server.num_peers})
    server.close()


def real_rank_ping(port: int, timeout: float = 10.0) -> float | None:
    """Seconds until a real rank's Ping is answered, or None."""
    peers = PeerSet(secret=SECRET, name="decode-rank-0")
    try:
        t0 = time.monotonic()
        peers.send(f"tcp://127.0.0.1:{port}", Ping(decode_rank="d0", seq=1))
        while time.monotonic() - t0 < timeout:
            if any(isinstance(m, Heartbeat) for _, m in peers.recv_ready(50)):
                return time.monotonic() - t0
        return None
    finally:
        peers.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=2000, help="unauthenticated connections to open")
    ap.add_argument("--addresses", type=int, default=64, help="loopback source addresses the flood comes from")
    ap.add_argument("--hold-s", type=float, default=1.5, help="how long the flood holds before RSS is read")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.connections + 256)), hard))
    ready, stop = mp.Queue(), mp.Event()
    proc = mp.Process(target=serve, args=(ready, stop), daemon=True)
    proc.start()
    port = ready.get(timeout=30)
    time.sleep(0.5)
    before = rss_mib(proc.pid)
    print(f"server RSS before the flood: {before:.1f} MiB", flush=True)
    socks: list[socket.socket] = []
    stalled = HEADER.pack(HELLO_MAX_BYTES) + b"\0" * (HELLO_MAX_BYTES - 1)
    huge = HEADER.pack(8 << 20) + b"\0" * (64 << 10)
    opened = 0
    try:
        for i in range(args.connections):
            try:
                source = f"127.0.{(i % args.addresses + 2) // 256}.{(i % args.addresses + 2) % 256}"
                sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
                sock.setblocking(False)
                try:
                    sock.send(huge if i % 10 == 0 else stalled)
                except OSError:  # (closed already, or the kernel buffer is full: the flood goes on)
                    pass
            except OSError:
                continue
            socks.append(sock)
            opened += 1
        ping_s = real_rank_ping(port)
        time.sleep(args.hold_s)
        during = rss_mib(proc.pid)
        print(f"server RSS with {opened} unauthenticated connections opened: {during:.1f} MiB "
              f"(+{during - before:.1f} MiB)", flush=True)
        print("real rank answered through the flood in "
              + (f"{ping_s * 1000:.0f} ms" if ping_s is not None else "NEVER"), flush=True)
    finally:
        for sock in socks:
            sock.close()
        stop.set()
        summary = ready.get(timeout=30)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    print(json.dumps({"connections": opened, "addresses": args.addresses, "rss_before_mib": round(before, 1), "rss_during_mib": round(during, 1),
                      "rss_growth_mib": round(during - before, 1), "real_rank_ping_ms":
                      None if ping_s is None else round(ping_s * 1000, 1), **summary}))


if __name__ == "__main__":
    main()
