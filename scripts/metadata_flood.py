"""What a write-token holder's registrations cost the bootstrap daemon: a daemon process with a
write token (in-memory store, default caps unless given), and new instances registered one after
another, each a decode rank with the largest ``engine_metadata`` a registration may carry
(256 Ki base64 characters), until the daemon answers 429 (its ``--max-metadata-chars`` total) or
``--registrations`` are done. The daemon's RSS is read before and after (/proc).

    .venv/bin/python scripts/metadata_flood.py [--registrations 512] [-- <extra kvbridge bootstrap flags>]

Prints a JSON summary: registrations accepted and refused (by status and error), RSS before,
after and its growth in MiB, seconds taken.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvbridge.bootstrap.schemas import ENGINE_METADATA_MAX

from kvbridge.bootstrap.contract import contract_from_preset
from kvbridge.bootstrap.schemas import RankIdentity, RegisterRequest
from kvbridge.bootstrap.topology import PoolDescriptor


def registration(contract, instance: str, port: int, metadata: str) -> dict:
    """A decode rank of a new instance with its own session, pools and the largest metadata."""
    pools, base = [], 1 << 40
    for pool in contract.pools:
        for layer in pool.layer_ids:
            pools.append(PoolDescriptor(pool=pool.name, layer_id=layer, base=base, capacity_pages=32,
                                        bytes_per_page=pool.bytes_per_page))
            base += 32 * pool.bytes_per_page
    req = RegisterRequest(rank=RankIdentity(instance=instance, role="decode"), control_endpoint="tcp://127.0.0.1:0",
                          session_id=f"127.0.0.1:{port}", pools=pools, contract=contract, engine_metadata=metadata)
    return req.model_dump(mode="json", exclude_none=True)


TOKEN = "metadata-flood-token"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_daemon(extra: list[str], workdir: Path) -> tuple[subprocess.Popen, str]:
    """``kvbridge bootstrap`` on a free loopback port with a write token; (process, url)."""
    port_file = workdir / "port"
    env = {**os.environ, "KVBRIDGE_BOOTSTRAP_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli.main", "--log-level", "ERROR", "bootstrap", "--port",
                             "0", "--port-file", str(port_file), *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(400):
        if port_file.exists() and port_file.read_text().strip():
            url = f"http://127.0.0.1:{int(port_file.read_text())}"
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0, trust_env=False).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("the daemon did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--registrations", type=int, default=512)
    ap.add_argument("extra", nargs="*", help="flags for kvbridge bootstrap (after --)")
    args = ap.parse_args()
    contract = contract_from_preset("deepseek-v3.2-fp8", num_layers=2, page_size=16, draft_layers=1)
    metadata = "A" * ENGINE_METADATA_MAX
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_daemon(args.extra, Path(tmp))
        pid, token = proc.pid, TOKEN
        before = rss_mib(pid)
        statuses: dict[str, int] = {}
        start = time.monotonic()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0,
                          trust_env=False) as h:
            for i in range(args.registrations):
                r = h.post("/v1/ranks", json=registration(contract, f"flood-{i}", 20000 + i, metadata))
                key = str(r.status_code) if r.status_code < 300 else f"{r.status_code} {r.json().get('error')}"
                statuses[key] = statuses.get(key, 0) + 1
        seconds = time.monotonic() - start
        after = rss_mib(pid)
        proc.terminate()
        proc.wait(10)
    print(json.dumps({"registrations": args.registrations, "statuses": statuses, "rss_before_mib": round(before, 1),
                      "rss_after_mib": round(after, 1), "growth_mib": round(after - before, 1),
                      "seconds": round(seconds, 1)}, indent=1))


if __name__ == "__main__":
    main()
