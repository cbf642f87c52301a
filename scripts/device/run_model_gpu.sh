#!/bin/bash
# The model demo on a GPU host (issue 11): with two GPUs prefill on cuda:0 -> decode on cuda:1 over Mooncake
# NVLink, then both sides on cuda:0 over Mooncake TCP. Run from a copy of this tree in .devcarry/h11 of the
# checkout the device tool sends, with .whl and .debs carried as for run_gpu.sh:
#   KVB=.devcarry/h11 bash .devcarry/h11/scripts/device/run_model_gpu.sh   (KVB: where kvbridge is imported from)
set -u
export PYTHONUNBUFFERED=1 GLOG_minloglevel=2
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
exec > >(tee -a $OUT/run.log) 2>&1
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/${KVB:-.}:/tmp/site
mkdir -p /tmp/debs; for f in .debs/*.deb; do dpkg -x $f /tmp/debs; done
CUDART=$(python3 -c "import glob,site,os;print(':'.join(sorted({os.path.dirname(p) for s in site.getsitepackages() for p in glob.glob(s+'/nvidia/**/libcudart.so*',recursive=True)})))")
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART:${LD_LIBRARY_PATH:-}
python3 -c 'import sys,torch,transformers,kvbridge; from mooncake.engine import TransferEngine; print(sys.version.split()[0], torch.__version__, transformers.__version__)' || exit 1
(cd ${KVB:-.} && python3 -c "import kvbridge; print(kvbridge.__file__)")
run() {  # name, demo args
  local name=$1; shift
  local t0=$(date +%s.%N)
  (cd ${KVB:-.} && timeout 120 python3 -m kvbridge.cli.main demo --no-progress --json --room-timeout 60 "$@") > $OUT/$name.json 2> $OUT/$name.err
  local rc=$?
  echo "== $name rc=$rc wall=$(python3 -c "print(round($(date +%s.%N)-$t0,2))")s"
  python3 - $OUT/$name.json <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no json:", exc); sys.exit()
print({k: s[k] for k in ("model", "device", "cp", "prefill_tp", "decode_ranks", "requests", "requests_ok", "tokens_equal",
                         "logits_equal", "bytes_equal", "poison_intact", "aux_equal", "colocated_s", "cluster_s")})
for r in s["per_request"]:
    if not r["ok"]:
        print("FAILED", r["index"], r["detail"][:300])
PY
  tail -5 $OUT/$name.err | grep -v "^[IWE][0-9]\{4\} "
}
GPUS=$(python3 -c "import torch;print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  run ds-cp2-nvlink --model tiny-deepseek-v3 --cp 2 --device cuda:0 --decode-device cuda:1 --transport nvlink
  run qwen-d2-nvlink --model tiny-qwen2 --decode-ranks 2 --device cuda:0 --decode-device cuda:1 --transport nvlink
fi
run ds-cp2-tcp-1gpu --model tiny-deepseek-v3 --cp 2 --device cuda:0
echo "== done"
