#!/bin/bash
# Issue 33, round 23: staged rooms before against after on one GPU, and prefill's turns split
# (scripts/prefill_split.py). The round's calls (docs/performance.md, "Issue 33, round 23") measured
# the gather moved to the loop turn's end (73b96eb, reverted after them), then the gather's source
# proof (StagedPlan.gather_unproven) with the SlotRequest sent before the Gather. Run as run_gpu.sh's
# EXTRA (carry .whl and .debs), with the tree before beside this one:
#   rm -rf _before && mkdir _before && git archive <rev> kvbridge scripts | tar -x -C _before
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="AB_RUNS=ipc:256 AB_PAIRS=3 AB_JSON=0 SPLIT_RUNS=256:untraced \
#     bash scripts/device/issue33_r23.sh" bash scripts/device/run_gpu.sh
# STEPS (default "ab split"):
#   ab     scripts/staged_process_bench.py --no-ceiling (every rank its own process, random pages, CP 2, V3.2
#          fp8 61+1 layers, 32K, 2 gather slots per rank and 4 on decode, every room checked), untraced,
#          after then before, $AB_PAIRS times (2), for each $AB_RUNS entry (engine:slot MiB; default IPC at 64
#          and 256 MiB, Mooncake NVLink at 64), $AB_REPS rooms (5); AB_JSON=0: no --json files (a device call
#          brings back a bounded number of files)
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
      for i in $(seq ${AB_PAIRS:-2}); do for which in after before; do
        t=$(tree $which)
        json=""; [ "${AB_JSON:-1}" = 1 ] && json="--json $OUT/ab-$eng-$mib-$which-$i.json"
        echo "== ab $eng ${mib} MiB $which $i @$(date +%T)"
        PYTHONPATH=$site:$t timeout ${AB_TIMEOUT:-90} python3 $t/scripts/staged_process_bench.py --engines $eng \
          --layouts procs --tokens $T --slot-mib $mib --gather-slots 2 --decode-slots 4 --reps ${AB_REPS:-5} \
          --no-ceiling --timeout 80 $json 2>&1 | quiet | grep -E ": staged |rror"
      done; done
    done ;;
  split)
    for run in ${SPLIT_RUNS:-64:traced 64:untraced 256:untraced}; do
      mib=${run%%:*}; mode=${run##*:}; flag=""; [ $mode = untraced ] && flag=--untraced
      echo "== split ipc ${mib} MiB $mode @$(date +%T)"
      PYTHONPATH=$site:$PWD timeout ${SPLIT_TIMEOUT:-120} python3 scripts/staged_cycle.py --device cuda:0 --engine ipc \
        --tokens $T --slot-kib $((mib * 1024)) --gather-slots 2 --decode-slots 4 --reps 3 --split $flag \
        --json $OUT/split-ipc-$mib-$mode.json 2>&1 | quiet > $OUT/split-ipc-$mib-$mode.txt
      sed -n '/^[0-9]* tokens/p;/^decode.s turn per landed/,$p' $OUT/split-ipc-$mib-$mode.txt
    done ;;
  esac
done
echo "== end @$(date +%T)"
