"""What one control-channel hop costs on this host, before any kvbridge code: a ZMQ
DEALER in this process and a ROUTER echo server in another (both on loopback, the server
waiting on the socket's file descriptor as kvbridge's loops do), round trips of one small
frame, back to back and after an idle spell.

    .venv/bin/python scripts/zmq_rtt.py [--rounds 2000] [--idle-ms 5]

A kvbridge room crosses two such hops (the request, the completion report). On a VM a
thread that slept wakes slower, and every hop wakes two threads per side (ZMQ's I/O
thread, then the loop), so the idle figure is the one a lone room pays.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import select
import statistics
import time

import zmq


def echo(endpoints: mp.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    poller = select.poll()
    poller.register(sock.getsockopt(zmq.FD), select.POLLIN)
    endpoints.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            poller.poll(1000)
        frames = sock.recv_multipart(zmq.NOBLOCK)
        if frames[1] == b"quit":
            break
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def rtts(sock: zmq.Socket, rounds: int, idle_s: float) -> list[float]:
    out = []
    for _ in range(rounds):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        sock.send(b"x")
        if not sock.poll(5000):
            raise SystemExit("no echo within 5 s")
        sock.recv()
        out.append((time.perf_counter() - t0) * 1e6)
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000, help="back-to-back round trips")
    ap.add_argument("--idle-ms", type=float, default=5.0, help="idle time before each of the idle round trips")
    args = ap.parse_args()
    with SocketPair() as (sock, _):
        rtts(sock, 100, 0)  # warm-up
        hot = rtts(sock, args.rounds, 0)
        idle = rtts(sock, max(args.rounds // 5, 50), args.idle_ms / 1e3)
    for name, v in (("back to back", hot), (f"after {args.idle_ms:g} ms idle", idle)):
        print(f"ZMQ round trip over loopback, {name}: p50 {statistics.median(v):.0f} us, "
              f"p90 {v[int(0.9 * len(v))]:.0f} us ({len(v)} round trips)")


class SocketPair:
    """A DEALER here, connected to an echo ROUTER in a child process (stopped on exit)."""

    def __enter__(self) -> tuple[zmq.Socket, mp.Process]:
        endpoints: mp.Queue = mp.Queue()
        self.proc = mp.Process(target=echo, args=(endpoints,), daemon=True)
        self.proc.start()
        try:
            endpoint = endpoints.get(timeout=10)
        except Exception:
            self.proc.kill()
            raise SystemExit("echo server did not start") from None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        return self.sock, self.proc

    def __exit__(self, *exc: object) -> None:
        self.sock.send(b"quit")
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.sock.close()
        self.ctx.term()


if __name__ == "__main__":
    main()
