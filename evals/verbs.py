"""The verbs of `python -m evals` that are scripts of their own (benchmarks, research, builders), and the command line
they share.

    python -m evals VERB --help        # a verb's own options

Each verb is a module of `evals` with a `main(argv)`; `VERBS` maps the verb to it. A verb's parser comes from
`parser`: `python -m evals VERB` as its name, the module's docstring as its help, and the options every measurement
takes (`--out`, the results folder; `--threads`; where it writes one named CSV, `--name` and `--table`, which prints
the table from that CSV and measures nothing).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path

from .suite import RESULTS, read_csv

#: verb -> the module of `evals` whose `main(argv)` runs it
VERBS = {
    # benchmarks: speed, memory, bytes
    "throughput": "bench_throughput", "profile": "profile_paths", "lossless": "bench_lossless",
    "salience": "bench_salience", "memory": "bench_memory", "blocks": "bench_blocks", "spill": "bench_spill",
    "scaling": "bench_scaling", "gemm": "bench_gemm", "calibration-cost": "bench_calibration",
    "generation-bytes": "bench_generation_bytes",
    # research: one question each, its CSV in evals/results
    "gemma-loss": "research_gemma_loss", "near-tokens": "research_near", "sliding": "research_sliding",
    "gemma-effect": "research_gemma_effect", "quantizer": "research_quantizer", "scales-vq": "research_scales_vq",
    "salience-variants": "research_salience", "shared-basis": "research_shared_basis",
    "step-loss": "research_step_loss", "figures": "research_figures", "needle-precision": "research_precision",
    "decode-ab": "research_decode_ab", "retrieval-weights": "research_retrieval_weights",
    "eviction": "research_eviction",
    # the shipped data, bases and reference models
    "build-mix": "build_calibration_mix", "build-prose": "build_prose", "build-tasks": "build_tasks",
    "calibrate": "calibrate_smollm2", "train-reference": "train_reference_model",
}


def run(verb: str, argv: Sequence[str]) -> None:
    """`python -m evals VERB ARGV...`: the verb's module's `main`."""
    importlib.import_module(f".{VERBS[verb]}", __package__).main(list(argv))


def parser(verb: str, doc: str, *, out: Path | None = RESULTS, threads: int | None = 1, name: str | None = None,
           table: bool = False) -> argparse.ArgumentParser:
    """The parser of `python -m evals VERB`, `doc` its help: unless `out` is None, `--out` (folder, default `out`);
    unless `threads` is None, `--threads` (torch threads, default `threads`; 0: torch's default); with `name`, `--name` (the results'
    stem, default `name`); with `table`, `--table`."""
    p = argparse.ArgumentParser(prog=f"python -m evals {verb}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        p.add_argument("--out", type=Path, default=out, help="folder of the results (default %(default)s)")
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help="torch threads (0: torch's default)")
    if name is not None:
        p.add_argument("--name", default=name, help="the results' file name, without its suffix")
    if table:
        p.add_argument("--table", action="store_true", help="print the table from the CSV; measure nothing")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`argv` parsed by `p`; torch's threads set to `--threads` where given and not 0."""
    args = p.parse_args(argv)
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    return args


def show_table(args: argparse.Namespace, table: Callable[[list[dict]], str]) -> None:
    """Print `table` of the rows of `<out>/<name>.csv`."""
    print(table(read_csv(args.out / f"{args.name}.csv")))
