#!/usr/bin/env bash
# Creates or reuses the virtual environment of the SGLang integration tests
# (.venv-sglang by default; `make test` calls this once, behind a stamp).
#
# SGLang 0.5.23 is installed with --no-deps from scripts/sglang-requirements.txt,
# which pins every package (SGLang's pure-Python dependencies that its
# disaggregation layer imports, the CUDA build of torch 2.14.1 that SGLang pins,
# which imports and runs without a GPU, kvbridge's own dependencies with the
# non-CUDA Mooncake wheel, pytest). Then kvbridge goes in editable, also with
# --no-deps. No GPU kernels are installed: SGLang cannot serve here, only be
# imported and driven by the tests.
#
# On the 2-core CPU host from an empty uv cache: about 50 s under load, 6 GB on disk
# (torch and its CUDA libraries are 5.5 GB of it). Mooncake needs Debian's
# libibverbs1, which scripts/setup.sh installs.
set -euo pipefail
VENV=${SGLANG_VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3}
REQUIREMENTS=scripts/sglang-requirements.txt

# The pinned set unpacks to about 6 GB (the largest wheel about 1 GB).
. "$(dirname "$0")/_venv_space.sh"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then  # not yet installed
  need_space setup-sglang "$VENV" "${KVBRIDGE_SGLANG_NEED_GB:-8}" 2 KVBRIDGE_SGLANG_NEED_GB 6
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# through uv (scripts/_uv.sh): its cache holds the unpacked wheels and the venv links to them,
# so the cache doubles no byte on the same disk
. "$(dirname "$0")/_uv.sh"
uv_pip "$VENV" --no-deps -r "$REQUIREMENTS"
uv_pip "$VENV" --no-deps -e .
# Fail here, not in the tests, if the pinned set no longer imports.
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
             "sglang.srt.server_args", "sglang.srt.plugins", "kvbridge", "kvbridge.bootstrap.app"):
    importlib.import_module(name)
PY
