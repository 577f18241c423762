# Sourced by setup_peers.sh and setup_vllm.sh with VENV (the environment) and CONSTRAINTS (its exact pins) set:
# goes to the repository root, creates $VENV if it is missing, and defines `pinned NAME` (NAME's version in
# $CONSTRAINTS) with the two pins every such environment shares, $TRANSFORMERS and $TORCH.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
pinned() { grep -iE "^$1==" "$CONSTRAINTS" | head -1 | cut -d= -f3; }
TRANSFORMERS=$(pinned transformers)
TORCH=$(pinned torch)
