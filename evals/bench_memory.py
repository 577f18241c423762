"""Peak memory of one prefill, each measured in a process of its own (results in evals/results/memory.csv).

    .venv/bin/python -m evals memory --out evals/results          # 4k and 32k, unpatched and 8x, both logits
    .venv/bin/python -m evals memory --table --out evals/results  # the docs' table, from the CSV

SmolLM2-135M-Instruct in bfloat16 with sdpa attention (eager attention's scores alone would take 18 GiB at 32k, for
patched and unpatched alike), its shipped bases, prose tokens. Each measurement is a fresh process: the model, the
artifact and the patch are loaded and a 64-token forward warms up (the first call loads the kernels), then VmRSS is
read, VmHWM reset (`/proc/self/clear_refs`) and one forward of `context` tokens runs into a new cache
(`LatentCache`, or `DynamicCache` unpatched), with `logits_to_keep=1` (`last`, as `generate` prefills) or every
token's logits (`all`). Columns, MiB:

- `peak_mib`: VmHWM after the prefill - VmRSS before it: the worst the process reached, the cache included;
- `held_mib`: VmRSS after the prefill - VmRSS before it: what stays (cache, logits, and memory the allocator kept);
- `cache_mib`: the bytes the cache holds by its own count (`patchkv.nbytes.cache_nbytes`).

`allocator`: `glibc` as a user runs it; `mmap` with `MALLOC_MMAP_THRESHOLD_=131072`. glibc raises its mmap threshold
to the size of each large block freed (up to 32 MiB), so after the first large frees every tensor of a 4k prefill
lives in the heap, whose freed holes stay resident and fragment: RSS then depends on the order of allocations as
much as on their sizes, and varies by tens of MiB between identical runs. A fixed threshold keeps large tensors in
their own mappings, returned when freed, so `mmap` rows follow the live tensors. The patched attention hands glibc's
free heap pages back around each layer of a long forward (`patchkv.heap`); the unpatched model does not. `--repeats`
runs each setting again in new processes; the table shows the median and the range.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .suite import CONFIGS, ROOT, write_csv
from .verbs import parse, parser, show_table

FIELDS = ("method", "context", "logits", "allocator", "repeat", "peak_mib", "held_mib", "cache_mib", "seconds")
ALLOCATORS = {"glibc": {}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
WARM_UP = 64


def status_mib(key: str) -> float:
    """A `/proc/self/status` field (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def measure(method: str, context: int, logits: str) -> dict:
    """One prefill in this process -> {peak_mib, held_mib, cache_mib, seconds} (module doc)."""
    import patchkv
    from patchkv.nbytes import cache_nbytes
    from transformers import DynamicCache

    from .profile_paths import prose_ids
    from .suite import load_artifacts, load_smollm2

    model, tokenizer = load_smollm2()
    patch = CONFIGS[method].patch(load_artifacts(), context)
    if patch is not None:
        patchkv.apply(model, *patch)
    ids = prose_ids(tokenizer, context)

    def new_cache():
        return patchkv.LatentCache(model) if patch is not None else DynamicCache()

    with torch.no_grad():
        model(input_ids=ids[:, :WARM_UP], cache=new_cache(), use_cache=True, logits_to_keep=1)
    gc.collect()
    before = status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    with torch.no_grad():
        cache = new_cache()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1 if logits == "last" else 0)
    seconds = time.perf_counter() - start
    row = {"peak_mib": status_mib("VmHWM") - before, "held_mib": status_mib("VmRSS") - before,
           "cache_mib": cache_nbytes(cache) / 2 ** 20, "seconds": seconds}
    del out
    return {name: round(value, 1) for name, value in row.items()}


def run_one(method: str, context: int, logits: str, allocator: str, repeat: int, threads: int) -> dict:
    """`measure` in a new process under `allocator`'s environment -> a CSV row."""
    env = {**os.environ, **ALLOCATORS[allocator], "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "evals", "memory", "--one", method, str(context), logits, "--threads", str(threads)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    row = {"method": method, "context": context, "logits": logits, "allocator": allocator, "repeat": repeat,
           **json.loads(done.stdout.strip().splitlines()[-1])}
    print(row, flush=True)
    return row


def table(rows: list[dict]) -> str:
    """Markdown: one line per context x logits x allocator, each method's median peak (range over repeats) and the
    cache it holds."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        key = (int(r["context"]), r["logits"], r["allocator"])
        groups.setdefault(key, {}).setdefault(r["method"], []).append(r)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = ["context", "logits", "allocator"] + [f"{m} peak MiB (cache)" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (context, logits, allocator), by_method in sorted(groups.items()):
        cells = []
        for m in methods:
            got = by_method.get(m)
            if not got:
                cells.append("—")
                continue
            peaks = [float(r["peak_mib"]) for r in got]
            spread = f" ({min(peaks):.0f}-{max(peaks):.0f})" if len(peaks) > 1 else ""
            cells.append(f"{statistics.median(peaks):.0f}{spread} ({float(got[0]['cache_mib']):.0f})")
        lines.append(f"| {context} | {logits} | {allocator} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser("memory", __doc__, threads=1, name="memory", table=True)
    p.add_argument("--methods", default="unpatched,8x")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--logits", default="last,all", help="last (logits_to_keep=1), all, or both")
    p.add_argument("--allocators", default="glibc,mmap", help=f"of {sorted(ALLOCATORS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--jobs", type=int, default=1, help="measurements run side by side (each its own process)")
    p.add_argument("--one", nargs=3, metavar=("METHOD", "CONTEXT", "LOGITS"), help=argparse.SUPPRESS)
    args = parse(p, argv)  # --threads: of each measurement
    if args.one:
        method, context, logits = args.one
        print(json.dumps(measure(method, int(context), logits)))
        return
    if args.table:
        return show_table(args, table)
    settings = [(m, int(c), lg, a, r) for c in args.contexts.split(",") for lg in args.logits.split(",")
                for a in args.allocators.split(",") for r in range(args.repeats) for m in args.methods.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda s: run_one(*s, args.threads), settings))
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS, {"threads": args.threads, "jobs": args.jobs})
    print(table(rows))
