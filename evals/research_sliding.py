"""Research: pricing the bit pool by the tokens each layer holds, on Gemma 3 270M (15 of 18 layers slide over 512).

    .venv/bin/python -m evals.research_sliding --out evals/results --context 2048   # about 10 minutes on one core

The shipped Gemma 3 artifact (`artifacts/gemma3-bases/pre_rope.safetensors`, `patchkv calibrate`'s defaults), the
model in bfloat16, token perplexity of the report's held-out prose (`patchkv.report.default_text`, `--context`
tokens fed 64 per forward through the `LatentCache`), at 8x and 16x against the 16-bit cache the unpatched model
really holds at that context (`sixteen_bit_bytes(artifact, context)`), every byte counted:

- **alike**: the budget as `parse_budget` builds it, every layer's bits priced alike;
- **priced**: the global pool priced at the context (a sliding layer's bits cost the 511 tokens it holds,
  `Quantized(..., context=)`), at the most bits per head whose cache fits the same bytes.

Both count each layer's codes over the tokens it really holds, and read the step scales of the nearest fitted
budget (`step_scales_for`; the shipped artifact's were fitted for pools priced alike). Results:
`sliding_pricing.csv` (+ provenance sidecar): configuration, bits, bytes per token held (measured on the cache),
perplexity and its change against unpatched.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import patchkv
from patchkv.artifact import Artifact
from patchkv.budgets import EXACT, bits_for_ratio, parse_budget, sixteen_bit_bytes
from patchkv.memory import cache_nbytes
from patchkv.methods import Quantized, SinksWindow
from patchkv.perplexity import token_nll
from patchkv.report import default_text

from .suite import ROOT, write_csv

ARTIFACT = ROOT / "artifacts/gemma3-bases/pre_rope.safetensors"
MODEL = ROOT / ".models/gemma-3-270m"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "evals/results")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ratios", type=float, nargs="+", default=[8, 16])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    artifact = Artifact.load(ARTIFACT)
    name, text = default_text()
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []  # as `patchkv report` feeds it
    ids = torch.tensor([(bos + tokenizer(text, add_special_tokens=False)["input_ids"])[:args.context]])
    context = ids.shape[1]
    configs: list[tuple[str, list | None]] = [("unpatched", None)]
    for ratio in args.ratios:
        budget = parse_budget(f"{ratio:g}x")
        configs.append((f"{ratio:g}x alike", budget.methods(artifact, context)))
        bits = bits_for_ratio(artifact, ratio, pool="global", context=context, priced=True)
        configs.append((f"{ratio:g}x priced", [SinksWindow(*EXACT), Quantized(bits, pool="global", context=context)]))
    rows, base = [], None
    for label, methods in configs:
        with (patchkv.patched(model, artifact, methods) if methods else torch.no_grad()):
            scored = token_nll(model, ids, 64)
        base = scored.perplexity if base is None else base
        held = cache_nbytes(scored.cache) / context
        rows.append({"configuration": label, "methods": " + ".join(m.spec() for m in methods or []),
                     "context": context, "text": name, "kv_bytes_per_token": round(held, 1),
                     "vs_unpatched_cache": round(sixteen_bit_bytes(artifact, context) / held, 2),
                     "perplexity": round(scored.perplexity, 4),
                     "change_pct": round(100 * (scored.perplexity / base - 1), 2)})
        print(rows[-1], flush=True)
        write_csv(rows, args.out / "sliding_pricing.csv")


if __name__ == "__main__":
    main()
