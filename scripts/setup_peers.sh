#!/usr/bin/env bash
# Create .venv-peers: kvpress (NVIDIA's KV-cache compression library) in its own environment, beside patchkv's .venv,
# for evals/peers/kvpress_ruler.py. Idempotent: does nothing when the pinned versions are already installed.
#
# kvpress 0.5.5 requires transformers<5.3 while patchkv pins transformers 5.24.0 (constraints.txt), so the two
# cannot share .venv. Every version here is an exact pin from evals/peers/constraints.txt (pip freeze after one
# resolve); transformers is 5.2.0, the newest release kvpress 0.5.5 accepts. torch is the same CPU build as
# patchkv's (torch==2.13.0, installed first, the same way scripts/setup.sh does, so nothing pulls a CUDA build).
# kvpress's runtime requirements all install on CPU from PyPI; flash-attn is only its optional extra and is not
# installed (the presses run with attn_implementation="sdpa").
#
# Nothing in the project's own .venv, constraints.txt or CI depends on this environment.
#
# Environment:
#   PEERS_VENV=.venv-peers   the virtual environment to create or update
set -euo pipefail
VENV=${PEERS_VENV:-.venv-peers}
CONSTRAINTS=evals/peers/constraints.txt
source "$(dirname "$0")/pinned_venv.sh"  # creates $VENV; pinned NAME, $TRANSFORMERS, $TORCH
KVPRESS=$(pinned kvpress)
if "$VENV/bin/python" - "$KVPRESS" "$TRANSFORMERS" "$TORCH" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
want = dict(zip(("kvpress", "transformers", "torch"), sys.argv[1:]))
sys.exit(0 if all(version(name).split("+")[0] == v for name, v in want.items()) else 1)
EOF
  echo "setup_peers: $VENV already has kvpress $KVPRESS, transformers $TRANSFORMERS, torch $TORCH"
  exit 0
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
# torch first: its CPU wheel must be in place before anything pulls a default (CUDA) build
"${PIP[@]}" "torch==$TORCH"
"${PIP[@]}" "kvpress==$KVPRESS" "transformers==$TRANSFORMERS"
"$VENV/bin/python" - <<'EOF'
import sys
from importlib.metadata import version
import kvpress, torch, transformers  # noqa: F401  (importing them is the check)
print(f"setup_peers: {sys.prefix}: kvpress {version('kvpress')}, transformers {transformers.__version__}, "
      f"torch {torch.__version__}")
EOF
