#!/bin/bash
# Issue 33, round 24: staged rooms on one GPU, several trees in turn: round 22's final tree, round 23's (the gather's
# source proof) and this one (wire 16: a chunk's scatter list rides in its SlotRequest and is checked there, so
# neither prefill's completion turn nor decode's landing turn builds, sends or checks it). Run as run_gpu.sh's EXTRA
# (carry .whl and .debs), each older tree unpacked beside this one:
#   for r in bc64053:_r22 91e19f3:_r23; do rm -rf ${r#*:} && mkdir ${r#*:} && git archive ${r%:*} kvbridge scripts \
#     | tar -x -C ${r#*:}; done
#   PYTEST_ARGS=tests/transfer/test_staging_gpu.py EXTRA="TREES='_r22 _r23 .' AB_RUNS='ipc:256 ipc:64' AB_PAIRS=3 \
#     SPLIT_RUNS=256 bash scripts/device/issue33_r24.sh" SKIP_BENCH=1 bash scripts/device/run_gpu.sh
# STEPS (default "ab split"):
#   ab     scripts/staged_process_bench.py --no-ceiling (every rank its own process, random pages, CP 2, V3.2 fp8 61+1
#          layers, 32K, 2 gather slots per rank and 4 on decode, every room checked), untraced, each of $TREES in turn
#          ("." is this tree), $AB_PAIRS rounds, for each $AB_RUNS entry (engine:slot MiB), $AB_REPS rooms (5). One
#          line per run: the staged GB/s row. No files (a device call brings back at most eight).
#   split  scripts/staged_cycle.py --split --untraced on each of $SPLIT_TREES ($TREES; IPC, $SPLIT_RUNS slot MiB): decode's landing
#          turn and prefill's turns split; the tables printed, one JSON per tree and size kept under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
T=${TOKENS:-32768}
TREES=${TREES:-.}
path() { [ "$1" = . ] && echo "$PWD" || echo "$PWD/$1"; }
for step in ${STEPS:-ab split}; do
  case $step in
  ab)
    for run in ${AB_RUNS:-ipc:256 ipc:64}; do
      eng=${run%%:*}; mib=${run##*:}
      for i in $(seq ${AB_PAIRS:-2}); do for tr in $TREES; do
        t=$(path $tr)
        echo "== ab $eng ${mib} MiB $tr $i @$(date +%T)"
        PYTHONPATH=$site:$t timeout ${AB_TIMEOUT:-90} python3 $t/scripts/staged_process_bench.py --engines $eng \
          --layouts procs --tokens $T --slot-mib $mib --gather-slots 2 --decode-slots 4 --reps ${AB_REPS:-5} \
          --no-ceiling --timeout 80 2>&1 | quiet | grep -E ": staged |rror"
      done; done
    done ;;
  split)
    for mib in ${SPLIT_RUNS:-256}; do for tr in ${SPLIT_TREES:-$TREES}; do
      t=$(path $tr); name=$(basename $(path $tr))
      echo "== split ipc ${mib} MiB $tr @$(date +%T)"
      PYTHONPATH=$site:$t timeout ${SPLIT_TIMEOUT:-120} python3 $t/scripts/staged_cycle.py --device cuda:0 --engine ipc \
        --tokens $T --slot-kib $((mib * 1024)) --gather-slots 2 --decode-slots 4 --reps 3 --split --untraced \
        --json $OUT/split-$name-$mib.json 2>&1 | quiet > /tmp/split.txt
      sed -n '/^[0-9]* tokens/p;/^decode.s SlotRequest turn/p;/^decode.s turn per landed/,$p' /tmp/split.txt
    done; done ;;
  esac
done
echo "== end @$(date +%T)"
