"""scripts/vllm_peer_bench.py --quick: vLLM's NixlConnector and kvbridge's connector (on
Mooncake, and on its NIXL engine: six vLLM processes at once on CI's two cores; vLLM's
MooncakeConnector row runs without ``--connectors``), each through vLLM's Scheduler and KVConnectorFactory in processes of
their own, one scattered-block room of each per model; every room must succeed byte for
byte and every connector must produce its row. Times are printed, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(900)
def test_peer_bench_quick(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_peer_bench.py"), "--quick", "--models", "gqa",
                           "--connectors", "nixl,kvbridge,kvbridge-nixl", "--json", str(out), "--logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, env=env, timeout=870)  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    # a peer that cannot run here is named with its reason; here all three run (nixl is pinned in .venv-vllm)
    assert result["not_run"] == {}, result["not_run"]
    rows = {(r["model"], r["connector"]): r for r in result["rows"]}
    assert set(rows) == {("gqa", c) for c in ("nixl", "kvbridge", "kvbridge-nixl")}
    for r in rows.values():
        assert r["succeeded"] == r["rooms"] == r["bytes_ok"] >= 1, r
        assert r["failed"] == 0 and r["prefill_freed"] == r["rooms"], r
        assert r["same_blocks"] == r["rooms"], r  # every connector moved the same scattered block ids
    for kvb in (rows[("gqa", "kvbridge")], rows[("gqa", "kvbridge-nixl")]):  # each against each of vLLM's
        assert kvb["gb_s_x_nixl"] is not None, kvb
