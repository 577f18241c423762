"""Effect weights measured on retrieval as well as prose: does the bit pool, told what retrieval reads, keep
needles in real text at 16x?

    PATCHKV_EVALS_DTYPE=float32 .venv/bin/python -m evals retrieval-weights --variants shipped,mixed --threads 2
    # -> evals/results/retrieval_weights.csv and _shares.csv: 35 minutes on 2 AVX2 cores in float32

The shipped effect weights (`patchkv.fisher`) are the Fisher of the summed next-token loss on 512-token prose and
verse rows: what continuation reads. A needle asked for 4k tokens later is read by other heads. Here the Fisher is
measured again on `--rows` retrieval rows of `--seq` tokens (`patchkv.retrieval.retrieval_row`, seeds 0 to rows - 1,
the rows `patchkv calibrate --retrieval-rows` measures): the calibration prose (evals/data/prose_calibration.txt, never
scored) with a 7-digit needle at a random depth in one of four wordings of their own (`patchkv.retrieval.WORDINGS`,
none of `needle_text`'s), the question after it and the answer; the loss is the answer's tokens only
(`FisherCapture.step`'s `scored`), the gradients those of the context tokens that will be coded (after the sinks,
before the window), 4 sinks and a 32-token window exact as `SinksWindow` serves them. The Fisher sums are kept in
`.cache/retrieval_fisher/` and read back on the next run.

Variants of the pre-RoPE artifact, every other field as shipped (bases, step scales):
- `shipped`: its effect weights;
- `mixed`: each kind's weights from the prose Fisher and the retrieval Fisher, each scaled to the same total effect
  (sum over components of variance x weight, keys and values together) and added: equal say
  (`patchkv.retrieval.mix_effect`, as `patchkv calibrate --retrieval-rows` mixes them);
- `mixedK`: the retrieval Fisher's at K times the prose's total effect;
- `retrieval`: the retrieval Fisher's alone.
- `--artifact NAME=FILE`: a pre-RoPE artifact of its own, e.g. one `patchkv calibrate` wrote with and without
  `--retrieval-rows` (the user's path: bases, weights and step scales all its own).
Each runs each of `--config` (suite configurations) on `needle_text` samples `--first` to `--samples` - 1 and on
the first `--ppl` documents of each of `--ppl-tasks` (the suite's protocol, 64 tokens a forward). Output:
`retrieval_weights.csv` (variant, config, task, index, score, count, bytes per token, answer) and
`retrieval_weights_shares.csv` (each layer's share of the keys' and the values' effect under the prose and the
retrieval Fisher, and the bits per token its codes get in each variant; `--shares-only` writes this one alone).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from pathlib import Path

import torch

import patchkv
from patchkv.adapters import adapter_for, attention_modules
from patchkv.fisher import FisherCapture, effect_weights
from patchkv.retrieval import measure, with_retrieval_weights

from .suite import CONFIGS, ROOT, SMOLLM2, load_artifacts, load_smollm2, models_dtype, write_csv
from .tasks import TASKS
from .verbs import parse, parser

SINKS, WINDOW = 4, 32
CACHE = ROOT / ".cache" / "retrieval_fisher"
FIELDS = ("variant", "config", "task", "index", "score", "count", "kv_bytes_per_token", "prediction")


def retrieval_fisher(model, tokenizer, rows: int, seq: int) -> dict:
    """The Fisher sums of the answers' loss over `rows` retrieval rows (per head and per layer, keys and values,
    float64) and the count of tokens they were summed over; read from `CACHE` when measured before."""
    path = CACHE / f"rows{rows}-seq{seq}.pt"
    if path.exists():
        return torch.load(path)
    text = (ROOT / "evals" / "data" / "prose_calibration.txt").read_text(encoding="utf-8")
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    with torch.no_grad(), FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=SINKS, window=WINDOW,
                                        layers=1) as fisher:
        losses = measure(fisher, tokenizer, text, range(rows), seq, torch.device("cpu"))
    print("retrieval rows' answer loss, nats a token:", [round(x, 3) for x in losses], flush=True)
    out = fisher.sums()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def reweighted(artifact: patchkv.Artifact, fisher: dict, share: float) -> patchkv.Artifact:
    """`artifact` with each kind's effect weights (per head and per layer) mixed with the retrieval Fisher's, the
    retrieval rows at `share` of the say (`patchkv.retrieval.with_retrieval_weights`)."""
    out = copy.copy(artifact)
    for kind, c in with_retrieval_weights({k: getattr(artifact, k) for k in ("keys", "values")}, fisher,
                                          share).items():
        setattr(out, kind, c)
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


def share(variant: str) -> float | None:
    """A variant's retrieval share of the effect weights: "shipped" None (the artifact's own), "mixed" 1/2, "mixedK"
    K/(1+K), "retrieval" 1."""
    if variant == "shipped":
        return None
    if variant == "retrieval":
        return 1.0
    try:
        k = float(variant.removeprefix("mixed") or 1)
    except ValueError:
        raise SystemExit(f"retrieval-weights: variant {variant!r} is none of shipped, mixed, mixedK (K a number), "
                         "retrieval") from None
    return k / (1 + k)


def main(argv: list[str] | None = None) -> None:
    p = parser("retrieval-weights", __doc__, threads=2, name="retrieval_weights")
    p.add_argument("--config", default="16x", help="the suite configurations every variant runs, comma-separated")
    p.add_argument("--variants", default="shipped,mixed,retrieval", help="shipped, mixed, mixedK, retrieval")
    p.add_argument("--artifact", action="append", default=[], metavar="NAME=FILE",
                   help="one more variant: the pre-RoPE artifact FILE (e.g. written by patchkv calibrate)")
    p.add_argument("--rows", type=int, default=24, help="retrieval rows the Fisher is measured on")
    p.add_argument("--seq", type=int, default=2048, help="tokens per retrieval row")
    p.add_argument("--samples", type=int, default=30, help="needle_text samples first..n-1 at 4k")
    p.add_argument("--first", type=int, default=0, help="the first needle_text sample run")
    p.add_argument("--ppl", type=int, default=2, help="documents of each perplexity task at 4k")
    p.add_argument("--ppl-tasks", default="ppl_prose", help="the perplexity tasks, comma-separated")
    p.add_argument("--shares-only", action="store_true", help="write the shares (and bits) CSV only")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    fisher = retrieval_fisher(model, tokenizer, args.rows, args.seq) if args.variants else None
    variants = {name: artifacts if (part := share(name)) is None else
                dict(artifacts, pre_rope=reweighted(artifacts["pre_rope"], fisher, part))
                for name in filter(None, args.variants.split(","))}
    files = {}
    for given in args.artifact:
        name, _, file = given.partition("=")
        variants[name] = dict(artifacts, pre_rope=patchkv.Artifact.load(file).to_dtype(models_dtype()))
        files[name] = {"file": file, "sha256": hashlib.sha256(Path(file).read_bytes()).hexdigest(),
                       "calibration": variants[name]["pre_rope"].calibration.get("effect_weights")}
    configs = [CONFIGS[name] for name in args.config.split(",")]
    if fisher is not None:
        bits = {name: code_bits(model, configs[-1].patch(variant, 4096)) for name, variant in variants.items()}
        write_csv(shares(artifacts["pre_rope"], fisher, bits), args.out / f"{args.name}_shares.csv",
                  extra={"rows": args.rows, "seq": args.seq, "config": configs[-1].name})
    if args.shares_only:
        return
    needle = TASKS["needle_text"]
    work = [(needle, s) for s in needle.samples(4096, args.samples, SMOLLM2)[args.first:]] + \
        [(TASKS[task], index) for task in filter(None, args.ppl_tasks.split(",")) for index in range(args.ppl)]
    rows = []
    for task, sample in work:
        for config, (name, variant) in itertools.product(configs, variants.items()):
            with torch.no_grad(), patchkv.patched(model, *config.patch(variant, 4096)):
                scored = task.run(model, tokenizer, sample, None, config.name) if task is needle else \
                    task.run(model, tokenizer, sample, 4096, None, config.name)
            rows.append({"variant": name, "config": config.name, "task": task.name, "index": scored.index,
                         "score": round(scored.score, 4), "count": scored.count,
                         "kv_bytes_per_token": round(scored.kv_bytes_per_token, 1),
                         "prediction": scored.prediction[:40]})
            print(rows[-1], flush=True)
    measured = {"rows": args.rows, "seq": args.seq} if fisher is not None else {}
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS, extra={**measured, "artifacts": files})
    for config, name in itertools.product(configs, variants):
        mine = [r for r in rows if r["variant"] == name and r["config"] == config.name]
        found = [r["score"] for r in mine if r["task"] == "needle_text"]
        ppl = {task: torch.tensor(sum(r["score"] for r in nll) / max(1, sum(r["count"] for r in nll))).exp().item()
               for task in dict.fromkeys(r["task"] for r in mine if r["task"] != "needle_text")
               for nll in [[r for r in mine if r["task"] == task]]}
        print(f"== {config.name} {name}: needle_text {sum(found):g} of {len(found)}, " +
              ", ".join(f"{task} {value:.3f}" for task, value in ppl.items()), flush=True)


if __name__ == "__main__":
    main()
