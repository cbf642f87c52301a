#!/bin/bash
# Issue 33's fixed cost, before against after on one device host in one call (run as run_gpu.sh's EXTRA,
# so the wheels are on PYTHONPATH and the libraries found). BEFORE: an older tree's kvbridge and scripts,
# untracked beside this one (the device tool carries untracked files):
#   rm -rf _before && mkdir _before && git archive <rev> kvbridge scripts | tar -x -C _before
# then, carrying .whl and .debs:
#   SKIP_BENCH=1 PYTEST_ARGS="tests/transfer/test_layerwise_posts.py" EXTRA="bash scripts/device/issue33_ab.sh" \
#     bash scripts/device/run_gpu.sh
# Steps (each bounded; STEPS picks some: control gpu profile):
#   control  scripts/control_bench.py --pages 2 at CP 1 and 2 (the CPU control path, local engine, one
#            process), before and after in turn, three rounds
#   gpu      scripts/gpu_bench.py, 8K contiguous, Mooncake NVLink and IPC, with the trace's hop table:
#            after, before, after (GB/s, p50, raw p50 per row; hop tables under $OUT/{after,before}*)
#   profile  the same rooms, after, each rank's threads under cProfile (KVBRIDGE_PROFILE_DIR=$OUT/prof)
#   stagedprof  32K random staged rooms on Mooncake NVLink (64 MiB slots) under cProfile ($OUT/sprof)
#   layerwise   scripts/layerwise_gpu_bench.py, 1K/8K/32K, CP 1 and 2, IPC engine
#   layout      staged rooms (Mooncake NVLink, random, 64 MiB slots) and scripts/staged_layout_bench.py
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS:-control gpu profile}
. "$(dirname "$0")/_ab_common.sh"  # site, B, quiet, tree
GPU_ARGS=${GPU_ARGS:---groups mooncake-nvlink ipc --alloc contiguous --tokens 8192 --reps 10}
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  case $step in
  control)
    for round in 1 2 3; do for which in before after; do for cp in 1 2; do
      t=$(tree $which)
      echo "$which cp$cp round $round: $(PYTHONPATH=$site:$t timeout 90 python3 $t/scripts/control_bench.py --cp $cp --pages 2 --rooms 300 2>&1 | tail -1)"
    done; done; done ;;
  gpu)
    for which in after before after2; do
      t=$(tree ${which%2}); mkdir -p $OUT/$which
      echo "-- gpu_bench $which ($t)"
      PYTHONPATH=$site:$t timeout 170 python3 $t/scripts/gpu_bench.py $GPU_ARGS --trace-tokens 8192 --trace-reps 10 \
        --json $OUT/$which/gpu_bench.json --trace-out $OUT/$which 2>&1 | grep -v "^[IWE][0-9]\{4\} "
    done ;;
  profile)
    mkdir -p $OUT/prof
    KVBRIDGE_PROFILE_DIR=$OUT/prof PYTHONPATH=$site:$PWD timeout 170 python3 scripts/gpu_bench.py $GPU_ARGS \
      --json $OUT/prof/gpu_bench.json 2>&1 | grep -v "^[IWE][0-9]\{4\} " | tail -30
    for f in $OUT/prof/prefill-*.txt $OUT/prof/decode-*.txt; do echo "-- $f"; sed -n '/kvbridge.(transfer/,$p' $f | head -75; done ;;
  stagedprof)
    mkdir -p $OUT/sprof
    KVBRIDGE_PROFILE_DIR=$OUT/sprof PYTHONPATH=$site:$PWD timeout 200 python3 scripts/gpu_bench.py --groups mooncake-nvlink \
      --alloc random --tokens 32768 --reps 3 --staged-slot-mib 64 --json $OUT/sprof/gpu_bench.json 2>&1 \
      | grep -v "^[IWE][0-9]\{4\} " | tail -30
    for f in $OUT/sprof/*.txt; do echo "-- $f"; head -40 $f; done ;;
  layerwise)
    PYTHONPATH=$site:$PWD timeout 240 python3 scripts/layerwise_gpu_bench.py --tokens 1024 8192 32768 --cp 1 2 --rooms 6 \
      --json $OUT/layerwise.json 2>&1 | grep -v "^[IWE][0-9]\{4\} " ;;
  layout)
    PYTHONPATH=$site:$PWD timeout 240 python3 scripts/gpu_bench.py --groups mooncake-nvlink --alloc random \
      --tokens 8192 32768 131072 --reps 3 --staged-slot-mib 64 --json $OUT/staged.json 2>&1 | grep -v "^[IWE][0-9]\{4\} "
    PYTHONPATH=$site:$PWD timeout 150 python3 scripts/staged_layout_bench.py --tokens 8192 32768 131072 --reps 5 \
      --slot-mib 64 --json $OUT/layout.json 2>&1 | grep -v "^[IWE][0-9]\{4\} " ;;
  esac
done
echo "== end @$(date +%T)"
