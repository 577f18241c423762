"""How cost grows with context, 1k to 128k: decode step by stage, 64-token chunk, prefill, peak memory, cache bytes.

    nice -n 10 .venv/bin/python -m evals scaling --out evals/results            # CPU default: 1k, 4k, 8k, 32k, 128k
    .venv/bin/python -m evals scaling --contexts 1024,4096,8192,16384,32768,65536,131072 --batch8-max 16384
    .venv/bin/python -m evals scaling --device cuda --out evals/results/gpu      # evals/gpu_check.sh's GPU rows
    .venv/bin/python -m evals scaling --table --out evals/results               # the README's table, from the CSV

SmolLM2-135M-Instruct in bfloat16 (sdpa, and `unpatched-eager`), its shipped bases, with linear RoPE scaling by
max(1, largest context / 8192) past its trained 8k: cost, not accuracy, is measured. Methods are the suite's configs
(`evals/suite.py`): unpatched sdpa and eager, QuantizedCache quanto int4, patchkv 4x/8x/16x and 8x-top256.

How each row's cache is filled (column `fill`):

- `prefill`: the method's own model ran over `context` prose tokens, 1024 tokens a forward (`prefill_s` is that
  run's wall time, one run); only at contexts up to `--prefill-max` (a 128k prefill on CPU is hours of O(n^2));
- `tiled from N`: every layer's keys and values of the unpatched model's real prefill of N prose tokens (N = min(
  context, `--source-tokens`)), repeated along the tokens to `context` (and along the batch for batch 8), written
  through the cache's own write path (`DynamicCache.update`, `QuantizedCache.update`, which quantizes them; a
  `LatentLayer`'s `append` and `after_attention`, which encode them) at positions 0 .. context-1. A decode step's
  cost depends on how many tokens are stored, not on what they are; `prefill_s` is `not run` on these rows.

Batch-1 rows at contexts past `--prefill-max` and every batch-8 row are tiled. Timed in one process, every method
side by side, as `bench_throughput` does: rounds of one decode step per method in an order rotating each round, the
first a warm-up; `decode_s` is the median, `decode_ratio` the median over rounds of the step's time over the
fastest unpatched attention of that round (sdpa or eager); `chunk64_s`/`chunk64_ratio` the same for 64-token
forwards (batch 1, up to `--chunk-max`). The two unpatched attentions read and extend one shared `DynamicCache` (the same stored tokens,
held once). Then one more step per method runs under `torch.profiler` for the stage split (on CUDA the profiler's
device times), in seconds of that profiled step:

- `projections_s`: the attention layers' q/k/v/o projections (forward hooks on those modules, profiler labels);
- `middle_s`: patchkv's one pass over the stored middle (`patchkv::attend`), and top-k's candidate scoring and
  reading (`patchkv::select`); 0 for caches that hold every token exact or dequantize it;
- `merge_s`: after that pass, the rest of `patchkv::decode_attention` (softmaxes combined, values decoded);
- `exact_s`: the rest of the attention modules (cache writes and reads, RoPE, the exact tokens' scores and values,
  and for unpatched and quanto the whole attention over all tokens);
- `rest_s`: the profiled step's wall time minus the attention modules (MLPs, norms, embeddings, lm_head).

Memory (at `--memory-contexts`, by default 8k and 128k): each method x context (batch 1) in a fresh process with glibc's mmap threshold
fixed (`bench_memory`'s `mmap` allocator, so freed tensors leave RSS): the model loads, a cache is filled as above
(tiled, from `--memory-source` tokens), then VmHWM is reset and one decode step runs. `process_peak_mib` is VmHWM
of that step (model, cache and the step's transients: the process's peak while decoding), `step_extra_mib` the peak
over VmRSS before the step (transient copies), `cache_bytes` the cache's own count (`patchkv.nbytes.cache_nbytes`) at `context` tokens, before any step.
On CUDA the memory columns are `torch.cuda.max_memory_allocated` of the same step in the timing process instead.

Ratios are comparable only within one run (one context's rows of one command); never assert on them. `--keep` runs
some contexts again (or more of them) and keeps the CSV's other rows, each with its own commit and command.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import patchkv
from patchkv.nbytes import cache_nbytes
from patchkv.provenance import commit

from .bench_memory import ALLOCATORS, status_mib
from .bench_throughput import ratios_to, rounds
from .profile_paths import prose_ids
from .suite import CONFIGS, ROOT, load_artifacts, load_smollm2, prefill, read_csv, write_csv
from .verbs import parse, parser, show_table

FIELDS = ("method", "context", "batch", "fill", "decode_s", "decode_ratio", "projections_s", "exact_s", "middle_s",
          "merge_s", "rest_s", "chunk64_s", "chunk64_ratio", "prefill_s", "process_peak_mib", "step_extra_mib",
          "cache_bytes", "device", "threads", "commit", "command")
METHODS = "unpatched,unpatched-eager,quanto-int4,4x,8x,16x,8x-top256"
UNPATCHED = ("unpatched", "unpatched-eager")
TRAINED = 8192  # SmolLM2's max_position_embeddings
NOT_RUN = "not run"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


# ----- models and caches ---------------------------------------------------------------------------------------

def rope_factor(context: int) -> float:
    return max(1.0, context / TRAINED)


def method_models(model, artifacts, names: list[str], context: int) -> dict[str, object]:
    """{method: its model}: the base model for sdpa-unpatched and QuantizedCache, a copy in eager attention, a
    patched copy per patchkv config (budgeted at `context`)."""
    out = {}
    for name in names:
        config = CONFIGS[name.removesuffix("-eager")]
        patch = config.patch(artifacts, context)
        if patch is None and not name.endswith("-eager"):
            out[name] = model
            continue
        twin = copy.deepcopy(model)
        if name.endswith("-eager"):
            twin.set_attn_implementation("eager")
        if patch is not None:
            patchkv.apply(twin, *patch)
        out[name] = twin
    return out


def new_cache(name: str, model):
    config = CONFIGS[name.removesuffix("-eager")]
    if getattr(model, "patchkv", None) is not None:
        return patchkv.LatentCache(model)
    return config.cache(model) if config.cache else DynamicCache()


def source_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values `[1, kv_heads, n, head_dim]` of the (unpatched) model's prefill of ids `[1, n]`."""
    cache = DynamicCache()
    prefill(model, ids, cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


def fill(cache, source: list[tuple[torch.Tensor, torch.Tensor]], context: int, batch: int) -> None:
    """Write `context` tokens into every layer of `cache` through its own write path (module doc, `tiled`): source's
    keys and values `[1, kv_heads, n, head_dim]` repeated along the tokens to `context` and along the batch."""
    device = source[0][0].device
    positions = torch.arange(context, device=device).expand(batch, context)
    for i, (k, v) in enumerate(source):
        reps = -(-context // k.shape[2])
        k, v = (x.repeat(batch, 1, reps, 1)[:, :, :context].contiguous() for x in (k, v))
        if isinstance(cache, patchkv.LatentCache):
            layer = cache.layer(i)
            layer.append(k, v, positions)
            layer.after_attention()
        else:
            cache.update(k, v, i)
        del k, v


# ----- timing --------------------------------------------------------------------------------------------------

def stepper(model, cache, ids: torch.Tensor, tokens: int, device: torch.device) -> Callable[[], None]:
    """fn() runs the next `tokens` tokens of ids `[batch, n]` (cycling) through model and cache, synchronized."""
    position = [0]

    def run():
        i = position[0] % (ids.shape[1] - tokens)
        with torch.no_grad():
            model(input_ids=ids[:, i:i + tokens], cache=cache, use_cache=True, logits_to_keep=1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        position[0] = i + tokens

    return run


class StageLabels:
    """Profiler labels around every attention module (`scaling::attention`) and its projections
    (`scaling::projections`) by forward hooks, for as long as the context lasts: no library code is changed."""

    def __init__(self, model):
        self.handles, self.open = [], {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            label = "scaling::projections" if leaf in PROJECTIONS else "scaling::attention" if leaf == "self_attn" \
                else None
            if label is not None:
                self.handles += [module.register_forward_pre_hook(self._enter(label)),
                                 module.register_forward_hook(self._exit)]

    def _enter(self, label: str):
        def hook(module, args):
            self.open[id(module)] = torch.profiler.record_function(label).__enter__()
        return hook

    def _exit(self, module, args, output):
        self.open.pop(id(module)).__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def stages(fn: Callable[[], None], model, device: torch.device) -> dict[str, float]:
    """One step of fn under the profiler -> {projections_s, exact_s, middle_s, merge_s, rest_s} (module doc)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def seconds(e) -> float:
        return (e.device_time_total if cuda else e.cpu_time_total) / 1e6

    with StageLabels(model), profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    events = prof.events()
    total = {label: sum(seconds(e) for e in events if e.name == label)
             for label in ("scaling::attention", "scaling::projections", "patchkv::attend", "patchkv::select")}
    merge = 0.0
    for e in events:
        if e.name == "patchkv::decode_attention":
            passes = [c for c in e.cpu_children if c.name == "patchkv::attend"]
            if passes:
                end = passes[-1].time_range.end
                merge += sum(seconds(c) for c in e.cpu_children if c.time_range.start >= end)
    middle = total["patchkv::attend"] + total["patchkv::select"]
    attention = total["scaling::attention"]
    return {"projections_s": total["scaling::projections"], "middle_s": middle, "merge_s": merge,
            "exact_s": attention - total["scaling::projections"] - middle - merge, "rest_s": wall - attention}


def timed_rows(fns: dict[str, Callable[[], None]], models: dict, repeats: int, device: torch.device,
               split: bool) -> dict[str, dict]:
    """{method: {seconds, ratio[, stages]}}: `repeats` rotating rounds (bench_throughput.rounds), ratios to the
    fastest unpatched attention of each round, and with `split` one profiled step per method."""
    times = rounds(fns, repeats)
    ratio = ratios_to(times, UNPATCHED)
    out = {name: {"seconds": round(statistics.median(ts), 5), "ratio": ratio.get(name, "")}
           for name, ts in times.items()}
    if split:
        for name, fn in fns.items():
            out[name]["stages"] = {k: round(v, 5) for k, v in stages(fn, models[name], device).items()}
    return out


def batch_one(model, artifacts, names, context, ids, source, args, device) -> list[dict]:
    """Rows at batch 1: prefill (or tiled fill), decode steps by stage, 64-token chunks."""
    models = method_models(model, artifacts, names, context)
    caches, fills, prefills, held = {}, {}, {}, {}  # held: the cache's bytes at `context` tokens, before any step
    shared = None  # the unpatched attentions' one DynamicCache: (the method that filled it, the cache)
    for name in names:
        if name in UNPATCHED and shared is not None:  # filled (and its prefill timed) by the other one
            caches[name], fills[name], prefills[name], held[name] = shared[1], fills[shared[0]], NOT_RUN, held[shared[0]]
            continue
        prefill(models[name], ids[:, :64], new_cache(name, models[name]))  # warm-up: the kernels load
        cache = new_cache(name, models[name])
        if context <= args.prefill_max:
            start = time.perf_counter()
            prefill(models[name], ids[:, :context], cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            fills[name], prefills[name] = "prefill", round(time.perf_counter() - start, 3)
        else:
            fill(cache, source, context, 1)
            fills[name], prefills[name] = f"tiled from {source[0][0].shape[2]}", NOT_RUN
        caches[name], held[name] = cache, cache_nbytes(cache)
        if name in UNPATCHED:
            shared = (name, cache)
        print(f"{context} {name}: {fills[name]} {prefills[name]}", flush=True)
    follow = ids[:, context:]
    decode = timed_rows({n: stepper(models[n], caches[n], follow, 1, device) for n in names}, models,
                        args.repeats, device, split=True)
    chunk = timed_rows({n: stepper(models[n], caches[n], follow, 64, device) for n in names}, models,
                       args.chunk_repeats, device, split=False) if context <= args.chunk_max else {}
    rows = []
    for name in names:
        got = decode[name]
        rows.append({"method": name, "context": context, "batch": 1, "fill": fills[name], "decode_s": got["seconds"],
                     "decode_ratio": got["ratio"], **got["stages"],
                     "chunk64_s": chunk[name]["seconds"] if chunk else NOT_RUN,
                     "chunk64_ratio": chunk[name]["ratio"] if chunk else "", "prefill_s": prefills[name],
                     "cache_bytes": held[name]})
    return rows


def batch_eight(model, artifacts, names, context, ids, source, args, device) -> list[dict]:
    """Rows at batch 8: caches tiled from `source`, decode steps by stage."""
    models = method_models(model, artifacts, names, context)
    caches, held, shared = {}, {}, None
    for name in names:
        if name in UNPATCHED and shared is not None:
            caches[name], held[name] = shared, cache_nbytes(shared)
            continue
        caches[name] = new_cache(name, models[name])
        fill(caches[name], source, context, 8)
        held[name] = cache_nbytes(caches[name])
        shared = caches[name] if name in UNPATCHED else shared
    follow = ids[:, context:].expand(8, -1)
    decode = timed_rows({n: stepper(models[n], caches[n], follow, 1, device) for n in names}, models,
                        args.repeats, device, split=True)
    return [{"method": n, "context": context, "batch": 8, "fill": f"tiled from {source[0][0].shape[2]}",
             "decode_s": decode[n]["seconds"], "decode_ratio": decode[n]["ratio"], **decode[n]["stages"],
             "chunk64_s": NOT_RUN, "chunk64_ratio": "", "prefill_s": NOT_RUN, "cache_bytes": held[n]}
            for n in names]


# ----- memory, one process per measurement ---------------------------------------------------------------------

def measure_memory(name: str, context: int, source_tokens: int, rope: float) -> dict:
    """In this process: load, fill a batch-1 cache (tiled), reset VmHWM, one decode step -> memory columns."""
    model, tokenizer = load_smollm2(rope_factor=rope)
    ids = prose_ids(tokenizer, max(source_tokens, 64) + 8)
    source = source_kv(model, ids[:, :min(context, source_tokens)])
    twin = method_models(model, load_artifacts(), [name], context)[name]
    del model  # a patched or eager method's copy: the process holds one model, as a user's does
    cache = new_cache(name, twin)
    fill(cache, source, context, 1)
    del source
    held = cache_nbytes(cache)
    step = stepper(twin, cache, ids[:, -8:], 1, torch.device("cpu"))
    step()  # warm-up: the kernels load, the cache's pages grow
    gc.collect()
    before = status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    step()
    peak = status_mib("VmHWM")
    return {"process_peak_mib": round(peak, 1), "step_extra_mib": round(peak - before, 1), "cache_bytes": held}


def memory_row(name: str, context: int, args) -> dict:
    """`measure_memory` in a new process (bench_memory's `mmap` allocator)."""
    env = {**os.environ, **ALLOCATORS["mmap"], "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "evals", "scaling", "--one", name, str(context), "--threads", str(args.threads),
               "--memory-source", str(args.memory_source), "--rope-factor", str(args.rope_factor)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"memory of {name} at {context} failed:\n{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(name, context, got, flush=True)
    return got


def cuda_memory(model, artifacts, name: str, context: int, source, ids: torch.Tensor) -> dict:
    """On CUDA: max allocated during one decode step over a tiled batch-1 cache, in the timing process."""
    twin = method_models(model, artifacts, [name], context)[name]
    cache = new_cache(name, twin)
    fill(cache, source, context, 1)
    held = cache_nbytes(cache)
    step = stepper(twin, cache, ids[:, context:], 1, torch.device("cuda"))
    step()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated()
    return {"process_peak_mib": round(peak / 2 ** 20, 1), "step_extra_mib": round((peak - before) / 2 ** 20, 1),
            "cache_bytes": held}


# ----- output --------------------------------------------------------------------------------------------------

def numeric(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def plot(rows: list[dict], path: Path) -> Path:
    """Log-log panels against context, one line per method: decode step (batch 1 and 8), 64-token chunk, prefill
    seconds; cache bytes and process peak MiB. Labels in each panel's legend (none on the lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("decode_s", 1, "decode step, batch 1 (s)"), ("decode_s", 8, "decode step, batch 8 (s)"),
              ("chunk64_s", 1, "64-token chunk (s)"), ("prefill_s", 1, "prefill, chunked (s)"),
              ("cache_bytes", 1, "cache bytes"), ("process_peak_mib", 1, "process peak while decoding (MiB)")]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (column, batch, title) in zip(axes.flat, panels):
        for i, method in enumerate(methods):
            pts = sorted((int(r["context"]), numeric(r[column])) for r in rows
                         if r["method"] == method and int(r["batch"]) == batch and numeric(r.get(column)) is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="os^vD<>p"[i % 8], color=f"C{i % 10}",
                        linestyle="-" if "eager" not in method else "--", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(rows: list[dict]) -> str:
    """Markdown: per context and batch, each method's decode step (ratio to the fastest unpatched), its stages,
    64-token chunk, prefill, peak and cache."""
    head = ("| context | batch | method | decode ms (vs unpatched) | proj / exact / middle / merge / rest ms | "
            "chunk64 ms (vs unpatched) | prefill s | peak MiB | cache MiB | fill |")
    lines = [head, "|" + "---|" * 10]

    def ms(v) -> str:
        x = numeric(v)
        return NOT_RUN if x is None else f"{1e3 * x:.0f}" if x >= 0.01 else f"{1e3 * x:.1f}"

    def vs(v) -> str:
        return f" ({float(v):.2f}x)" if numeric(v) is not None else ""

    for r in rows:
        split = " / ".join(ms(r[k]) for k in ("projections_s", "exact_s", "middle_s", "merge_s", "rest_s"))
        peak = numeric(r.get("process_peak_mib"))
        lines.append(f"| {r['context']} | {r['batch']} | {r['method']} | {ms(r['decode_s'])}{vs(r['decode_ratio'])} | "
                     f"{split} | {ms(r['chunk64_s'])}{vs(r['chunk64_ratio'])} | {r['prefill_s']} | "
                     f"{'' if peak is None else f'{peak:.0f}'} | {int(r['cache_bytes']) / 2 ** 20:.1f} | {r['fill']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser("scaling", __doc__, threads=2, name="scaling", table=True)
    p.add_argument("--contexts", default="1024,4096,8192,32768,131072")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--prefill-max", type=int, default=4096, help="largest context prefilled by the model itself")
    p.add_argument("--source-tokens", type=int, default=4096, help="real tokens a tiled cache repeats")
    p.add_argument("--batch8-max", type=int, default=8192, help="largest context of the batch-8 decode rows (0: none)")
    p.add_argument("--repeats", type=int, default=3, help="counted rounds of decode steps")
    p.add_argument("--chunk-repeats", type=int, default=2, help="counted rounds of 64-token chunks")
    p.add_argument("--chunk-max", type=int, default=32768, help="largest context of the 64-token chunks (0: none)")
    p.add_argument("--memory-contexts", default="8192,131072",
                   help="contexts of the memory processes, comma-separated ('': every one; 0: none)")
    p.add_argument("--memory-source", type=int, default=1024, help="real tokens a memory process's cache repeats")
    p.add_argument("--rope-factor", type=float, default=0.0, help="linear RoPE factor (0: largest context / 8192)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--memory-only", action="store_true", help="measure memory again at --contexts, in the CSV's rows")
    p.add_argument("--keep", action="store_true", help="keep the CSV's rows of contexts not run now")
    p.add_argument("--one", nargs=2, metavar=("METHOD", "CONTEXT"), help=argparse.SUPPRESS)
    args = parse(p, argv)
    out = args.out
    if args.table:
        return show_table(args, table)
    contexts = [int(c) for c in args.contexts.split(",")]
    args.rope_factor = args.rope_factor or rope_factor(max(contexts))
    if args.one:
        print(json.dumps(measure_memory(args.one[0], int(args.one[1]), args.memory_source, args.rope_factor)))
        return
    if args.memory_only:  # the CSV's batch-1 rows at these contexts get new memory columns, nothing else changes
        rows = read_csv(out / f"{args.name}.csv")
        for row in rows:
            if int(row["context"]) in contexts and row["batch"] == "1":
                row.update(memory_row(row["method"], int(row["context"]), args))
        write(rows, out, args)
        return
    device = torch.device(args.device)
    names = args.methods.split(",")
    model, tokenizer = load_smollm2(rope_factor=args.rope_factor)
    model.to(device)
    artifacts = load_artifacts()
    ids = prose_ids(tokenizer, max(contexts) + 64 * (args.chunk_repeats + 2) + 1).to(device)
    source = source_kv(model, ids[:, :min(args.source_tokens, max(contexts))])
    stamp = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "threads": torch.get_num_threads(), "commit": commit(),
             "command": "python -m evals scaling " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = out / f"{args.name}.csv"
    # --keep: the rows of other contexts already in the CSV stay (each row names the commit and command it came from)
    rows = [r for r in read_csv(path) if int(r["context"]) not in contexts] \
        if args.keep and path.is_file() else []
    for context in contexts:
        here = [(k, v[:, :, :context]) for k, v in source] if context < source[0][0].shape[2] else source
        got = batch_one(model, artifacts, names, context, ids, here, args, device)
        if not args.memory_contexts or str(context) in args.memory_contexts.split(","):
            for row in got:
                if device.type == "cuda":
                    row.update(cuda_memory(model, artifacts, row["method"], context, here, ids))
                else:
                    row.update(memory_row(row["method"], context, args))
        if context <= args.batch8_max:
            got += batch_eight(model, artifacts, names, context, ids, here, args, device)
        rows += [{**{f: "" for f in FIELDS}, **r, **stamp} for r in got]
        for r in got:
            print({k: r[k] for k in ("method", "context", "batch", "decode_s", "decode_ratio", "chunk64_s")},
                  flush=True)
        gc.collect()
        rows.sort(key=lambda r: (int(r["context"]), int(r["batch"])))
        write(rows, out, args)  # after every context: a run stopped early keeps what it measured
    print(table(rows))


def write(rows: list[dict], out: Path, args) -> None:
    write_csv(rows, out / f"{args.name}.csv", FIELDS,
              {"threads": args.threads, "rope_factor": args.rope_factor, "device": args.device})
    plot(rows, out / f"{args.name}.png")
