"""``scripts/landing_cost.py``: the host work of a staged chunk on both sides, timed alone on the CPU
(decode's request with the scatter list's check, its landing and the stager's range checks; prefill's
gather list and its range checks; the request sealed and opened with a cluster secret, beside both MACs),
runs on a small room and prints each part (the figures themselves are not asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_landing_cost_times_both_sides_of_every_chunk():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "landing_cost.py"), "--tokens", "2048",
                          "--slot-mib", "1", "--reps", "2"], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout
    m = re.search(r"(\d+) landings: DecodeStaging.request p50 [\d.]+ ms \(wire 16: the list checked here\), "
                  r"DecodeStaging.landed p50 [\d.]+ ms, CudaStager.copy \(range checks\) p50 [\d.]+ ms, "
                  r"both p50 [\d.]+ ms; (\d+) gathers on prefill: CudaStager.gather \(the list and its range checks\) "
                  r"p50 [\d.]+ ms", out)
    assert m is not None, out
    assert int(m[1]) == int(m[2]) > 0  # every chunk landed once and was gathered once, per rep
    mac = re.search(r"SlotRequest with a cluster secret, (\d+) chunks: sealed p50 [\d.]+ ms, opened p50 [\d.]+ ms "
                    r"\(this tree's MAC\); over the same frames HMAC-SHA256 p50 [\d.]+ ms, keyed BLAKE3 p50 [\d.]+ ms",
                    out)
    assert mac is not None, out
    assert int(mac[1]) == int(m[1])  # every chunk's request sealed and opened
