"""Calibrate the shipped SmolLM2-135M-Instruct bases on the general-domain mix (committed command).

    python -m evals calibrate --out artifacts/smollm2-bases

The mix interleaves 8,000-character pieces of modern technical prose (evals/data/prose_calibration.txt,
Python docs held out of the prose evaluation) and verse/drama (the Shakespeare training works, none of the
held-out plays), so neither domain dominates; Milton is never seen (cross-domain check). The first
`--sink-tokens` positions of every 512-token sequence are left out of the statistics (attention sinks
are outliers that would skew the bases; `SinksWindow` keeps them exact at inference). Effect weights
(`patchkv.fisher`, for `Quantized(pool="global")`) are measured on the first `--fisher-tokens` tokens with the
4 sinks and a 32-token window exact, as `SinksWindow(4, 32)` serves them. The model runs in bfloat16, as it is
evaluated; moments and Fisher matrices are accumulated in float64.

Step scales (`patchkv.step_scales`, artifact format version 4) are then fitted, for the `--step-modes` artifacts
(pre-RoPE by default), one set per budget in `--step-budgets` (each ratio resolved to `Quantized(bits,
pool="global")` at `--step-context` tokens, as `evals/suite.py` runs it) over `--step-grid`, with the same sinks
and window, on `--step-rows` sequences of `--step-seq` tokens from the ends of the two calibration sources.
`--steps-only` fits them on the artifacts already in `--out`, adding or replacing the sets of the budgets named
and keeping the others (calibration is deterministic, so a full run gives the same files).

Layer bases (artifact format version 5, for `Quantized(basis="layer")`) are calibrated with the per-head bases,
on the same tokens. `--layer-bases-only` adds them to the artifacts already in `--out` (one calibration pass with
effect weights, without step fits; its per-head bases must agree with the file's, or nothing is written; the
per-head effect weights in the file are kept, and how far the fresh ones differ is printed): the
shipped pre-RoPE artifact got its layer bases so, `--layer-bases-only --modes pre_rope --threads 1`. With
`--layers-per-basis S` each basis spans S layers (format version 7, what `python -m evals shared-basis --spanned`
reads).

The shipped pre-RoPE artifact's sets: 8x from `--step-budgets 8x --step-grid 1,1.25,1.5,1.75` (the first fit),
then 16x and 32x from `--steps-only --step-budgets 16x,32x --step-passes 2 --threads 1` (the default grid; keys,
then values); each fit's trials are in the artifact's `calibration["step_scale_fits"]`. 4x has no set of its own:
it reads none (its bits are beyond the 8x set's reach) and costs under 1% without one.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchkv
from patchkv.budgets import Budget
from patchkv.cli import budget_list, step_grid
from patchkv.corpus import shakespeare_train
from patchkv.step_scales import fit_step_scales

from .suite import BASES, ROOT, SMOLLM2
from .verbs import parse, parser


def pieces(text: str, size: int = 8000) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def general_mix() -> list[str]:
    """Prose and verse pieces, alternating."""
    prose = pieces((ROOT / "evals" / "data" / "prose_calibration.txt").read_text(encoding="utf-8"))
    verse = pieces("\n\n".join(shakespeare_train()))
    return [p for pair in itertools.zip_longest(prose, verse) for p in pair if p]


def main(argv: list[str] | None = None) -> None:
    ap = parser("calibrate", __doc__, out=BASES, threads=0)
    ap.add_argument("--max-tokens", type=int, default=65_536)
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--modes", default="pre_rope,post_rope")
    ap.add_argument("--fisher-tokens", type=int, default=8192)
    ap.add_argument("--fisher-window", type=int, default=32)
    ap.add_argument("--retrieval-rows", type=int, default=0,
                    help="retrieval rows mixed into the effect weights (patchkv.retrieval; the shipped bases: none)")
    ap.add_argument("--step-budgets", type=budget_list, default="8x,16x,32x",
                    help="budgets the step scales are fitted for, one set each")
    ap.add_argument("--step-context", type=int, default=4096, help="the context a ratio is met at")
    ap.add_argument("--step-grid", type=step_grid,
                    default=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0), help="step multipliers tried")
    ap.add_argument("--step-rows", type=int, default=2)
    ap.add_argument("--step-seq", type=int, default=2048)
    ap.add_argument("--step-modes", default="pre_rope", help="modes whose artifacts get step scales")
    ap.add_argument("--step-passes", type=int, default=3, help="keys, values, keys again (3) or keys, values (2)")
    ap.add_argument("--steps-only", action="store_true", help="refit the step scales of the artifacts in --out")
    ap.add_argument("--layer-bases-only", action="store_true", help="add layer bases to the artifacts in --out")
    ap.add_argument("--layers-per-basis", type=int, default=1,
                    help="layers each layer basis spans (format version 7 above 1: bases across layers)")
    args = parse(ap, argv)
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16).eval()
    ids = step_ids(tokenizer, args.step_rows, args.step_seq)
    step_modes = args.step_modes.split(",")
    for mode in args.modes.split(","):
        file = Path(args.out) / f"{mode}.safetensors"
        if args.layer_bases_only:
            artifact = with_layer_bases(patchkv.Artifact.load(file), calibrate(model, tokenizer, mode, args,
                                                                               args.fisher_tokens))
            print(artifact.save(file), artifact)
            continue
        if args.steps_only:
            if mode not in step_modes:
                continue
            artifact = patchkv.Artifact.load(file)
        else:
            artifact = calibrate(model, tokenizer, mode, args, args.fisher_tokens)
        if mode in step_modes:
            for budget in args.step_budgets:
                bits = Budget(budget.ratio, budget.bits, pool="global").quantized(artifact, args.step_context).bits
                artifact = fit_step_scales(model, artifact, ids, bits=bits, pool="global", grid=args.step_grid,
                                           passes=args.step_passes, sink_tokens=args.sink_tokens,
                                           window=args.fisher_window)
                fit = artifact.calibration["step_scale_fits"][-1]
                print(f"{mode} {budget} ({bits} bits per head): keys x{fit['keys']}, values x{fit['values']}; "
                      f"{artifact.save(file)}", flush=True)  # saved after each budget: a long fit can be split
        print(artifact.save(file), artifact)


def calibrate(model, tokenizer, mode: str, args: argparse.Namespace, fisher_tokens: int) -> patchkv.Artifact:
    return patchkv.calibrate(model, general_mix(), tokenizer=tokenizer, mode=mode, rank=32, max_tokens=args.max_tokens,
                             sink_tokens=args.sink_tokens, fisher_tokens=fisher_tokens,
                             fisher_window=args.fisher_window, layer_bases=True,
                             layers_per_basis=args.layers_per_basis, retrieval_rows=args.retrieval_rows,
                             source="general mix: Python docs prose + Shakespeare training works")


def with_layer_bases(artifact: patchkv.Artifact, fresh: patchkv.Artifact) -> patchkv.Artifact:
    """`artifact` with the layer bases of `fresh`, calibrated on the same tokens: their per-head spectra must agree."""
    for kind in ("keys", "values"):
        mine, theirs = getattr(artifact, kind), getattr(fresh, kind)
        if not torch.allclose(mine.eigenvalues.double(), theirs.eigenvalues.double(), rtol=1e-3, atol=1e-6):
            raise SystemExit(f"the fresh calibration's {kind} spectra differ from the artifact's: not the same data "
                             "or settings; nothing written.")
        if mine.weights is not None:  # effect weights are a gradient statistic: report, do not require, agreement
            old, new = mine.weights.double(), theirs.weights.double()
            change = (old - new).abs() / old.abs().clamp_min(1e-12)
            print(f"{kind} effect weights, fresh against the artifact's: median relative difference "
                  f"{change.median().item():.2e}, max {change.max().item():.2e}", flush=True)
        for name in ("layer_mean", "layer_eigenvalues", "layer_eigenvectors", "layer_weights"):
            setattr(mine, name, getattr(theirs, name))
    artifact.calibration["layer_bases"] = fresh.calibration["layer_bases"]
    return patchkv.Artifact(mode=artifact.mode, model=artifact.model, keys=artifact.keys, values=artifact.values,
                            calibration=artifact.calibration, step_budgets=artifact.step_budgets)


def step_ids(tokenizer, rows: int, seq: int) -> torch.Tensor:
    """`[rows, seq]` token ids, each row a BOS token and the last `seq - 1` tokens of the prose calibration text
    (even rows) or of the Shakespeare training works (odd rows), every row from a different stretch."""
    sources = [(ROOT / "evals" / "data" / "prose_calibration.txt").read_text(encoding="utf-8"),
               "\n\n".join(shakespeare_train())]
    out = []
    for row in range(rows):
        text = sources[row % 2][-(row // 2 + 1) * 8 * seq:]  # about 4 characters a token: ample
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        stretch = ids[len(ids) - (row // 2 + 1) * (seq - 1):][: seq - 1]
        out.append([tokenizer.bos_token_id, *stretch])
    return torch.tensor(out)


if __name__ == "__main__":
    main()
