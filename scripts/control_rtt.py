"""What one control-channel hop costs on this host: a round trip of one small message between
this process and an echo process on loopback, over kvbridge's control channel (a PeerSet
here, a ControlServer there, each waiting on file descriptors as the endpoints' loops do:
a Ping out, a Heartbeat back) and, for comparison, over ZMQ (a DEALER here, a ROUTER echo
there, carrying the same messages, encoded and decoded the same way on both sides), back to
back and after an idle spell. kvbridge does not depend on pyzmq: without it the ZMQ
comparison says it is skipped.

    .venv/bin/python scripts/control_rtt.py [--rounds 2000] [--idle-ms 5] [--secret]

A kvbridge room crosses two such hops (the request, the completion report). On a VM a
thread that slept wakes slower, so the idle figures are the ones a lone room pays. ZMQ
hands each message to an I/O thread on both sides (two more thread wake-ups per hop);
kvbridge's channel sends on the calling thread and receives on the loop thread.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import select
import statistics
import time
from collections.abc import Callable

try:
    import zmq
except ImportError:  # an optional comparison
    zmq = None

from kvbridge.transfer.channel import wire
from kvbridge.transfer.channel import ControlServer, PeerSet


def kvbridge_echo(endpoints: mp.Queue, secret: bytes | None) -> None:
    server = ControlServer(secret=secret)
    endpoints.put(server.endpoint)
    while True:
        for peer, msg in server.recv_ready(1000):
            if isinstance(msg, wire.Ping) and msg.decode_rank == "stop":
                server.close()
                return
            if isinstance(msg, wire.Ping):
                server.send(peer, wire.Heartbeat(cp_rank=0, seq=msg.seq))


def zmq_echo(endpoints: mp.Queue, secret: bytes | None) -> None:
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
        peer, data = sock.recv_multipart(zmq.NOBLOCK)
        if data == b"quit":
            break
        msg = wire.decode(data, secret)  # the same work per message as the kvbridge echo
        sock.send_multipart([peer, wire.encode(wire.Heartbeat(cp_rank=0, seq=msg.seq), secret)])
    sock.close()
    ctx.term()


def timed(trip: Callable[[], None], rounds: int, idle_s: float) -> list[float]:
    out = []
    for _ in range(rounds):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        trip()
        out.append((time.perf_counter() - t0) * 1e6)
    return sorted(out)


class Echo:
    """An echo process (``target``), stopped on exit; ``endpoint`` is where it listens."""

    def __init__(self, target: Callable[[mp.Queue, bytes | None], None], secret: bytes | None) -> None:
        self.target = target
        self.secret = secret

    def __enter__(self) -> str:
        endpoints: mp.Queue = mp.Queue()
        self.proc = mp.Process(target=self.target, args=(endpoints, self.secret), daemon=True)
        self.proc.start()
        try:
            return endpoints.get(timeout=10)
        except Exception:
            self.proc.kill()
            raise SystemExit("echo process did not start") from None

    def __exit__(self, *exc: object) -> None:
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def kvbridge_trips(rounds: int, idle_s: float, secret: bytes | None) -> tuple[list[float], list[float]]:
    with Echo(kvbridge_echo, secret) as endpoint:
        peers = PeerSet(secret=secret)
        seq = iter(range(1 << 62))

        def trip() -> None:
            n = next(seq)
            peers.send(endpoint, wire.Ping(decode_rank="rtt", seq=n))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if any(isinstance(m, wire.Heartbeat) and m.seq == n for _, m in peers.recv_ready(1000)):
                    return
            raise SystemExit("no echo within 5 s")

        try:
            timed(trip, 100, 0)  # warm-up (and the connection)
            return timed(trip, rounds, 0), timed(trip, max(rounds // 5, 50), idle_s)
        finally:
            peers.send(endpoint, wire.Ping(decode_rank="stop", seq=0))
            peers.recv_ready(0)  # (the loop turn that flushes it, if the kernel did not take it at once)
            peers.close()


def zmq_trips(rounds: int, idle_s: float, secret: bytes | None) -> tuple[list[float], list[float]]:
    with Echo(zmq_echo, secret) as endpoint:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)

        seq = iter(range(1 << 62))

        def trip() -> None:
            n = next(seq)
            sock.send(wire.encode(wire.Ping(decode_rank="rtt", seq=n), secret))
            if not sock.poll(5000):
                raise SystemExit("no echo within 5 s")
            if wire.decode(sock.recv(), secret).seq != n:
                raise SystemExit("echo out of order")

        try:
            timed(trip, 100, 0)
            return timed(trip, rounds, 0), timed(trip, max(rounds // 5, 50), idle_s)
        finally:
            sock.send(b"quit")
            sock.close()
            ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000, help="back-to-back round trips")
    ap.add_argument("--idle-ms", type=float, default=5.0, help="idle time before each of the idle round trips")
    ap.add_argument("--secret", action="store_true", help="sign every message (its MAC) as a cluster with a secret does")
    args = ap.parse_args()
    secret = b"control-rtt-secret" if args.secret else None
    for name, run in (("kvbridge channel", kvbridge_trips), ("ZMQ", zmq_trips)):
        if run is zmq_trips and zmq is None:
            print("ZMQ round trip: skipped (pyzmq is not installed; kvbridge does not need it)")
            continue
        hot, idle = run(args.rounds, args.idle_ms / 1e3, secret)
        for what, v in (("back to back", hot), (f"after {args.idle_ms:g} ms idle", idle)):
            print(f"{name} round trip over loopback, {what}: p50 {statistics.median(v):.0f} us, "
                  f"p90 {v[int(0.9 * len(v))]:.0f} us ({len(v)} round trips)")


if __name__ == "__main__":
    main()
