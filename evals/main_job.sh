#!/usr/bin/env bash
# The main job (README, first command): SmolLM2-135M-Instruct calibrated with `patchkv calibrate`'s defaults, then
# `patchkv report` on three held-out 4k documents (modern prose, Shakespeare, Milton: none in the calibration mix)
# against the unpatched model and transformers' QuantizedCache. About 13 minutes on 2 CPU cores after setup.
# Writes bases/smollm2/ and evals/results/main_job/report.{md,csv,png} (report.md names the commit and command).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=.models/SmolLM2-135M-Instruct
DATA=patchkv/tasks/data
.venv/bin/patchkv calibrate --model "$MODEL" --out bases/smollm2 --force
.venv/bin/patchkv report --model "$MODEL" --artifact bases/smollm2 --dtype bfloat16 \
  --text "$DATA/prose_4k.jsonl" --text "$DATA/shakespeare_4k.jsonl" --text "$DATA/milton_4k.jsonl" \
  --out evals/results/main_job
