#!/usr/bin/env bash
# Creates or reuses the virtual environment and installs everything kvbridge
# needs on a CPU host: Debian packages (libibverbs1 for Mooncake, Chromium for
# the diagnostics-page test, etcd-server for the bootstrap daemon's etcd store:
# its tests start their own three-member cluster on free loopback ports), the pinned CPU build of torch first (a bare
# `torch` requirement would pull a CUDA build of several GB), then the package, through uv
# (scripts/_uv.sh).
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${KVBRIDGE_TORCH_VERSION:-2.13.0}

need_apt=()
for pkg in libibverbs1 chromium chromium-driver etcd-server; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian packages: ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    # the package enables a system etcd on 2379; kvbridge runs its own clusters: leave that one off
    if [[ " ${need_apt[*]} " == *" etcd-server "* ]] && [ -d /run/systemd/system ]; then
      systemctl disable --now etcd >/dev/null 2>&1 || true
    fi
  else
    echo "setup: missing Debian packages (${need_apt[*]}); install them as root" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# uv does the installs (scripts/_uv.sh: pip's find-links, indexes and constraint handed over);
# pip puts uv itself into the venv, where the engine venvs' scripts find it too.
. "$(dirname "$0")/_uv.sh"
"$VENV/bin/python" -m pip -q --disable-pip-version-check install "uv==$UV_VERSION"
"$VENV/bin/python" -c "import torch" 2>/dev/null || uv_pip "$VENV" "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is not None)" || {
  echo "setup: $VENV holds a CUDA build of torch; kvbridge's CPU set-up wants the CPU build $TORCH_VERSION" >&2; exit 1; }
uv_pip "$VENV" -e ".[cpu,dev]"
# NIXL (kvbridge[nixl]): the wheel and its meta package without their requirements (the meta
# package requires both CUDA wheels, and both require torch); their one runtime need, numpy,
# is installed above. The NIXL tests fail rather than skip under CI=true without it.
NIXL_VERSION=1.5.1
"$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('nixl-cu12') != '$NIXL_VERSION')" \
  2>/dev/null || uv_pip "$VENV" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
