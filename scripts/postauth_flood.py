"""What authenticated connections can make a prefill rank's control channel buffer: a
ControlServer with a cluster secret and the default limits, serving from its loop thread in a
child process (as a prefill rank does), against ``--connections`` connections that each pass
the challenge with a valid Hello (the attacker holds the secret) and then announce the largest
frame the channel takes and push as much of it as the server reads, from ``--addresses``
loopback source addresses (127.0.0.2, ...; the default fills every slot: 4,096 = 64 addresses x
the 64-per-address cap). The child's RSS and the bytes its readers hold are sampled while the
flood holds, and a real rank (a PeerSet with the secret) pings through it.

    .venv/bin/python scripts/postauth_flood.py [--connections 4096] [--addresses 64] [--hold-s 5]

Prints one line per phase and a JSON summary (RSS in MiB; buffered: the readers' bytes, whose
bound is connections x frame_allowance + frame_budget; what the server counted; the real rank's
answer and how long it took).
"""

from __future__ import annotations

import argparse
import json
import socket
import time

from _flood import ServerChild, ping_line, raise_nofile, source_address

from kvbridge.transfer.channel import Limits
from kvbridge.transfer.channel.frames import HEADER, frame
from kvbridge.transfer.channel.wire import auth_limit, codec

SECRET = b"postauth-flood-secret"


def attacker(port: int, source: str) -> socket.socket | None:
    """One authenticated connection (it announces its frame once every slot is taken: a frame's
    clock starts with its first byte)."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        (size,) = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        nonce = codec(SECRET).open_challenge(sock.recv(size, socket.MSG_WAITALL)).nonce
        sock.sendall(frame(codec(SECRET).hello(f"flood-{source}", nonce)))
    except OSError:
        return None
    sock.setblocking(False)
    return sock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=4096, help="authenticated connections to open")
    ap.add_argument("--addresses", type=int, default=64, help="loopback source addresses the flood comes from")
    ap.add_argument("--hold-s", type=float, default=5.0, help="how long the flood pushes before RSS is read")
    args = ap.parse_args()
    raise_nofile(args.connections + 512)
    server = ServerChild(SECRET)
    port = server.start()
    before = server.rss_mib()
    print(f"server RSS before the flood: {before:.1f} MiB", flush=True)
    socks: list[socket.socket] = []
    chunk = b"\0" * (256 << 10)
    pushed = 0
    peak = before
    try:
        for i in range(args.connections):
            sock = attacker(port, source_address(i, args.addresses))
            if sock is not None:
                socks.append(sock)
        print(f"{len(socks)} authenticated connections, each announcing a {auth_limit(4 << 20):,}-byte frame",
              flush=True)
        for sock in socks:
            try:
                sock.send(HEADER.pack(auth_limit(4 << 20)))
            except OSError:
                pass
        until = time.monotonic() + args.hold_s
        while time.monotonic() < until:  # push the announced bodies as fast as the server reads them
            for sock in socks:
                try:
                    pushed += sock.send(chunk)
                except OSError:  # kernel buffer full (the server reads no more), or closed
                    pass
            peak = max(peak, server.rss_mib())
        ping_s = server.real_rank_ping(port, timeout=20.0)
        peak = max(peak, server.rss_mib())
        print(f"server RSS peak with {len(socks)} connections pushing partial frames: {peak:.1f} MiB "
              f"(+{peak - before:.1f} MiB); {pushed / (1 << 20):.0f} MiB pushed into sockets", flush=True)
        print(ping_line(ping_s), flush=True)
    finally:
        for sock in socks:
            sock.close()
        summary = server.stop()
    limits = Limits()
    bound = len(socks) * limits.frame_allowance + limits.frame_budget
    print(json.dumps({"connections": len(socks), "addresses": args.addresses, "rss_before_mib": round(before, 1),
                      "rss_peak_mib": round(peak, 1), "rss_growth_mib": round(peak - before, 1),
                      "buffered_bound_mib": round(bound / (1 << 20), 1), "pushed_mib": round(pushed / (1 << 20), 1),
                      "real_rank_ping_ms": None if ping_s is None else round(ping_s * 1000, 1), **{k: summary[k] for k in ("stats", "peers_peak", "buffered_peak_mib", "limits")}}))


if __name__ == "__main__":
    main()
