#!/bin/bash
# Issue 33, round 15: the aux row in the report (DecodeConfig.aux_inline, wire 14) against the aux row
# written, on the GPU, in ONE tree (the flag picks; no before tree needed). Run as run_gpu.sh's EXTRA
# (carry .whl and .debs):
#   SKIP_TEST=1 SKIP_BENCH=1 STEPS="lw hops" EXTRA="bash scripts/device/issue33_r15.sh" bash scripts/device/run_gpu.sh
# then pack $OUT's folders in one archive (the device tool brings back only a few files per call).
# Written in round 15, when no device was lent. Round 17 ran STEPS="ctl lw" with ROUNDS=1 on an H100 host
# (docs/performance.md "Issue 33, round 17"); the hops step has not run yet.
# Steps (STEPS picks; each bounded; ROUNDS: how many inline/written pairs, alternating):
#   lw     layerwise_gpu_bench.py $LW_ARGS (default --tokens 8192 32768 --cp 1 2 --rooms 8; IPC), inline then
#          written, ROUNDS times; the traced tail (--trace-dir) once of each
#   hops   gpu_bench.py, 8K contiguous, Mooncake NVLink and IPC, inline then written: p50 against the raw
#          engine, the traced rooms' trace lines, and scripts/trace_ranks.py's rank-by-rank table of both
#   ctl    no GPU: scripts/control_bench.py on the device host's 16 cores (issue 33's CP 2 goal is set on
#          that host), ROUNDS rounds of 4+1 and 61+1 layers, CP 1 and 2, decode asking last, first, and
#          the layer-wise tail (--aux-last), 300 rooms each
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS-lw hops}; ROUNDS=${ROUNDS:-2}
LW_ARGS=${LW_ARGS:---tokens 8192 32768 --cp 1 2 --rooms 8}
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  if [ $step = ctl ]; then
    nproc; uptime
    for round in $(seq "$ROUNDS"); do
      for L in 4 61; do for cp in 1 2; do for o in "" --ask-first --aux-last; do
        PYTHONPATH=$site:$PWD timeout 60 python3 scripts/control_bench.py --cp $cp --pages 2 --rooms 300 --layers $L $o \
          2>&1 | quiet | tail -1
      done; done; done
    done
    continue
  fi
  for round in $(seq "$ROUNDS"); do
    for mode in inline written; do
      flag=$([ $mode = written ] && echo --aux-written); o=$OUT/$mode$round; mkdir -p $o
      echo "-- $step, aux row $mode, round $round"
      case $step in
      lw)
        PYTHONPATH=$site:$PWD timeout 200 python3 scripts/layerwise_gpu_bench.py $LW_ARGS $flag \
          --json $o/layerwise.json 2>&1 | quiet | grep -v '^{'
        if [ "$round" = 1 ]; then
          PYTHONPATH=$site:$PWD timeout 200 python3 scripts/layerwise_gpu_bench.py $LW_ARGS $flag \
            --trace-dir $o/lwtrace --json $o/layerwise-traced.json 2>&1 | quiet | grep -v '^{'
        fi ;;
      hops)
        PYTHONPATH=$site:$PWD timeout 200 python3 scripts/gpu_bench.py --groups mooncake-nvlink ipc --alloc contiguous \
          --tokens 8192 --reps 10 --trace-tokens 8192 --trace-reps 20 $flag --json $o/gpu_bench.json \
          --trace-out $o 2>&1 | quiet
        ls $o/trace-*.log > /dev/null 2>&1 && python3 scripts/trace_ranks.py $o/trace-*.log ;;
      esac
    done
  done
done
echo "== end @$(date +%T)"
