"""Decode steps before and after two bookkeeping changes, side by side in one process.

    .venv/bin/python -m evals decode-ab --before 4c66468 --context 8192 --threads 2 --out evals/results  # ~20 min

The configurations with near codes on layer bases decoded 1.6-1.9x slower than plain codes at the same ratio. Two
changes (issue 30) act on that: near tokens move into the middle a block at a time (`LatentLayer.near_block`, a
sixty-fourth of the region; before, one token per step, each recoded on its own), and the CPU kernels unpack a layer
basis's codes once per block for all heads (before, once per head). "before" runs the kernels built from `--before`'s
`kernels/latent_cpu.cpp` and caches with `near_block = 1`, which is the code of that revision; "after" the kernels and
caches of the working tree. Every configuration gets its own model copy and cache, prefilled with the same prose;
then `--steps` rounds run one decode step of each, in turn (the first two not counted), so all compare at the same
context and load. Output `decode_ab.csv` (+ provenance): per configuration and variant, the median step and its
ratio to the plain configuration of the same ratio (`--plain`), in the same run.
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

import patchkv
from patchkv.kernels import cpu

from .profile_paths import prose_ids
from .suite import CONFIGS, ROOT, load_artifacts, load_smollm2, prefill, write_csv
from .verbs import parse, parser


def kernels_at(revision: str):
    """The CPU kernels built from `revision`'s source."""
    source = subprocess.run(["git", "show", f"{revision}:kernels/latent_cpu.cpp"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "latent_cpu_before.cpp"
    path.write_text(source)
    return cpp_extension.load(name=f"patchkv_cpu_before_{revision}", sources=[str(path)], extra_cflags=cpu.FLAGS)


def main(argv: list[str] | None = None) -> None:
    p = parser("decode-ab", __doc__, threads=2)
    p.add_argument("--before", required=True, help="the revision whose kernels and one-token near moves are 'before'")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--configs", default="16x-layer-near4-novelty-int8-w8,32x-layer-near6-novelty-int4-w8")
    p.add_argument("--plain", default="16x,32x", help="the plain configuration of each ratio, in --configs' order")
    p.add_argument("--steps", type=int, default=22)
    args = parse(p, argv)
    after, before = cpu.extension(), kernels_at(args.before)
    extension = cpu.extension
    active = {"kernels": after}
    cpu.extension = lambda: active["kernels"]  # the kernels each variant's steps run
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    ids = prose_ids(tokenizer, args.context + args.steps)
    plain = dict(zip(args.configs.split(","), args.plain.split(",")))
    runs = {}
    for name in [*args.plain.split(","), *plain]:
        for variant in ("after",) if name not in plain else ("before", "after"):
            twin = copy.deepcopy(model)
            patchkv.apply(twin, *CONFIGS[name].patch(artifacts, args.context))
            cache = patchkv.LatentCache(twin)
            prefill(twin, ids[:, :args.context], cache)
            if variant == "before":
                for layer in cache.layers:
                    layer.near_block = 1
            runs[name, variant] = [twin, cache, before if variant == "before" else after, []]
    with torch.no_grad():
        for step in range(args.steps):
            for twin, cache, kernels, times in runs.values():
                active["kernels"] = kernels
                start = time.perf_counter()
                twin(input_ids=ids[:, args.context + step:args.context + step + 1], cache=cache, use_cache=True)
                if step >= 2:
                    times.append(time.perf_counter() - start)
    cpu.extension = extension
    medians = {key: statistics.median(run[3]) for key, run in runs.items()}
    rows = [{"config": name, "variant": variant, "context": args.context, "seconds": round(seconds, 4),
             "plain": plain.get(name, name),
             "ratio_to_plain": round(seconds / medians[plain.get(name, name), "after"], 3)}
            for (name, variant), seconds in medians.items()]
    for row in rows:
        print(row, flush=True)
    write_csv(rows, args.out / "decode_ab.csv", extra={"before": args.before, "counted_steps": args.steps - 2})


if __name__ == "__main__":
    main()
