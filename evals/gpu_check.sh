#!/usr/bin/env bash
# GPU checks for a lent CUDA machine (one H200, one run of at most 10 minutes, nothing downloadable), run in a
# copy of this repository with the machine's own python3 (torch, triton, transformers, matplotlib installed):
#
#     bash evals/gpu_check.sh                  # results in $OUT if set, else evals/results/gpu/
#     bash evals/gpu_check.sh --cpu-smoke      # the same steps at tiny sizes on CPU (tests/test_bench_op.py)
#
# 1. the Triton kernels against their PyTorch references, compiled on CUDA (the script of tests/test_kernels.py
#    with CUDA as the default device; --cpu-smoke: under TRITON_INTERPRET=1);
# 2. the GEMM benchmark (python -m evals gemm, evals/bench_gemm.py);
# 3. the scaling benchmark's rows on this device (python -m evals scaling --device cuda: 1k to 128k, every method,
#    decode by stage, 64-token chunks, prefill to 32k, memory), stopped after $SCALING_SECONDS (default 300; 1500 with
#    --cpu-smoke) so the
#    whole script stays under 8 minutes: its CSV is rewritten after every context, so a stopped run keeps the
#    contexts it finished. QuantizedCache rows only where optimum-quanto imports. It reads
#    .models/SmolLM2-135M-Instruct (scripts/setup.sh): carry it to the lent machine.
# Each step's output goes to $RESULTS/log.txt too; versions and nvidia-smi to $RESULTS/env.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-evals/results/gpu}
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
LOG="$RESULTS/log.txt"
: >"$LOG"

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  DEVICE=cpu
  INTERPRET=1  # the kernels step only: elsewhere the benchmarks run what a CPU runs, the PyTorch references
  GEMM_ARGS=(--seq 64 --heads 64 --head-dims 1,8,64 --ranks 8,32 --rank-heads 8 --square 256 --repeats 2 --threads 1)
  SCALING_LIMIT=${SCALING_SECONDS:-1500}  # no device budget here; 2 busy cores take minutes for 512 tokens
  SCALING_ARGS=(--contexts 512 --methods unpatched,unpatched-eager,QUANTO8x,8x-top256 --prefill-max 512
                --source-tokens 256 --batch8-max 0 --repeats 1 --chunk-repeats 1 --memory-contexts 0 --threads 1)
  # (batch 8 on CPU: tests/test_bench_scaling.py)
else
  DEVICE=cuda
  INTERPRET=0
  GEMM_ARGS=(--warmup 3 --repeats 20)
  SCALING_LIMIT=${SCALING_SECONDS:-300}
  SCALING_ARGS=(--contexts 1024,4096,8192,16384,32768,65536,131072 --methods unpatched,unpatched-eager,QUANTO4x,8x,16x,8x-top256
                --prefill-max 32768 --source-tokens 32768 --batch8-max 32768 --chunk-max 131072 --repeats 5 --chunk-repeats 3)
  # this package from the local tree only (no index, no dependencies: the machine's torch and transformers stay)
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tee -a "$LOG"
fi

step() {  # step NAME COMMAND...: run it, its output into the log, stop at the first failure
  echo "== $1 ($(date +%T))" | tee -a "$LOG"
  shift
  "$@" 2>&1 | tee -a "$LOG"
}

{
  "$PY" -c "import torch, transformers, triton, patchkv; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| triton', triton.__version__, '| patchkv', patchkv.__version__)"
  if [[ $DEVICE == cuda ]]; then nvidia-smi; fi
} >"$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt" | tee -a "$LOG"

step "triton kernels vs references ($DEVICE)" env TRITON_INTERPRET=$INTERPRET "$PY" -c "
import importlib.util, torch
spec = importlib.util.spec_from_file_location('test_kernels', 'tests/test_kernels.py')
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.set_default_device('$DEVICE')
exec(module.SCRIPT)"
step "GEMM benchmark ($DEVICE)" "$PY" -m evals gemm --device "$DEVICE" "${GEMM_ARGS[@]}" \
  --conditions "gpu_check.sh on $DEVICE" --out "$RESULTS"
# QUANTO: the QuantizedCache config where optimum-quanto imports (the lent machine may not have it)
QUANTO=$("$PY" -c "import optimum.quanto" 2>/dev/null && echo "quanto-int4," || true)
SCALING_ARGS=("${SCALING_ARGS[@]/QUANTO/$QUANTO}")
scaling() {  # the scaling benchmark under its time limit; stopped there, it keeps the contexts it finished
  local rc=0
  timeout --signal=INT "$SCALING_LIMIT" "$PY" -m evals scaling --device "$DEVICE" "${SCALING_ARGS[@]}" \
    --out "$RESULTS" || rc=$?
  if [[ $rc == 124 ]]; then echo "scaling: stopped at $SCALING_LIMIT s, the CSV holds the contexts finished"
  elif [[ $rc != 0 ]]; then return $rc; fi
}
step "scaling benchmark ($DEVICE)" scaling
echo "== done: $(ls "$RESULTS" | tr '\n' ' ')" | tee -a "$LOG"
