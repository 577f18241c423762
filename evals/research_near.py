"""Research: how many of the newest coded tokens `NearCodes` keeps, and at how many times the bits of the rest,
chosen on calibration text.

    .venv/bin/python -m evals near-tokens --out evals/results --threads 1   # about 8 minutes on one core
    .venv/bin/python -m evals near-tokens --tokens 960 --factors 3,4 --name near_factors --out evals/results --threads 1

SmolLM2-135M-Instruct in bfloat16 with its shipped bases (`artifacts/smollm2-bases`), token perplexity through the
`LatentCache` (64 tokens per forward) of the last 4,096 tokens of the calibration mix `patchkv calibrate` reads
(`patchkv.texts.default_texts`: text the bases were fitted on, not the suite's held-out documents), at `--budget`
with and without near codes of each `--tokens` at twice the bits, then of 960 tokens at each of `--factors` times the
bits (each config paying for them from the same bytes, `parse_budget`).
Results: `<--name>.csv` (default `near_tokens.csv`, + provenance sidecar): budget, the middle's bits, KV bytes per token (measured on the
cache), perplexity and its change against unpatched.
"""

from __future__ import annotations

import torch

from patchkv.artifact import Artifact
from patchkv.budgets import parse_budget
from patchkv.texts import default_texts

from .suite import BASES, load_smollm2, perplexity, perplexity_fields, write_csv
from .verbs import parse, parser

CONTEXT = 4096


def main(argv: list[str] | None = None) -> None:
    p = parser("near-tokens", __doc__)
    p.add_argument("--budget", default="16x")
    p.add_argument("--tokens", default="224,480,960", help="near tokens at twice the bits, one config each")
    p.add_argument("--factors", default="", help="factors over the middle's bits for the default 960 near tokens")
    p.add_argument("--name", default="near_tokens", help="the CSV's name in --out")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifact = Artifact.load(BASES / "pre_rope.safetensors")
    text = tokenizer("\n\n".join(default_texts()), add_special_tokens=False)["input_ids"]
    ids = torch.tensor([([tokenizer.bos_token_id] + text)[-CONTEXT:]])
    base = perplexity(model, ids).perplexity
    rows = []
    budgets = [args.budget, *(f"{args.budget}+near:tokens={n}" for n in args.tokens.split(",") if n),
               *(f"{args.budget}+near:factor={f}" for f in args.factors.split(",") if f)]
    for budget in budgets:
        methods = parse_budget(budget).methods(artifact, CONTEXT)
        scored = perplexity(model, ids, artifact, methods)
        rows.append({"budget": budget, "middle_bits": methods[1].bits, "context": CONTEXT, "text": "calibration mix",
                     **perplexity_fields(scored, base, CONTEXT)})
        print(rows[-1], flush=True)
        write_csv(rows, args.out / f"{args.name}.csv")


if __name__ == "__main__":
    main()
