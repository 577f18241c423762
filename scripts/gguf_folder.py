"""A GGUF turned into a standard Hugging Face folder, checked: what scripts/get_smollm2.py and get_gemma3.py share.

transformers (with the `gguf` package) dequantizes the GGUF to float32 weights; `convert` copies them into a plain
model of the same config (a GGUF-loaded model refuses `save_pretrained`), saves it as `model.safetensors` with
`config.json` (no `quantization_config`), the tokenizer files and `generation_config.json` into `<out>.partial`,
checks that the folder's logits equal the GGUF-loaded model's and its tokenizer the GGUF's, then renames it to
`out`. Installs nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from pathlib import Path

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def complete(out: Path) -> bool:
    """Whether `out` already holds every file `convert` writes."""
    return all((out / name).is_file() for name in REQUIRED)


def target(description: str, default: Path) -> Path | None:
    """The folder to write, from the command line (`--out`, default `default`; `--force`), or None, said so, when it
    is already complete and --force is not given."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=default)
    ap.add_argument("--force", action="store_true", help="rewrite the folder even if it is complete")
    args = ap.parse_args()
    if complete(args.out) and not args.force:
        print(f"{args.out}: present, nothing to do")
        return None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return args.out


def convert(folder: Path, gguf_name: str, out: Path):
    """`folder / gguf_name` -> the folder `out` (see the module doc); returns the GGUF-loaded model. Exits with a
    one-line message if the weights or the saved folder do not match."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32).eval()
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
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (model.generation_config or GenerationConfig()).save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        if cfg.pop("quantization_config", None) is not None:
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

        # the folder must reproduce the GGUF-loaded model exactly
        ids = tokenizer("The quick brown fox jumps over the lazy dog. HAMLET. To be, or not to be:",
                        return_tensors="pt")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.no_grad():
            a, b = model(**ids).logits, reloaded(**ids).logits
        if not torch.equal(a, b):
            sys.exit(f"logits differ between the GGUF model and the saved folder (max abs diff "
                     f"{(a - b).abs().max().item():.3g})")
        sample = "Hello, world!\n  def f(x):"
        if AutoTokenizer.from_pretrained(tmp)(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
            sys.exit("the saved tokenizer does not reproduce the GGUF tokenizer")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model
