#!/bin/bash
# Issue 33, round 12b (run as run_gpu.sh's EXTRA: the wheels on PYTHONPATH, the libraries found): decode's turn
# per landed chunk, split (scripts/staged_cycle.py --split: scripts/decode_split.py's timers in the decode rank),
# V3.2 fp8 61+1 layers, CP 2, random pages, 32K tokens, 64 MiB slots, every rank its own process on cuda:0,
# Mooncake NVLink and the IPC engine. Per engine, 2/4 slots: split (traced), plain (traced, no timers: what the
# timers cost), untraced (split, KVBRIDGE_TRACE off: the turn without the trace's lines); RUNS="ipc:4:8:split ..."
# picks others. $OUT/split.txt (the tables), split.json ({name: staged_cycle's JSON}), detail.txt
# (staged_cycle_detail.py over the traced runs). Round 12b in docs/performance.md.
#   cd .gpu33 && WHEELS=../.whl DEBS=../.debs SKIP_TEST=1 SKIP_BENCH=1 \
#     EXTRA="bash scripts/device/issue33_r12b.sh" bash scripts/device/run_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; RUNS=${RUNS:-"mooncake:2:4:split ipc:2:4:split mooncake:2:4:untraced ipc:2:4:untraced mooncake:2:4:plain ipc:2:4:plain"}
. "$(dirname "$0")/_ab_common.sh"  # site, B, quiet, tree
mkdir -p /tmp/cyc
for run in $RUNS; do IFS=: read eng g d how <<< "$run"
  echo "-- staged_cycle --engine $eng --gather-slots $g --decode-slots $d ($how) @$(date +%T)"
  flag=; [ "$how" = split ] && flag=--split; [ "$how" = untraced ] && flag="--split --untraced"
  PYTHONPATH=$site:$PWD timeout 80 python3 scripts/staged_cycle.py --device cuda:0 --engine $eng --tokens 32768 \
    --slot-kib 65536 --gather-slots $g --decode-slots $d --reps 3 $flag --json /tmp/cyc/$eng-$g-$d-$how.json 2>&1 | quiet
done 2>&1 | tee $OUT/split.txt
python3 -c "import json,glob,os;print(json.dumps({os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob('/tmp/cyc/*.json'))}))" \
  > $OUT/split.json
python3 scripts/staged_cycle_detail.py $OUT/split.json > $OUT/detail.txt 2>&1; cat $OUT/detail.txt
echo "== end @$(date +%T)"
