#!/bin/bash
# Issue 33, round 25: the staged goal's row in one call (the staged rooms, the staging ceiling in one process and
# in the rooms' own three-process layout, and the chained layout, all on the same host in the same run), and the
# staging slots swept. Run as run_gpu.sh's EXTRA (carry .whl and .debs):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r25.sh" bash scripts/device/run_gpu.sh
# STEPS (default "goal slots secret"):
#   goal   scripts/staged_process_bench.py --engines $GOAL_ENGINES (ipc) --layouts procs --tokens $GOAL_TOKENS
#          (8192 32768 131072) --slot-mib 256 --gather-slots 2 --decode-slots 4 --reps 3 --ceiling-reps 5: every rank its
#          own process, random pages, CP 2, V3.2 fp8 61+1 layers, every room checked; JSON under $OUT.
#   slots  the same rooms at 32K (IPC, 256 MiB slots, --no-ceiling, $SLOT_REPS rooms, 5) for each "gather:decode" of
#          $SLOTS (2:4 2:6 2:8 4:8), $SLOT_PASSES passes (2), every other pass in reverse order. One line per run.
#   secret the same rooms at 32K (IPC, 256 MiB slots, 2:4, --no-ceiling, 5 rooms) for each tree:how of $SECRET_RUNS
#          (". plain", ". secret", "_hmac secret": how is plain or with a cluster secret, KVBRIDGE_SECRET, every
#          control frame MAC'd as in production; _hmac is this tree with wire 16's HMAC-SHA256 envelope, made by
#          `mkdir _hmac && cp -r kvbridge scripts _hmac && git show fe37e56:kvbridge/transfer/channel/envelope.py >
#          _hmac/kvbridge/transfer/channel/envelope.py && git show fe37e56:kvbridge/_version.py > _hmac/kvbridge/_version.py`),
#          $SECRET_PAIRS passes (2), every other pass in reverse order. One line per run.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
staged32() {  # gather slots, decode slots: one staged row at 32K, IPC, 256 MiB slots, 5 rooms
  PYTHONPATH=$site:$PWD timeout ${SLOT_TIMEOUT:-90} python3 scripts/staged_process_bench.py --engines ipc \
    --layouts procs --tokens 32768 --slot-mib 256 --gather-slots $1 --decode-slots $2 \
    --reps ${SLOT_REPS:-5} --no-ceiling --timeout 80 2>&1 | quiet | grep -E ": staged |rror"
}
for step in ${STEPS:-goal slots secret}; do
  case $step in
  goal)
    echo "== goal: ${GOAL_ENGINES:-ipc}, tokens ${GOAL_TOKENS:-8192 32768 131072} @$(date +%T)"
    PYTHONPATH=$site:$PWD timeout ${GOAL_TIMEOUT:-300} python3 scripts/staged_process_bench.py \
      --engines ${GOAL_ENGINES:-ipc} --layouts procs --tokens ${GOAL_TOKENS:-8192 32768 131072} --slot-mib 256 \
      --gather-slots 2 --decode-slots 4 --reps 3 --ceiling-reps 5 --timeout ${GOAL_RUN_TIMEOUT:-200} \
      --json $OUT/goal.json 2>&1 | quiet | grep -v "^ROWS " ;;
  slots)
    order=${SLOTS:-2:4 2:6 2:8 4:8}
    for pass in $(seq ${SLOT_PASSES:-2}); do
      for gd in $order; do
        echo "== slots ${gd} pass $pass @$(date +%T)"
        staged32 ${gd%%:*} ${gd##*:}
      done
      order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
    done ;;
  secret)
    order=${SECRET_RUNS:-.:plain .:secret _hmac:secret}
    for i in $(seq ${SECRET_PAIRS:-2}); do
      for run in $order; do
        tr=${run%%:*}; how=${run##*:}; t=$([ "$tr" = . ] && echo "$PWD" || echo "$PWD/$tr")
        echo "== secret: $tr $how, pass $i @$(date +%T)"
        if [ $how = secret ]; then (cd $t && KVBRIDGE_SECRET=bench-cluster-secret staged32 2 4)
        else (cd $t && staged32 2 4); fi
      done
      order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
    done ;;
  esac
done
echo "== end @$(date +%T)"
