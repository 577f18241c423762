"""Where the time goes, per stage, on the three paths (torch.profiler; the library labels its stages `patchkv::*`).

    .venv/bin/python -m evals profile --out evals/results        # -> profile.md (+ provenance), ~5 minutes

SmolLM2-135M-Instruct in bfloat16, its shipped bases, 2 threads by default:

1. calibration, without and with effect weights (`--calib-tokens` tokens of prose, 512-token sequences);
2. a 64-token forward at `--context` (4k) tokens of context, unpatched and with the `8x` config (global pre-RoPE
   codes, 4 sinks + 32-token window exact), as the benchmarks score text;
3. a decode step at `--decode-context` (8k) tokens, unpatched (sdpa and eager) and `8x`.

Each path is profiled `--repeats` times after a warm-up; a stage's time is the profiler's total for its label
(labels nest: `dense_operands` includes `reconstruct`), "rest of the model" is the step's wall time minus the
top-level patchkv stages (projections, MLPs, norms, lm_head, the cache bookkeeping of transformers). Tables also
list the heaviest aten operators. Never used for asserts: a profile, not a benchmark (`bench_throughput.py` gives
the ratios).
"""

from __future__ import annotations

import contextlib
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import patchkv

from .suite import CONFIGS, ROOT, load_artifacts, load_smollm2, write_provenance
from .verbs import parse, parser

#: top-level labels per path (others nest inside these)
TOP = {"calibrate": ("patchkv::moments", "patchkv::fisher_backward", "patchkv::pca"),
       "forward": ("patchkv::dense_operands", "patchkv::attention_function", "patchkv::encode",
                   "patchkv::decode_attention", "patchkv::select")}
NESTED = ("patchkv::attend", "patchkv::reconstruct", "patchkv::scores", "patchkv::unpack")


def prose_ids(tokenizer, n: int) -> torch.Tensor:
    """`[1, n]` ids: the prose task documents, concatenated (BOS first)."""
    ids = [tokenizer.bos_token_id]
    lines = (ROOT / "patchkv" / "tasks" / "data" / "prose_4k.jsonl").read_text().splitlines()
    while len(ids) < n:
        for line in lines:
            ids += tokenizer(json.loads(line)["text"] + "\n\n", add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:n]])


def profiled(fn, repeats: int) -> tuple[float, dict[str, float], list[tuple[str, float]]]:
    """Run fn once to warm up, then `repeats` times under the profiler -> (wall ms per run, {label: ms per run},
    the heaviest aten ops by self time [(name, ms per run)])."""
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        wall = (time.perf_counter() - start) * 1e3 / repeats
    events = prof.key_averages()
    labels = {e.key: e.cpu_time_total / 1e3 / repeats for e in events if e.key.startswith("patchkv::")}
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / repeats) for e in events if e.key.startswith("aten::")),
                 key=lambda x: -x[1])[:6]
    return wall, labels, ops


def table(title: str, wall: float, labels: dict[str, float], ops, top: tuple[str, ...]) -> list[str]:
    lines = [f"**{title}**: {wall:.1f} ms", "", "| stage | ms | share |", "|---|---|---|"]
    top_total = sum(labels.get(name, 0.0) for name in top)
    for name in top:
        if name in labels:
            lines.append(f"| {name.removeprefix('patchkv::')} | {labels[name]:.1f} | {labels[name] / wall:.0%} |")
            for inner in NESTED:
                if inner in labels and _nested_in(inner, name):
                    lines.append(f"| &nbsp;&nbsp;of which {inner.removeprefix('patchkv::')} | {labels[inner]:.1f} | "
                                 f"{labels[inner] / wall:.0%} |")
    lines.append(f"| rest of the model | {wall - top_total:.1f} | {(wall - top_total) / wall:.0%} |")
    lines += ["", "heaviest operators (self time): " + ", ".join(f"`{n.removeprefix('aten::')}` {ms:.1f} ms"
                                                               for n, ms in ops), ""]
    return lines


def _nested_in(inner: str, outer: str) -> bool:
    return {"patchkv::dense_operands": ("patchkv::reconstruct",),
            "patchkv::decode_attention": ("patchkv::attend", "patchkv::scores", "patchkv::unpack"),
            "patchkv::select": ("patchkv::unpack",)}.get(outer, ()).__contains__(inner)


def main(argv: list[str] | None = None) -> None:
    p = parser("profile", __doc__, threads=2)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--decode-context", type=int, default=8192)
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--config", default="8x", help=f"the patchkv config profiled, among {', '.join(CONFIGS)}")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    lines = [f"# Profile of the three paths ({args.config} config, SmolLM2-135M-Instruct, bfloat16)", "",
             "Produced by `python -m evals profile` (provenance in `profile.md.provenance.json`). Stage times are "
             "the profiler's totals for the library's labels, per run; labels nest as shown.", ""]

    # 1. calibration
    ids = prose_ids(tokenizer, args.calib_tokens).view(-1, 512)
    lines += ["## Calibration", ""]
    for fisher in (0, args.calib_tokens):
        def calibrate(fisher=fisher):
            patchkv.calibrate(model, ids, mode="pre_rope", rank=32, max_tokens=ids.numel(), fisher_tokens=fisher,
                              progress=False)
        wall, labels, ops = profiled(calibrate, 1)
        with torch.no_grad():
            start = time.perf_counter()
            model(ids)
            plain = (time.perf_counter() - start) * 1e3
        title = f"calibrate {ids.numel()} tokens, {'with' if fisher else 'without'} effect weights " \
                f"({ids.numel() / wall * 1e3:.0f} tokens/s; a plain forward of them: {plain:.0f} ms, " \
                f"{ids.numel() / plain * 1e3:.0f} tokens/s)"
        lines += table(title, wall, labels, ops, TOP["calibrate"])

    # 2. and 3. a 64-token forward at 4k, a decode step at 8k
    config = CONFIGS[args.config]
    for path, context, step in (("64-token forward", args.context, 64), ("decode step", args.decode_context, 1)):
        lines += [f"## {path.capitalize()} at {context} tokens", ""]
        ids = prose_ids(tokenizer, context + step * (args.repeats + 2))
        variants = [("unpatched (sdpa)", None, "sdpa"), (f"{args.config}", config, "sdpa")]
        if step == 1:
            variants.insert(1, ("unpatched (eager)", None, "eager"))
        for title, cfg, attn in variants:
            model.set_attn_implementation(attn)
            patch = cfg.patch(artifacts, context) if cfg is not None else None
            with patchkv.patched(model, *patch) if patch else contextlib.nullcontext(), torch.no_grad():
                cache = patchkv.LatentCache(model) if patch else DynamicCache()
                for start in range(0, context, 1024):
                    model(input_ids=ids[:, start:min(start + 1024, context)], cache=cache, use_cache=True)
                position = [context]

                def forward():
                    i = position[0]
                    model(input_ids=ids[:, i:i + step], cache=cache, use_cache=True)
                    position[0] = i + step

                wall, labels, ops = profiled(forward, args.repeats)
            lines += table(title, wall, labels, ops, TOP["forward"])
        model.set_attn_implementation("sdpa")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.md").write_text("\n".join(lines))
    write_provenance(args.out / "profile.md")
    print("\n".join(lines))

