"""What every benchmark shares: the reference model, the named configurations (registry), provenance.

    from evals.suite import CONFIGS, load_smollm2
    model, tokenizer = load_smollm2()
    patch = CONFIGS["8x"].patch(artifacts, context=4096)   # (artifact, methods) or None for a cache config

A configuration is methods + artifact + budget: `patchkv` configs compress the cache at a ratio against the bf16
cache, every byte counted (codes, the exact sinks and window, the int32 positions) at the context they run at;
`QuantizedCache` configs are transformers' own quantized cache. Every result file a benchmark writes has a
provenance sidecar (`<file>.provenance.json`: commit, command, machine, threads, versions, date).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import patchkv
from patchkv.budgets import Budget
from patchkv.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
BASES = ROOT / "artifacts" / "smollm2-bases"


def load_smollm2(dtype: torch.dtype = torch.bfloat16, attn: str = "sdpa"):
    """(model, tokenizer): SmolLM2-135M-Instruct from the folder `scripts/setup.sh` writes, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=dtype, attn_implementation=attn).eval()
    return model, AutoTokenizer.from_pretrained(SMOLLM2)


@dataclass(frozen=True)
class Config:
    """A named configuration: `unpatched`, a patchkv patch (`mode` artifact, methods built for the context by
    `methods`), or transformers' QuantizedCache (`cache`)."""

    name: str
    mode: str | None = None
    methods: Callable[[patchkv.Artifact, int], list] | None = None
    cache: Callable[[object], object] | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "patchkv" if self.mode else "quantized_cache" if self.cache else "unpatched"

    def patch(self, artifacts: dict[str, patchkv.Artifact], context: int):
        """(artifact, methods) for `patchkv.patched`, or None."""
        if self.mode is None:
            return None
        artifact = artifacts[self.mode]
        return artifact, self.methods(artifact, context)


def _coded(ratio: float, pool: str = "global", extra: tuple = (), basis: str = "head", salience=None):
    def methods(artifact, context):
        return [*Budget(ratio=ratio, pool=pool, basis=basis, salience=salience).methods(artifact, context), *extra]
    return methods


#: the salient fraction the suite's salience configs keep exact per KV head (paid for from the same budget)
SALIENT_FRACTION = 1 / 128


def _salient(ratio: int, scorer: type) -> Config:
    method = scorer(SALIENT_FRACTION)
    return Config(f"{ratio}x-{method.name.replace('_', '')}", "pre_rope", _coded(ratio, salience=method),
                  note=f"global pre-RoPE codes + {method.spec()} exact, {ratio}x vs bf16",
                  extra={"family": f"patchkv+{method.name}"})


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
    Config("32x", "pre_rope", _coded(32), note="global pre-RoPE codes, 32x vs bf16"),
    Config("8x-layer", "pre_rope", _coded(8, basis="layer"), note="global pre-RoPE codes on layer bases, 8x vs bf16",
           extra={"family": "patchkv-layer"}),
    Config("16x-layer", "pre_rope", _coded(16, basis="layer"), note="global pre-RoPE codes on layer bases, 16x vs bf16",
           extra={"family": "patchkv-layer"}),
    Config("32x-layer", "pre_rope", _coded(32, basis="layer"), note="global pre-RoPE codes on layer bases, 32x vs bf16",
           extra={"family": "patchkv-layer"}),
    Config("8x-top256", "pre_rope", _coded(8, extra=(patchkv.TopK(256, 16),)),
           note="8x + decode over the best 256 latent tokens per KV head"),
    Config("8x-post", "post_rope", _coded(8), note="global post-RoPE codes, 8x vs bf16"),
    *(_salient(ratio, scorer) for ratio in (8, 16, 32) for scorer in (patchkv.Novelty, patchkv.CodeError,
                                                                       patchkv.KeyNorm, patchkv.AttentionMass)),
)}


def load_artifacts(dtype: torch.dtype = torch.bfloat16, bases: Path = BASES) -> dict[str, patchkv.Artifact]:
    return {mode: patchkv.Artifact.load(bases / f"{mode}.safetensors").to_dtype(dtype)
            for mode in ("pre_rope", "post_rope")}


def write_csv(rows: list[dict], path: Path) -> Path:
    """`rows` to the CSV `path` (columns from the first row), with its provenance sidecar."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_provenance(path)
    print(f"wrote {path}")
    return path


def write_provenance(path: Path, extra: dict | None = None) -> Path:
    """`<path>.provenance.json` beside a result file."""
    side = path.with_name(path.name + ".provenance.json")
    side.write_text(json.dumps({**provenance(), **(extra or {})}, indent=2) + "\n")
    return side
