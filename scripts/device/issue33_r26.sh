#!/bin/bash
# Issue 33, round 26: where an 8K staged room's time goes on the GPU (one chunk per prefill rank at the default
# 256 MiB slots, so no chunk overlaps another: every host step is on the room's path), beside 32K. Run as
# run_gpu.sh's EXTRA (carry .whl and .debs):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r26.sh" bash scripts/device/run_gpu.sh
# STEPS (default "cycle split ctl"):
#   cycle  scripts/staged_cycle.py --device cuda:0 --engine ipc --tokens T --slot-kib 262144 --gather-slots 2
#          --decode-slots 4 --reps $CYCLE_REPS (5), traced, for each T of $CYCLE_TOKENS (8192 32768): every rank its own
#          process, random pages, CP 2, V3.2 fp8 61+1 layers, every room checked; the chunk's cycle and each room's
#          steps after decode's request; JSON under $OUT. Round 27: for each G of $GRANTED (0), G of the $DECODE_SLOTS
#          (4) decode slots kept for grants sent with a room's request (--granted-slots G: each prefill rank's first
#          chunk written without a SlotGrant), e.g. GRANTED="0 2" for the room before and after.
#   split  the same at $SPLIT_TOKENS (8192) with --split --untraced: prefill's and decode's turns, timed in parts
#          (round 28: for each G of $GRANTED, and prefill's request turn too).
#   goal   as issue33_r25.sh's goal (the staged rooms beside the staging ceiling in three layouts), at $GOAL_TOKENS;
#          round 28: for each G of $GRANTED, --granted-slots G of the $DECODE_SLOTS, the ceiling with the first G only
#          (none with GOAL_NO_CEILING=1).
#   load   round 29: the goal's rooms (procs layout, $LOAD_ENGINES, default ipc) with --rooms-in-flight K for each K of
#          $LOAD_K (4 8): beside the rooms one at a time, K rooms at once, staged and direct, each verified, with what
#          each rank's threads were busy with meanwhile (round 30); the
#          ceiling once (none with GOAL_NO_CEILING=1); JSON under $OUT.
#   ctl    the CPU control path on this host's cores (no GPU): scripts/control_bench.py --cp {1,2} --pages 2 --rooms 300
#          --layers 4 --ask-first --poller 200, then kvbridge bench --tokens 128 --cp 1,2 --layers 4 --reps 40 --ask-first
#          --alloc contiguous --engine mooncake --no-staged (every rank its own process, Mooncake TCP on loopback).
# Each tree of $TREES (".") runs every step in turn (an older tree unpacked beside this one, as _ab_common.sh says).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
for tr in ${TREES:-.}; do
  t=$([ "$tr" = . ] && echo "$PWD" || echo "$PWD/$tr"); tag=$(basename $tr | tr -d .); tag=${tag:-this}
  for step in ${STEPS:-cycle split ctl}; do
    case $step in
    cycle)
      for n in ${CYCLE_TOKENS:-8192 32768}; do for g in ${GRANTED:-0}; do
        echo "== cycle $tr $n granted $g @$(date +%T)"
        PYTHONPATH=$site:$t timeout ${CYCLE_TIMEOUT:-150} python3 $t/scripts/staged_cycle.py --device cuda:0 --engine ipc \
          --tokens $n --slot-kib 262144 --gather-slots 2 --decode-slots ${DECODE_SLOTS:-4} --reps ${CYCLE_REPS:-5} \
          $([ "$g" = 0 ] || echo --granted-slots $g) --json $OUT/cycle-$tag-$n-g$g.json 2>&1 | quiet | grep -v "^trace logs"
      done; done ;;
    split)
      for n in ${SPLIT_TOKENS:-8192}; do for g in ${GRANTED:-0}; do
        echo "== split $tr $n granted $g @$(date +%T)"
        PYTHONPATH=$site:$t timeout ${SPLIT_TIMEOUT:-150} python3 $t/scripts/staged_cycle.py --device cuda:0 --engine ipc \
          --tokens $n --slot-kib 262144 --gather-slots 2 --decode-slots ${DECODE_SLOTS:-4} --reps ${CYCLE_REPS:-5} \
          $([ "$g" = 0 ] || echo --granted-slots $g) --split --untraced --json $OUT/split-$tag-$n-g$g.json 2>&1 \
          | quiet | grep -v "^trace logs"
      done; done ;;
    ctl)
      for cp in 1 2; do
        echo "== ctl $tr cp $cp @$(date +%T)"
        PYTHONPATH=$site:$t timeout 120 python3 $t/scripts/control_bench.py --cp $cp --pages 2 --rooms 300 --layers 4 \
          --ask-first --poller 200 2>&1 | quiet | tail -2
      done
      echo "== kb $tr @$(date +%T)"
      (cd $t && PYTHONPATH=$site:$t timeout 150 python3 -m kvbridge.cli.main bench --tokens 128 --cp 1,2 --layers 4 \
        --reps 40 --ask-first --alloc contiguous --engine mooncake --no-staged 2>&1 | quiet | tail -8) ;;
    goal)
      c=${GOAL_NO_CEILING:+--no-ceiling}; for g in ${GRANTED:-0}; do
        echo "== goal $tr: ${GOAL_TOKENS:-8192 32768} granted $g @$(date +%T)"
        PYTHONPATH=$site:$t timeout ${GOAL_TIMEOUT:-300} python3 $t/scripts/staged_process_bench.py --engines ipc \
          --layouts procs --tokens ${GOAL_TOKENS:-8192 32768} --slot-mib 256 --gather-slots 2 \
          --decode-slots ${DECODE_SLOTS:-4} --granted-slots $g --reps 3 --ceiling-reps 5 $c \
          --timeout ${GOAL_RUN_TIMEOUT:-200} --json $OUT/goal-$tag-g$g.json 2>&1 | quiet | grep -v "^ROWS "
        c=--no-ceiling  # the ceiling once per tree
      done ;;
    load)
      c=${GOAL_NO_CEILING:+--no-ceiling}; for k in ${LOAD_K:-4 8}; do
        echo "== load $tr: ${GOAL_TOKENS:-8192 32768} rooms in flight $k @$(date +%T)"
        PYTHONPATH=$site:$t timeout ${GOAL_TIMEOUT:-300} python3 $t/scripts/staged_process_bench.py \
          --engines ${LOAD_ENGINES:-ipc} --layouts procs --tokens ${GOAL_TOKENS:-8192 32768} --slot-mib 256 \
          --gather-slots 2 --decode-slots ${DECODE_SLOTS:-4} --reps ${LOAD_REPS:-3} --ceiling-reps 5 --rooms-in-flight $k \
          $c --timeout ${GOAL_RUN_TIMEOUT:-200} --json $OUT/load-$tag-k$k.json 2>&1 | quiet | grep -v "^ROWS "
        c=--no-ceiling  # the ceiling once per tree
      done ;;
    esac
  done
done
echo "== end @$(date +%T)"
