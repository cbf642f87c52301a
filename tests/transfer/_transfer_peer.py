"""A transfer-engine peer in its own process, for tests that write across processes.

    python _transfer_peer.py NBYTES [ENGINE [DEVICE]]   (ENGINE: mooncake (default), nixl, ipc or auto; DEVICE: cpu or cuda)
    -> prints {"session": ..., "addr": ..., "nbytes": ..., "metadata": base64} once its zeroed buffer is
       registered (a writer loads ``metadata`` with ``add_peer``: NIXL needs it)
    <- "check SEED"  -> "ok" when the buffer equals rng(SEED) bytes, else "mismatch N bytes"
    <- "zero"        -> "ok" when the buffer is still all zeros, else "mismatch N bytes"
    <- "unregister"  -> "unregistered" once the engine withdrew the buffer
    <- "sha256 [A B]" -> the sha256 hex of the buffer (of its bytes [A, B)) (cpu)
    <- "copy JSON"   -> "ok" after copying [[src_off, dst_off, len], ...] inside the buffer (a
                        receiver's scatter out of its staging slot) (cpu)
    <- EOF or "exit" -> closes the engine and exits
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvbridge.transfer.engine import create_engine, tensor_region


@contextmanager
def peer_process(nbytes: int, kind: str = "mooncake", device: str = "cpu",
                 log_path: Any = None) -> Iterator[tuple[subprocess.Popen, dict, Callable[[str], str]]]:
    """Run this script as a peer process: yields ``(child, info, ask)``, ``ask("check 7")`` -> its
    answer; the child is stopped (or reaped, when a test killed it) on the way out."""
    err = open(log_path, "w") if log_path is not None else subprocess.DEVNULL
    child = subprocess.Popen([sys.executable, __file__, str(nbytes), kind, device], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err, text=True)

    def ask(cmd: str) -> str:
        child.stdin.write(cmd + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    try:
        yield child, json.loads(child.stdout.readline()), ask
    finally:
        if child.poll() is None:
            try:
                child.stdin.close()
                child.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait(10)
        child.stdout.close()
        if log_path is not None:
            err.close()


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> None:
    nbytes = int(sys.argv[1])
    kind = sys.argv[2] if len(sys.argv) > 2 else "mooncake"
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    engine = create_engine(kind, host="127.0.0.1")
    if device == "cpu":
        buf = np.zeros(nbytes, dtype=np.uint8)
    else:
        import torch

        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
    engine.register(*tensor_region(buf))
    print(json.dumps({"session": engine.session_id, "addr": tensor_region(buf)[0], "nbytes": nbytes,
                      "metadata": base64.b64encode(engine.metadata).decode()}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        host = buf if device == "cpu" else buf.cpu().numpy()
        if cmd == "check":
            bad = int(np.count_nonzero(host != pattern(int(args[0]), nbytes)))
            print("ok" if bad == 0 else f"mismatch {bad} bytes", flush=True)
        elif cmd == "zero":
            bad = int(np.count_nonzero(host))
            print("ok" if bad == 0 else f"mismatch {bad} bytes", flush=True)
        elif cmd == "sha256":
            import hashlib

            a, b = (int(args[0]), int(args[1])) if args else (0, nbytes)
            print(hashlib.sha256(host[a:b].tobytes()).hexdigest(), flush=True)
        elif cmd == "copy":
            for src, dst, n in json.loads(line.split(maxsplit=1)[1]):
                buf[dst : dst + n] = buf[src : src + n]
            print("ok", flush=True)
        elif cmd == "unregister":
            engine.unregister(tensor_region(buf)[0])
            print("unregistered", flush=True)
        elif cmd == "exit":
            break
    engine.close()


if __name__ == "__main__":
    main()
