#!/bin/bash
# Issue 33, round 22: where a staged chunk's decode-slot hold goes on one GPU, and whether the
# interpreters' thread switching is part of it. Run as run_gpu.sh's EXTRA (carry .whl and .debs);
# the round's two calls (docs/performance.md, "Issue 33, round 22"):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="CYCLES='ipc:64 mooncake:64 ipc:256' GIL_ENGINES=ipc GIL_RUNS=1 \
#     CYCLE_TIMEOUT=120 GIL_TIMEOUT=110 bash scripts/device/issue33_r22.sh" bash scripts/device/run_gpu.sh
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="STEPS=spy SPY_SLOTS=64 SPY_REPS=8 SPY_TIMEOUT=120 bash scripts/device/issue33_r22.sh" \
#     bash scripts/device/run_gpu.sh      # with py-spy's wheel in .whl
# STEPS (default "cycle gil"):
#   cycle  scripts/staged_cycle.py traced (32K, 2 / 4 slots; $CYCLES: engine:slot MiB, default IPC and
#          Mooncake NVLink at 64 MiB, IPC at 256): the cycle table, prefill's post + write split by the
#          chunk's write, each room's own steps; each run's trace logs are copied to $OUT/cycle-<engine>-<MiB>/
#          (a call brings back a bounded number of files: run one or two cycles to get them)
#   spy    a sampling profile of the same untraced staged rooms (every process; IPC, 32K, $SPY_SLOTS MiB slots,
#          default "64 256", $SPY_REPS rooms, 10): py-spy record -r 2000 --subprocesses $SPY_FLAGS (e.g. --idle)
#          -f raw, when py-spy 0.4.3's wheel was carried in .whl (not committed); $OUT/spy-<MiB>.raw.gz
#   gil    scripts/staged_process_bench.py --no-ceiling (32K, 64 MiB, $GIL_ENGINES, default IPC and Mooncake
#          NVLink), with Python's default thread switch interval (5 ms) and with $SWITCH_S (default 0.0001)
#          set in every process of the run through a sitecustomize written under /tmp (a diagnostic, not a
#          setting kvbridge makes), in turn, $GIL_RUNS times (2)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
T=${TOKENS:-32768}
for step in ${STEPS:-cycle gil}; do
  case $step in
  cycle)
    for run in ${CYCLES:-ipc:64 mooncake:64 ipc:256}; do
      eng=${run%%:*}; mib=${run##*:}
      echo "== cycle $eng ${mib} MiB @$(date +%T)"
      PYTHONPATH=$site:$PWD timeout ${CYCLE_TIMEOUT:-150} python3 scripts/staged_cycle.py --device cuda:0 \
        --engine $eng --tokens $T --slot-kib $((mib * 1024)) --gather-slots 2 --decode-slots 4 --reps 3 \
        --json $OUT/cycle-$eng-$mib.json 2>&1 | quiet | tee $OUT/cycle-$eng-$mib.txt
      d=$(sed -n 's/^trace logs: //p' $OUT/cycle-$eng-$mib.txt | tail -1)
      [ -n "$d" ] && mkdir -p $OUT/cycle-$eng-$mib && cp $d/*.log $OUT/cycle-$eng-$mib/ 2>/dev/null
    done ;;
  spy)
    for mib in ${SPY_SLOTS:-64 256}; do
      echo "== spy ${mib} MiB @$(date +%T)"
      PYTHONPATH=$site:$PWD timeout ${SPY_TIMEOUT:-150} $site/bin/py-spy record -r 2000 --subprocesses ${SPY_FLAGS:-} -f raw \
        -o $OUT/spy-$mib.raw -- python3 scripts/staged_process_bench.py --engines ipc --layouts procs --tokens $T \
        --slot-mib $mib --gather-slots 2 --decode-slots 4 --reps ${SPY_REPS:-10} --no-ceiling --timeout 120 2>&1 | quiet | tail -3
      gzip -f $OUT/spy-$mib.raw
    done ;;
  gil)
    hook=/tmp/gilhook; mkdir -p $hook
    printf 'import os, sys\nif os.environ.get("KVB_DIAG_SWITCH_S"):\n    sys.setswitchinterval(float(os.environ["KVB_DIAG_SWITCH_S"]))\n' > $hook/sitecustomize.py
    for i in $(seq ${GIL_RUNS:-2}); do
      for sw in default ${SWITCH_S:-0.0001}; do
        echo "== gil switch=$sw run $i @$(date +%T)"
        if [ $sw = default ]; then env=""; else env="KVB_DIAG_SWITCH_S=$sw"; fi
        env $env PYTHONPATH=$hook:$site:$PWD timeout ${GIL_TIMEOUT:-150} python3 scripts/staged_process_bench.py \
          --engines ${GIL_ENGINES:-ipc mooncake-nvlink} --layouts procs --tokens $T --slot-mib 64 --gather-slots 2 \
          --decode-slots 4 --reps 3 --no-ceiling --timeout 120 --json $OUT/gil-$sw-$i.json 2>&1 | quiet | tail -8
      done
    done ;;
  esac
done
