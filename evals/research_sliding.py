"""Research: pricing the bit pool by the tokens each layer holds, on Gemma 3 270M (15 of 18 layers slide over 512).

    .venv/bin/python -m evals sliding --out evals/results --context 2048   # about 10 minutes on one core

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

from patchkv.artifact import Artifact
from patchkv.budgets import EXACT, bits_for_ratio, parse_budget, sixteen_bit_bytes
from patchkv.nbytes import cache_nbytes
from patchkv.methods import Quantized, SinksWindow
from patchkv.report import default_text

from .suite import GEMMA3_BASES, load_gemma3, perplexity, perplexity_fields, text_ids, write_csv
from .verbs import parse, parser

FIELDS = ("configuration", "methods", "context", "text", "kv_bytes_per_token", "vs_unpatched_cache", "perplexity",
          "change_pct")


def main(argv: list[str] | None = None) -> None:
    p = parser("sliding", __doc__)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ratios", type=float, nargs="+", default=[8, 16])
    args = parse(p, argv)
    model, tokenizer = load_gemma3()
    artifact = Artifact.load(GEMMA3_BASES / "pre_rope.safetensors")
    name, text = default_text()
    ids = text_ids(tokenizer, text, args.context)
    context = ids.shape[1]
    configs: list[tuple[str, list | None]] = [("unpatched", None)]
    for ratio in args.ratios:
        budget = parse_budget(f"{ratio:g}x")
        configs.append((f"{ratio:g}x alike", budget.methods(artifact, context)))
        bits = bits_for_ratio(artifact, ratio, pool="global", context=context, priced=True)
        configs.append((f"{ratio:g}x priced", [SinksWindow(*EXACT), Quantized(bits, pool="global", context=context)]))
    rows, base = [], None
    for label, methods in configs:
        scored = perplexity(model, ids, artifact, methods)
        base = scored.perplexity if base is None else base
        held = cache_nbytes(scored.cache) / context
        rows.append({"configuration": label, "methods": " + ".join(m.spec() for m in methods or []),
                     "context": context, "text": name, **perplexity_fields(scored, base, context),
                     "vs_unpatched_cache": round(sixteen_bit_bytes(artifact, context) / held, 2)})
        print(rows[-1], flush=True)
        write_csv(rows, args.out / "sliding_pricing.csv", FIELDS)


if __name__ == "__main__":
    main()
