"""``kvbridge doctor`` against a healthy local cluster (real processes, real Mooncake over
loopback), and against each broken hop: a wrong token, a wrong cluster secret, a control
port nobody listens on, an engine session nothing answers, a contract that differs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.schemas import RankIdentity, RegisterRequest, ScratchDescriptor
from kvbridge.chaos.ports import private_ports
from kvbridge.doctor import FAIL, OK, SKIP, DoctorReport, DoctorSpec, format_table, run_doctor
from kvbridge.transfer.engine import mooncake_available, nixl_available
from kvbridge.worker.cluster import Cluster, ClusterSpec
from kvbridge.worker.resources import build_contract

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="needs the Mooncake transfer engine")

GLOG = re.compile(r"^([IWEF]\d{4} \d|WARNING: Logging before InitGoogleLogging)", re.M)  # Mooncake's glog lines
SPEC = ClusterSpec(cp=2, decode_ranks=1, layers=2, pages=32, prefill_instance="doc-p", decode_instance="doc-d")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(SPEC) as c:
        yield c


def doctor(cluster: Cluster, **kw: object) -> DoctorReport:
    spec = dict(bootstrap=cluster.bootstrap_url, prefill=SPEC.prefill_instance, decode=SPEC.decode_instance,
                token=SPEC.token, secret=SPEC.secret.encode(), timeout=2.0)
    return run_doctor(DoctorSpec(**(spec | kw)))  # type: ignore[arg-type]


def rows(report: DoctorReport, hop: str) -> list:
    return [c for c in report.checks if c.hop == hop]


def free_port() -> int:
    """A port nobody listens on: free now, and below the kernel's ephemeral range, which the kernel hands
    no process (``bind(0)``, an outbound connection) unless it asks for it by number."""
    return private_ports(1)[0]


def fake_prefill(cluster: Cluster, name: str, *, layers: int = SPEC.layers) -> BootstrapClient:
    """A prefill instance registered by hand: its control port and engine session answer nothing."""
    contract = build_contract(SPEC.preset, layers, SPEC.page_size, SPEC.draft_layers, "interleaved")
    client = BootstrapClient(cluster.bootstrap_url, token=SPEC.token)
    client.register(RegisterRequest(
        rank=RankIdentity(instance=name, role="prefill"), control_endpoint=f"tcp://127.0.0.1:{free_port()}",
        session_id=f"127.0.0.1:{free_port()}", contract=contract, scratch=ScratchDescriptor(base=1 << 30, nbytes=4096)))
    return client


def test_a_healthy_cluster_passes_every_hop(cluster: Cluster) -> None:
    report = doctor(cluster)
    assert report.ok, format_table(report)
    hops = {c.hop for c in report.checks}
    assert hops == {"bootstrap", "clock", "token", "instance", "contract", "lease", "control", "engine"}
    assert [c.status for c in rows(report, "control")] == [OK, OK]  # both prefill CP ranks
    assert [c.status for c in rows(report, "engine")] == [OK, OK, OK]  # two prefill + one decode session
    assert all("written into its scratch and read back" in c.detail for c in rows(report, "engine"))
    assert len(rows(report, "lease")) == 3 and all(c.status == OK for c in rows(report, "lease"))


def test_cli_json_and_exit_status(cluster: Cluster) -> None:
    argv = [sys.executable, "-m", "kvbridge.cli.main", "doctor", "--json", "--bootstrap", cluster.bootstrap_url,
            "--prefill", SPEC.prefill_instance, "--decode", SPEC.decode_instance, "--timeout", "2"]
    env = {"KVBRIDGE_BOOTSTRAP_TOKEN": SPEC.token, "KVBRIDGE_SECRET": SPEC.secret, "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["ok"] is True and out["failed"] == 0 and {c["hop"] for c in out["checks"]} >= {"engine", "control"}
    assert not GLOG.search(done.stderr), done.stderr[-3000:]  # Mooncake's own lines stay off doctor's output
    env["KVBRIDGE_SECRET"] = "not-the-secret"
    bad = subprocess.run(argv[:-2] + ["--timeout", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and json.loads(bad.stdout)["ok"] is False


def test_wrong_token(cluster: Cluster) -> None:
    report = doctor(cluster, token="not-the-token")
    reads, writes = rows(report, "token")
    # the daemon has a write token: reads need a token too (issue 20, finding 6), and this one is wrong
    assert reads.status == FAIL and "401" in reads.detail
    assert writes.status == FAIL and "401" in writes.detail and "KVBRIDGE_BOOTSTRAP_TOKEN" in writes.fix
    assert not report.ok and "what to fix" in format_table(report)


def test_wrong_token_with_a_read_token(start_daemon) -> None:
    d = start_daemon("--token", "w", "--read-token", "r")
    report = run_doctor(DoctorSpec(bootstrap=d.url, prefill="p", decode="d", token="nope", timeout=1.0))
    assert [c.status for c in rows(report, "token")] == [FAIL, FAIL]
    assert rows(report, "instance")[0].status == SKIP and not report.ok


def test_wrong_secret(cluster: Cluster) -> None:
    report = doctor(cluster, secret=b"not-the-secret", timeout=1.0)
    controls = rows(report, "control")
    assert [c.status for c in controls] == [FAIL, FAIL]
    assert "no Heartbeat" in controls[0].detail and "secret" in controls[0].fix
    assert all(c.status == OK for c in rows(report, "engine"))  # the engine hop does not use the secret
    no_secret = doctor(cluster, secret=None, timeout=1.0)
    assert [c.status for c in rows(no_secret, "control")] == [FAIL, FAIL]


def test_a_control_port_nobody_listens_on_and_an_engine_session_nothing_answers(cluster: Cluster) -> None:
    client = fake_prefill(cluster, "doc-ghost")
    try:
        report = doctor(cluster, prefill="doc-ghost", timeout=1.0)
    finally:
        client.close()
    (control,) = rows(report, "control")
    assert control.status == FAIL and "nobody listens" in control.detail and "doc-ghost/dp0/cp0" in control.target
    engines = {c.target: c for c in rows(report, "engine")}
    ghost = engines["doc-ghost/dp0/cp0/tp0/pp0"]
    assert ghost.status == FAIL and "nothing answers" in ghost.detail
    assert engines[f"{SPEC.decode_instance}/dp0/cp0/tp0/pp0"].status == OK
    assert rows(report, "contract")[0].status == OK and not report.ok


def test_a_contract_that_differs(cluster: Cluster) -> None:
    client = fake_prefill(cluster, "doc-other", layers=SPEC.layers + 1)
    try:
        report = doctor(cluster, prefill="doc-other", timeout=1.0, engine=False)
    finally:
        client.close()
    (contract,) = rows(report, "contract")
    assert contract.status == FAIL and "model.target_layers" in contract.detail
    assert any(d["path"] == "model.target_layers" for d in contract.data["diff"])


@pytest.mark.nixl
@pytest.mark.skipif(not nixl_available() and os.environ.get("CI") != "true", reason="NIXL not importable")
def test_a_healthy_cluster_on_nixl_passes_the_engine_hop() -> None:
    """Workers on NIXL: doctor loads each rank's NIXL metadata from its registration and writes
    and reads back a nonce in its scratch through kvbridge's NIXL engine."""
    spec = ClusterSpec(cp=1, decode_ranks=1, layers=2, pages=32, prefill_instance="doc-nixl-p",
                       decode_instance="doc-nixl-d", engine="nixl")
    with Cluster(spec) as c:
        report = run_doctor(DoctorSpec(bootstrap=c.bootstrap_url, prefill=spec.prefill_instance,
                                       decode=spec.decode_instance, token=spec.token, secret=spec.secret.encode(),
                                       timeout=5.0))
    assert report.ok, format_table(report)
    engine = rows(report, "engine")
    assert [c.status for c in engine] == [OK, OK]  # the prefill and the decode session
    assert all(c.target.startswith("doc-nixl") and "read back over NIXL" in c.detail and "nixl:" in c.detail
               for c in engine), engine


