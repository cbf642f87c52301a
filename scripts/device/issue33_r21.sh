#!/bin/bash
# Issue 33, round 21: what bounds the staged rooms on one GPU, kvbridge's host work or the chain of
# dependencies every staged chunk waits through. Run as run_gpu.sh's EXTRA (carry .whl and .debs):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r21.sh" bash scripts/device/run_gpu.sh
# One step, bounded: scripts/staged_process_bench.py, every rank its own process, IPC and Mooncake NVLink,
# 64 MiB slots, 2 gather slots per prefill rank and 4 on decode, random pages, CP 2, V3.2 fp8 61+1 layers,
# every room checked; beside them in the same run the staging ceiling of the same chunks in one process
# and in three, and the same three processes chained (grants asked for, and sent ahead; the last room's
# bytes checked). $TOKENS_SETS: the lengths of each run, runs separated by commas (default "32768,8192 131072").
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
IFS=, read -ra sets <<< "${TOKENS_SETS:-32768,8192 131072}"
i=0
for set_ in "${sets[@]}"; do
  i=$((i + 1))
  echo "== staged rooms and chains, tokens $set_ @$(date +%T)"
  PYTHONPATH=$site:$PWD GLOG_minloglevel=2 timeout ${SPB_TIMEOUT:-280} python3 scripts/staged_process_bench.py \
    --engines ${ENGINES:-ipc mooncake-nvlink} --layouts procs --tokens $set_ --slot-mib ${SLOT_MIB:-64} \
    --gather-slots ${GATHER_SLOTS:-2} --decode-slots ${DECODE_SLOTS:-4} --reps 3 --ceiling-reps 5 --timeout 150 \
    --json $OUT/staged-chain-$i.json 2>&1 | quiet
done
