"""KV bytes per token and decode-step latency vs context length, every method side by side in one run.

    python evals/bench_decode.py --contexts 1024,2048,4096,8192,16384 --out evals/results

For each context length and method: prefill random corpus tokens in chunks, then time decode steps
(median). Latency numbers are only comparable within one run; the CSV records ratios to the unpatched
model measured in the same run. The reference model was trained on 256-token windows: at these
lengths its outputs are meaningless, only memory and time are measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, QuantizedCache

import patchkv
from patchkv.memory import cache_nbytes

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "artifacts" / "reference-llama"))
    p.add_argument("--bases", default=str(ROOT / "artifacts" / "reference-llama-bases"))
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(ROOT / "evals" / "results"))
    p.add_argument("--name", default="decode")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    pre, post = (patchkv.Artifact.load(Path(args.bases) / f"{m}.safetensors").to_dtype(dtype)
                 for m in ("pre_rope", "post_rope"))
    window = dict(sink_tokens=4, window=32)
    methods = {
        "unpatched": ({}, None),
        "pca-pre-r16": ({"artifact": pre.with_ranks(rank=16)}, None),
        "pca-post-r16": ({"artifact": post.with_ranks(rank=16)}, None),
        "dp-pre-64bits": ({"artifact": pre, "bits": 64}, None),
        "topk64-pre-r16": ({"artifact": pre.with_ranks(rank=16), "top_k": 64, "top_k_rank": 8, **window}, None),
        "topk64-post-r16": ({"artifact": post.with_ranks(rank=16), "top_k": 64, "top_k_rank": 8, **window}, None),
        "quanto-int4": ({}, lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4,
                                                   residual_length=32)),
    }
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # warm-up: first calls pay one-time costs that would skew the first row
        warm = torch.randint(3, model.config.vocab_size, (1, 64), generator=g).to(args.device)
        cache = DynamicCache(config=model.config)
        for i in range(4):
            model(input_ids=warm[:, i * 16:(i + 1) * 16], cache=cache, use_cache=True)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(3, model.config.vocab_size, (1, context + args.steps), generator=g).to(args.device)
        base_ms = None
        for name, (spec, cache_factory) in methods.items():
            spec = dict(spec)
            artifact = spec.pop("artifact", None)
            if artifact is not None:
                patchkv.apply(model, artifact, **spec)
            try:
                cache = cache_factory() if cache_factory else (
                    patchkv.LatentCache(model) if artifact is not None else DynamicCache(config=model.config))
                with torch.no_grad():
                    for start in range(0, context, args.chunk):
                        model(input_ids=ids[:, start:min(start + args.chunk, context)], cache=cache, use_cache=True)
                    times = []
                    for i in range(args.steps):
                        if args.device == "cuda":
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        model(input_ids=ids[:, context + i: context + i + 1], cache=cache, use_cache=True)
                        if args.device == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                ms = 1000 * statistics.median(times[2:])  # the first steps warm up
                base_ms = base_ms or ms
                row = {"context": context, "method": name, "kv_bytes_per_token": round(cache_nbytes(cache) /
                                                                                       cache.get_seq_length(), 1),
                       "decode_ms": round(ms, 3), "latency_vs_unpatched": round(ms / base_ms, 3)}
            finally:
                if artifact is not None:
                    patchkv.remove(model)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / f"{args.name}.png", args.device)


def plot(rows: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == name]
        a.plot([r["context"] for r in pts], [r["decode_ms"] for r in pts], marker="o", label=name)
        b.plot([r["context"] for r in pts], [r["kv_bytes_per_token"] for r in pts], marker="o", label=name)
    a.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel=f"decode step ms ({device})")
    b.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="KV bytes per token")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
