"""What every benchmark shares: the reference model, the named configurations (registry), provenance.

    from suite import CONFIGS, load_smollm2, provenance
    model, tokenizer = load_smollm2()
    patch = CONFIGS["8x"].patch(artifacts, context=4096)   # (artifact, methods) or None for a cache config

A configuration is methods + artifact + budget: `patchkv` configs compress the cache at a ratio against the bf16
cache, every byte counted (codes, the exact sinks and window, the int32 positions) at the context they run at;
`QuantizedCache` configs are transformers' own quantized cache. Every result file a benchmark writes has a
provenance sidecar (`<file>.provenance.json`: commit, command, machine, threads, versions, date).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import patchkv

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
BASES = ROOT / "artifacts" / "smollm2-bases"
#: sinks and recent window every patchkv config keeps exact (and counts)
EXACT = (4, 32)
POSITION_BYTES = 4  # the int32 true position a LatentCache keeps per token


def load_smollm2(dtype: torch.dtype = torch.bfloat16, attn: str = "sdpa"):
    """(model, tokenizer): SmolLM2-135M-Instruct from the folder `scripts/setup.sh` writes, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=dtype, attn_implementation=attn).eval()
    return model, AutoTokenizer.from_pretrained(SMOLLM2)


def bf16_bytes_per_token(model) -> int:
    """Bytes per token of the unpatched bf16 cache: K and V, every layer, KV head and head dim, 2 bytes each."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2


def bits_for(artifact: patchkv.Artifact, target_bytes: float, pool: str, context: int, bf16_bytes: int) -> int:
    """The most bits per head (average) whose whole cache at `context` tokens (exact sinks and window in bf16, codes,
    positions) holds at most `target_bytes` per token."""
    exact = sum(EXACT)

    def total(bits: int) -> float:
        return (exact * bf16_bytes + (context - exact) * artifact.kv_bytes_per_token(bits, pool)) / context \
            + POSITION_BYTES

    low, high = 1, artifact.head_dim * 8
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if total(mid) <= target_bytes else (low, mid - 1)
    return low


@dataclass(frozen=True)
class Config:
    """A named configuration: `unpatched`, a patchkv patch (`mode` artifact, methods built for the context by
    `methods`), or transformers' QuantizedCache (`cache`)."""

    name: str
    mode: str | None = None
    methods: Callable[[patchkv.Artifact, int, int], list] | None = None
    cache: Callable[[object], object] | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "patchkv" if self.mode else "quantized_cache" if self.cache else "unpatched"

    def patch(self, artifacts: dict[str, patchkv.Artifact], context: int, bf16_bytes: int):
        """(artifact, methods) for `patchkv.patched`, or None."""
        if self.mode is None:
            return None
        artifact = artifacts[self.mode]
        return artifact, self.methods(artifact, context, bf16_bytes)


def _coded(ratio: float, pool: str = "global", extra: tuple = ()):
    def methods(artifact, context, bf16_bytes):
        bits = bits_for(artifact, bf16_bytes / ratio, pool, context, bf16_bytes)
        return [patchkv.SinksWindow(*EXACT), patchkv.Quantized(bits, pool=pool), *extra]
    return methods


def _quantized_cache(backend: str, nbits: int):
    from transformers import QuantizedCache

    return lambda model: QuantizedCache(backend=backend, config=model.config, nbits=nbits, q_group_size=64,
                                        residual_length=128)


CONFIGS: dict[str, Config] = {c.name: c for c in (
    Config("unpatched"),
    Config("quanto-int4", cache=_quantized_cache("quanto", 4), note="QuantizedCache quanto int4 g64 residual 128"),
    Config("4x", "pre_rope", _coded(4), note="global pre-RoPE codes, 4x vs bf16"),
    Config("8x", "pre_rope", _coded(8), note="global pre-RoPE codes, 8x vs bf16"),
    Config("16x", "pre_rope", _coded(16), note="global pre-RoPE codes, 16x vs bf16"),
    Config("8x-top256", "pre_rope", _coded(8, extra=(patchkv.TopK(256, 16),)),
           note="8x + decode over the best 256 latent tokens per KV head"),
    Config("8x-post", "post_rope", _coded(8), note="global post-RoPE codes, 8x vs bf16"),
)}


def load_artifacts(dtype: torch.dtype = torch.bfloat16, bases: Path = BASES) -> dict[str, patchkv.Artifact]:
    return {mode: patchkv.Artifact.load(bases / f"{mode}.safetensors").to_dtype(dtype)
            for mode in ("pre_rope", "post_rope")}


def provenance() -> dict:
    """Commit (with `+dirty` if the tree has changes), command, machine, threads, versions, date."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    dirty = git("status", "--porcelain", "--untracked-files=no")
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers

    return {"commit": git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty and dirty != "unknown" else ""),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": f"{cpu}, {os.cpu_count()} cores",
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_provenance(path: Path, extra: dict | None = None) -> Path:
    """`<path>.provenance.json` beside a result file."""
    side = path.with_name(path.name + ".provenance.json")
    side.write_text(json.dumps({**provenance(), **(extra or {})}, indent=2) + "\n")
    return side
