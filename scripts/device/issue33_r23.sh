#!/bin/bash
# Issue 33, round 23: a staged chunk's gather moved out of the feed that gives it its gather slot (to the
# loop turn's end, PrefillEndpoint._defer_gather), before against after on one GPU, and prefill's turns
# split. Run as run_gpu.sh's EXTRA (carry .whl and .debs), with the tree before the change beside this one:
#   rm -rf _before && mkdir _before && git archive <rev> kvbridge scripts | tar -x -C _before
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r23.sh" bash scripts/device/run_gpu.sh
# STEPS (default "ab split"):
#   ab     scripts/staged_process_bench.py --no-ceiling (every rank its own process, random pages, CP 2, V3.2
#          fp8 61+1 layers, 32K, 2 gather slots per rank and 4 on decode, every room checked), untraced,
#          after / before / after / before for each $AB_RUNS entry (engine:slot MiB; default IPC at 64 and
#          256 MiB, Mooncake NVLink at 64), $AB_REPS rooms (5)
#   split  scripts/staged_cycle.py --split, after (IPC; $SPLIT_RUNS: slot MiB:traced|untraced, default "64:traced
#          64:untraced 256:untraced"): traced, the cycle table and prefill's post + write; both, decode's landing
#          turn and prefill's turns split (scripts/prefill_split.py)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. "$(dirname "$0")/_ab_common.sh"  # site, B, quiet, tree
T=${TOKENS:-32768}
for step in ${STEPS:-ab split}; do
  case $step in
  ab)
    for run in ${AB_RUNS:-ipc:64 ipc:256 mooncake-nvlink:64}; do
      eng=${run%%:*}; mib=${run##*:}
      for which in after before after2 before2; do
        t=$(tree ${which%2})
        echo "== ab $eng ${mib} MiB $which @$(date +%T)"
        PYTHONPATH=$site:$t timeout ${AB_TIMEOUT:-90} python3 $t/scripts/staged_process_bench.py --engines $eng \
          --layouts procs --tokens $T --slot-mib $mib --gather-slots 2 --decode-slots 4 --reps ${AB_REPS:-5} \
          --no-ceiling --timeout 80 --json $OUT/ab-$eng-$mib-$which.json 2>&1 | quiet | grep -E ": staged |rror"
      done
    done ;;
  split)
    for run in ${SPLIT_RUNS:-64:traced 64:untraced 256:untraced}; do
      mib=${run%%:*}; mode=${run##*:}; flag=""; [ $mode = untraced ] && flag=--untraced
      echo "== split ipc ${mib} MiB $mode @$(date +%T)"
      PYTHONPATH=$site:$PWD timeout ${SPLIT_TIMEOUT:-120} python3 scripts/staged_cycle.py --device cuda:0 --engine ipc \
        --tokens $T --slot-kib $((mib * 1024)) --gather-slots 2 --decode-slots 4 --reps 3 --split $flag \
        --json $OUT/split-ipc-$mib-$mode.json 2>&1 | quiet | tee $OUT/split-ipc-$mib-$mode.txt
    done ;;
  esac
done
echo "== end @$(date +%T)"
