"""The vLLM connector suite runs in the vLLM venv (.venv-vllm); elsewhere it is skipped
as a whole (the main suite's Makefile target leaves this folder out)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def daemon():
    from kvbridge import start_bootstrap

    with start_bootstrap(lease_ttl=5.0) as (url, token):
        yield url, token


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that ran real servers (``vllm serve``, the proxy) gets each one's log tail in
    its report: a 500 from the proxy says nothing of why prefill or decode failed the room."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    started = getattr(sys.modules.get("_vllm_serve"), "STARTED", {})
    for name, proc in sorted(started.items()):
        tail = proc.log_tail(8000)
        if tail:
            report.sections.append((f"log of {name} (its last 8000 characters)", tail))
        log = proc.log_tail(10**8)
        dumps = [log[at:at + 12000] for at in _dump_starts(log)][-2:]  # KVBRIDGE_STALL_DUMP's stacks, the last two
        for i, dump in enumerate(dumps):
            report.sections.append((f"{name}: a loop turn's stall, every thread's stack ({i + 1} of {len(dumps)})", dump))


def _dump_starts(log: str) -> list[int]:
    """Where faulthandler's dumps start in a server's log (``Timeout (h:mm:ss)!``)."""
    starts, at = [], log.find("Timeout (")
    while at >= 0:
        starts.append(at)
        at = log.find("Timeout (", at + 1)
    return starts
