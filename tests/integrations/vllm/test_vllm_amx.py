"""The connector's worker side asks Linux for the AMX tile state (kvbridge/integrations/vllm/amx.py):
vLLM's CPU attention picks AMX kernels from the CPU's flags and nothing on a decode's path asked
for the state, so a disaggregated decode's first step died with SIGILL on an AMX host."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vLLM: make test-vllm")

CHILD = """
from kvbridge.integrations.vllm.amx import amx_flags, amx_permitted, request_amx_state
before = amx_permitted()
got = request_amx_state()
print(amx_flags(), before, got, amx_permitted())
"""


def test_a_fresh_process_holds_the_amx_state_after_the_request_exactly_when_the_cpu_has_amx() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    flags, before, got, after = (w == "True" for w in out.stdout.split())
    assert not before  # Linux grants it only on request: what vLLM's AMX attention never made
    assert got == after == flags  # held after the request where the CPU has AMX; nothing asked elsewhere


def test_the_worker_side_asks_before_any_forward() -> None:
    """The request sits in the connector's worker-side construction (vLLM builds it in the worker
    process before the first forward), not on a path a decode might skip."""
    import inspect

    from kvbridge.integrations.vllm.connector import KVBridgeConnector

    src = inspect.getsource(KVBridgeConnector.__init__)
    assert src.index("request_amx_state()") < src.index("WorkerSide(")
