#!/bin/bash
# Issue 33, round 20: the layer-wise tail in the order an engine calls the room's last send, and the CP 2
# control path with every rank in its own process. Run as run_gpu.sh's EXTRA (carry .whl and .debs):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r20.sh" bash scripts/device/run_gpu.sh
# Steps (STEPS picks, default "lw kb ctl"; each bounded):
#   lw    layerwise_gpu_bench.py, 8K and 32K, CP 1 and 2, 8 rooms a kind after a warm-up, on each engine of
#         $ENGINES (default ipc): both orders of the room's last send(s), alternating room by room - readback
#         (after the first token is read back, as every bench before) and launch (as soon as the last layer's
#         kernels are queued, with their event: vLLM's wait_for_save, where kvbridge's vLLM worker sends)
#         (LW_TOKENS, LW_CP and LW_ORDERS narrow it); STAGING=never|always: the prefill ranks' staging (default auto);
#         FWD_STREAM=side: the prefill's forward on a non-blocking stream of its own, not the legacy default stream
#   lwt   lw traced (every rank's trace lines; the tail hop by hop), the orders in $LWT_ORDERS (default launch)
#   kb    kvbridge bench on the host's CPUs (no GPU): 2 pages (128 tokens), 4+1 layers, Mooncake TCP on
#         loopback, decode asking first, CP 1 and 2, every rank its own process, against raw Mooncake posting
#         the same slices from the same ranks; $KB_RUNS times
#   ctl   scripts/control_bench.py (one process, the ranks' send() one after the other on one thread): the same
#         rooms' control path, CP 1 and 2, asking first, beside kb's
# Round 20 ran five calls, each on a fresh host (docs/performance.md, "Issue 33, round 20"):
#   EXTRA="bash scripts/device/issue33_r20.sh"
#   EXTRA="STEPS='lwt lw kb' ENGINES='ipc mooncake' bash scripts/device/issue33_r20.sh"
#   EXTRA="STEPS=lw ENGINES='mooncake ipc' FWD_STREAM=side bash scripts/device/issue33_r20.sh"
#   EXTRA="for st in never always; do STEPS=lw ENGINES=mooncake STAGING=\$st LW_ORDERS=launch bash scripts/device/issue33_r20.sh;
#          done; STEPS=lw ENGINES=mooncake STAGING=never LW_ORDERS=launch FWD_STREAM=side LW_CP=1 bash scripts/device/issue33_r20.sh"
#   EXTRA="STEPS=lw ENGINES=mooncake STAGING=always LW_ORDERS=launch FWD_STREAM=side bash scripts/device/issue33_r20.sh;
#          STEPS='kb ctl' bash scripts/device/issue33_r20.sh"
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS-lw kb ctl}; mkdir -p $OUT
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  case $step in
  lw)
    for eng in ${ENGINES:-ipc}; do
      o=$OUT/lw-$eng-${FWD_STREAM:-default}-${STAGING:-auto}; mkdir -p $o
      echo "-- $eng"
      PYTHONPATH=$site:$PWD timeout ${LW_TIMEOUT:-330} python3 scripts/layerwise_gpu_bench.py --tokens ${LW_TOKENS:-8192 32768} \
        --cp ${LW_CP:-1 2} --rooms 8 --engine $eng --forward-stream ${FWD_STREAM:-default} \
        --staging ${STAGING:-auto} --orders ${LW_ORDERS:-readback launch} \
        --json $o/layerwise.json 2>&1 | quiet | grep -v '^{'
    done ;;
  lwt)
    for eng in ${ENGINES:-ipc}; do
      o=$OUT/lwt-$eng; mkdir -p $o
      echo "-- $eng, traced"
      PYTHONPATH=$site:$PWD timeout ${LW_TIMEOUT:-330} python3 scripts/layerwise_gpu_bench.py --tokens ${LW_TOKENS:-8192 32768} \
        --cp 1 2 --rooms 8 --engine $eng --orders ${LWT_ORDERS:-launch} --trace-dir $o/trace --json $o/layerwise.json \
        2>&1 | quiet | grep -v '^{'
      tar -czf $o/trace.tgz -C $o trace && rm -rf $o/trace
    done ;;
  kb)
    for i in $(seq ${KB_RUNS:-2}); do
      PYTHONPATH=$site:$PWD timeout 120 python3 -m kvbridge.cli.main bench --tokens 128 --cp 1,2 --layers 4 --reps 40 \
        --ask-first --alloc contiguous --engine mooncake --no-staged --no-progress --json $OUT/kb$i.json 2>&1 \
        | quiet | grep -A3 "engine  cp"
    done ;;
  ctl)
    for cp in 1 2; do
      PYTHONPATH=$site:$PWD timeout 120 python3 scripts/control_bench.py --cp $cp --pages 2 --rooms 300 --layers 4 \
        --ask-first 2>&1 | quiet | grep "control path"
    done ;;
  esac
done
echo "== end @$(date +%T)"
