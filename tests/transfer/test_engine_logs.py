"""Mooncake's own log lines stay out of an engine's output unless kvbridge logs at DEBUG."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbridge.transfer.engine import mooncake_available

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]

# Two engines in one process write to each other: every start-up line and a per-batch line.
SCRIPT = """
import logging, sys
import numpy as np
if sys.argv[1] == "debug":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from kvbridge.transfer.engine import create_engine, mooncake_available, tensor_region
assert mooncake_available()  # imports mooncake.engine first, as a test or a health check would
a, b = create_engine("mooncake"), create_engine("mooncake")
src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
a.register(*tensor_region(src)); b.register(*tensor_region(dst))
for _ in range(3):
    a.write(b.session_id, np.array([src.ctypes.data], np.uint64), np.array([dst.ctypes.data], np.uint64),
            np.array([4096], np.uint64))
print("moved", int(dst.sum()), file=sys.stderr)
a.close(); b.close()
"""
NOISE = ("Local segment descriptor not found", "Batch Transfer completed!", "Logging before InitGoogleLogging",
         "TcpTransport: listen on port")


def run(mode: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "GLOG_minloglevel")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def test_mooncake_lines_are_silent_by_default_and_shown_at_debug():
    quiet = run("info")
    assert "moved 4096" in quiet
    assert not [n for n in NOISE if n in quiet], quiet[-2000:]
    loud = run("debug")
    assert "moved 4096" in loud
    assert "Local segment descriptor not found" in loud and "Batch Transfer completed!" in loud  # untouched
