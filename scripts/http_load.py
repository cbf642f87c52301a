"""HTTP load through ``kvbridge vllm-proxy`` in front of a real prefill + decode ``vllm serve`` pair,
with the connector's DEFAULT settings (docs/vllm.md's quick start), optionally on a host loaded
with busy processes; reports failures, latencies and the load averages seen.

    python scripts/http_load.py --requests 500 --concurrency 8 --busy 4 --json out.json

By default it starts everything (a bootstrap daemon, prefill, decode, the proxy, all on
127.0.0.1) on a tiny random-weight Llama-shaped model built offline (the tests' model, CPU
build of vLLM); ``--model`` serves another folder, ``--url`` sends to a proxy already running
(nothing started). ``--busy N`` starts N ``nice -n 0`` Python busy loops for the run (stopped at
the end). Every process it starts is stopped on exit. Performance is measured here, never
asserted: the exit status is 0 whatever the failures (the report says them).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvbridge.chaos.ports import private_ports

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
# what the tests' servers share (tests/integrations/vllm/_vllm_serve.py): no compilation, a small KV
# cache, OpenMP threads unbound so that two servers share a small host
SERVER_ARGS = ("--max-model-len", "512", "--block-size", "32", "--served-model-name", "tiny", "--max-num-seqs", "8",
               "--enforce-eager", "-O0", "--seed", "0")  # fmt: skip
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1",
              "DO_NOT_TRACK": "1"}  # fmt: skip
BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="http_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: python scripts/http_load.py --requests 500 --busy 4 --json load.json")
    p.add_argument("--requests", type=int, default=500, help="requests to send (default: 500)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default: 8)")
    p.add_argument("--busy", type=int, default=0, help="busy-loop processes to run beside (default: 0)")
    p.add_argument("--url", default="", help="a running proxy to send to (nothing is started)")
    p.add_argument("--model", type=Path, default=None, help="a model folder to serve (default: the tiny test model)")
    p.add_argument("--extra-config", default="{}",
                   help="JSON merged into both servers' kv_connector_extra_config (default: none: the defaults)")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens of a request (default: 16)")
    p.add_argument("--max-prompt", type=int, default=300, help="longest prompt in words (default: 300)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take (default: 300)")
    p.add_argument("--workdir", type=Path, default=None, help="where logs go (default: a fresh temp folder)")
    p.add_argument("--seed", type=int, default=0, help="prompt lengths and contents (default: 0)")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = p.parse_args(argv)
    if args.requests <= 0 or args.concurrency <= 0 or args.busy < 0:
        p.error("--requests and --concurrency must be > 0, --busy >= 0")
    return args


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (``private_ports``): a server binds
    it only after its start-up, and meanwhile the kernel hands no one such a port."""
    return private_ports(1, HOST)[0]


