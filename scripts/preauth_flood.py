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
import socket
import time

from _flood import ServerChild, ping_line, raise_nofile, source_address

from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES
from kvbridge.transfer.channel.frames import HEADER

SECRET = b"preauth-flood-secret"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=2000, help="unauthenticated connections to open")
    ap.add_argument("--addresses", type=int, default=64, help="loopback source addresses the flood comes from")
    ap.add_argument("--hold-s", type=float, default=1.5, help="how long the flood holds before RSS is read")
    args = ap.parse_args()
    raise_nofile(args.connections + 256)
    server = ServerChild(SECRET)
    port = server.start()
    before = server.rss_mib()
    print(f"server RSS before the flood: {before:.1f} MiB", flush=True)
    socks: list[socket.socket] = []
    stalled = HEADER.pack(HELLO_MAX_BYTES) + b"\0" * (HELLO_MAX_BYTES - 1)
    huge = HEADER.pack(8 << 20) + b"\0" * (64 << 10)
    opened = 0
    try:
        for i in range(args.connections):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5,
                                                source_address=(source_address(i, args.addresses), 0))
                sock.setblocking(False)
                try:
                    sock.send(huge if i % 10 == 0 else stalled)
                except OSError:  # (closed already, or the kernel buffer is full: the flood goes on)
                    pass
            except OSError:
                continue
            socks.append(sock)
            opened += 1
        ping_s = server.real_rank_ping(port, timeout=10.0)
        time.sleep(args.hold_s)
        during = server.rss_mib()
        print(f"server RSS with {opened} unauthenticated connections opened: {during:.1f} MiB "
              f"(+{during - before:.1f} MiB)", flush=True)
        print(ping_line(ping_s), flush=True)
    finally:
        for sock in socks:
            sock.close()
        summary = server.stop()
    print(json.dumps({"connections": opened, "addresses": args.addresses, "rss_before_mib": round(before, 1), "rss_during_mib": round(during, 1),
                      "rss_growth_mib": round(during - before, 1), "real_rank_ping_ms":
                      None if ping_s is None else round(ping_s * 1000, 1), **{k: summary[k] for k in ("stats", "pending", "peers")}}))


if __name__ == "__main__":
    main()
