#!/bin/bash
# Issue 33, round 19: what the host's idle CPUs cost a room. Run as run_gpu.sh's EXTRA (carry .whl and .debs):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r19.sh" bash scripts/device/run_gpu.sh
# Every run marked "held" runs under scripts/device/idle_probe.py --hold: /dev/cpu_dma_latency held at 0, so
# the CPUs poll when idle instead of halting (the kernel's PM QoS request, released when the run ends); "plain"
# runs leave the host as it is (HOWS picks: default "plain held"; the gpu step runs each twice, alternating).
# Steps (STEPS picks; each bounded):
#   probe  idle_probe.py [--qos]: waking a thread or a process on another CPU, and a slice of send()'s own
#          work, right after activity and after idle times ($GAPS, default "0 200" ms), as is and held ($QOS)
#   ctl    scripts/control_bench.py (no GPU), 4+1 layers, 2 pages, decode asking first: CP 1 and 2 back to
#          back (0 ms between rooms) and CP 2 with 200 ms idle before each room, plain then held; CTL_RUNS
#          picks (cp:gap ms:rooms[:send-early ms], default "1:0:300 2:0:300 2:200:100")
#   gpu    gpu_bench.py, 8K contiguous, Mooncake NVLink and IPC, decode asking first, untraced, $HOWS twice
#          (the fixed cost over the raw engine, whose own run has no hand-off)
#   lw     layerwise_gpu_bench.py (8K and 32K, CP 1 and 2), $HOWS
#   early  gpu_bench.py as in gpu, each rank calling send() with the KV whole (0) or while the forward's last
#          N ms still run with their event as ready_event (--send-early N, vLLM's order; the room timed
#          from the KV whole): EARLY_RUNS, default "0 5 0 5 20"; an entry N:host makes the tail a host timer
#          (--send-early-on host), N:device:FLAGS adds gpu_bench flags
# Round 19 ran it twice, the second on a fresh machine:
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="bash scripts/device/issue33_r19.sh" bash scripts/device/run_gpu.sh
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="GAPS='0 1 2 5 20 50 200' QOS= HOWS=plain STEPS='probe ctl gpu lw' \
#     bash scripts/device/issue33_r19.sh" bash scripts/device/run_gpu.sh
# then the early send on one host (calls 3-5: EARLY_RUNS "0 5 0 5 20", "0 5 5:host 5:device:--aux-written 0 5 5:host"
# and "0 5:host 5 0 5:host 5 5:host") and on a fresh one (call 6):
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="STEPS=early EARLY_RUNS='...' bash scripts/device/issue33_r19.sh" bash scripts/device/run_gpu.sh
#   SKIP_TEST=1 SKIP_BENCH=1 EXTRA="STEPS='ctl early' HOWS=plain CTL_RUNS='1:0:300 1:0:300:5 2:0:300 2:0:300:5' \
#     EARLY_RUNS='0 5:host 0 5:host' bash scripts/device/issue33_r19.sh" bash scripts/device/run_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; STEPS=${STEPS-probe ctl gpu}; HOWS=${HOWS:-plain held}
. "$(dirname "$0")/_ab_common.sh"  # site, quiet
HOLD="python3 scripts/device/idle_probe.py --hold --"
ARGS="--groups mooncake-nvlink ipc --alloc contiguous --tokens 8192 --reps 10 --ask-first"
for step in $STEPS; do
  echo "== $step @$(date +%T)"
  case $step in
  probe)
    PYTHONPATH=$site:$PWD timeout 150 python3 scripts/device/idle_probe.py --rounds 30 --gaps ${GAPS:-0 200} ${QOS---qos} ;;
  ctl)
    for how in $HOWS; do
      pre=$([ $how = held ] && echo "$HOLD")
      for run in ${CTL_RUNS:-1:0:300 2:0:300 2:200:100}; do
        IFS=: read -r cp gap rooms early <<< "$run"
        echo "-- $how cp $cp gap $gap ms send-early ${early:-0} ms"
        PYTHONPATH=$site:$PWD timeout 120 $pre python3 scripts/control_bench.py --cp $cp --pages 2 --rooms $rooms \
          --layers 4 --ask-first --gap-ms $gap --send-early ${early:-0} 2>&1 | quiet | grep "cpu_dma\|control path"
      done
    done ;;
  gpu)
    i=0
    for how in $HOWS $HOWS; do
      i=$((i + 1)); o=$OUT/gpu$i-$how; mkdir -p $o
      pre=$([ $how = held ] && echo "$HOLD")
      echo "-- $how"
      PYTHONPATH=$site:$PWD timeout 150 $pre python3 scripts/gpu_bench.py $ARGS --json $o/gpu_bench.json 2>&1 \
        | quiet | grep -A2 "alloc tokens      MB  slices\|cpu_dma"
    done ;;
  early)
    i=0
    for run in ${EARLY_RUNS:-0 5 0 5 20}; do
      IFS=: read -r ms on flags <<< "$run"
      i=$((i + 1)); o=$OUT/early$i-$ms-${on:-device}; mkdir -p $o
      echo "-- send-early $ms ms on ${on:-device} ${flags:-}"
      PYTHONPATH=$site:$PWD timeout 150 python3 scripts/gpu_bench.py $ARGS --send-early $ms --send-early-on ${on:-device} \
        ${flags:-} --json $o/gpu_bench.json 2>&1 | quiet | grep -A2 "alloc tokens      MB  slices\|failed\|Error\|tail p50"
    done ;;
  lw)
    for how in $HOWS; do
      o=$OUT/lw-$how; mkdir -p $o
      pre=$([ $how = held ] && echo "$HOLD")
      echo "-- $how"
      PYTHONPATH=$site:$PWD timeout 200 $pre python3 scripts/layerwise_gpu_bench.py --tokens 8192 32768 --cp 1 2 \
        --rooms 8 --json $o/layerwise.json 2>&1 | quiet | grep -v '^{'
    done ;;
  esac
done
echo "== end @$(date +%T)"
