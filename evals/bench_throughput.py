"""Throughput of every path, every method side by side in one run (results in evals/results/throughput.csv / .png).

    .venv/bin/python -m evals throughput --out evals/results         # about 25 minutes on 2 cores
    .venv/bin/python -m evals throughput --table --out evals/results # the README's table, from the CSV

SmolLM2-135M-Instruct in bfloat16, its shipped bases. Paths:

- `forward64`: a 64-token forward at `--context` (4k) tokens of context, as the benchmarks score text;
- `decode`: one decode step at each of `--decode-contexts` (8k, 32k) tokens;
- `calibrate`: `patchkv.calibrate` on `--calib-tokens` tokens without (`calibrate`) and with (`calibrate+fisher`)
  effect weights, against a plain forward of the same tokens (`forward`).

Every method gets its own copy of the model and its own cache, prefilled once with the same prose tokens. Then
rounds run every method once each, in an order that rotates from round to round, all advancing through the same
tokens, so each round compares them at the same context and under the same load; the first round warms up and is
not counted. `seconds` is the median over rounds; `ratio_to_unpatched` is the median over rounds of the method's
time over the fastest unpatched attention in that round (sdpa or eager); `ratio_to_quantizedcache` the same against
transformers' `QuantizedCache` (quanto int4). Contexts grow by one step per round. Ratios are only comparable
within a run; never assert on them.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import patchkv

from .profile_paths import prose_ids
from .suite import CONFIGS, load_artifacts, load_smollm2, prefill, write_csv
from .verbs import parse, parser, show_table

FIELDS = ("path", "method", "context", "tokens", "seconds", "ratio_to_unpatched", "ratio_to_quantizedcache")
UNPATCHED = ("unpatched", "unpatched-eager")
REFERENCE_CACHE = "quanto-int4"


def runners(model, artifacts, names: list[str], ids: torch.Tensor, context: int, step: int) -> dict:
    """{method: fn} where fn() runs the method's next `step` tokens through its own model copy and cache, prefilled
    with ids[:, :context]."""
    out = {}
    for name in names:
        config = CONFIGS[name.removesuffix("-eager")]
        twin = copy.deepcopy(model)
        if name.endswith("-eager"):
            twin.set_attn_implementation("eager")
        patch = config.patch(artifacts, context)
        if patch is not None:
            patchkv.apply(twin, *patch)
        cache = patchkv.LatentCache(twin) if patch else config.cache(twin) if config.cache else DynamicCache()
        prefill(twin, ids[:, :context], cache)
        position = [context]

        def run(twin=twin, cache=cache, position=position):
            i = position[0]
            with torch.no_grad():
                twin(input_ids=ids[:, i:i + step], cache=cache, use_cache=True)
            position[0] = i + step

        out[name] = run
    return out


def rounds(fns: dict, count: int) -> dict[str, list[float]]:
    """{method: [seconds per round]} over `count` counted rounds (plus a warm-up), order rotating each round."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(count + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = time.perf_counter()
            fns[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    return times


def ratios_to(times: dict[str, list[float]], references: tuple[str, ...]) -> dict[str, float]:
    """{method: median over rounds of its time over the fastest of `references` in that round}; {} when none of
    them ran."""
    base = [min(ts) for ts in zip(*(times[n] for n in references if n in times))]
    if not base:
        return {}
    return {name: round(statistics.median(t / b for t, b in zip(ts, base)), 3) for name, ts in times.items()}


def rows_for(path: str, context: int, tokens: int, times: dict[str, list[float]]) -> list[dict]:
    to_unpatched, to_cache = ratios_to(times, UNPATCHED), ratios_to(times, (REFERENCE_CACHE,))
    out = []
    for name, ts in times.items():
        row = {"path": path, "method": name, "context": context, "tokens": tokens,
               "seconds": round(statistics.median(ts), 4), "ratio_to_unpatched": to_unpatched.get(name, ""),
               "ratio_to_quantizedcache": to_cache.get(name, "")}
        out.append(row)
        print(row, flush=True)
    return out


def calibration_rows(model, tokenizer, tokens: int, repeats: int) -> list[dict]:
    """forward / calibrate / calibrate+fisher on the same `tokens` prose tokens, interleaved; ratios to the forward."""
    ids = prose_ids(tokenizer, tokens).view(-1, 512)
    fns = {"forward": lambda: model(ids),
           "calibrate": lambda: patchkv.calibrate(model, ids, mode="pre_rope", rank=32, max_tokens=ids.numel(),
                                                  progress=False),
           "calibrate+fisher": lambda: patchkv.calibrate(model, ids, mode="pre_rope", rank=32, max_tokens=ids.numel(),
                                                         fisher_tokens=ids.numel(), progress=False)}
    with torch.no_grad():
        times = rounds(fns, repeats)
    out = []
    for name, ts in times.items():
        row = {"path": "calibrate", "method": name, "context": 512, "tokens": ids.numel(),
               "seconds": round(statistics.median(ts), 3),
               "ratio_to_unpatched": round(statistics.median(t / f for t, f in zip(ts, times["forward"])), 3),
               "ratio_to_quantizedcache": ""}
        out.append(row)
        print(row, flush=True)
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Each path and context's ratios to the fastest unpatched attention, a panel each; none drawn (and `path`
    removed) where no unpatched method ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["path"], r["context"]) for r in rows if r["ratio_to_unpatched"] != ""))
    if not groups:
        path.unlink(missing_ok=True)
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3.6), squeeze=False)
    for ax, (p, context) in zip(axes[0], groups):
        mine = [r for r in rows if (r["path"], r["context"]) == (p, context) and r["ratio_to_unpatched"] != ""]
        ax.bar([r["method"] for r in mine], [float(r["ratio_to_unpatched"]) for r in mine], color="tab:blue")
        ax.axhline(1.0, color="gray", linestyle="--")
        ax.set_title(f"{p} @ {context}" if p != "calibrate" else f"calibrate ({mine[0]['tokens']} tokens)")
        ax.set_ylabel("time / fastest unpatched" if p != "calibrate" else "time / plain forward")
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    head = "| path | context | method | seconds | vs fastest unpatched | vs QuantizedCache int4 |\n|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        ratio = f"{float(r['ratio_to_unpatched']):.2f}x" if r["ratio_to_unpatched"] != "" else ""
        vs_cache = f"{float(r['ratio_to_quantizedcache']):.2f}x" if r["ratio_to_quantizedcache"] != "" else ""
        lines.append(f"| {r['path']} | {r['context']} | {r['method']} | {float(r['seconds']):.3f} | {ratio} | {vs_cache} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser("throughput", __doc__, threads=2, name="throughput", table=True)
    p.add_argument("--context", type=int, default=4096, help="context of the 64-token forwards")
    p.add_argument("--decode-contexts", default="8192,32768")
    p.add_argument("--forward-methods", default="unpatched,unpatched-eager,quanto-int4,4x,8x,16x")
    p.add_argument("--decode-methods", default="unpatched,unpatched-eager,quanto-int4,4x,8x,16x,8x-top256")
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--paths", default="forward64,decode,calibrate")
    args = parse(p, argv)
    if args.table:
        return show_table(args, table)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    paths = args.paths.split(",")
    rows = []
    if "forward64" in paths:
        ids = prose_ids(tokenizer, args.context + 64 * (args.rounds + 1))
        fns = runners(model, artifacts, args.forward_methods.split(","), ids, args.context, 64)
        rows += rows_for("forward64", args.context, 64, rounds(fns, args.rounds))
        del fns
    if "decode" in paths:
        for context in (int(c) for c in args.decode_contexts.split(",")):
            ids = prose_ids(tokenizer, context + args.rounds + 1)
            fns = runners(model, artifacts, args.decode_methods.split(","), ids, context, 1)
            rows += rows_for("decode", context, 1, rounds(fns, args.rounds))
            del fns
    if "calibrate" in paths:
        rows += calibration_rows(model, tokenizer, args.calib_tokens, max(2, args.rounds // 3))
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS)
    plot(rows, args.out / f"{args.name}.png")
    print(table(rows))

