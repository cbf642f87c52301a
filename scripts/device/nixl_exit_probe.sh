#!/bin/bash
# Where the NIXL engine's exit segfault comes from (docs/engines.md: a process that created a NIXL
# engine exits 139 after close() on the GPU host). Run by run_gpu.sh with NIXL_PROBE=1, after the
# wheels are installed: each variant is one fresh process, its exit code printed; then a native
# backtrace of the plain case under cuda-gdb (the image has no gdb).
set -u
mk='from kvbridge.transfer.engine import create_engine; e = create_engine("nixl")'
probe() {  # name, env..., python code
  local name=$1; shift
  local code="${@: -1}"; local envs=("${@:1:$#-1}")
  env "${envs[@]}" timeout 60 python3 -X faulthandler -c "$code" > /tmp/nixl-probe.log 2>&1
  local rc=$?
  echo "nixl-probe $name rc=$rc $(grep -m1 -i 'fatal\|segmentation\|error' /tmp/nixl-probe.log | cut -c1-160)"
}
probe plain X=1 "$mk; e.close()"
probe no-close X=1 "$mk"
probe agent-only X=1 'import nixl_cu13._api as a, uuid; ag = a.nixl_agent(uuid.uuid4().hex, a.nixl_agent_config(backends=["UCX"])); del ag'
probe agent-no-backend X=1 'import nixl_cu13._api as a, uuid; ag = a.nixl_agent(uuid.uuid4().hex, a.nixl_agent_config(backends=[])); del ag'
probe torch-cuda-first X=1 "import torch; torch.zeros(1, device='cuda'); $mk; e.close()"
probe gpu-region X=1 "import torch; from kvbridge.transfer.engine import tensor_region; t = torch.zeros(1 << 20, device='cuda'); $mk; e.register(*tensor_region(t)); e.close()"
probe tls-no-cuda UCX_TLS=tcp,sm,self "$mk; e.close()"
probe tls-cuda-ipc UCX_TLS=cuda_ipc,cuda_copy,tcp,sm,self "$mk; e.close()"
probe no-mem-hooks UCX_MEM_MALLOC_HOOKS=no UCX_MEM_EVENTS=no "$mk; e.close()"
probe cuda-hook-none UCX_MEM_CUDA_HOOK_MODE=none "$mk; e.close()"
probe no-rcache UCX_RCACHE_ENABLE=n UCX_MEMTYPE_CACHE=n "$mk; e.close()"
probe gc-then-exit X=1 "import gc; $mk; e.close(); del e; gc.collect()"
probe os-exit X=1 "import os; $mk; e.close(); os._exit(0)"
if command -v cuda-gdb >/dev/null; then
  echo "== cuda-gdb backtrace of the plain case"
  timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -c "$mk; e.close()" 2>&1 \
    | grep -v "^\[New Thread\|^\[Thread .* exited\|^\[Detaching" | grep -A40 "SIGSEGV\|signal" | head -60
fi
