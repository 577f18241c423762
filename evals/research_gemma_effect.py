"""Gemma 3: effect weights measured on 2,048-token calibration sequences against the default 512, at equal bytes.

    .venv/bin/python -m evals gemma-effect      # about 25 minutes on one busy core (the calibration)

The hypothesis it tests (README, "Gemma 3"): on 512-token sequences a full-attention layer's tokens are read by no
more queries than a sliding layer's (window 512), so the effect weights undervalue the three full layers at longer
contexts. It calibrates the model with `seq_len=2048` (otherwise `patchkv calibrate`'s defaults: rank 64, 16,384
tokens, 4 sinks, 4,096 tokens of effect weights, window 32) and scores both artifacts without step scales (so the
allocation alone differs) at 8x and 16x of the real 2k cache, layers priced alike (the budget as `parse_budget`
builds it) and priced by the tokens each holds (`bits_for_ratio(..., priced=True)`): token perplexity of the report's
held-out prose, 64 tokens per forward, bfloat16. Prints one line per configuration: artifact, ratio, pricing,
codes, KV bytes per token held, perplexity, change against unpatched.
"""

from __future__ import annotations

import dataclasses
import time

import torch

import patchkv
from patchkv import Artifact
from patchkv.artifact import KINDS
from patchkv.budgets import bits_for_ratio, parse_budget
from patchkv.cli import _load_model
from patchkv.nbytes import cache_nbytes
from patchkv.methods import Quantized
from patchkv.report import default_text
from patchkv.texts import read_texts

from .suite import GEMMA3, GEMMA3_BASES, ROOT, perplexity, text_ids
from .verbs import parse, parser

SHIPPED = GEMMA3_BASES / "pre_rope.safetensors"
LONG = ROOT / ".cache/gemma3_seq2048.safetensors"
CONTEXT = 2048


def plain(a: Artifact) -> Artifact:
    """`a` without step scales."""
    parts = {k: dataclasses.replace(getattr(a, k), step_scales=None) for k in KINDS}
    return Artifact(mode=a.mode, model=a.model, calibration=a.calibration, step_budgets=None, **parts)


def main(argv: list[str] | None = None) -> None:
    parse(parser("gemma-effect", __doc__, out=None), argv)
    start = time.time()
    model, tokenizer = _load_model(str(GEMMA3), "auto")
    if LONG.exists():
        long = Artifact.load(LONG)
    else:
        long = patchkv.calibrate(model, read_texts(None), tokenizer=tokenizer, mode="pre_rope", rank=64,
                                 max_tokens=16384, sink_tokens=4, seq_len=2048, fisher_tokens=4096, fisher_window=32,
                                 progress=False)
        long.save(LONG)
    print("calibrated", f"{time.time() - start:.0f} s", flush=True)
    shipped = plain(Artifact.load(SHIPPED))
    long = plain(long).with_sliding_windows(shipped.sliding_windows)
    model = model.to(torch.bfloat16)
    _, text = default_text()
    ids = text_ids(tokenizer, text, CONTEXT)
    base = perplexity(model, ids).perplexity
    for label, art in (("seq512", shipped), ("seq2048", long)):
        for ratio in (8, 16):
            alike = parse_budget(f"{ratio}x").methods(art, CONTEXT)
            bits = bits_for_ratio(art, ratio, pool="global", context=CONTEXT, priced=True)
            priced = [alike[0], Quantized(bits, pool="global", context=CONTEXT)]
            for kind, methods in (("alike", alike), ("priced", priced)):
                scored = perplexity(model, ids, art, methods)
                print(label, f"{ratio}x", kind, methods[1].spec(), round(cache_nbytes(scored.cache) / CONTEXT, 1),
                      round(scored.perplexity, 4), f"{100 * (scored.perplexity / base - 1):+.1f}%",
                      f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
