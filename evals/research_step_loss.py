"""Step scales on a restricted vocabulary: does the loss over a few thousand tokens pick what the full loss picks?

    .venv/bin/python -m evals step-loss --model .models/SmolLM2-135M-Instruct \
        --artifact artifacts/smollm2-bases/pre_rope.safetensors --budget 16x --out evals/results   # ~12 min, one core
    .venv/bin/python -m evals step-loss --model .models/gemma-3-270m \
        --artifact artifacts/gemma3-bases/pre_rope.safetensors --budget 8x --points path --out evals/results

`fit_step_scales` reads its loss over the text's tokens and each position's `top` likeliest tokens under the
unpatched model (`patchkv.step_scales.loss_vocabulary`), not the whole vocabulary, whose head is most of each trial's
time on a 262k-token model. This scores every candidate of the step-scale grid (`--points grid`: all 16 pairs;
`path`: the 7 a two-pass coordinate search tries from (1, 1) when keys 1.25 win) once through the cache, as the fit
does (`patchkv calibrate`'s held-out rows, 64 tokens per forward, the budget at 2,048 tokens), and reads from the same
logits the full loss and the restricted ones for `--tops`. Output `step_loss_<model>_<budget>.csv` (+ provenance):
per candidate, each loss; the summary printed and in the sidecar: pairs of candidates ordered alike by the full and
each restricted loss, and the best candidate of each.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

import patchkv
from patchkv.artifact import Artifact
from patchkv.budgets import parse_budget
from patchkv.cli import _held_out_rows, _load_model
from patchkv.step_scales import GRID, loss_vocabulary, with_step_scales
from patchkv.texts import read_texts

from .suite import write_csv, write_provenance
from .verbs import parse, parser

#: the two-pass coordinate search's candidates when keys 1.25 win the first pass (the shipped Gemma fits' path)
PATH = ((1.0, 1.0), (1.25, 1.0), (1.5, 1.0), (1.75, 1.0), (1.25, 1.25), (1.25, 1.5), (1.25, 1.75))


def losses(model, rows: torch.Tensor, vocabularies: dict[int, torch.Tensor], chunk: int) -> dict[str, float]:
    """Mean next-token NLL of `rows` `[batch, seq]` fed `chunk` tokens per forward through the model's cache: over
    the whole vocabulary ("full") and over each of `vocabularies` (its `top`: sorted token ids)."""
    total, count, cache = {"full": 0.0, **{top: 0.0 for top in vocabularies}}, 0, None
    with torch.no_grad():
        for start in range(0, rows.shape[1], chunk):
            out = model(input_ids=rows[:, start:start + chunk], cache=cache, use_cache=True)
            cache = out.cache
            targets = rows[:, start + 1:start + 1 + chunk]
            if not targets.shape[1]:
                continue
            logits = out.logits[:, :targets.shape[1]].float()
            total["full"] -= logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).sum().item()
            for top, vocabulary in vocabularies.items():
                at = torch.searchsorted(vocabulary, targets.contiguous())
                total[top] -= logits[..., vocabulary].log_softmax(-1).gather(-1, at.unsqueeze(-1)).sum().item()
            count += targets.numel()
    return {str(k): v / count for k, v in total.items()}


def main(argv: list[str] | None = None) -> None:
    p = parser("step-loss", __doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--artifact", required=True)
    p.add_argument("--budget", default="16x")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--points", choices=("grid", "path"), default="grid")
    p.add_argument("--tops", default="16,64,256")
    args = parse(p, argv)
    model, tokenizer = _load_model(args.model, "auto")
    rows = _held_out_rows(read_texts(None), tokenizer, 2048)
    artifact = Artifact.load(args.artifact)
    vocabularies = {int(t): loss_vocabulary(model, rows, int(t)) for t in args.tops.split(",")}
    methods = parse_budget(args.budget).methods(artifact, args.context)
    bits, pool = methods[1].bits, methods[1].pool
    points = list(itertools.product(GRID, GRID)) if args.points == "grid" else list(PATH)
    table = []
    for keys, values in points:
        with patchkv.patched(model, with_step_scales(artifact, keys, values, bits=bits, pool=pool), methods):
            scored = losses(model, rows, vocabularies, 64)
        table.append({"keys": keys, "values": values, **{f"loss_{k}": round(v, 6) for k, v in scored.items()}})
        print(table[-1], flush=True)
    summary = {"vocabulary": {t: int(v.numel()) for t, v in vocabularies.items()},
               "vocab_size": model.get_output_embeddings().weight.shape[0], "budget": args.budget, "bits": bits}
    for top in vocabularies:
        pairs = list(itertools.combinations(table, 2))
        alike = sum((a["loss_full"] - b["loss_full"]) * (a[f"loss_{top}"] - b[f"loss_{top}"]) > 0 for a, b in pairs)
        best = min(table, key=lambda r: r[f"loss_{top}"])
        summary[f"top{top}"] = {"pairs_ordered_alike": f"{alike}/{len(pairs)}",
                                "best": [best["keys"], best["values"]]}
    full = min(table, key=lambda r: r["loss_full"])
    summary["best_full"] = [full["keys"], full["values"]]
    print(summary)
    name = f"step_loss_{Path(args.model).name}_{args.budget}.csv"
    write_csv(table, args.out / name)
    write_provenance(args.out / name, {"summary": summary})


if __name__ == "__main__":
    main()
