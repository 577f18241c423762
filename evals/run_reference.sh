#!/usr/bin/env bash
# The main job, end to end on the shipped reference model: calibrate pre- and post-RoPE bases on the
# Shakespeare training works, then evaluate both at 4x KV compression against the unpatched model.
set -euo pipefail
cd "$(dirname "$0")/.."
PATCHKV=.venv/bin/patchkv
OUT=${OUT:-evals/results/run}
mkdir -p "$OUT"
for mode in pre_rope post_rope; do
  $PATCHKV calibrate --model artifacts/reference-llama --data corpus --mode "$mode" --rank 16 \
    --max-tokens 65536 --out "$OUT/$mode.safetensors"
done
$PATCHKV eval --model artifacts/reference-llama --artifact "$OUT/pre_rope.safetensors" \
  --artifact "$OUT/post_rope.safetensors" --out "$OUT" --name reference_4x "$@"
