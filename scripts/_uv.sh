# Sourced by scripts/setup.sh, setup_sglang.sh and setup_vllm.sh: installs go through uv
# (`uv pip install`), with pip's own view of where packages lie on this host.
#
# uv installs in parallel and links unpacked wheels from its cache instead of copying them.
# Measured on the 2-core machine under a load of about 3: the pinned SGLang set (6 GB, torch
# 2.14.1 with its CUDA libraries) in 49 s from an empty cache without bytecode, where pip took
# 455 s in a fresh-clone CI run. Bytecode is compiled at install (--compile-bytecode), as pip
# does: this host runs with PYTHONDONTWRITEBYTECODE=1, so a venv without .pyc files compiles
# every module it imports in every process (a fresh-clone run without it: the main suite about
# a third slower, every test process compiling torch anew).
#
# uv reads none of pip's configuration, and this host has pip configured (local wheels such as
# the CPU build of torch as find-links, local mirrors as extra indexes, a constraint file
# capping torch). So `uv_pip` asks the venv's pip for its configuration (`pip config list`,
# environment included) and hands uv the same find-links, index URLs and constraint files, with
# pip's choice among indexes (the best version wherever it lies: --index-strategy
# unsafe-best-match). Without a configuration uv uses PyPI, as pip does.
#
#   uv_pip VENV ARGS...   # uv pip install --python VENV/bin/python ARGS...
UV_VERSION=0.13.8

# uv itself: the one in UV, else in the main venv (scripts/setup.sh installs it there), else put
# into VENV by its pip (an engine venv built without the main one).
uv_find() {
  local venv=$1 main=${MAIN_VENV:-.venv}
  if [ -n "${UV:-}" ] && [ -x "$UV" ]; then echo "$UV"; return; fi
  for candidate in "$main/bin/uv" "$venv/bin/uv"; do
    if [ -x "$candidate" ] && [ "$("$candidate" --version | awk '{print $2}')" = "$UV_VERSION" ]; then
      echo "$candidate"; return
    fi
  done
  "$venv/bin/python" -m pip -q --disable-pip-version-check install "uv==$UV_VERSION" >&2
  echo "$venv/bin/uv"
}

uv_pip() {
  local venv=$1 uv line key value v
  shift
  uv=$(uv_find "$venv")
  local config=()
  while IFS= read -r line; do  # scope.key='value' (value: one or more, space-separated)
    key=${line#*.}; key=${key%%=*}
    value=${line#*=}; value=${value#\'}; value=${value%\'}
    case $key in
      find-links) for v in $value; do config+=(--find-links "$v"); done ;;
      index-url) config+=(--index-url "$value") ;;
      extra-index-url) for v in $value; do config+=(--extra-index-url "$v"); done ;;
      constraint) for v in $value; do config+=(--constraint "$v"); done ;;
    esac
  done < <("$venv/bin/python" -m pip config list 2>/dev/null)
  "$uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" --index-strategy unsafe-best-match \
    "${config[@]}" "$@"
}
