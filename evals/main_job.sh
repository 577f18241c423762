#!/usr/bin/env bash
# The main job (README, first command): SmolLM2-135M-Instruct calibrated with `patchkv calibrate`'s defaults, then
# `patchkv report` on three held-out 4k documents (modern prose, Shakespeare, Milton: none in the calibration mix)
# against the unpatched model and transformers' QuantizedCache. About 13 minutes on 2 CPU cores after setup
# where bf16 is native (several times that on an AVX2-only CPU, where torch emulates it: README, quick start).
# Writes bases/smollm2/ and this run's evals/results/run/main_job/report.{md,csv,png} (report.md names the commit,
# command, machine and date; neither folder is tracked), then says whether they reproduce a tracked run:
# evals/results/main_job/ (the README's, made on an AMD EPYC) or evals/results/main_job/xeon/ (an Intel Xeon); bf16
# arithmetic differs between CPUs in the last digits, so a run reproduces the one made on its kind of CPU. The tree
# is left as it is; `bash evals/main_job.sh --keep` copies this run over evals/results/main_job/report.*.
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
# of the unrounded values) and is compared with neither, only replaced with them by --keep
for kept in "$KEPT" "$KEPT/xeon"; do
  if cmp -s "$RUN/report.csv" "$kept/report.csv" && cmp -s <(results "$RUN") <(results "$kept"); then
    echo "the results are those of $kept/report.md, to the digit (this run: $RUN/report.md)"
    exit 0
  fi
done
if [ "${1:-}" = "--keep" ]; then
  cp "$RUN"/report.md "$RUN"/report.csv "$RUN"/report.png "$KEPT"/
  echo "the results differ from every tracked run: $KEPT/report.{md,csv,png} replaced by this run's (git diff $KEPT)"
else
  echo "the results differ from every tracked run ($KEPT/report.md, $KEPT/xeon/report.md): see" \
    "diff $RUN/report.csv $KEPT/report.csv; the tree is left as it is (--keep replaces $KEPT/report.*)"
fi
