"""The peer benchmark (scripts/sglang_peer_bench.py) in its quick mode: SGLang's Mooncake backend
and kvbridge's (CP 1 and 2) through SGLang's classes, in child processes over Mooncake TCP on
loopback. Checks its rows (every room of every configuration and size succeeded and was
byte-checked, a ratio against the stock backend), never its speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.disaggregation.mooncake.conn", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

SCRIPT = Path(__file__).parents[3] / "scripts" / "sglang_peer_bench.py"


def test_quick_mode_rows(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["cp"], r["tokens"]) for r in rows] == [
        (b, cp, n) for b, cp in (("mooncake", 1), ("kvbridge", 1), ("kvbridge", 2)) for n in (1024, 8192, 32768)]
    for r in rows:
        assert r["rooms"] == r["succeeded"] == r["bytes_checked"] == 2 and r["failed"] == 0, r
        assert r["gb_s"] > 0 and r["ratio"] > 0 and r["mb_per_room"] == pytest.approx(r["tokens"] * 656 * 4 / 1e6)
    assert all(r["ratio"] == 1.0 for r in rows if r["backend"] == "mooncake")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("SGLang peer benchmark: 4 layers x 656 B per token") and len(lines) == 2 + len(rows)
