"""Effect weights measured on retrieval as well as prose: does the bit pool, told what retrieval reads, keep
needles in real text at 16x?

    PATCHKV_EVALS_DTYPE=float32 .venv/bin/python -m evals retrieval-weights --variants shipped,mixed --threads 2
    # -> evals/results/retrieval_weights.csv and _shares.csv: 35 minutes on 2 AVX2 cores in float32

The shipped effect weights (`patchkv.fisher`) are the Fisher of the summed next-token loss on 512-token prose and
verse rows: what continuation reads. A needle asked for 4k tokens later is read by other heads. Here the Fisher is
measured again on `--rows` retrieval rows of `--seq` tokens: the calibration prose (evals/data/prose_calibration.txt,
never scored) with a 7-digit needle at a random depth in one of four wordings of their own (`NEEDLES`, none of
`needle_text`'s), the question after it and the answer; the loss is the answer's tokens only (`FisherCapture.step`'s
`scored`), the gradients those of the context tokens that will be coded (after the sinks, before the window), 4
sinks and a 32-token window exact as `SinksWindow` serves them. Rows are seeded: the same on every run. The Fisher
sums are kept in `.cache/retrieval_fisher/` and read back on the next run.

Variants of the pre-RoPE artifact, every other field as shipped (bases, step scales):
- `shipped`: its effect weights;
- `mixed`: each kind's weights from the prose Fisher and the retrieval Fisher, each scaled to the same total effect
  (sum over components of variance x weight, keys and values together) and added: equal say;
- `mixedK`: the retrieval Fisher's scaled to K times the prose's total effect;
- `retrieval`: the retrieval Fisher's alone.
Each runs `--config` (a suite configuration) on `needle_text` samples `--samples` and on the `--ppl` documents of
`ppl_prose` (the suite's protocol, 64 tokens a forward). Output: `retrieval_weights.csv` (variant, task, index,
score, count, bytes per token, answer) and `retrieval_weights_shares.csv` (each layer's share of the keys' and the
values' effect under the prose and the retrieval Fisher, and the bits per token its codes get in each variant;
`--shares-only` writes this one alone).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import torch

import patchkv
from patchkv.adapters import adapter_for, attention_modules
from patchkv.fisher import FisherCapture, effect_weights

from .suite import CONFIGS, ROOT, SMOLLM2, load_artifacts, load_smollm2, write_csv
from .tasks import NEEDLE_INTRO, TASKS, hide_needle
from .verbs import parse, parser

#: (the sentence hidden in the text, the question that asks for it): wordings of their own, none of needle_text's
NEEDLES = (
    ("The code word for the vault is {n}.", "What is the code word for the vault? The code word for the vault is"),
    ("Please note that the locker combination is {n}.", "What is the locker combination? The locker combination is"),
    ("The ticket number of the lost suitcase was {n}.",
     "What was the ticket number of the lost suitcase? The ticket number was"),
    ("Remember this: the captain's lucky number is {n}.",
     "What is the captain's lucky number? The captain's lucky number is"),
)
SINKS, WINDOW = 4, 32
CACHE = ROOT / ".cache" / "retrieval_fisher"
FIELDS = ("variant", "config", "task", "index", "score", "count", "kv_bytes_per_token", "prediction")


def retrieval_row(tokenizer, text: str, seq: int, seed: int) -> tuple[torch.Tensor, int]:
    """One seeded retrieval row of about `seq` tokens: (ids `[1, n]`, where the answer starts). The intro of
    `needle_text`, a piece of `text` with a needle of `NEEDLES` at a depth in [10%, 90%] (moved to a line break),
    the question, the answer (" 1234567.")."""
    rng = random.Random(seed)
    start = rng.randrange(0, len(text) - 4 * 8 * seq)
    piece = text[start:start + 8 * seq]
    needle, question = NEEDLES[seed % len(NEEDLES)]
    number = str(rng.randrange(1_000_000, 10_000_000))
    question_ids = tokenizer("\n\n" + question, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(" " + number + ".", add_special_tokens=False)["input_ids"]
    intro = tokenizer(NEEDLE_INTRO, add_special_tokens=False)["input_ids"]
    room = seq - len(question_ids) - len(answer_ids) - len(intro) - 30  # the needle's own tokens
    hidden, _ = hide_needle(tokenizer, piece, needle.format(n=number), room, rng)
    context = tokenizer(NEEDLE_INTRO + hidden, add_special_tokens=False)["input_ids"]
    return torch.tensor([context + question_ids + answer_ids]), len(context) + len(question_ids)


def retrieval_fisher(model, tokenizer, rows: int, seq: int) -> dict:
    """The Fisher sums of the answers' loss over `rows` retrieval rows (per head and per layer, keys and values,
    float64) and the count of tokens they were summed over; read from `CACHE` when measured before."""
    path = CACHE / f"{rows}x{seq}.pt"
    if path.exists():
        return torch.load(path)
    text = (ROOT / "evals" / "data" / "prose_calibration.txt").read_text(encoding="utf-8")
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    with torch.no_grad(), FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=SINKS, window=WINDOW,
                                        layers=True) as fisher:
        for row in range(rows):
            ids, answer = retrieval_row(tokenizer, text, seq, 1000 + row)
            n = ids.shape[1]
            positions = torch.arange(n).unsqueeze(0)
            counted = (positions >= SINKS) & (positions < answer - WINDOW)  # the context tokens that are coded
            loss = fisher.step(ids, torch.ones_like(ids), positions, counted, torch.device("cpu"),
                               scored=positions >= answer)
            print(f"retrieval row {row}: {n} tokens, answer {loss / (n - answer):.3f} nats a token", flush=True)
    out = {"keys": fisher.keys, "values": fisher.values, "layer_keys": fisher.layer_keys,
           "layer_values": fisher.layer_values, "count": fisher.count}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def reweighted(artifact: patchkv.Artifact, fisher: dict, prose: float, retrieval: float) -> patchkv.Artifact:
    """`artifact` with each kind's effect weights (per head and per layer) `prose` x its own + `retrieval` x the
    retrieval Fisher's, each first scaled to a total effect of 1 (sum of variance x weight over both kinds)."""
    measured = {kind: (effect_weights(fisher[kind] / fisher["count"], getattr(artifact, kind).eigenvectors),
                       effect_weights(fisher[f"layer_{kind}"] / fisher["count"],
                                      getattr(artifact, kind).layer_eigenvectors))
                for kind in ("keys", "values")}
    total_prose = sum(float((getattr(artifact, k).weights.double() * getattr(artifact, k).eigenvalues.double()).sum())
                      for k in measured)
    total_retrieval = sum(float((measured[k][0] * getattr(artifact, k).eigenvalues.double()).sum()) for k in measured)
    out = copy.copy(artifact)
    for kind, (head, layer) in measured.items():
        c = getattr(artifact, kind)
        mix = lambda own, new: (prose * own.double() / total_prose + retrieval * new / total_retrieval  # noqa: E731
                                ).to(own.dtype)
        setattr(out, kind, dataclasses.replace(c, weights=mix(c.weights, head), layer_weights=mix(c.layer_weights,
                                                                                                   layer)))
    return out


