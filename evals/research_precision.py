"""Where a needle in real prose is lost: the middle of one configuration read at a finer rate, part by part.

    .venv/bin/python -m evals needle-precision --out evals/results      # evals/results/needle_precision.csv

`needle_text` samples that `--config` misses (by default `16x-layer-near4-novelty-int8-w8` on samples 0-5, all six
misses) run again with the middle's codecs of some layers and kinds replaced by the near codes' (`NearCodes`, 4x the
middle's bits with `near:factor=4`): keys and values of every layer, keys alone, values alone, and each third of the
layers. A diagnostic, not a configuration: the cache then holds more than the budget pays for (the bytes column says
what it held; every part at the near rate about twice the budget at 16x). If one part carried the needle, raising it
alone would find it.
"""

from __future__ import annotations

import torch

import patchkv

from .suite import SMOLLM2, config, load_artifacts, load_smollm2, write_csv
from .tasks import TASKS
from .verbs import parse, parser

#: variant -> (kinds read at the near rate, first layer, last layer); None: the configuration as it is
VARIANTS = {"as is": None, "keys and values": ("keys", "values"), "keys": ("keys",), "values": ("values",)}
FIELDS = ("config", "variant", "index", "score", "kv_bytes_per_token", "prediction")


def variants(layers: int) -> dict[str, tuple[tuple[str, ...], int, int] | None]:
    """Every variant over a model of `layers` layers: `VARIANTS` over all of them, then keys and values by thirds."""
    out = {name: None if kinds is None else (kinds, 0, layers - 1) for name, kinds in VARIANTS.items()}
    cuts = [round(i * layers / 3) for i in range(4)]
    for first, end in zip(cuts, cuts[1:]):
        out[f"keys and values, layers {first}-{end - 1}"] = (("keys", "values"), first, end - 1)
    return out


def finer(model, kinds: tuple[str, ...], first: int, last: int) -> None:
    """The patched `model`'s middle codecs of `kinds` in layers `first`..`last` replaced by its near codecs."""
    for lp in model.patchkv.layers:
        if first <= lp.layer_idx <= last:
            for kind in kinds:
                setattr(lp, kind, getattr(lp, f"near_{kind}"))


def main(argv: list[str] | None = None) -> None:
    p = parser("needle-precision", __doc__, name="needle_precision")
    p.add_argument("--config", default="16x-layer-near4-novelty-int8-w8", help="a suite configuration with near codes")
    p.add_argument("--samples", default="0,1,2,3,4,5", help="needle_text sample indices (comma-separated)")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifact, methods = config(args.config).patch(load_artifacts(), 4096)
    if not any(isinstance(m, patchkv.NearCodes) for m in methods):
        raise SystemExit(f"needle-precision: {args.config} keeps no near codes to read the middle at; pick one "
                         "whose name has 'near'.")
    task = TASKS["needle_text"]
    indices = [int(i) for i in args.samples.split(",")]
    samples = task.samples(4096, max(indices) + 1, SMOLLM2)
    rows = []
    for name, part in variants(model.config.num_hidden_layers).items():
        for index in indices:
            with torch.no_grad(), patchkv.patched(model, artifact, methods):
                if part is not None:
                    finer(model, *part)
                scored = task.run(model, tokenizer, samples[index], None, args.config)
            rows.append({"config": args.config, "variant": name, "index": index, "score": scored.score,
                         "kv_bytes_per_token": round(scored.kv_bytes_per_token), "prediction": scored.prediction})
            print(f"{name} #{index}: {scored.score:g} {scored.prediction[:30]!r}", flush=True)
        found = sum(r["score"] for r in rows if r["variant"] == name)
        print(f"== {name}: {found:g} of {len(indices)}", flush=True)
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS)
