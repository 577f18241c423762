"""Bytes per token while generating: does a configuration hold its ratio past the prompt?

    .venv/bin/python -m evals generation-bytes --configs 16x,16x-evict --context 4096 --new 1024 --threads 2
    # -> evals/results/generation_bytes.csv (+ provenance)

SmolLM2-135M-Instruct in the suite's dtype, its shipped bases. Each configuration prefills `--context` tokens of the
prose documents (`profile_paths.prose_ids`) into its own cache, then greedy-decodes `--new` tokens one step at a
time; every `--every` steps a row: the tokens held so far, the cache's bytes per token by its own count
(`patchkv.nbytes.cache_nbytes`, positions included) and the compression against the unpatched bf16 cache. A
configuration with `Evict` also gets `all_kept_bytes_per_token`: what the cache would hold had every token that left
the window one decode step at a time been kept (its bytes plus the dropped decode tokens' middle codes, counted from
the layers' bitmaps, which hold a bit for every token either way): what ranking decode steps' tokens saves, measured
in the same run.
"""

from __future__ import annotations

import torch

import patchkv
from patchkv.cache import KEPT, LatentCache, unpack_bits
from patchkv.nbytes import cache_nbytes

from .profile_paths import prose_ids
from .suite import CONFIGS, load_artifacts, load_smollm2, models_dtype, prefill, sixteen_bit_bytes_per_token, \
    write_csv
from .verbs import parse, parser, show_table

FIELDS = ("config", "prompt", "generated", "kv_bytes_per_token", "compression_vs_bf16", "all_kept_bytes_per_token")


def dropped_while_decoding(cache: LatentCache, prompt_passed: list[int]) -> int:
    """Bytes of the middle codes of the tokens the cache's layers dropped after the first `prompt_passed[i]` of layer
    i's tokens left its window (those that left one decode step at a time), batch 1."""
    total = 0
    for layer, start in zip(cache.layers, prompt_passed):
        if layer.evict is None:
            continue
        gone = int((~unpack_bits(layer.tensors[KEPT], layer.passed)[0, start:]).sum())
        total += gone * (layer.patch.keys.bytes_per_token() + layer.patch.values.bytes_per_token())
    return total


@torch.no_grad()
def generate_rows(model, ids: torch.Tensor, cache, new: int, every: int, name: str, unpatched: float) -> list[dict]:
    """Prefill `ids` `[1, n]` into `cache` (the last token alone, as the first decode step reads it), then
    greedy-decode `new` tokens, a row every `every` steps."""
    prefill(model, ids[:, :-1], cache)
    evicting = isinstance(cache, LatentCache) and any(layer.evict is not None for layer in cache.layers)
    prompt_passed = [layer.passed for layer in cache.layers] if evicting else []
    token = model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    rows = []
    for step in range(1, new + 1):
        token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if step % every and step != new:
            continue
        held = ids.shape[1] + step
        nbytes = cache_nbytes(cache)
        kept = (nbytes + dropped_while_decoding(cache, prompt_passed)) / held if evicting else ""
        rows.append({"config": name, "prompt": ids.shape[1], "generated": step, "kv_bytes_per_token": nbytes / held,
                     "compression_vs_bf16": unpatched / (nbytes / held), "all_kept_bytes_per_token": kept})
        print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| configuration | generated | bytes/token | vs bf16 | every decode token kept |", "|---|---|---|---|---|"]
    for r in rows:
        kept = f"{float(r['all_kept_bytes_per_token']):,.0f}" if r["all_kept_bytes_per_token"] not in ("", None) else ""
        lines.append(f"| {r['config']} | {r['generated']} | {float(r['kv_bytes_per_token']):,.0f} | "
                     f"{float(r['compression_vs_bf16']):.2f}x | {kept} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser("generation-bytes", __doc__, threads=2, name="generation_bytes", table=True)
    p.add_argument("--configs", default="16x,16x-evict", help="suite configurations, comma-separated")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens")
    p.add_argument("--new", type=int, default=1024, help="tokens generated")
    p.add_argument("--every", type=int, default=128, help="a row every this many generated tokens")
    args = parse(p, argv)
    if args.table:
        return show_table(args, table)
    model, tokenizer = load_smollm2(models_dtype())
    artifacts = load_artifacts(models_dtype())
    ids = prose_ids(tokenizer, args.context)
    unpatched = sixteen_bit_bytes_per_token()
    rows = []
    for name in args.configs.split(","):
        patch = CONFIGS[name].patch(artifacts, args.context)
        if patch is None:
            raise SystemExit(f"generation-bytes: {name!r} is not a patchkv configuration (its cache holds every token "
                             "at 16 bits); name patchkv configurations (python -m evals list).")
        with patchkv.patched(model, *patch):
            rows += generate_rows(model, ids, LatentCache(model), args.new, args.every, name, unpatched)
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS)
    print(table(rows))
