"""deploy/: manifests and units parse, and every kvbridge flag and KVBRIDGE_* variable they use
is one the command line accepts (and, for workers, resolves to a valid configuration)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from kvbridge.cli.main import build_parser
from kvbridge.worker.config import load_config, read_toml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
ENV_RE = re.compile(r"KVBRIDGE_[A-Z0-9_]+")
ROLE_OF = {"prefill-worker": "prefill", "decode-worker": "decode"}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def accepted_env(command: str) -> set[str]:
    """Variables a command reads: those its --help names, plus the global log level."""
    return set(ENV_RE.findall(subparsers()[command].format_help())) | {"KVBRIDGE_LOG_LEVEL"}


def check_command(argv: list[str], env: dict[str, str], where: str) -> None:
    """``argv`` starts at the subcommand; every flag known, every variable read, and a worker's config resolves."""
    command, rest = argv[0], argv[1:]
    parsers = subparsers()
    assert command in parsers, f"{where}: unknown command kvbridge {command}"
    parser = parsers[command]
    known = {opt for action in parser._actions for opt in action.option_strings}
    for token in rest:
        if token.startswith("--"):
            assert token.split("=", 1)[0] in known, f"{where}: kvbridge {command} has no flag {token}"
    unknown = {k for k in env if k.startswith("KVBRIDGE_")} - accepted_env(command)
    assert not unknown, f"{where}: kvbridge {command} reads no {sorted(unknown)}"
    if command in ROLE_OF:
        args = parser.parse_args(rest)
        args.config = None  # the file lives on the target host; its content is checked separately
        load_config(ROLE_OF[command], args, env)
    else:
        parser.parse_args(rest)


# ---- Kubernetes -----------------------------------------------------------------------------------
def k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_manifests_parse_and_have_the_expected_objects():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_docs()}
    assert ("Deployment", "kvbridge-bootstrap") in kinds and ("Service", "kvbridge-bootstrap") in kinds
    assert ("StatefulSet", "kvbridge-prefill") in kinds and ("StatefulSet", "kvbridge-decode") in kinds
    for name, d in k8s_docs():
        assert d.get("apiVersion") and d["metadata"].get("name"), name


def containers():
    for name, d in k8s_docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield f"{name}:{c['name']}", d, c


@pytest.mark.parametrize("where, doc, container", list(containers()), ids=lambda x: x if isinstance(x, str) else "")
def test_k8s_commands_and_env_are_accepted(where, doc, container):
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv[0] == "kvbridge", where
    env = {}
    for e in container.get("env", []):
        src = e.get("valueFrom", {})
        if "fieldRef" in src:  # the pod ordinal or the pod IP at runtime
            path = src["fieldRef"]["fieldPath"]
            env[e["name"]] = "0" if "pod-index" in path else "10.0.0.1"
        else:
            env[e["name"]] = e.get("value", "x")
    check_command(argv[1:], env, where)
    if doc["kind"] == "StatefulSet":
        ordinal = [e for e in container["env"] if "pod-index" in str(e.get("valueFrom", ""))]
        assert ordinal and ordinal[0]["name"] in ("KVBRIDGE_CP_RANK", "KVBRIDGE_TP_RANK"), where
        size = env["KVBRIDGE_CP_SIZE" if ordinal[0]["name"] == "KVBRIDGE_CP_RANK" else "KVBRIDGE_TP_SIZE"]
        assert int(size) == doc["spec"]["replicas"], f"{where}: replicas must equal the rank count"


def test_configmap_toml_is_valid_for_both_roles(tmp_path):
    cm = next(d for _, d in k8s_docs() if d["kind"] == "ConfigMap")
    path = tmp_path / "worker.toml"
    path.write_text(cm["data"]["worker.toml"])
    for role in ("prefill", "decode"):
        read_toml(path, role)
        load_config(role, {"config": str(path)}, {})


def test_example_toml_is_valid_for_both_roles():
    path = DEPLOY / "config" / "worker.toml"
    for role in ("prefill", "decode"):
        cfg = load_config(role, {"config": str(path)}, {})
        assert cfg.sources["preset"] == "toml"


