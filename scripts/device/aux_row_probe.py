"""What one aux row's copy costs on a GPU: ``_DeviceRows.write`` (host -> device, what decode does
with a row its report carried) against ``.read`` (device -> host, a row a transfer wrote), and the
same copies as plain ``cudaMemcpy``, on an idle GPU and while another process keeps the GPU's copy
engines busy (a 256 MiB device-to-device copy in a loop: other transfers landing). Issue 33, round 18
(docs/performance.md): a 14,368-byte row, 400 copies each, p50 / p90 in microseconds.

    python3 scripts/device/aux_row_probe.py        (on a device host: run_gpu.sh's EXTRA)
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from kvbridge.transfer.aux_rows import _DeviceRows

ROW_BYTES, ROWS, COPIES = 14_368, 512, 400


def busy(seconds: float = 20.0) -> None:
    """Keep the GPU's copy engines busy from another process (another CUDA context)."""
    a = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        b.copy_(a)
        torch.cuda.synchronize()


def timed(fn) -> str:
    out = []
    for i in range(COPIES):
        slot = i * 7919 % ROWS
        t = time.perf_counter()
        fn(slot)
        out.append((time.perf_counter() - t) * 1e6)
        time.sleep(0.0002)
    return f"p50 {statistics.median(out):7.1f} us  p90 {np.percentile(out, 90):7.1f}"


def main() -> None:
    if sys.argv[1:] == ["busy"]:
        busy()
        return
    rows = _DeviceRows(torch.zeros(ROWS, ROW_BYTES, dtype=torch.uint8, device="cuda:0"), ROW_BYTES)
    row = np.random.default_rng(0).integers(0, 255, ROW_BYTES, dtype=np.uint8)
    rt = rows._cuda.rt

    def plain_write(slot: int) -> None:
        rows._host[:] = row
        rt.cudaMemcpy(ctypes.c_void_p(rows._base + slot * ROW_BYTES), ctypes.c_void_p(rows._host.ctypes.data),
                      ctypes.c_size_t(ROW_BYTES), 4)

    def plain_read(slot: int) -> None:
        rt.cudaMemcpy(ctypes.c_void_p(rows._host.ctypes.data), ctypes.c_void_p(rows._base + slot * ROW_BYTES),
                      ctypes.c_size_t(ROW_BYTES), 4)

    for label in ("idle", "busy"):
        other = subprocess.Popen([sys.executable, __file__, "busy"]) if label == "busy" else None
        if other is not None:
            time.sleep(5)  # its CUDA context up and copying
        try:
            for name, fn in (("write", lambda s: rows.write(s, row)), ("read", rows.read),
                             ("cudaMemcpy write", plain_write), ("cudaMemcpy read", plain_read)):
                print(f"{label:5s} {name:18s} {timed(fn)}", flush=True)
        finally:
            if other is not None:
                other.kill()
                other.wait()


if __name__ == "__main__":
    main()
