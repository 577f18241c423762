"""Model-level decode step vs the unpatched model, every method side by side in one run, robust to load.

    .venv/bin/python evals/bench_decode.py --contexts 8192 --rounds 12 --steps 3 --threads 1 --out evals/results

SmolLM2-135M-Instruct (bfloat16) by default, with its bases in `artifacts/smollm2-bases`. For each context
length, every method gets its own copy of the model and its own cache, prefilled once (in chunks) with the
same prose tokens. Then the methods are timed in interleaved rounds: each round runs `--steps` decode steps
of every method in turn (the order rotates from round to round), all methods advancing through the same
tokens in lockstep, so each round compares them at the same context length and under the same load. Per
method the CSV gives the median step time over every timed step and, the figure to read, the median over
rounds of the ratio (method's median step / unpatched median step in that round), with the spread of those
ratios (and the same ratio to the eager-attention unpatched model). The first round warms up and is not
counted. Contexts grow by `rounds x steps` tokens during the run
(the caches are real decode caches: each step encodes the token leaving the window).

Targets (the decode-speed issue, ratio to unpatched at 8k tokens): post-RoPE 4x <= 0.35x, pre-RoPE 4x dense
<= 0.9x, pre-RoPE with latent top-k <= 0.4x, DP codes at 16x <= 0.8x. Latency is only comparable within one
run; never assert on it.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import patchkv
from patchkv.memory import cache_nbytes

ROOT = Path(__file__).resolve().parents[1]
WINDOW = [patchkv.SinksWindow(4, 32)]



class Config(NamedTuple):
    bases: str | None  # None: the unpatched model
    methods: list
    target: float | None  # the target ratio to unpatched, if it sets one
    attn: str = "sdpa"


CONFIGS: dict[str, Config] = {
    "unpatched": Config(None, [], None),
    # the same model with transformers' eager attention: on CPU, torch's bfloat16 SDPA with grouped KV heads is
    # several times slower than eager's matrix products at long context; the baseline to read the others against
    "unpatched-eager": Config(None, [], None, "eager"),
    "post-r16": Config("post_rope", [patchkv.LowRank(16)], 0.35),
    "pre-r16": Config("pre_rope", [patchkv.LowRank(16)], 0.9),
    "pre-r16-top64": Config("pre_rope", [patchkv.LowRank(16), *WINDOW, patchkv.TopK(64, 8)], 0.4),
    "post-r16-top64": Config("post_rope", [patchkv.LowRank(16), *WINDOW, patchkv.TopK(64, 8)], None),
    "dp-pre-64bits": Config("pre_rope", [*WINDOW, patchkv.Quantized(64)], 0.8),
}

FIELDS = ("context", "method", "spec", "kv_bytes_per_token", "step_ms_median", "ratio_vs_unpatched",
          "ratio_q1", "ratio_q3", "ratio_vs_unpatched_eager", "rounds", "steps_per_round", "threads", "target",
          "target_met")


def tokens(model_dir: Path, n: int, vocab: int) -> torch.Tensor:
    """`[1, n]` ids: the prose documents of the lm-eval task data, concatenated (random ids if the model has no
    tokenizer)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    ids: list[int] = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    lines = (ROOT / "patchkv" / "tasks" / "data" / "prose_4k.jsonl").read_text().splitlines()
    while len(ids) < n:
        for line in lines:
            ids += tokenizer(json.loads(line)["text"] + "\n\n", add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:n]]).clamp_max(vocab - 1)


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--bases", default=str(ROOT / "artifacts" / "smollm2-bases"))
    p.add_argument("--contexts", default="8192")
    p.add_argument("--methods", default=",".join(CONFIGS), help=f"comma-separated, among {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (plus one warm-up round)")
    p.add_argument("--steps", type=int, default=3, help="decode steps of each method per round")
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=str(ROOT / "evals" / "results"))
    p.add_argument("--name", default="decode")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = args.methods.split(",")
    if names[0] != "unpatched" or any(n not in CONFIGS for n in names):
        p.error(f"--methods: 'unpatched' first, then any of {', '.join(CONFIGS)}")
    dtype = getattr(torch, args.dtype)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    artifacts = {m: patchkv.Artifact.load(Path(args.bases) / f"{m}.safetensors").to_dtype(dtype)
                 for m in ("pre_rope", "post_rope")}
    contexts = [int(c) for c in args.contexts.split(",")]
    total = args.steps * (args.rounds + 1)
    ids = tokens(Path(args.model), max(contexts) + total, base.config.vocab_size)
    models = {}
    for name in names:
        config = CONFIGS[name]
        model = base if name == "unpatched" else copy.deepcopy(base)
        if config.attn != "sdpa":
            model.set_attn_implementation(config.attn)
        if config.bases is not None:
            patchkv.apply(model, artifacts[config.bases], config.methods)
        models[name] = model
    summary, raw = [], []
    for context in contexts:
        caches = {}
        with torch.no_grad():
            for name, model in models.items():
                t0 = time.perf_counter()
                cache = DynamicCache(config=model.config) if CONFIGS[name].bases is None else patchkv.LatentCache(model)
                for start in range(0, context, args.chunk):
                    model(input_ids=ids[:, start:min(start + args.chunk, context)], cache=cache, use_cache=True)
                caches[name] = cache
                print(f"prefilled {name} at {context} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
            times = {name: [] for name in names}  # per round, the step times of each method
            at = context
            for r in range(args.rounds + 1):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    steps = []
                    for i in range(args.steps):
                        t0 = time.perf_counter()
                        models[name](input_ids=ids[:, at + i: at + i + 1], cache=caches[name], use_cache=True)
                        steps.append(time.perf_counter() - t0)
                    if r:  # round 0 warms up
                        times[name].append(steps)
                at += args.steps
        for r in range(args.rounds):
            for name in names:
                raw.append({"context": context, "round": r, "method": name,
                            "step_ms": " ".join(f"{1000 * t:.2f}" for t in times[name][r])})
        for name in names:
            ratios = [statistics.median(times[name][r]) / statistics.median(times["unpatched"][r])
                      for r in range(args.rounds)]
            q1, q3 = quartiles(ratios)
            eager = "" if "unpatched-eager" not in names else round(statistics.median(
                statistics.median(times[name][r]) / statistics.median(times["unpatched-eager"][r])
                for r in range(args.rounds)), 3)
            config = CONFIGS[name]
            target, ratio = config.target, statistics.median(ratios)
            row = {"context": context, "method": name,
                   "spec": " + ".join(m.spec() for m in config.methods) or f"DynamicCache, {config.attn}",
                   "kv_bytes_per_token": round(cache_nbytes(caches[name]) / caches[name].get_seq_length(), 1),
                   "step_ms_median": round(1000 * statistics.median(t for ts in times[name] for t in ts), 2),
                   "ratio_vs_unpatched": round(ratio, 3), "ratio_q1": round(q1, 3), "ratio_q3": round(q3, 3),
                   "ratio_vs_unpatched_eager": eager,
                   "rounds": args.rounds, "steps_per_round": args.steps, "threads": args.threads,
                   "target": "" if target is None else target,
                   "target_met": "" if target is None else ("yes" if ratio <= target else "no")}
            summary.append(row)
            print(json.dumps(row), flush=True)
        del caches
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(summary)
    with open(out / f"{args.name}_rounds.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["context", "round", "method", "step_ms"])
        w.writeheader()
        w.writerows(raw)
    plot(summary, out / f"{args.name}.png", Path(args.model).name, args.threads)


def plot(rows: list[dict], path: Path, model: str, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        mine = [r for r in rows if r["context"] == context]
        x = range(len(mine))
        ratio = [r["ratio_vs_unpatched"] for r in mine]
        err = [[r["ratio_vs_unpatched"] - r["ratio_q1"] for r in mine],
               [r["ratio_q3"] - r["ratio_vs_unpatched"] for r in mine]]
        colors = ["grey" if r["method"].startswith("unpatched") else "tab:blue" for r in mine]
        ax.bar(x, ratio, yerr=err, capsize=3, color=colors)
        for i, r in enumerate(mine):
            if r["target"] != "":
                ax.hlines(r["target"], i - 0.4, i + 0.4, colors="red", linestyles="--")
            ax.text(i, r["ratio_vs_unpatched"] + 0.03, f"{r['ratio_vs_unpatched']:.2f}", ha="center", fontsize=8)
        ax.set_xticks(list(x), [r["method"] for r in mine], rotation=30, ha="right", fontsize=8)
        ax.set(ylabel="decode step / unpatched (median of rounds)\nred dashes: the issue's targets",
               title=f"{model}, {context} tokens, CPU, {threads} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