PROBE_QUIETLY = """
import logging, sys
import numpy as np
from kvbridge.bootstrap.schemas import RankView, ScratchDescriptor
from kvbridge.doctor.probes import EngineProbe
from kvbridge.transfer.engine import create_engine
level = sys.argv[1]
if level != "-":
    logging.basicConfig(level=level)
target = create_engine("mooncake")
scratch = np.zeros(4096, np.uint8)
target.register(scratch.ctypes.data, scratch.nbytes)
probe = EngineProbe()
desc = ScratchDescriptor(base=scratch.ctypes.data, nbytes=scratch.nbytes)
print(probe._write_and_read(target.session_id, desc, 5.0) or "ok")
probe.close()
target.close()
"""


@pytest.mark.parametrize("level", ["-", "DEBUG"])
def test_doctors_own_mooncake_engine_keeps_its_log_lines_off_stderr(level: str) -> None:
    """Doctor's engine (the Mooncake binding itself, not kvbridge's adapter) starts and probes with
    its glog lines captured, as kvbridge's engines do: nothing of Mooncake's on stderr unless the
    ``kvbridge.transfer.engine`` logger is at DEBUG (then they are Mooncake's own, straight through)."""
    done = subprocess.run([sys.executable, "-c", PROBE_QUIETLY, level], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout[-2000:] + done.stderr[-2000:]
    if level == "-":
        assert not GLOG.search(done.stderr), done.stderr[-3000:]
    else:
        assert GLOG.search(done.stderr), done.stderr[-3000:]  # the test sees the lines when they do come
