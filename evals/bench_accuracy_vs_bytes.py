"""Accuracy and perplexity at equal KV bytes, every method measured in one run.

    python evals/bench_accuracy_vs_bytes.py --limit-ppl 10 --limit-cloze 100 --out evals/results

The reference model runs in bfloat16 (so "x vs fp16" is what the cache really saves). Every row is
scored by lm-eval through `StreamingLM`: the context is prefilled and each scored token is decoded
through the cache, so decode-time methods (top-k, transformers' QuantizedCache, which attends in full
precision during prefill) show their true cost. Bytes/token are measured on the caches used.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, QuantizedCache

import patchkv
from patchkv.evaluate import HEADLINE, run_tasks
from patchkv.streaming import StreamingLM

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("patchkv_shakespeare_ppl", "patchkv_milton_ppl", "patchkv_shakespeare_cloze")
WINDOW = dict(sink_tokens=4, window=32)  # quanto keeps its last 32 tokens full precision too


def methods(pre: patchkv.Artifact, post: patchkv.Artifact, config) -> list[tuple[str, dict]]:
    """(name, spec): spec has `artifact` and apply options, or a `cache` factory."""

    def quanto(nbits: int):
        return lambda: QuantizedCache(backend="quanto", config=config, nbits=nbits, q_group_size=64,
                                      residual_length=32)

    r16, r8 = pre.with_ranks(rank=16), pre.with_ranks(rank=8)
    return [
        ("unpatched (bf16)", {}),
        ("transformers QuantizedCache quanto int4, residual 32", {"cache": quanto(4)}),
        ("transformers QuantizedCache quanto int2, residual 32", {"cache": quanto(2)}),
        ("PCA pre-RoPE rank 16", {"artifact": r16}),
        ("PCA post-RoPE rank 16", {"artifact": post.with_ranks(rank=16)}),
        ("PCA pre-RoPE rank 8", {"artifact": r8}),
        ("PCA pre-RoPE rank 16 + sinks 4 / window 32", {"artifact": r16, **WINDOW}),
        ("PCA pre-RoPE rank 8 + sinks 4 / window 32", {"artifact": r8, **WINDOW}),
        ("DP-quantized pre-RoPE 288 bits/head + sinks/window", {"artifact": pre, "bits": 288, **WINDOW}),
        ("DP-quantized pre-RoPE 160 bits/head + sinks/window", {"artifact": pre, "bits": 160, **WINDOW}),
        ("DP-quantized pre-RoPE 64 bits/head (16x) + sinks/window", {"artifact": pre, "bits": 64, **WINDOW}),
        ("DP-quantized pre-RoPE 32 bits/head (32x) + sinks/window", {"artifact": pre, "bits": 32, **WINDOW}),
        ("DP-quantized pre-RoPE 64 bits/head (16x), no sinks/window", {"artifact": pre, "bits": 64}),
        ("top-k 64 (rank-8 scores), pre-RoPE rank 16 + sinks/window",
         {"artifact": r16, "top_k": 64, "top_k_rank": 8, **WINDOW}),
        ("top-k 64 (rank-8 scores), post-RoPE rank 16 + sinks/window",
         {"artifact": post.with_ranks(rank=16), "top_k": 64, "top_k_rank": 8, **WINDOW}),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "artifacts" / "reference-llama"))
    p.add_argument("--bases", default=str(ROOT / "artifacts" / "reference-llama-bases"))
    p.add_argument("--limit-ppl", type=int, default=10, help="documents per perplexity task")
    p.add_argument("--limit-cloze", type=int, default=100, help="questions of the cloze task")
    p.add_argument("--only", help="comma-separated row numbers to run (default all)")
    p.add_argument("--out", default=str(ROOT / "evals" / "results"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from an existing CSV in --out")
    args = p.parse_args()
    if args.plot_only:
        return plot(Path(args.out))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pre, post = (patchkv.Artifact.load(Path(args.bases) / f"{m}.safetensors").to_dtype(torch.bfloat16)
                 for m in ("pre_rope", "post_rope"))
    cfg = model.config
    fp16_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    rows = []
    chosen = methods(pre, post, cfg)
    if args.only:
        chosen = [chosen[int(i)] for i in args.only.split(",")]
    for name, spec in chosen:
        spec = dict(spec)
        artifact, cache = spec.pop("artifact", None), spec.pop("cache", None)
        lm = StreamingLM(model, tokenizer, cache_factory=cache)
        start = time.time()
        with patchkv.patched(model, artifact, **spec) if artifact is not None else contextlib.nullcontext():
            results = run_tasks(model, tokenizer, TASKS[:2], limit=args.limit_ppl, lm=lm)
            results |= run_tasks(model, tokenizer, TASKS[2:], limit=args.limit_cloze, lm=lm)
        row = {"method": name, "kv_bytes_per_token": round(lm.kv_bytes_per_token, 1),
               "x_vs_fp16": round(fp16_bytes / lm.kv_bytes_per_token, 2),
               **{t: round(results[t][HEADLINE[t][0]], 4) for t in TASKS}, "seconds": round(time.time() - start)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "accuracy_vs_bytes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = rows[0]
    lines = ["| method | KV bytes/token | x vs fp16 | Shakespeare byte-ppl | Milton byte-ppl | cloze acc |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        def rel(t):
            return "" if r is base else f" ({100 * (r[t] / base[t] - 1):+.1f}%)"
        acc = "" if r is base else f" ({r['patchkv_shakespeare_cloze'] - base['patchkv_shakespeare_cloze']:+.3f})"
        lines.append(f"| {r['method']} | {r['kv_bytes_per_token']:.0f} | {r['x_vs_fp16']:.2f} | "
                     f"{r['patchkv_shakespeare_ppl']:.4f}{rel('patchkv_shakespeare_ppl')} | "
                     f"{r['patchkv_milton_ppl']:.4f}{rel('patchkv_milton_ppl')} | "
                     f"{r['patchkv_shakespeare_cloze']:.3f}{acc} |")
    (out / "accuracy_vs_bytes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out)


def plot(out: Path) -> None:
    """Each perplexity vs measured KV bytes per token, one marker per method family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(out / "accuracy_vs_bytes.csv")))
    families = {"unpatched": "black", "QuantizedCache": "tab:red", "PCA": "tab:blue", "DP": "tab:green",
                "top-k": "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, task in zip(axes, ("patchkv_shakespeare_ppl", "patchkv_milton_ppl")):
        for family, color in families.items():
            for post in (False, True):
                pts = [r for r in rows if family in r["method"] and ("post-RoPE" in r["method"]) == post]
                if pts:
                    ax.scatter([float(r["kv_bytes_per_token"]) for r in pts], [float(r[task]) for r in pts],
                               color=color, marker="^" if post else "o",
                               label=family + (" (post-RoPE)" if post else ""))
        ax.legend(fontsize=7)
        ax.set(xscale="log", xlabel="KV bytes per token (measured, bf16)", ylabel=f"{task} byte-perplexity",
               title=task.removeprefix("patchkv_"))
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_bytes.png", dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
