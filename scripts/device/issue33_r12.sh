#!/bin/bash
# Issue 33, round 12 (run as run_gpu.sh's EXTRA: the wheels on PYTHONPATH, the libraries found). STEPS picks:
#   cycle    scripts/staged_cycle.py on the GPU: staged rooms (V3.2 fp8 61+1 layers, CP 2, random pages, 32K
#            tokens, 64 MiB slots, every rank its own process on cuda:0), every chunk's cycle from the trace,
#            on Mooncake NVLink and the IPC engine, gather/decode slots 2/4 and 4/8 ($OUT/cycle.txt, cycle.json)
#   layout   scripts/staged_layout_bench.py at 32K, 64 MiB slots (the ceiling in the rooms' layout)
#   prof     a cProfile of every rank of staged rooms (scripts/staged_process_bench.py, IPC engine, processes,
#            32K), the rank files concatenated into $OUT/sprof_summary.txt and the .prof files in $OUT/sprof.tgz
#   ab       before/after: scripts/gpu_bench.py's staged rooms (mooncake-nvlink) and staged_process_bench.py
#            (ipc, procs) run after, before, after; the tree before is $BEFORE (default _before, unpacked
#            beside this tree by `git archive <rev> kvbridge scripts | tar -x -C _before`)
# Call 1:  cd .gpu33 && WHEELS=../.whl DEBS=../.debs SKIP_TEST=1 SKIP_BENCH=1 \
#            EXTRA="bash scripts/device/issue33_r12.sh" bash scripts/device/run_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS:-cycle prof layout}
. "$(dirname "$0")/_ab_common.sh"  # site, B, quiet, tree
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  case $step in
  cycle)
    mkdir -p /tmp/cyc
    for eng in mooncake ipc; do for s in '2 4' '4 8'; do set -- $s
      echo "-- staged_cycle --engine $eng --gather-slots $1 --decode-slots $2 @$(date +%T)"
      PYTHONPATH=$site:$PWD timeout 120 python3 scripts/staged_cycle.py --device cuda:0 --engine $eng --tokens 32768 \
        --slot-kib 65536 --gather-slots $1 --decode-slots $2 --reps 3 --json /tmp/cyc/$eng-$1-$2.json 2>&1 | quiet
    done; done | tee $OUT/cycle.txt
    python3 -c "import json,glob,os;print(json.dumps({os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob('/tmp/cyc/*.json'))}))" \
      > $OUT/cycle.json ;;
  layout)
    PYTHONPATH=$site:$PWD timeout 120 python3 scripts/staged_layout_bench.py --tokens 32768 --reps 5 --slot-mib 64 \
      2>&1 | quiet | tee $OUT/layout.txt ;;
  prof)
    rm -rf /tmp/sprof; mkdir -p /tmp/sprof
    KVBRIDGE_PROFILE_DIR=/tmp/sprof PYTHONPATH=$site:$PWD timeout 200 python3 scripts/staged_process_bench.py \
      --engines ipc --layouts procs --tokens 32768 --reps 8 --no-ceiling --timeout 180 2>&1 | quiet
    for f in /tmp/sprof/*.txt; do echo "=== $f"; cat $f; done > $OUT/sprof_summary.txt
    tar -czf $OUT/sprof.tgz -C /tmp sprof ;;
  ab)
    for which in after before after2; do
      t=$(tree ${which%2})
      echo "-- $which ($t) @$(date +%T)"
      PYTHONPATH=$site:$t timeout 200 python3 $t/scripts/gpu_bench.py --groups mooncake-nvlink --alloc random \
        --tokens 8192 32768 131072 --reps 3 --staged-slot-mib 64 ${AB_SLOTS:-} --json $OUT/ab-mc-$which.json 2>&1 | quiet
      PYTHONPATH=$site:$t timeout 200 python3 $t/scripts/staged_process_bench.py --engines ipc --layouts procs \
        --tokens 8192 32768 131072 --reps 3 --no-ceiling --timeout 180 ${AB_SLOTS:-} 2>&1 | quiet
    done 2>&1 | tee $OUT/ab.txt ;;
  esac
done
echo "== end @$(date +%T)"
