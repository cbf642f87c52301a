"""The peer benchmark (scripts/sglang_peer_bench.py) in its quick mode: SGLang's Mooncake backend
and kvbridge's (CP 1 and 2, staging auto; and staged, KVBRIDGE_STAGING=always) through SGLang's classes, in child processes over Mooncake TCP on loopback. Checks its rows
(every room of every configuration and size succeeded and was byte-checked, the path each
kvbridge room took as its senders reported it, staged rows wholly staged, a ratio against the
stock backend, send() timed on its thread), never its speed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    sizes = (1024, 8192, 32768)
    configs = (("mooncake", 1, None), ("kvbridge", 1, "auto"), ("kvbridge", 2, "auto"), ("kvbridge staged", 1, "always"),
               ("kvbridge staged", 2, "always"))  # fmt: skip
    assert [(r["backend"], r["cp"], r["staging"], r["tokens"]) for r in rows] == [
        (b, cp, mode, n) for b, cp, mode in configs for n in sizes]
    for r in rows:
        assert r["rooms"] == r["succeeded"] == r["bytes_checked"] == 2 and r["failed"] == 0, r
        assert r["gb_s"] > 0 and r["ratio"] > 0 and r["mb_per_room"] == pytest.approx(r["tokens"] * 656 * 4 / 1e6)
        assert r["p50_ms"] > 0 and r["p50_ratio"] > 0 and r["base_cp"] == 1  # no stock CP 2 without --stock-cp2
        assert r["send_cpu_ms"] >= 0  # each room's send() timed on its calling thread, every rank's
        if r["backend"] == "mooncake":  # the stock sender reports no path
            assert r["ratio"] == r["p50_ratio"] == 1.0 and r["paths"] == {"-": 2} and r["staged_share"] is None
        elif r["staging"] == "always":  # every byte of every room through decode's staging area
            assert r["paths"] == {"staged": 2} and r["staged_share"] == 1.0, r
        else:  # auto: the path the senders chose, read back; Mooncake TCP stages from 64 slices a target
            # (registry.TCP_PAGE_SIZED): 1K at 4 layers is 64 at CP 1 (staged), 32 a rank at CP 2 (direct)
            want = "direct" if (r["tokens"], r["cp"]) == (1024, 2) else "staged"
            assert r["paths"] == {want: 2} and r["staged_share"] == (1.0 if want == "staged" else 0.0), r
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("SGLang peer benchmark: 4 layers x 656 B per token") and len(lines) == 2 + len(rows)
    assert [line.split()[3:5] for line in lines[-6:]] == [["always", "staged"]] * 6, lines[-6:]


def test_rank_processes_put_each_prefill_cp_rank_in_its_own_child(tmp_path):
    """--rank-processes: a prefill child per CP rank (a log for each), and
    every room of CP 1 and CP 2 still moves whole and byte-checked (1K, auto: both ranks' bytes).
    --stock-cp2: the stock backend at CP 2 too (the bench refuses to start if either stock rank would
    not send its own pages), and kvbridge's CP 2 row is set against it, its CP 1 row against stock CP 1."""
    out, logs = tmp_path / "rows.json", tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--configs", "auto", "--sizes", "1024", "--stock-cp2",
                           "--rank-processes", "--json", str(out), "--logs", str(logs)], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in logs.glob("prefill*.log")} == {"prefill-cp0.log", "prefill-cp1.log"}
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["cp"]) for r in rows] == [("mooncake", 1), ("mooncake", 2), ("kvbridge", 1),
                                                       ("kvbridge", 2)]  # fmt: skip
    for r in rows:
        assert r["rooms"] == r["succeeded"] == r["bytes_checked"] == 2 and r["failed"] == 0, r
        assert len(r["latencies_ms"]) == 2 and r["base_cp"] == r["cp"], r
    stock = {r["cp"]: r for r in rows if r["backend"] == "mooncake"}
    for r in rows:
        assert r["p50_ratio"] == pytest.approx(r["p50_ms"] / stock[r["cp"]]["p50_ms"]), r
    assert [line.split()[-2] for line in proc.stdout.splitlines()[-4:]] == ["1", "2", "1", "2"]  # the vs column


def test_page_pattern_is_the_formula(monkeypatch):
    """The byte check is only as strong as the pattern: page p of layer l holds (p*31 + l*7 + j) % 251
    at offset j, so pages and layers differ; the bench builds it by gathering window rows."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling modules, as when run as a script
    spec = importlib.util.spec_from_file_location("sglang_peer_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    pages, j = np.array([1, 9, 250, 251, 4000]), np.arange(64 * 656)
    for layer in (0, 3, 60):
        want = ((pages.reshape(-1, 1) * 31 + layer * 7 + j) % 251).astype(np.uint8)
        assert np.array_equal(bench.pattern(pages, layer), want)
    assert not np.array_equal(bench.pattern([1], 0), bench.pattern([2], 0))
    assert not np.array_equal(bench.pattern([1], 0), bench.pattern([1], 1))
