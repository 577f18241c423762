#!/usr/bin/env bash
# RULER through lm-eval's own tasks, offline, on the unpatched SmolLM2-135M-Instruct (CPU).
#   bash evals/run_ruler.sh [max_seq_length=1024] [limit=5] [tasks=niah_single_1]
# Subtasks that build offline: niah_single_1, niah_multikey_2, niah_multikey_3 (repeat / needle haystacks),
# ruler_vt, ruler_cwe, ruler_fwe (need nltk, wonderwords, scipy; see scripts/setup.sh).
# Not offline: niah_single_2/3, niah_multikey_1, niah_multiquery, niah_multivalue (Paul Graham essays from the
# Hub dataset baber/paul_graham_essays or the web), ruler_qa_squad, ruler_qa_hotpot (download SQuAD / HotpotQA).
# nltk's failed punkt_tab download at import is harmless: only the essay haystacks sentence-split.
# The tasks' metric list names 4096..131072; other lengths still score under their own key (e.g. 1024).
set -euo pipefail
cd "$(dirname "$0")/.."
LEN=${1:-1024}; LIMIT=${2:-5}; TASKS=${3:-niah_single_1}
MODEL=.models/SmolLM2-135M-Instruct
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/lm_eval --model hf \
  --model_args "pretrained=$MODEL,dtype=float32" --tasks "$TASKS" \
  --metadata "{\"max_seq_lengths\": [$LEN], \"tokenizer\": \"$MODEL\"}" \
  --limit "$LIMIT" --batch_size 1 --device cpu --output_path evals/results/run/ruler
