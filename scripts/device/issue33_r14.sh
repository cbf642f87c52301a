#!/bin/bash
# Issue 33, round 14: the fixed cost's hops on the GPU (run as run_gpu.sh's EXTRA, so the wheels are on
# PYTHONPATH and the libraries found; carry .whl, .debs and, for "before" rows, _before):
#   SKIP_TEST=1 SKIP_BENCH=1 STEPS="..." EXTRA="bash scripts/device/issue33_r14.sh" bash scripts/device/run_gpu.sh
# The round's before/after call (docs/performance.md "Issue 33, round 14"; about 8 minutes on one H100):
#   rm -rf _before && mkdir _before && git archive 40b14e4 kvbridge scripts | tar -x -C _before
#   cp scripts/layerwise_gpu_bench.py _before/scripts/   # (a script imports kvbridge from its own tree)
#   SKIP_BENCH=1 PYTEST_ARGS="tests/transfer/test_gpu.py tests/transfer/test_ipc.py tests/transfer/test_layerwise_posts.py" \
#     STEPS="lw hops" TREES="after before after2" EXTRA="bash scripts/device/issue33_r14.sh" bash scripts/device/run_gpu.sh
# then pack $OUT's folders in one archive (the device tool brings back only a few files per call).
# Steps (STEPS picks; each bounded; TREES="after" or "after before after2": the trees run in turn):
#   hops      gpu_bench.py, 8K contiguous, Mooncake NVLink and IPC: p50 against the raw engine, and the
#             traced rooms' hop table (trace lines under $OUT/<tree>/)
#   lw        layerwise_gpu_bench.py $LW_ARGS (default --tokens 8192 32768 --cp 1 2 --rooms 8; IPC), untraced,
#             then traced on the tree "after" (--trace-dir: the tail's hop table; LW_TRACED=0: not)
#   profile   the 8K rooms with every rank's threads under cProfile ($OUT/prof/*.txt and .prof)
#   wake      scripts/wake_probe.py and control_rtt.py (this host's wake-up cost)
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS:-hops lw}; TREES=${TREES:-after}
LW_ARGS=${LW_ARGS:---tokens 8192 32768 --cp 1 2 --rooms 8}
. "$(dirname "$0")/_ab_common.sh"  # site, B, quiet, tree
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  for which in $TREES; do
    t=$(tree ${which%2}); o=$OUT/$which; mkdir -p $o
    echo "-- $step, tree $which ($t)"
    case $step in
    hops)
      PYTHONPATH=$site:$t timeout 200 python3 $t/scripts/gpu_bench.py --groups mooncake-nvlink ipc --alloc contiguous \
        --tokens 8192 --reps 10 --trace-tokens 8192 --trace-reps 20 --json $o/gpu_bench.json --trace-out $o 2>&1 | quiet ;;
    lw)
      PYTHONPATH=$site:$t timeout 200 python3 $t/scripts/layerwise_gpu_bench.py $LW_ARGS \
        --json $o/layerwise.json 2>&1 | quiet | grep -v '^{'
      if [ "$which" = after ] && [ "${LW_TRACED:-1}" = 1 ]; then
        PYTHONPATH=$site:$t timeout 200 python3 $t/scripts/layerwise_gpu_bench.py $LW_ARGS \
          --trace-dir $o/lwtrace --json $o/layerwise-traced.json 2>&1 | quiet | grep -v '^{'
      fi ;;
    profile)
      mkdir -p $o/prof
      KVBRIDGE_PROFILE_DIR=$o/prof PYTHONPATH=$site:$t timeout 170 python3 $t/scripts/gpu_bench.py \
        --groups mooncake-nvlink ipc --alloc contiguous --tokens 8192 --reps 20 --json $o/prof/gpu_bench.json 2>&1 \
        | quiet | tail -12 ;;
    wake)
      python3 scripts/wake_probe.py --rounds 300 --idle-ms 0 1 5 50 --spin-us 0 500
      PYTHONPATH=$site:$t python3 $t/scripts/control_rtt.py --rounds 500 --idle-ms 5 ;;
    esac
  done
done
echo "== end @$(date +%T)"
