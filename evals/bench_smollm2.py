"""Accuracy per KV byte on the real reference model, SmolLM2-135M-Instruct, every method and transformers'
QuantizedCache in one run (committed command; results in evals/results/smollm2_accuracy.csv).

    python evals/bench_smollm2.py --docs 4 --ruler-samples 20 --out evals/results
    python evals/bench_smollm2.py --plot-only --out evals/results      # the PNG, from that CSV
    python evals/bench_smollm2.py --table --out evals/results          # the README's table, from that CSV

Perplexity: lm-eval's rolling log-likelihood on the `patchkv_{prose,shakespeare,milton}_ppl_4k` tasks (each
document one 4096-token window), scored through the cache by `patchkv.streaming.StreamingLM` in chunks of
`--chunk` tokens: every token sees the earlier chunks as the cache holds them and its own chunk exact, as a
decode step would (QuantizedCache too attends in full precision within a forward). Scores are token
perplexities, exp(-log-likelihood / tokens). RULER: lm-eval's own `ruler` tasks (synthetic, built offline
from the tokenizer) through lm-eval's HFLM; each prompt is prefilled `--chunk` tokens per forward into the
cache under test (LatentCache, or QuantizedCache), then `generate()` continues from it, so the question reads
the compressed haystack. KV bytes per token are measured on the caches used (everything: codes, sinks,
window, positions, quanto's scales and residual), and compression is against the bf16 cache.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, QuantizedCache

import patchkv
from patchkv.evaluate import run_tasks
from patchkv.streaming import StreamingLM

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
BASES = ROOT / "artifacts" / "smollm2-bases"
CONTEXT = 4096
BF16_BYTES = 2 * 30 * 3 * 64 * 2  # K and V, layers, KV heads, head_dim, 2 bytes
PPL_TASKS = {"ppl_prose": "patchkv_prose_ppl_4k", "ppl_shakespeare": "patchkv_shakespeare_ppl_4k",
             "ppl_milton": "patchkv_milton_ppl_4k"}
FIELDS = ["method", "kv_bytes_per_token", "compression_vs_bf16", "task", "context", "score", "unpatched_score"]


EXACT = (4, 32)  # sinks and recent window kept exact by every patchkv config
POSITION_BYTES = 4  # the int32 true position a LatentCache stores per token


def bits_for(artifact: patchkv.Artifact, target_bytes: float, pool: str) -> int:
    """The most bits per head (average) whose whole cache at CONTEXT tokens (exact sinks and window in bf16,
    codes, positions) holds at most `target_bytes` per token."""
    exact = sum(EXACT)

    def total(bits: int) -> float:
        return (exact * BF16_BYTES + (CONTEXT - exact) * artifact.kv_bytes_per_token(bits, pool)) / CONTEXT \
            + POSITION_BYTES

    low, high = 1, artifact.head_dim * 8
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if total(mid) <= target_bytes else (low, mid - 1)
    return low


def methods(pre: patchkv.Artifact, post: patchkv.Artifact) -> list[tuple[str, dict]]:
    """(name, spec): spec has `artifact` and `methods` (or `methods_for(target bytes)` with `bytes_of`, the
    config whose measured bytes it matches, or `ratio`), or a `cache` factory for QuantizedCache."""

    def quantized_cache(backend: str, nbits: int):
        return lambda model: QuantizedCache(backend=backend, config=model.config, nbits=nbits, q_group_size=64,
                                            residual_length=128)

    sw = patchkv.SinksWindow(*EXACT)

    def coded(artifact, pool, extra=()):
        return lambda target: [sw, patchkv.Quantized(bits_for(artifact, target, pool), pool=pool), *extra]

    quanto4, quanto2 = "QuantizedCache quanto int4 g64 residual 128", "QuantizedCache quanto int2 g64 residual 128"
    out = [("unpatched", {}), (quanto4, {"cache": quantized_cache("quanto", 4)}),
           (quanto2, {"cache": quantized_cache("quanto", 2)})]
    for label, match in (("quanto int4", quanto4), ("quanto int2", quanto2)):
        out.append((f"quantized global pre-RoPE @ {label} bytes", {"artifact": pre, "bytes_of": match,
                                                                   "methods_for": coded(pre, "global")}))
    for ratio in (4, 8, 16):
        out.append((f"quantized global pre-RoPE {ratio}x", {"artifact": pre, "ratio": ratio,
                                                           "methods_for": coded(pre, "global")}))
    out += [
        ("quantized per-head pre-RoPE 8x", {"artifact": pre, "ratio": 8, "methods_for": coded(pre, "head")}),
        ("quantized global post-RoPE 8x", {"artifact": post, "ratio": 8, "methods_for": coded(post, "global")}),
        ("quantized global pre-RoPE 8x + top-k 256", {"artifact": pre, "ratio": 8, "methods_for": coded(
            pre, "global", [patchkv.TopK(256, 16)])}),
        ("lowrank 16 pre-RoPE", {"artifact": pre.with_ranks(rank=16), "methods": [sw, patchkv.LowRank(rank=16)]}),
    ]
    out += [(f"QuantizedCache hqq int{n} g64 residual 128", {"cache": quantized_cache("hqq", n)}) for n in (4, 2)]
    return out


def token_ppl(model, tokenizer, tasks: list[str], docs: int, chunk: int, cache) -> tuple[dict, float]:
    """{task: token perplexity}, bytes per token held, through StreamingLM."""
    lm = StreamingLM(model, tokenizer, cache_factory=(lambda: cache(model)) if cache else None,
                     max_length=CONTEXT, chunk=chunk)
    results = run_tasks(model, tokenizer, tasks, limit=docs, lm=lm)
    out = {}
    for task in tasks:
        data = [json.loads(line)["text"] for line in
                (ROOT / "patchkv" / "tasks" / "data" / f"{task.split('_')[1]}_4k.jsonl").read_text().splitlines()]
        data = data[:docs]
        n_bytes = sum(len(t.encode("utf-8")) for t in data)
        n_tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in data)
        # lm-eval's byte perplexity is exp(-LL / bytes): the same log-likelihood per token
        out[task] = math.exp(math.log(results[task]["byte_perplexity"]) * n_bytes / n_tokens)
    return out, lm.kv_bytes_per_token


def ruler_tasks(subtasks: list[str], lengths: list[int]) -> dict[int, dict]:
    """{length: lm-eval's ruler tasks at that length}, built once (the synthetic haystacks take minutes) and
    reused for every config: one task set per length, since lm-eval's `limit` takes a task's first samples
    and those are all of its first length. Seeded: some (ruler_vt) draw from the unseeded global generators."""
    import random

    import numpy as np
    from lm_eval.tasks import TaskManager

    random.seed(0)
    np.random.seed(0)
    return {n: TaskManager(metadata={"max_seq_lengths": [n], "tokenizer": str(SMOLLM2)}).load(subtasks)
            for n in lengths}


def ruler(model, tokenizer, tasks: dict[int, dict], samples: int, chunk: int, cache) -> dict:
    """{(subtask, length): score in [0, 100]} from lm-eval's ruler `tasks` (`ruler_tasks`) through HFLM, the
    first `samples` of each length. The prompt is prefilled `chunk` tokens per forward into the cache (a
    LatentCache when patched, `cache(model)` for QuantizedCache, else a DynamicCache), so the question at its
    end reads the haystack as the cache holds it; then `generate()` continues from that cache."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import DynamicCache

    class Generator(HFLM):
        def _model_generate(self, context, max_length, stop, **kwargs):
            past = cache(model) if cache else patchkv.LatentCache(model) if patchkv.is_patched(model) \
                else DynamicCache()
            with torch.no_grad():
                for start in range(0, context.shape[1] - 1, chunk):
                    model(input_ids=context[:, start:min(start + chunk, context.shape[1] - 1)], cache=past,
                          use_cache=True)
            return super()._model_generate(context, max_length, stop, cache=past, **kwargs)

    lm = Generator(pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=max(tasks) + 256)
    out = {}
    for length, task_dict in tasks.items():
        res = evaluate(lm=lm, task_dict=task_dict, limit=samples, bootstrap_iters=0)
        for task, metrics in res["results"].items():
            value = metrics.get(f"{length},none")
            if isinstance(value, (int, float)) and value >= 0:  # -1: length not run
                out[(task, length)] = 100 * value
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        pts = [r for r in rows if r["task"] == task and r["method"] != "unpatched"]
        for family, marker in (("quantized", "o"), ("QuantizedCache", "s"), ("lowrank", "^")):
            sel = sorted((float(r["compression_vs_bf16"]), float(r["score"])) for r in pts
                         if r["method"].startswith(family))
            if sel:
                ax.plot(*zip(*sel), marker=marker, linestyle="none", label=family)
        base = next(float(r["unpatched_score"]) for r in rows if r["task"] == task)
        ax.axhline(base, color="gray", linestyle="--", label="unpatched")
        ax.set_title(task)
        ax.set_xlabel("KV compression vs bf16 (x)")
        ax.set_ylabel("token perplexity (lower is better)" if task.startswith("ppl") else "score (higher is better)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4, help="4096-token documents per perplexity task")
    ap.add_argument("--chunk", type=int, default=64, help="tokens per forward, perplexity and RULER prefill")
    ap.add_argument("--ruler", default="niah_single_1,niah_multikey_2,vt,cwe,fwe",
                    help="ruler subtasks that build offline ('' for none); the essay haystacks need the web")
    ap.add_argument("--ruler-lengths", default="1024,2048,4096")
    ap.add_argument("--ruler-samples", type=int, default=20)
    ap.add_argument("--only", help="comma-separated method indices (for quick runs)")
    ap.add_argument("--out", default=str(ROOT / "evals" / "results"))
    ap.add_argument("--name", default="smollm2_accuracy")
    ap.add_argument("--bases", default=str(BASES))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the CSV as the README's markdown table")
    ap.add_argument("--combine", nargs="+", metavar="CSV",
                    help="merge the CSVs of runs split by --only (each with the unpatched config) into --name")
    args = ap.parse_args()
    out = Path(args.out)
    if args.table:
        print(table(list(csv.DictReader(open(out / f"{args.name}.csv")))))
        return
    if args.combine:
        rows = [r for path in args.combine for r in csv.DictReader(open(path))]
        rows = [r for i, r in enumerate(rows) if r["method"] != "unpatched" or
                (r["task"], r["context"]) not in {(q["task"], q["context"]) for q in rows[:i] if q["method"] == "unpatched"}]
        write_rows(rows, out / f"{args.name}.csv")
        args.plot_only = True
    if args.plot_only:
        plot(list(csv.DictReader(open(out / f"{args.name}.csv"))), out / f"{args.name}.png")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16).eval()
    pre = patchkv.Artifact.load(Path(args.bases) / "pre_rope.safetensors")
    post = patchkv.Artifact.load(Path(args.bases) / "post_rope.safetensors")
    chosen = methods(pre, post)
    if args.only:
        chosen = [chosen[int(i)] for i in args.only.split(",")]
    # lm-eval's names: niah_* as they are, the others prefixed (ruler_vt, ruler_cwe, ruler_fwe)
    subtasks = [t if t.startswith(("niah", "ruler_")) else f"ruler_{t}" for t in args.ruler.split(",") if t]
    lengths = [int(n) for n in args.ruler_lengths.split(",")]
    tasks = ruler_tasks(subtasks, lengths) if subtasks else {}
    rows, base, measured = [], {}, {}
    for name, spec in chosen:
        start = time.time()
        artifact, cache = spec.get("artifact"), spec.get("cache")
        chosen_methods = spec.get("methods")
        if "methods_for" in spec:
            target = measured[spec["bytes_of"]] if "bytes_of" in spec else BF16_BYTES / spec["ratio"]
            chosen_methods = spec["methods_for"](target)
            name = f"{name} ({' + '.join(m.spec() for m in chosen_methods)})"
        with patchkv.patched(model, artifact, chosen_methods) if artifact else contextlib.nullcontext():
            scores, per_token = token_ppl(model, tokenizer, list(PPL_TASKS.values()), args.docs, args.chunk, cache)
            ruler_scores = ruler(model, tokenizer, tasks, args.ruler_samples, args.chunk, cache) if subtasks else {}
        if name == "unpatched":
            per_token = BF16_BYTES + 0.0  # the DynamicCache in bf16
        measured[name] = per_token
        results = {k: v for k, v in zip(PPL_TASKS, scores.values())}
        results |= {("ruler_" + t.removeprefix("ruler_"), n): v for (t, n), v in ruler_scores.items()}
        for key, score in results.items():
            task, context = key if isinstance(key, tuple) else (key, CONTEXT)
            if name == "unpatched":
                base[(task, context)] = score
            rows.append({"method": name, "kv_bytes_per_token": round(per_token, 1),
                         "compression_vs_bf16": round(BF16_BYTES / per_token, 3), "task": task, "context": context,
                         "score": round(score, 4), "unpatched_score": round(base.get((task, context), float("nan")), 4)})
        print(json.dumps({"method": name, "bytes": round(per_token, 1), "seconds": round(time.time() - start),
                          **{str(k): round(v, 3) for k, v in results.items()}}), flush=True)
        write_rows(rows, out / f"{args.name}.csv")
    plot(rows, out / f"{args.name}.png")


def table(rows: list[dict]) -> str:
    """Markdown: one line per method (name without its spec), bytes, compression, each perplexity with its
    change against unpatched, each RULER task and length."""
    ppl = [(task, str(CONTEXT)) for task in PPL_TASKS]
    ruler_keys = sorted({(r["task"], r["context"]) for r in rows if r["task"].startswith("ruler")},
                        key=lambda k: (k[0], int(k[1])))
    head = ["method", "KV bytes/token", "vs bf16", "prose ppl", "Shakespeare ppl", "Milton ppl"] + [
        f"{task.removeprefix('ruler_')} {int(n) // 1024}k" for task, n in ruler_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in dict.fromkeys(r["method"] for r in rows):
        got = {(r["task"], r["context"]): r for r in rows if r["method"] == method}
        first = next(iter(got.values()))
        cells = [method.split(" (")[0], f"{float(first['kv_bytes_per_token']):.0f}",
                 f"{float(first['compression_vs_bf16']):.2f}x"]
        for key in ppl + ruler_keys:
            r = got.get(key)
            if r is None:
                cells.append("—")
                continue
            score, base = float(r["score"]), float(r["unpatched_score"])
            change = "" if method == "unpatched" or key in ruler_keys else f" ({100 * (score / base - 1):+.1f}%)"
            cells.append(f"{score:.0f}" if key in ruler_keys else f"{score:.2f}{change}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
