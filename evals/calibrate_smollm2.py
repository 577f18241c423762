"""Calibrate the shipped SmolLM2-135M-Instruct bases on the general-domain mix (committed command).

    python evals/calibrate_smollm2.py --out artifacts/smollm2-bases

The mix interleaves 8,000-character pieces of modern technical prose (evals/data/prose_calibration.txt,
Python docs held out of the prose evaluation) and verse/drama (the Shakespeare training works, none of the
held-out plays), so neither domain dominates; Milton is never seen (cross-domain check). The first
`--sink-tokens` positions of every 512-token sequence are left out of the statistics (attention sinks
are outliers that would skew the bases; `SinksWindow` keeps them exact at inference). Effect weights
(`patchkv.fisher`, for `Quantized(pool="global")`) are measured on the first `--fisher-tokens` tokens with the
4 sinks and a 32-token window exact, as `SinksWindow(4, 32)` serves them. The model runs in bfloat16, as it is
evaluated; moments and Fisher matrices are accumulated in float64.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchkv
from patchkv.corpus import shakespeare_train

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"


def pieces(text: str, size: int = 8000) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def general_mix() -> list[str]:
    """Prose and verse pieces, alternating."""
    prose = pieces((ROOT / "evals" / "data" / "prose_calibration.txt").read_text(encoding="utf-8"))
    verse = pieces("\n\n".join(shakespeare_train()))
    return [p for pair in itertools.zip_longest(prose, verse) for p in pair if p]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "smollm2-bases"))
    ap.add_argument("--max-tokens", type=int, default=65_536)
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--modes", default="pre_rope,post_rope")
    ap.add_argument("--fisher-tokens", type=int, default=8192)
    ap.add_argument("--fisher-window", type=int, default=32)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16).eval()
    for mode in args.modes.split(","):
        artifact = patchkv.calibrate(model, general_mix(), tokenizer=tokenizer, mode=mode, rank=32,
                                     max_tokens=args.max_tokens, sink_tokens=args.sink_tokens,
                                     fisher_tokens=args.fisher_tokens, fisher_window=args.fisher_window,
                                     source="general mix: Python docs prose + Shakespeare training works")
        print(artifact.save(Path(args.out) / f"{mode}.safetensors"), artifact)


if __name__ == "__main__":
    main()
