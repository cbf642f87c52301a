"""Bad worker arguments end in one ``kvbridge <command>: error: ...`` line naming the
setting and exit status 2, never a traceback (issue 10, bug 6)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvbridge.errors import ConfigError
from kvbridge.worker.config import load_config, memory_total


def run_cli(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvbridge.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], command: str, field: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"kvbridge {command}: error:")]
    assert len(errors) == 1 and field in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize("command", ["prefill-worker", "decode-worker"])
def test_ops_port_in_use(command: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        proc = run_cli(command, "--ops-port", port, "--bootstrap", "http://127.0.0.1:9")
    assert_one_line_error(proc, command, "ops_port")
    # said once: the bind error is not wrapped in a copy of itself (issue 26)
    assert proc.stderr.count("cannot bind the ops channel") == 1, proc.stderr[-2000:]
    assert proc.stderr.count(port) == 1, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--pages", "1000000000000"], "pages"),  # over int32 page ids
        (["--pages", "2000000000"], "pages"),  # int32, but no host has that much memory
        (["--lease-ttl", "-1"], "lease_ttl"),
        (["--metrics-port", "70000"], "metrics_port"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv: list[str], field: str) -> None:
    assert_one_line_error(run_cli("prefill-worker", *argv), "prefill-worker", field)


def test_pool_memory_is_checked_before_allocating() -> None:
    total = memory_total()
    if total is None:
        pytest.skip("no /proc/meminfo")
    with pytest.raises(ConfigError, match="GiB") as info:
        load_config("decode", {"pages": 2**31 - 1}, {})
    assert info.value.field == "pages"
    assert load_config("decode", {"pages": 64}, {}).pages == 64


def test_the_command_line_stays_light() -> None:
    """Every command's parser is built at start-up: none may pull in torch or Mooncake (the
    bootstrap daemon would carry them for nothing)."""
    code = ("import sys; from kvbridge.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'mooncake', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
