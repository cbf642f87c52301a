"""What a sleeping thread's wake-up costs on this host, and what spinning before blocking saves:
a one-byte ping-pong between two processes over a loopback TCP connection, each side waiting
for its byte either in a blocking ``select`` (what kvbridge's loops do) or by polling ``select``
with a zero timeout for up to ``--spin-us`` before blocking. Each round trip follows an idle
spell (0 and each ``--idle-ms``), so both sides have gone to sleep as a lone room's peers have.
Standard library only, so it runs on a bare device host.

    python3 scripts/wake_probe.py [--rounds 400] [--idle-ms 0 1 5 50] [--spin-us 0 200 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import select
import socket
import statistics
import time


def wait_readable(sock: socket.socket, spin_s: float) -> None:
    """Wait until ``sock`` is readable: poll it for up to ``spin_s``, then block."""
    if spin_s > 0:
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            if select.select([sock], [], [], 0)[0]:
                return
    select.select([sock], [], [], 10.0)


def echo(port: int, spin_s: float) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        wait_readable(sock, spin_s)
        b = sock.recv(1)
        if not b or b == b"q":
            return
        sock.sendall(b)


def trips(spin_s: float, idle_s: float, rounds: int) -> list[float]:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    proc = mp.Process(target=echo, args=(lst.getsockname()[1], spin_s), daemon=True)
    proc.start()
    try:
        conn, _ = lst.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for i in range(rounds + 20):
            if idle_s:
                time.sleep(idle_s)
            t0 = time.perf_counter()
            conn.sendall(b"p")
            wait_readable(conn, spin_s)
            conn.recv(1)
            if i >= 20:
                out.append((time.perf_counter() - t0) * 1e6)
        conn.sendall(b"q")
        conn.close()
        return sorted(out)
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        lst.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--idle-ms", type=float, nargs="+", default=[0, 1, 5, 50])
    ap.add_argument("--spin-us", type=float, nargs="+", default=[0, 200, 2000])
    args = ap.parse_args()
    for idle in args.idle_ms:
        rounds = args.rounds if idle < 20 else max(args.rounds // 8, 40)
        for spin in args.spin_us:
            v = trips(spin / 1e6, idle / 1e3, rounds)
            print(f"idle {idle:g} ms, spin {spin:g} us: round trip p50 {statistics.median(v):.0f} us, "
                  f"p90 {v[int(0.9 * len(v))]:.0f} us ({len(v)} trips)", flush=True)


if __name__ == "__main__":
    main()
