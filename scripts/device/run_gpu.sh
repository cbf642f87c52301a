#!/bin/bash
# Runs the GPU tests and scripts/gpu_bench.py on a device host (H200 image: Python 3.12, torch cu130,
# Triton, no package registry). Carried, not committed: the engines' wheels (Mooncake's CUDA 13 wheel and
# NIXL's, each cut to what kvbridge uses by scripts/device/trim_wheel.py so both fit one call's 64 MiB),
# the control plane's wheels and their small pure dependencies (cryptography, cffi and pycparser too:
# decode's endpoint imports the ownership proof's Ed25519 at module level), and five Debian packages
# (.whl and .debs are git-ignored). Prepare them once on a machine with a registry, from the repository root:
#
#   P="python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
#   $P --platform manylinux_2_28_x86_64 -d /tmp/engine-whl mooncake-transfer-engine-cuda13==0.3.14 nixl-cu13==1.5.1
#   for w in /tmp/engine-whl/*.whl; do python3 scripts/device/trim_wheel.py $w .whl; done   # 9 + 25 MiB
#   $P --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl msgspec fastapi opentelemetry-api starlette uvicorn pydantic \
#       pydantic-core typing-extensions typing-inspection annotated-types annotated-doc
#   $P --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl prometheus-client msgpack \
#       httpx httpcore h11 anyio idna certifi sniffio click blake3
#   $P --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl cryptography cffi pycparser
#   apt-get update && (mkdir -p .debs && cd .debs && apt-get download libibverbs1 ibverbs-providers libnl-3-200 \
#       libnl-route-3-200 libnuma1)
#
# The whole issue-12 measurement in one device call (carry .whl and .debs; about 4 minutes):
#   bash scripts/device/run_gpu.sh
# which runs the GPU tests, then
#   python scripts/gpu_bench.py --ceilings --trace-tokens 8192 131072 --json $OUT/gpu_bench.json --trace-out $OUT
# (groups mooncake-nvlink, falling back to mooncake-tcp, and ipc; 8K/32K/128K tokens; contiguous and random
# allocation; one GPU: both sides on cuda:0). Issue 19's staged figures (docs/performance.md, "Staged
# transfers"; about 3 minutes):
#   PYTEST_ARGS="tests/transfer/test_staging_gpu.py tests/transfer/test_gpu.py" \
#   BENCH_ARGS="--ceilings --alloc random --tokens 8192 32768 131072" bash scripts/device/run_gpu.sh
# and the staged rooms alone (no groups; under a minute): BENCH_ARGS="--ceilings --alloc random --groups
# --slot-mib 16 64 256" SKIP_TEST=1. Staged rooms on GPU pages end to end (the staged GPU tests, then staged vs
# direct vs raw Mooncake beside the staging ceiling of the same pages; about 6 minutes):
#   PYTEST_ARGS="tests/transfer/test_gpu.py tests/transfer/test_staging_gpu.py" PYTEST_TIMEOUT=240 \
#   BENCH_ARGS="--staged-ceilings --slot-mib 64 --groups mooncake-nvlink --alloc random contiguous \
#   --tokens 1024 2048 8192 32768 131072" BENCH_TIMEOUT=300 bash scripts/device/run_gpu.sh
# NIXL (issue 27; both engines' trimmed wheels in .whl as above: the NIXL engine tests on GPU memory, the
# four NIXL staged-room GPU tests, then the NIXL group: direct, staged and raw NIXL on the same slices):
#   PYTEST_ARGS="tests/transfer/test_engine.py tests/transfer/test_gpu.py -k nixl" BENCH_ARGS="--groups nixl \
#   --alloc contiguous random --tokens 8192 32768 131072" bash scripts/device/run_gpu.sh
# NIXL_PROBE=1 first runs scripts/device/nixl_exit_probe.sh (the exit segfault's variants, docs/engines.md).
# A wheel folder of NIXL alone (WHEELS=.whl-nixl: the control plane's wheels without Mooncake's) works too.
# From a copy of the tree elsewhere, point WHEELS and DEBS at the
# carried folders. Knobs: PYTEST_ARGS, PYTEST_TIMEOUT, BENCH_ARGS, BENCH_TIMEOUT, SKIP_TEST, SKIP_BENCH, NIXL_PROBE,
# EXTRA (a command run last, in the same environment: the wheels on PYTHONPATH, the libraries found).
set -u
export PYTHONUNBUFFERED=1 GLOG_minloglevel=2
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
WHEELS=${WHEELS:-.whl}; DEBS=${DEBS:-.debs}
exec > >(tee -a $OUT/run.log) 2>&1
echo "== env"; nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5
python3 -c 'import sys,torch,triton;print(sys.version.split()[0],torch.__version__,triton.__version__,torch.cuda.device_count())'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/debs; for f in $DEBS/*.deb; do dpkg -x $f /tmp/debs; done
CUDART=$(python3 -c "import glob,site,os;print(':'.join(sorted({os.path.dirname(p) for s in site.getsitepackages() for p in glob.glob(s+'/nvidia/**/libcudart.so*',recursive=True)})))")
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART:${LD_LIBRARY_PATH:-}
# the engines carried: Mooncake's wheel, NIXL's (nixl_cu13), or both
if [ -e /tmp/site/mooncake/engine.so ]; then
  ldd /tmp/site/mooncake/engine.so | grep -i "not found"
  python3 -c 'from mooncake.engine import TransferEngine; print("mooncake ok")' || exit 1
fi
if [ -d /tmp/site/nixl_cu13 ]; then
  [ "${NIXL_PROBE:-0}" = 1 ] && bash scripts/device/nixl_exit_probe.sh
  python3 -c 'from kvbridge.transfer.engine import create_engine; create_engine("nixl").close(); print("nixl ok")'
  rc=$?; echo "nixl check exit code $rc"; [ $rc = 0 ] || [ "${NIXL_PROBE:-0}" = 1 ] || exit 1
fi
python3 -c 'import msgspec, fastapi, uvicorn, pydantic, cryptography; import kvbridge.transfer.decode.endpoint; print("imports ok")' || exit 1
if [ "${SKIP_TEST:-0}" != 1 ]; then
  echo "== pytest: ${PYTEST_ARGS:=tests/transfer/test_gpu.py tests/transfer/test_ipc.py tests/transfer/test_auto_engine.py tests/transfer/test_engine.py}"
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest ${PYTEST_ARGS} -q -rs -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | grep -v "^[IWE][0-9]\{4\} " | tail -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench: ${BENCH_ARGS:=--ceilings --trace-tokens 8192 131072}"
  timeout ${BENCH_TIMEOUT:-480} python3 scripts/gpu_bench.py --json $OUT/gpu_bench.json --trace-out $OUT $BENCH_ARGS 2>&1 | grep -v "^[IWE][0-9]\{4\} " | tee $OUT/bench.log
fi
if [ -n "${EXTRA:-}" ]; then
  echo "== extra: $EXTRA"
  bash -c "$EXTRA" 2>&1 | grep -v "^[IWE][0-9]\{4\} "
fi
echo "== done"
