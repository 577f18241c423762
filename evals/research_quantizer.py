"""Research: two changes to the 16x codes that keep the bytes fixed, measured through the real cache.

    .venv/bin/python -m evals quantizer --out evals/results --ratios 16   # about 12 minutes on one core

SmolLM2-135M-Instruct in bfloat16, the shipped pre-RoPE artifact, held-out perplexity of the first document of
each perplexity task (prose, Shakespeare, Milton; 4,096 tokens fed 64 per forward through the `LatentCache`, as
`python -m evals run` scores them), at 16x and 32x (global pool, every byte counted):

- **the split between the exact window and the codes**: `SinksWindow(4, w)` for w in 8, 16, 32 (what the suite
  runs), 64, 128, each with the most bits per head that fit the same bytes (`bits_for_ratio`); a window too wide
  for the budget is skipped;
- **a rotation inside equal-bit groups** (`RotatedQuantized`): within each head, the components that get the same
  number of bits are turned by a seeded random orthogonal matrix before the scalar quantizer and back after, so
  heavy-tailed coefficients are mixed with others of the same rate (QuaRot / KVTC-style spreading of outliers). The
  rotation is folded into the basis (the codes stay fixed-rate and the kernels unchanged); each rotated component's
  step is matched to its variance (the diagonal of the rotated covariance).

Results: `quantizer_variants.csv` (+ provenance sidecar), one row per variant and document: NLL sum, tokens,
perplexity, change against unpatched on the same document, bytes per token held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import patchkv
from patchkv.allocation import bit_allocation, step_scales_for
from patchkv.budgets import bits_for_ratio
from patchkv.latent import LatentBasis
from patchkv.methods import Quantized, SinksWindow
from patchkv.methods.quantized import QuantizedCodec

from .suite import load_artifacts, load_smollm2, write_csv
from .tasks import TASKS
from .verbs import parse, parser

WINDOWS = (8, 16, 32, 64, 128)
RATIOS = (16, 32)
TASK_NAMES = ("ppl_prose", "ppl_shakespeare", "ppl_milton")


@dataclass(frozen=True)
class RotatedQuantized(Quantized):
    """`Quantized` with each head's equal-bit components turned by a seeded random orthogonal matrix (research)."""

    seed: int = 0

    def spec(self) -> str:
        return super().spec() + f",rotate={self.seed}"

    def codecs(self, artifact, query_groups, dtype):
        allocation = bit_allocation(artifact, self.bits, self.pool)
        scales = step_scales_for(artifact, self.bits, self.pool)
        gen = torch.Generator().manual_seed(self.seed)
        out = []
        for i, (groups, key_bits, value_bits) in enumerate(zip(query_groups, *allocation)):
            pair = []
            for kind, c, bits in ((0, artifact.keys, key_bits), (1, artifact.values, value_bits)):
                vectors, variances = c.eigenvectors[i].double().clone(), c.eigenvalues[i].double().clamp_min(0).clone()
                for h in range(bits.shape[0]):
                    for b in bits[h].unique().tolist():
                        same = (bits[h] == b).nonzero().squeeze(1)
                        if b == 0 or len(same) < 2:
                            continue
                        q, r = torch.linalg.qr(torch.randn(len(same), len(same), generator=gen, dtype=torch.float64))
                        q = q * r.diagonal().sign()
                        vectors[h][:, same] = vectors[h][:, same] @ q
                        variances[h, same] = (q * variances[h, same].unsqueeze(1) * q).sum(0)
                ranks = [int((row > 0).nonzero().max()) + 1 if row.any() else 1 for row in bits]
                basis = LatentBasis(c.mean[i], vectors.to(c.eigenvectors.dtype), ranks, groups, dtype)
                pair.append(QuantizedCodec(basis, bits, variances.to(c.eigenvalues.dtype),
                                           None if scales is None else scales[kind][i]))
            out.append(tuple(pair))
        return out


def variants(artifact, context: int, ratios: tuple[float, ...] = RATIOS) -> dict[str, list | None]:
    out: dict[str, list | None] = {"unpatched": None}
    for ratio in ratios:
        for window in WINDOWS:
            try:
                bits = bits_for_ratio(artifact, ratio, pool="global", context=context, sink_tokens=4, window=window)
            except ValueError:  # the window alone takes more than the budget
                continue
            out[f"{ratio:g}x w={window}"] = [SinksWindow(4, window), Quantized(bits, pool="global")]
        bits = bits_for_ratio(artifact, ratio, pool="global", context=context)
        out[f"{ratio:g}x rotated"] = [SinksWindow(4, 32), RotatedQuantized(bits, pool="global")]
    return out


def main(argv: list[str] | None = None) -> None:
    p = parser("quantizer", __doc__)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--ratios", default="16,32", help="compression ratios to try the variants at")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifact = load_artifacts()["pre_rope"]
    rows, base = [], {}
    for name, methods in variants(artifact, args.context, tuple(float(r) for r in args.ratios.split(","))).items():
        for task in TASK_NAMES:
            if methods is None:
                scored = TASKS[task].run(model, tokenizer, 0, args.context, None)
            else:
                with patchkv.patched(model, artifact, methods):
                    scored = TASKS[task].run(model, tokenizer, 0, args.context, None)
            ppl = math.exp(scored.score / scored.count)
            base.setdefault(task, ppl) if methods is None else None
            rows.append({"variant": name, "methods": " + ".join(m.spec() for m in methods or []), "task": task,
                         "document": 0, "nll": round(scored.score, 3), "tokens": scored.count, "ppl": round(ppl, 4),
                         "vs_unpatched_pct": round(100 * (ppl / base[task] - 1), 2),
                         "kv_bytes_per_token": round(scored.kv_bytes_per_token, 1)})
            print(rows[-1], flush=True)
    write_csv(rows, args.out / "quantizer_variants.csv")


if __name__ == "__main__":
    main()
