"""The vLLM connector suite runs in the vLLM venv (.venv-vllm); elsewhere it is skipped
as a whole (the main suite's Makefile target leaves this folder out)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
ROOT = Path(__file__).resolve().parents[3]
WATCH_GAP_S = 3.0  # scripts/freeze_watch.py reports a wake-up later than this
WATCH: dict[str, Path] = {}  # "log": the session's freeze_watch lines
if HERE not in sys.path:
    sys.path.insert(0, HERE)

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def daemon():
    from kvbridge import start_bootstrap

    with start_bootstrap(lease_ttl=5.0) as (url, token):
        yield url, token


@pytest.fixture(scope="session", autouse=True)
def freeze_watch(tmp_path_factory):
    """``scripts/freeze_watch.py`` for the whole session, in a process of its own: did the host
    stand still (every process, this watcher too) when a worker stood still? A failed test's
    report carries what it saw over the test's span; the session's summary lists every gap."""
    log = tmp_path_factory.getbasetemp() / "freeze_watch.log"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "freeze_watch.py"), "--gap", str(WATCH_GAP_S),
                             "--out", str(log)], stdin=subprocess.PIPE)
    WATCH["log"] = log
    try:
        yield log
    finally:
        proc.stdin.close()  # its EOF: it ends
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _watcher():
    """scripts/freeze_watch.py as a module (its ``gaps`` reads the lines back)."""
    mod = sys.modules.get("freeze_watch")
    if mod is None:
        spec = importlib.util.spec_from_file_location("freeze_watch", ROOT / "scripts" / "freeze_watch.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["freeze_watch"] = mod
    return mod


def pytest_terminal_summary(terminalreporter):
    log = WATCH.get("log")
    if log is not None and log.exists():
        gaps = _watcher().gaps(log)
        terminalreporter.write_sep("-", f"freeze_watch: {len(gaps)} wake-ups later than {WATCH_GAP_S:g} s")
        for line in gaps:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that ran real servers (``vllm serve``, the proxy) gets each one's log tail in
    its report: a 500 from the proxy says nothing of why prefill or decode failed the room. Any
    failed phase gets what ``freeze_watch`` saw meanwhile."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    gaps = _watcher().gaps(WATCH["log"], call.start, call.stop) if "log" in WATCH else []
    report.sections.append((f"freeze_watch over this {report.when} ({call.stop - call.start:.0f} s)",
                            "\n".join(gaps) or f"every wake-up within {WATCH_GAP_S:g} s: the host did not stand still that long"))
    if report.when != "call":
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