class Procs:
    """Processes in sessions of their own (a vLLM server is a tree), stopped together."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                    start_new_session=True, cwd=self.workdir)  # fmt: skip
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)

    def tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def wait_http(url: str, proc: subprocess.Popen[bytes], name: str, procs: Procs, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{procs.tail(name)}")
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} not up within {timeout:.0f}s:\n{procs.tail(name)}")


def tiny_model(workdir: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "integrations" / "vllm"))
    from _vllm_model import LLAMA_GQA, build_model

    return build_model(workdir / "model-gqa", LLAMA_GQA)


def start_pair(args: argparse.Namespace, procs: Procs) -> str:
    """daemon, prefill, decode and the proxy (docs/vllm.md's quick start); the proxy's URL."""
    py = sys.executable
    env = {**SERVER_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VLLM_CACHE_ROOT": str(procs.workdir / "vllm-cache")}
    model = args.model or tiny_model(procs.workdir)
    dport = free_port()
    daemon = procs.start("daemon", [py, "-m", "kvbridge.cli.main", "bootstrap", "--host", HOST, "--port", str(dport)],
                         env)
    wait_http(f"http://{HOST}:{dport}/healthz", daemon, "daemon", procs, 60.0)
    extra = json.loads(args.extra_config)
    vllm = str(Path(py).parent / "vllm")
    urls = {}
    for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
        cfg = {"bootstrap_url": f"http://{HOST}:{dport}", "instance": f"{name}-0", **extra}
        if name == "decode":
            cfg["prefill_instance"] = "prefill-0"
        port = free_port()
        transfer = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
                    "kv_role": role, "kv_connector_extra_config": cfg}
        rpc = tempfile.mkdtemp(prefix="kvb-load-")
        proc = procs.start(name, [vllm, "serve", str(model), "--host", HOST, "--port", str(port), *SERVER_ARGS,
                                  "--kv-transfer-config", json.dumps(transfer)],
                           {**env, "VLLM_RPC_BASE_PATH": rpc})  # fmt: skip
        wait_http(f"http://{HOST}:{port}/health", proc, name, procs)  # decode checks prefill's contract first
        urls[name] = f"http://{HOST}:{port}"
    pport = free_port()
    proxy = procs.start("proxy", [py, "-m", "kvbridge.cli.main", "vllm-proxy", "--host", HOST, "--port", str(pport),
                                  "--prefill", urls["prefill"], "--decode", urls["decode"]], env)
    wait_http(f"http://{HOST}:{pport}/health", proxy, "proxy", procs, 60.0)
    return f"http://{HOST}:{pport}"


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def send_all(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx

    rng = random.Random(args.seed)
    bodies = []
    for i in range(args.requests):
        n = rng.randint(1, args.max_prompt)
        bodies.append({"model": "tiny", "prompt": words([rng.randint(3, 500) for _ in range(n)]),
                       "max_tokens": rng.randint(1, args.max_tokens), "temperature": 0.0, "ignore_eos": True})
    out: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(i: int, client: Any) -> None:
        start = time.monotonic()
        try:
            r = client.post(f"{url}/v1/completions", json=bodies[i], timeout=args.timeout)
            status, text = r.status_code, r.text if r.status_code != 200 else ""
        except httpx.HTTPError as exc:
            status, text = 0, f"{type(exc).__name__}: {exc}"
        with lock:
            out.append({"i": i, "status": status, "s": time.monotonic() - start, "error": text[:600]})
            if len(out) % 50 == 0:
                print(f"{len(out)}/{args.requests} done, {sum(1 for o in out if o['status'] != 200)} failed, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)

    with httpx.Client(trust_env=False, limits=httpx.Limits(max_connections=args.concurrency)) as client:
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda i: one(i, client), range(args.requests)))
    return out


def proxy_metrics(url: str) -> dict[str, float]:
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    except httpx.HTTPError:
        return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kvbridge_\S+) (\S+)$", text, re.M)}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvb-http-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Procs(workdir)
    loads: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(5.0):
            loads.append(os.getloadavg())

    report: dict[str, Any] = {"workdir": str(workdir), "cores": os.cpu_count(), "busy": args.busy,
                              "requests": args.requests, "concurrency": args.concurrency,
                              "extra_config": json.loads(args.extra_config)}  # fmt: skip
    try:
        url = args.url or start_pair(args, procs)
        for i in range(args.busy):
            procs.start(f"busy{i}", ["nice", "-n", "0", sys.executable, "-c", BUSY.format(s=4 * 3600)])
        time.sleep(10.0 if args.busy else 0.0)  # the load average climbs
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        loads.append(os.getloadavg())
        start = time.monotonic()
        results = send_all(url, args)
        report["wall_s"] = round(time.monotonic() - start, 1)
        stop.set()
        loads.append(os.getloadavg())
        lat = sorted(r["s"] for r in results if r["status"] == 200)
        failed = [r for r in results if r["status"] != 200]
        report.update({
            "ok": len(results) - len(failed), "failed": len(failed),
            "failed_by_status": {str(s): sum(1 for r in failed if r["status"] == s) for s in {r["status"] for r in failed}},
            "failures": failed[:10],
            "latency_s": {"p50": round(lat[len(lat) // 2], 3), "p99": round(lat[int(len(lat) * 0.99)], 3),
                          "max": round(lat[-1], 3)} if lat else {},
            "load_1min": {"min": min(x[0] for x in loads), "mean": round(sum(x[0] for x in loads) / len(loads), 2),
                          "max": max(x[0] for x in loads)},
            "proxy_metrics": proxy_metrics(url),
        })  # fmt: skip
    finally:
        stop.set()
        procs.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