def code_bits(model, patch) -> list[dict[str, int]]:
    """Bits per token each layer's middle codes hold under `patch` (artifact, methods), keys and values, all heads."""
    with patchkv.patched(model, *patch):
        return [{kind: int(sum(bin(int(m)).count("1") for m in getattr(layer.self_attn.patchkv, kind).table.mask))
                 for kind in ("keys", "values")} for layer in model.model.layers]


def shares(artifact: patchkv.Artifact, fisher: dict, bits: dict[str, list[dict[str, int]]]) -> list[dict]:
    """Each layer's share of each kind's total effect under the shipped (prose) weights and the retrieval Fisher, and
    the bits per token its codes get in each variant (`bits`: variant -> `code_bits`)."""
    rows = []
    for kind in ("keys", "values"):
        c = getattr(artifact, kind)
        prose = (c.weights.double() * c.eigenvalues.double()).sum((1, 2))
        retrieval = (effect_weights(fisher[kind] / fisher["count"], c.eigenvectors) * c.eigenvalues.double()).sum((1, 2))
        rows += [{"kind": kind, "layer": layer, "prose": round(float(p / prose.sum()), 4),
                  "retrieval": round(float(r / retrieval.sum()), 4),
                  **{f"bits_{name}": per_layer[layer][kind] for name, per_layer in bits.items()}}
                 for layer, (p, r) in enumerate(zip(prose, retrieval))]
    return rows


