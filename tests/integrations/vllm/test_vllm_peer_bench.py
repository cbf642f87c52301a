"""scripts/vllm_peer_bench.py --quick: vLLM's NixlConnector and kvbridge's connector (on
Mooncake, and on its NIXL engine: six vLLM processes at once on CI's two cores; vLLM's
MooncakeConnector row runs without ``--connectors``), each through vLLM's Scheduler and KVConnectorFactory in processes of
their own, one scattered-block room of each per model (GQA and MLA: on an AMX host vLLM's own
connectors refused MLA's block 16 until the bench asked for the CPU_MLA backend); every room must
succeed byte for byte and every connector must produce its row. Times are printed, never asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "vllm_peer_bench.py"
MODELS = ("gqa", "mla")


@pytest.mark.timeout(900)
def test_peer_bench_quick(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_peer_bench.py"), "--quick", "--models", ",".join(MODELS),
                           "--connectors", "nixl,kvbridge,kvbridge-nixl", "--json", str(out), "--logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, env=env, timeout=870)  # fmt: skip
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    # a peer that cannot run here is named with its reason; here all three run (nixl is pinned in .venv-vllm)
    assert result["not_run"] == {}, result["not_run"]
    rows = {(r["model"], r["connector"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in MODELS for c in ("nixl", "kvbridge", "kvbridge-nixl")}
    for r in rows.values():
        assert r["others_paused"] is True, r  # the other connectors' processes stopped while one is timed
        assert r["succeeded"] == r["rooms"] == r["bytes_ok"] >= 1, r
        assert r["failed"] == 0 and r["prefill_freed"] == r["rooms"], r
        assert r["same_blocks"] == r["rooms"], r  # every connector moved the same scattered block ids
    for m in MODELS:
        for kvb in (rows[(m, "kvbridge")], rows[(m, "kvbridge-nixl")]):  # each against each of vLLM's
            assert kvb["gb_s_x_nixl"] is not None, kvb


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_paused_stops_the_other_connectors_processes_and_resumes_them(monkeypatch):
    """While one connector's decode is timed the others' processes are stopped (state T) and run
    again after, also when the timed call raises; a child that already exited is left alone."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling _child, as when run as a script
    spec = importlib.util.spec_from_file_location("vllm_peer_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    try:
        children = [SimpleNamespace(proc=p) for p in (*procs, gone)]
        with bench.paused(children):
            assert [_proc_state(p.pid) for p in procs] == ["T", "T"]
        assert all(_proc_state(p.pid) in "SR" for p in procs)
        try:
            with bench.paused(children):
                raise RuntimeError("the timed call failed")
        except RuntimeError:
            pass
        assert all(_proc_state(p.pid) in "SR" for p in procs)
        assert bench.paused([]).pids == []
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("vllm_peer_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_same_block_ids_needs_every_id_of_every_connector_seen(monkeypatch):
    """A room counts as the same blocks only when every connector's decode and prefill ids name all
    the room's pages and equal the first connector's: ids not seen (empty, short, a room that
    failed first) never count as the same."""
    bench = _bench(monkeypatch)
    a = [5, 9, 2]
    assert bench.same_block_ids([(a, a), (list(a), list(a)), (list(a), list(a))], 3)
    assert not bench.same_block_ids([(a, a), ([5, 2, 9], a)], 3)  # one connector's decode ids differ
    assert not bench.same_block_ids([(a, a), (a, [9, 5, 2])], 3)  # or its prefill's
    assert not bench.same_block_ids([([], []), ([], []), ([], [])], 3)
    assert not bench.same_block_ids([(a[:2], a[:2]), (a[:2], a[:2])], 3)
    assert not bench.same_block_ids([(None, None), (None, None)], 3)
    assert not bench.same_block_ids([], 3)


@pytest.mark.parametrize("noted", [True, False])
def test_decode_names_the_blocks_its_room_held_however_late_it_polls(monkeypatch, noted):
    """A decode room may be allocated, loaded and freed before the command's thread polls once (a
    loaded host). Its ids are read in the engine's step, right after schedule(), so decode still
    names and checks them; ids never seen fail the room instead of passing an empty check."""
    bench = _bench(monkeypatch)
    ids, checked = [41, 7, 63, 2, 30], []
    requests: dict[str, list[int]] = {}
    kvm = SimpleNamespace(get_block_ids=lambda req_id: (list(requests.get(req_id, [])),))
    eng = SimpleNamespace(lock=threading.Lock(), scheduler=SimpleNamespace(requests=requests, kv_cache_manager=kvm),
                          block_ids={}, recved={}, failed=set(), invalid=set(), outputs={},
                          idle=lambda timeout: True, shuffle=lambda seed: None, room_stats=lambda req_id: {},
                          add=lambda req_id, prompt, params, max_tokens: None,
                          check=lambda blocks, seed: checked.append(list(blocks)) or 0)

    def wait(cond, timeout):  # the whole room runs, step by step, before the poll's first look
        if "r" not in eng.recved:
            requests["r"] = ids  # schedule(): the room's blocks allocated
            if noted:
                bench.Engine.note_block_ids(eng, {})  # what step() does after each schedule()
            eng.recved["r"] = time.perf_counter()  # the load finished
            del requests["r"]  # update_from_output(): the request finished and its blocks freed
            eng.outputs["r"] = SimpleNamespace(finish_reason="length")
        return cond()

    eng.wait = wait
    d = bench.Engine.decode(eng, {"req_id": "r", "prompt": [3] * 64, "params": {}, "seed": 1, "pages": 4})
    if noted:
        assert d["ok"] and d["wrong"] == 0 and d["blocks"] == ids[:4] and checked == [ids[:4]], d
    else:
        assert not d["ok"] and d["wrong"] == -1 and checked == [], d


@pytest.mark.parametrize("staging", ["always", "never", "auto"])
def test_kvbridge_staging_option_reaches_the_connector_config(monkeypatch, tmp_path, staging):
    """--kvbridge-staging goes to run(), into kvbridge's kv_connector_extra_config (both roles,
    both of kvbridge's rows; vLLM's own connectors' configs untouched), and the connector's
    settings read it as its staging mode."""
    import _vllm_config as C

    from kvbridge.integrations.vllm.settings import read_settings

    bench = _bench(monkeypatch)
    seen = {}
    monkeypatch.setattr(bench, "run", lambda *a, **kw: (seen.update(kw), ([], {}))[1])
    bench.main(["--connectors", "kvbridge", "--kvbridge-staging", staging])
    assert seen["kvbridge_staging"] == staging
    cfg = {"kvbridge_url": "http://127.0.0.1:1", "kvbridge_token": "t", "tag": "x", "kvbridge_staging": staging,
           "mooncake_bootstrap": "127.0.0.1:2"}
    for c in ("kvbridge", "kvbridge-nixl"):
        for role in ("kv_producer", "kv_consumer"):
            extra = json.loads(bench.transfer_json(c, role, cfg))["kv_connector_extra_config"]
            assert extra["staging"] == staging
            monkeypatch.delenv("KVBRIDGE_STAGING", raising=False)
            vc = C.vllm_config(C.model_dir(tmp_path, "gqa"), role, extra)
            assert read_settings(vc).staging == staging
    assert "staging" not in json.loads(bench.transfer_json("mooncake", "kv_producer", cfg)).get(
        "kv_connector_extra_config", {})