# ---- systemd --------------------------------------------------------------------------------------
def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """INI with repeatable keys (systemd allows Environment= many times)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}:{lineno}: not 'Key=value' in a section"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_units_parse_and_their_commands_and_env_are_accepted(unit):
    sections = parse_unit(unit)
    assert {"Unit", "Service", "Install"} <= set(sections), unit.name
    service = sections["Service"]
    assert service.get("KillSignal") == ["SIGTERM"]
    env: dict[str, str] = {}
    for ref in service.get("EnvironmentFile", []):
        local = DEPLOY / "systemd" / Path(ref.lstrip("-")).name
        assert local.exists(), f"{unit.name}: EnvironmentFile {ref} has no example in deploy/systemd"
        env.update(read_env_file(local))
    for item in service.get("Environment", []):
        key, value = item.split("=", 1)
        env[key] = value.replace("%i", "1")
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start.replace("%i", "1"))
    assert Path(argv[0]).name == "kvbridge", unit.name
    env.pop("KVBRIDGE_CONFIG", None)  # the file lives on the target host
    check_command(argv[1:], env, unit.name)


def test_every_daemon_has_a_unit_and_a_manifest():
    commands = {shlex.split(parse_unit(u)["Service"]["ExecStart"][0])[1] for u in UNITS}
    assert commands == {"bootstrap", "prefill-worker", "decode-worker"}
    assert {c["command"][1] for _, _, c in containers()} == commands


def test_readme_warns_about_mooncake_listeners():
    text = (DEPLOY / "README.md").read_text()
    assert "bind all interfaces" in text and "no authentication" in text


# ---- monitoring -----------------------------------------------------------------------------------
SOURCES = Path(__file__).resolve().parents[1] / "kvbridge"
METRIC_RE = re.compile(r"kvbridge_(?:worker|bootstrap)_[a-z_]+")
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def family(name: str) -> str:
    """A sample or counter name without its exposition suffix (``_total``, ``_bucket`` ...)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def exported_metrics() -> set[str]:
    """Every metric family the daemon and the workers export (as written in their source)."""
    names = set()
    for module in ("bootstrap/metrics.py", "worker/metrics.py"):
        names |= {family(n) for n in METRIC_RE.findall((SOURCES / module).read_text())}
    return names


def test_grafana_dashboard_queries_only_metrics_kvbridge_exports():
    dash = json.loads((DEPLOY / "grafana" / "kvbridge.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15 and dash["uid"] == "kvbridge"
    used = {family(name) for e in exprs for name in METRIC_RE.findall(e)}
    unknown = used - exported_metrics()
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"
    # the per-phase histograms and the worker metrics are on the board
    for needed in ("kvbridge_worker_phase_seconds", "kvbridge_worker_rooms", "kvbridge_worker_room_failures",
                   "kvbridge_worker_peers", "kvbridge_worker_writes_in_flight", "kvbridge_worker_bytes"):
        assert needed in used, needed


def test_prometheus_scrapes_the_ports_the_units_and_manifests_open():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = [t for j in jobs.values() for sc in j.get("static_configs", []) for t in sc["targets"]]
    ports = {int(t.rsplit(":", 1)[1]) for t in targets}
    units = {u.name: parse_unit(u)["Service"]["ExecStart"][0] for u in UNITS}
    opened = {8998}
    for text in units.values():
        m = re.search(r"--metrics-port (\d+)%i", text)
        if m:
            opened |= {int(m.group(1) + str(rank)) for rank in (0, 1)}
    assert ports == opened, (ports, opened)
    pod_ports = {p["containerPort"] for _, _, c in containers() for p in c.get("ports", [])
                 if p["name"] in ("metrics", "http")}
    assert pod_ports == {9400, 8998}
    for _, _, c in containers():
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if c["name"] != "bootstrap":
            assert env["KVBRIDGE_METRICS_PORT"] == "9400", c["name"]
    keep = [r for r in jobs["kvbridge-k8s"]["relabel_configs"] if r.get("action") == "keep"]
    assert any("metrics" in r["regex"] for r in keep)


def test_network_policies_cover_the_workers_and_the_daemon():
    policies = [d for _, d in k8s_docs() if d["kind"] == "NetworkPolicy"]
    selected = set()
    for p in policies:
        sel = p["spec"]["podSelector"]
        selected |= set(sel.get("matchLabels", {}).values())
        for expr in sel.get("matchExpressions", []):
            selected |= set(expr["values"])
    assert {"kvbridge-prefill", "kvbridge-decode", "kvbridge-bootstrap"} <= selected


def test_readme_documents_what_kvbridge_cannot_protect_and_the_restart_paths():
    text = (DEPLOY / "README.md").read_text()
    for words in ("lease secret", "admin token", "read token", "NetworkPolicy", "KVBRIDGE_LEASE_FILE", "kvbridge doctor"):
        assert words in text, words


# ---- store mode: three replicas on etcd ----------------------------------------------------------
def store_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DEPLOY / "k8s" / "store-etcd").glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_store_mode_manifests_run_three_replicas_on_a_three_member_etcd():
    from kvbridge.bootstrap.store import parse_store_url

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in store_docs()}
    boot = docs[("Deployment", "kvbridge-bootstrap")]
    etcd = docs[("StatefulSet", "kvbridge-etcd")]
    assert boot["spec"]["replicas"] == 3 and etcd["spec"]["replicas"] == 3
    assert ("Service", "kvbridge-etcd") in docs and etcd["spec"]["serviceName"] == "kvbridge-etcd"
    (c,) = boot["spec"]["template"]["spec"]["containers"]
    argv = [*c["command"], *c["args"]]
    env = {e["name"]: e.get("value", "x") for e in c["env"]}
    check_command(argv[1:], env, "store-etcd/bootstrap-replicas.yaml")
    kind, endpoints, _ = parse_store_url(argv[argv.index("--store") + 1])
    assert kind == "etcd" and [h for h, _ in endpoints] == [f"kvbridge-etcd-{i}.kvbridge-etcd" for i in range(3)]
    (member,) = etcd["spec"]["template"]["spec"]["containers"]
    cluster = next(a for a in member["args"] if a.startswith("--initial-cluster="))
    assert cluster.count("kvbridge-etcd-") == 2 * 3  # each member's name and its peer URL
    # the same Service name as the in-memory mode's: workers need no change
    single = next(d for _, d in k8s_docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvbridge-bootstrap")
    assert single["metadata"]["labels"] == boot["metadata"]["labels"]


def test_store_mode_systemd_env_names_an_etcd_store_with_tls():
    from kvbridge.bootstrap.store import parse_store_url

    env = read_env_file(DEPLOY / "systemd" / "bootstrap-etcd.env")
    kind, endpoints, tls = parse_store_url(env["KVBRIDGE_STORE"])
    assert kind == "etcd" and len(endpoints) == 3 and tls
    assert {"KVBRIDGE_ETCD_CA_CERT", "KVBRIDGE_ETCD_CERT", "KVBRIDGE_ETCD_KEY"} <= set(env)
    member = read_env_file(DEPLOY / "systemd" / "etcd-member.env")
    assert member["ETCD_INITIAL_CLUSTER"].count("=http") == 3


def test_grafana_shows_the_store_health():
    dash = json.loads((DEPLOY / "grafana" / "kvbridge.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for needed in ("kvbridge_bootstrap_store_up", "kvbridge_bootstrap_replicas", "kvbridge_bootstrap_store_requests",
                   "kvbridge_bootstrap_store_watch_restarts"):
        assert needed in exprs, needed


def test_readme_shows_both_store_modes_and_the_failure_table():
    text = (DEPLOY / "README.md").read_text()
    for words in ("--store etcd://", "in-memory", "quorum", "store_unavailable", "store-etcd/"):
        assert words in text, words


# ---- every secret set (issue 20) -------------------------------------------------------------------
# The daemon guards writes, reads and operator actions with three tokens; the workers need the write
# token (which reads too) and the cluster secret. A production config that leaves one out leaves the
# door it guards open (an unset write token: anyone registers; no token at all: anyone reads every
# rank's sessions and addresses; no cluster secret: control messages unauthenticated).
DAEMON_SECRETS = {"KVBRIDGE_BOOTSTRAP_TOKEN", "KVBRIDGE_READ_TOKEN", "KVBRIDGE_ADMIN_TOKEN"}
WORKER_SECRETS = {"KVBRIDGE_BOOTSTRAP_TOKEN", "KVBRIDGE_SECRET"}
SECRET_OF = {"bootstrap": DAEMON_SECRETS, "prefill-worker": WORKER_SECRETS, "decode-worker": WORKER_SECRETS}


def example_secret_keys() -> set[tuple[str, str]]:
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "secret.example.yaml").read_text())
    return {(d["metadata"]["name"], key) for d in docs if d and d["kind"] == "Secret" for key in d["stringData"]}