def weights(variant: str) -> tuple[float, float] | None:
    """A variant's (prose, retrieval) shares of the effect weights: "shipped" None (the artifact's own), "mixed"
    (1, 1), "mixedK" (1, K), "retrieval" (0, 1)."""
    if variant == "shipped":
        return None
    if variant == "retrieval":
        return 0.0, 1.0
    try:
        return 1.0, float(variant.removeprefix("mixed") or 1)
    except ValueError:
        raise SystemExit(f"retrieval-weights: variant {variant!r} is none of shipped, mixed, mixedK (K a number), "
                         "retrieval") from None


def main(argv: list[str] | None = None) -> None:
    p = parser("retrieval-weights", __doc__, threads=2, name="retrieval_weights")
    p.add_argument("--config", default="16x", help="the suite configuration every variant runs")
    p.add_argument("--variants", default="shipped,mixed,retrieval", help="shipped, mixed, mixedK, retrieval")
    p.add_argument("--rows", type=int, default=24, help="retrieval rows the Fisher is measured on")
    p.add_argument("--seq", type=int, default=2048, help="tokens per retrieval row")
    p.add_argument("--samples", type=int, default=30, help="needle_text samples 0..n-1 at 4k")
    p.add_argument("--ppl", type=int, default=2, help="ppl_prose documents at 4k")
    p.add_argument("--shares-only", action="store_true", help="write the shares (and bits) CSV only")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    fisher = retrieval_fisher(model, tokenizer, args.rows, args.seq)
    variants = {name: dict(artifacts, pre_rope=reweighted(artifacts["pre_rope"], fisher, *mix))
                if (mix := weights(name)) else artifacts for name in args.variants.split(",")}
    config = CONFIGS[args.config]
    bits = {name: code_bits(model, config.patch(variant, 4096)) for name, variant in variants.items()}
    write_csv(shares(artifacts["pre_rope"], fisher, bits), args.out / f"{args.name}_shares.csv",
              extra={"rows": args.rows, "seq": args.seq, "config": config.name})
    if args.shares_only:
        return
    needle, prose = TASKS["needle_text"], TASKS["ppl_prose"]
    work = [(needle, s) for s in needle.samples(4096, args.samples, SMOLLM2)] + \
        [(prose, index) for index in range(args.ppl)]
    rows = []
    for task, sample in work:
        for name, variant in variants.items():
            with torch.no_grad(), patchkv.patched(model, *config.patch(variant, 4096)):
                scored = task.run(model, tokenizer, sample, None, config.name) if task is needle else \
                    task.run(model, tokenizer, sample, 4096, None, config.name)
            rows.append({"variant": name, "config": config.name, "task": task.name, "index": scored.index,
                         "score": round(scored.score, 4), "count": scored.count,
                         "kv_bytes_per_token": round(scored.kv_bytes_per_token, 1),
                         "prediction": scored.prediction[:40]})
            print(rows[-1], flush=True)
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS, extra={"rows": args.rows, "seq": args.seq})
    for name in variants:
        found = [r["score"] for r in rows if r["variant"] == name and r["task"] == "needle_text"]
        nll = [r for r in rows if r["variant"] == name and r["task"] == "ppl_prose"]
        ppl = torch.tensor(sum(r["score"] for r in nll) / max(1, sum(r["count"] for r in nll))).exp().item()
        print(f"== {name}: needle_text {sum(found):g} of {len(found)}, ppl_prose {ppl:.3f}", flush=True)


if __name__ == "__main__":
    main()
