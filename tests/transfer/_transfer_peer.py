"""A transfer-engine peer in its own process, for tests that write across processes.

    python _transfer_peer.py NBYTES [ENGINE [DEVICE]]   (ENGINE: mooncake (default), ipc or auto; DEVICE: cpu or cuda)
    -> prints {"session": ..., "addr": ..., "nbytes": ...} once its zeroed buffer is registered
    <- "check SEED"  -> "ok" when the buffer equals rng(SEED) bytes, else "mismatch N bytes"
    <- "zero"        -> "ok" when the buffer is still all zeros, else "mismatch N bytes"
    <- "unregister"  -> "unregistered" once the engine withdrew the buffer
    <- EOF or "exit" -> closes the engine and exits
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvbridge.transfer.engine import create_engine, tensor_region


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
    print(json.dumps({"session": engine.session_id, "addr": tensor_region(buf)[0], "nbytes": nbytes}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        host = buf if device == "cpu" else buf.cpu().numpy()
        if cmd == "check":
            bad = int(np.count_nonzero(host != pattern(int(args[0]), nbytes)))
            print("ok" if bad == 0 else f"mismatch {bad} bytes", flush=True)
        elif cmd == "zero":
            bad = int(np.count_nonzero(host))
            print("ok" if bad == 0 else f"mismatch {bad} bytes", flush=True)
        elif cmd == "unregister":
            engine.unregister(tensor_region(buf)[0])
            print("unregistered", flush=True)
        elif cmd == "exit":
            break
    engine.close()


if __name__ == "__main__":
    main()