def all_k8s_containers():
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            if d and d["kind"] in ("Deployment", "StatefulSet"):
                for c in d["spec"]["template"]["spec"]["containers"]:
                    yield f"{path.relative_to(DEPLOY)}:{c['name']}", c


def test_k8s_sets_every_secret_from_a_secret():
    keys = example_secret_keys()
    seen = set()
    for where, c in all_k8s_containers():
        argv = [*c.get("command", []), *c.get("args", [])]
        if argv[:1] != ["kvbridge"]:
            continue  # etcd itself
        need = SECRET_OF[argv[1]]
        seen.add(argv[1])
        refs = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c.get("env", [])}
        for name in need:
            ref = refs.get(name)
            assert ref, f"{where}: {name} is not set from a Secret"
            assert (ref["name"], ref["key"]) in keys, f"{where}: {name} names {ref} that secret.example.yaml lacks"
        if argv[1] != "bootstrap":  # the admin token never reaches a worker
            assert "KVBRIDGE_ADMIN_TOKEN" not in refs, where
    assert seen == set(SECRET_OF), seen


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_sets_every_secret(unit):
    service = parse_unit(unit)["Service"]
    env: dict[str, str] = {}
    for ref in service.get("EnvironmentFile", []):
        env.update(read_env_file(DEPLOY / "systemd" / Path(ref.lstrip("-")).name))
    command = shlex.split(service["ExecStart"][0].replace("%i", "1"))[1]
    for name in SECRET_OF[command]:
        assert env.get(name, "").strip(), f"{unit.name}: {name} is not set by its EnvironmentFile(s)"
    if command == "bootstrap":
        tokens = [env[n] for n in DAEMON_SECRETS]
        assert len(set(tokens)) == len(tokens), f"{unit.name}: the three tokens must differ"
    else:
        assert "KVBRIDGE_ADMIN_TOKEN" not in env, unit.name
