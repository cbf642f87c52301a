#!/bin/bash
# Issue 33, round 13 (run as run_gpu.sh's EXTRA: the wheels on PYTHONPATH, the libraries found): the tree
# after against the tree before, in turn, in one call. The tree before is $BEFORE (default _before, unpacked
# beside this tree by `git archive <rev> kvbridge scripts | tar -x -C _before` and carried). STEPS picks:
#   split    decode's per-landing turn split (scripts/staged_cycle.py --split --untraced: V3.2 fp8 61+1 layers,
#            CP 2, random pages, 32K tokens, 64 MiB slots, 2 gather slots per rank / 4 on decode, every rank its
#            own process on cuda:0), runs after:mooncake before:mooncake after:mooncake before:ipc after:ipc
#            ($OUT/split.txt, $OUT/split-<run>.json)
#   fixed    the fixed cost of 8K contiguous rooms (scripts/gpu_bench.py --groups mooncake-nvlink ipc --alloc
#            contiguous --tokens 8192 --reps 10), after, before, after ($OUT/fixed.txt, fixed-<run>.json)
#   big      the staged cycle with 256 MiB slots (the GPU default), after only, Mooncake ($OUT/big.txt)
#   layout   scripts/staged_layout_bench.py at 32K with 64 and 256 MiB slots (the ceiling in the rooms' layout)
# Call:  rm -rf _before && mkdir _before && git archive <rev> kvbridge scripts | tar -x -C _before
#        SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r13.sh" bash scripts/device/run_gpu.sh
#        (carry .whl, .debs and _before)
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS:-split fixed big layout}
. "$(dirname "$0")/_ab_common.sh"  # site, B, quiet, tree
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  case $step in
  split)
    for run in after:mooncake before:mooncake after:mooncake before:ipc after:ipc; do
      which=${run%%:*}; eng=${run##*:}; t=$(tree $which); n=$((${n:-0} + 1))
      echo "-- $n $which $eng ($t) @$(date +%T)"
      (cd $t && PYTHONPATH=$site:$t timeout 150 python3 scripts/staged_cycle.py --device cuda:0 --engine $eng \
        --tokens 32768 --slot-kib 65536 --gather-slots 2 --decode-slots 4 --reps 3 --split --untraced \
        --json $OUT/split-$n-$which-$eng.json 2>&1 | quiet)
    done 2>&1 | tee $OUT/split.txt ;;
  fixed)
    for which in after before after2; do
      t=$(tree ${which%2})
      echo "-- $which ($t) @$(date +%T)"
      (cd $t && PYTHONPATH=$site:$t timeout 200 python3 scripts/gpu_bench.py --groups mooncake-nvlink ipc \
        --alloc contiguous --tokens 8192 --reps 10 --json $OUT/fixed-$which.json 2>&1 | quiet)
    done 2>&1 | tee $OUT/fixed.txt ;;
  big)
    PYTHONPATH=$site:$PWD timeout 150 python3 scripts/staged_cycle.py --device cuda:0 --engine mooncake \
      --tokens 32768 --slot-kib 262144 --gather-slots 2 --decode-slots 4 --reps 3 --split --untraced \
      --json $OUT/big.json 2>&1 | quiet | tee $OUT/big.txt ;;
  layout)
    for mib in 64 256; do
      PYTHONPATH=$site:$PWD timeout 120 python3 scripts/staged_layout_bench.py --tokens 32768 --reps 5 \
        --slot-mib $mib 2>&1 | quiet
    done | tee $OUT/layout.txt ;;
  esac
done
echo "== end @$(date +%T)"
