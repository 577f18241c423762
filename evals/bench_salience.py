"""What a salience scorer costs: the seconds it spends scoring a prefill's tokens as a fraction of that prefill.

    python -m evals salience --context 4096 --rounds 3 --out evals/results

SmolLM2 in bfloat16 with its shipped bases, one forward of `context` tokens of held-out prose through a patched model
(16x codes and each scorer keeping 1/128 exact, `evals.suite`); the scorer's own calls are timed inside the same
forward, so the ratio holds on a busy machine. Median over rounds, one row per scorer, in `salience_cost.csv`.
"""

from __future__ import annotations

import statistics
import time

import torch

import patchkv
from patchkv.methods import Salience

from .suite import CONFIGS, load_artifacts, load_smollm2, write_csv
from .tasks import TASKS
from .verbs import parse, parser


def measure(model, tokenizer, artifacts, config: str, context: int) -> tuple[float, float]:
    """(seconds of one prefill of `context` tokens under `config`, seconds its scorer took inside it)."""
    artifact, methods = CONFIGS[config].patch(artifacts, context)
    ids = tokenizer(TASKS["ppl_prose"].documents()[0], return_tensors="pt").input_ids[:, :context]
    scorer = next(m for m in methods if isinstance(m, Salience))
    spent = []
    original = type(scorer).score

    def timed(self, *args):
        start = time.perf_counter()
        out = original(self, *args)
        spent.append(time.perf_counter() - start)
        return out

    type(scorer).score = timed
    try:
        with patchkv.patched(model, artifact, methods), torch.inference_mode():
            start = time.perf_counter()
            model(ids, use_cache=True)
            total = time.perf_counter() - start
    finally:
        type(scorer).score = original
    return total, sum(spent)


def main(argv: list[str] | None = None) -> None:
    p = parser("salience", __doc__)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="16x-novelty,16x-codeerror,16x-keynorm")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    runs = {c: [] for c in args.configs.split(",")}
    for _ in range(args.rounds):
        for config in runs:  # interleaved, so every scorer sees the same machine
            runs[config].append(measure(model, tokenizer, artifacts, config, args.context))
    rows = [{"config": config, "context": args.context, "rounds": args.rounds, "threads": args.threads,
             "prefill_s": round(statistics.median(t for t, _ in r), 3),
             "scoring_s": round(statistics.median(s for _, s in r), 4),
             "scoring_fraction_of_prefill": round(statistics.median(s / t for t, s in r), 4)}
            for config, r in runs.items()]
    for row in rows:
        print(row)
    write_csv(rows, args.out / "salience_cost.csv")
