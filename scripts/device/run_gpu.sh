#!/bin/bash
# Runs the GPU tests and scripts/gpu_bench.py on a device host (2x H200 image: Python 3.12,
# torch cu130, no package registry). Carried, not committed: .whl/ and .debs/ (both listed in
# .git/info/exclude). Prepare them on a machine with a registry, from the repository root:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl mooncake-transfer-engine-cuda13==0.3.14 pyzmq fastapi \
#       opentelemetry-api starlette uvicorn pydantic pydantic-core typing-extensions typing-inspection annotated-types
#   (cd .debs && apt-get download libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1)
#
# then run this with the device tool, carrying .whl .debs and scripts/device, e.g.
#   BENCH_ARGS="--transports nvlink tcp --tokens 8192 32768 --trace-dir $OUT/trace" bash scripts/device/run_gpu.sh
# Knobs: PYTEST_ARGS, PYTEST_TIMEOUT, BENCH_ARGS, BENCH_TIMEOUT, BENCH2_ARGS, SKIP_TEST, SKIP_BENCH, TEST_LAST.
set -u
export PYTHONUNBUFFERED=1 GLOG_minloglevel=2
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
exec > >(tee -a $OUT/run.log) 2>&1
echo "== env"; nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -5
python3 -c 'import sys,torch;print(sys.version.split()[0],torch.__version__,torch.cuda.device_count())'
python3 -c 'import zmq, msgpack, fastapi, uvicorn, httpx, pydantic' 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/debs; for f in .debs/*.deb; do dpkg -x $f /tmp/debs; done
CUDART=$(python3 -c "import glob,site,os;print(':'.join(sorted({os.path.dirname(p) for s in site.getsitepackages() for p in glob.glob(s+'/nvidia/**/libcudart.so*',recursive=True)})))")
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART:${LD_LIBRARY_PATH:-}
echo "cudart: $CUDART"
ldd /tmp/site/mooncake/engine.so | grep -i "not found"
python3 -c 'from mooncake.engine import TransferEngine; import zmq, fastapi, uvicorn, pydantic; print("imports ok")' || exit 1
run_pytest() {
  echo "== pytest: ${PYTEST_ARGS:-tests/transfer/test_gpu.py tests/transfer/test_engine.py -m gpu -v}"
  timeout ${PYTEST_TIMEOUT:-240} python3 -m pytest ${PYTEST_ARGS:-tests/transfer/test_gpu.py tests/transfer/test_engine.py -m gpu -v} -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | grep -v "^[IWE][0-9]\{4\} "
}
if [ "${SKIP_TEST:-0}" != 1 ] && [ "${TEST_LAST:-0}" != 1 ]; then run_pytest; fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench"
  timeout ${BENCH_TIMEOUT:-420} python3 scripts/gpu_bench.py --json $OUT/gpu_bench.json ${BENCH_ARGS:-} 2>&1 | grep -v "^[IWE][0-9]\{4\} " | tee $OUT/bench.log
fi
if [ -n "${BENCH2_ARGS:-}" ]; then
  echo "== bench 2: $BENCH2_ARGS"
  timeout ${BENCH2_TIMEOUT:-200} python3 scripts/gpu_bench.py --json $OUT/gpu_bench2.json $BENCH2_ARGS 2>&1 | grep -v "^[IWE][0-9]\{4\} " | tee $OUT/bench2.log
fi
if [ "${SKIP_TEST:-0}" != 1 ] && [ "${TEST_LAST:-0}" = 1 ]; then run_pytest; fi
echo "== done"
