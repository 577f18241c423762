#!/usr/bin/env bash
# The main job (README, first command): SmolLM2-135M-Instruct calibrated with `patchkv calibrate`'s defaults, then
# `patchkv report` on three held-out 4k documents (modern prose, Shakespeare, Milton: none in the calibration mix)
# against the unpatched model and transformers' QuantizedCache. About 13 minutes on 2 CPU cores after setup.
# Writes bases/smollm2/ and this run's evals/results/run/main_job/report.{md,csv,png} (report.md names the commit,
# command, machine and date; the folder is not tracked), then copies them over the tracked
# evals/results/main_job/report.* only where the results differ: a rerun that reproduces them leaves the tree clean.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=.models/SmolLM2-135M-Instruct
DATA=patchkv/tasks/data
RUN=evals/results/run/main_job
KEPT=evals/results/main_job
.venv/bin/patchkv calibrate --model "$MODEL" --out bases/smollm2 --force
.venv/bin/patchkv report --model "$MODEL" --artifact bases/smollm2 --dtype bfloat16 \
  --text "$DATA/prose_4k.jsonl" --text "$DATA/shakespeare_4k.jsonl" --text "$DATA/milton_4k.jsonl" \
  --out "$RUN"
# report.md without what changes from run to run whatever the results (its time, date, commit, machine, threads, and
# the command, whose --out names the folder this run wrote to)
results() { grep -v -E '^- (seconds|date|commit|machine|threads|command): ' "$1/report.md"; }
# the results are report.csv and report.md; report.png is drawn from them (its bytes can differ with the last digits
# of the unrounded values) and is replaced with them
if cmp -s "$RUN/report.csv" "$KEPT/report.csv" && cmp -s <(results "$RUN") <(results "$KEPT"); then
  echo "the results are those of $KEPT/report.md: left as it is (this run: $RUN/report.md)"
else
  cp "$RUN"/report.md "$RUN"/report.csv "$RUN"/report.png "$KEPT"/
  echo "the results differ from the tracked ones: $KEPT/report.{md,csv,png} updated (git diff $KEPT)"
fi
