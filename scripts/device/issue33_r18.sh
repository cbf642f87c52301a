#!/bin/bash
# Issue 33, round 18: the fixed cost of an 8K contiguous room in both orders, on the GPU. Run as run_gpu.sh's
# EXTRA (carry .whl and .debs):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r18.sh" bash scripts/device/run_gpu.sh
# then pack $OUT's folders in one archive (the device tool brings back only a few files per call).
# Steps (STEPS picks; each bounded):
#   order  gpu_bench.py, 8K contiguous, Mooncake NVLink and IPC, decode asking last (the bench's order so far:
#          timed from decode's receiver()) and asking first (--ask-first, an engine's order: timed from the
#          prefill ranks' send()): p50 against the raw engine, the traced rooms' hop tables, and
#          scripts/trace_ranks.py's rank-by-rank table of each
#   prof   the same rooms asked first, untraced, every rank's threads under cProfile (KVBRIDGE_PROFILE_DIR)
#   ab     the same rooms, untraced, on this tree ("after") and on $BEFORE ("before": an older kvbridge with this
#          tree's bench harness copied in, so both run the same bench; see _ab_common.sh): asked first after /
#          before / after, asked last after / before, then after asked first with --aux-written (the staged row's
#          copy queued by the write that reads it) and after asked first, traced (hops and rank by rank);
#          AB_RUNS="after first|before first|..." picks the untraced runs
#   timers the rooms asked first, untraced, every process under scripts/device/send_timers (wall-clock p50 of each
#          function on the send, post and commit path: $OUT/timers/timers-<pid>.txt)
#   probe  scripts/device/aux_row_probe.py: one aux row's copy to and from the GPU, idle and with the copy engines busy
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS-order prof}
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
ARGS="--groups mooncake-nvlink ipc --alloc contiguous --tokens 8192 --reps 10"
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  case $step in
  order)
    for order in last first; do
      o=$OUT/$order; mkdir -p $o; flag=$([ $order = first ] && echo --ask-first)
      echo "-- decode asks $order"
      PYTHONPATH=$site:$PWD timeout 200 python3 scripts/gpu_bench.py $ARGS --trace-tokens 8192 --trace-reps 20 $flag \
        --json $o/gpu_bench.json --trace-out $o 2>&1 | quiet
      ls $o/trace-*.log > /dev/null 2>&1 && python3 scripts/trace_ranks.py $o/trace-*.log
    done ;;
  ab)
    i=0
    AB_RUNS=${AB_RUNS:-"after first|before first|after first|after last|before last|after first --aux-written"}
    IFS='|' read -ra runs <<< "$AB_RUNS"
    for run in "${runs[@]}"; do
      set -- $run; i=$((i + 1)); t=$(tree $1); o=$OUT/ab$i-$1-$2; mkdir -p $o
      echo "-- $run"
      PYTHONPATH=$site:$t timeout 150 python3 $t/scripts/gpu_bench.py $ARGS $([ $2 = first ] && echo --ask-first) \
        ${3:-} --json $o/gpu_bench.json 2>&1 | quiet | grep -A2 "alloc tokens      MB  slices"
    done
    o=$OUT/ab-traced; mkdir -p $o
    PYTHONPATH=$site:$PWD timeout 200 python3 scripts/gpu_bench.py $ARGS --ask-first --trace-tokens 8192 \
      --trace-reps 20 --json $o/gpu_bench.json --trace-out $o 2>&1 | quiet | grep -v "^  \|^#"
    ls $o/trace-*.log > /dev/null 2>&1 && python3 scripts/trace_ranks.py $o/trace-*.log ;;
  timers)
    mkdir -p $OUT/timers
    KVBRIDGE_TIMERS=1 KVBRIDGE_TIMERS_DIR=$OUT/timers PYTHONPATH=$site:$PWD/scripts/device/send_timers:$PWD \
      timeout 200 python3 scripts/gpu_bench.py $ARGS --ask-first 2>&1 | quiet | grep -A2 "alloc tokens      MB  slices" ;;
  probe)
    PYTHONPATH=$site:$PWD timeout 120 python3 scripts/device/aux_row_probe.py ;;
  prof)
    mkdir -p $OUT/prof
    KVBRIDGE_PROFILE_DIR=$OUT/prof PYTHONPATH=$site:$PWD timeout 200 python3 scripts/gpu_bench.py $ARGS --ask-first \
      --json $OUT/prof/gpu_bench.json 2>&1 | quiet | tail -4 ;;
  esac
done
echo "== end @$(date +%T)"
