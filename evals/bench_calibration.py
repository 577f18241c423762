"""What `patchkv calibrate` costs a user with its defaults, beside a plain forward of the same tokens.

    .venv/bin/python -m evals calibration-cost --model .models/gemma-3-270m --out evals/results/gemma3
    .venv/bin/python -m evals calibration-cost --table --out evals/results/gemma3

`patchkv calibrate --model MODEL --out <a temporary folder>` runs as a user runs it (its own process, every default:
statistics and effect weights on `--max-tokens` tokens of the shipped mix, step scales for 4x, 8x and 16x), timed
from start to exit, model loading included. Then, in this process, the model loaded as the CLI loads it (`--dtype
auto`) runs a plain forward (no cache, full logits) over the same number of tokens of the same mix, in the CLI's
sequences and batches (`--seq-len`, 4 rows). `ratio` is calibration's tokens per second over the forward's: the cost
of a calibration in forwards. One row per run, appended to `<name>.csv` with its commit and command.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from patchkv.calibrate import calibrate, text_batches
from patchkv.cli import build_parser
from patchkv.provenance import commit, machine
from patchkv.texts import default_texts

from .suite import read_csv, write_csv
from .verbs import parse, parser, show_table

FIELDS = ("model", "tokens", "calibrate_s", "calibrate_tokens_per_s", "forward_s", "forward_tokens_per_s", "ratio",
          "threads", "machine", "commit", "command")
#: rows of a batch in calibration (`patchkv.calibrate`'s default)
BATCH = calibrate.__kwdefaults__["batch_size"]


def cli_defaults() -> tuple[int, int]:
    """(`--max-tokens`, `--seq-len`) of `patchkv calibrate`, as its parser sets them."""
    args = build_parser().parse_args(["calibrate", "--model", "m", "--out", "o"])
    return args.max_tokens, args.seq_len


def calibrate_seconds(model: str) -> float:
    """Wall seconds of `patchkv calibrate --model model` with every default, in a process of its own."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "patchkv", "calibrate", "--model", model, "--out", out], check=True)
        return time.perf_counter() - start


def forward_seconds(model_path: str, tokens: int, seq_len: int) -> float:
    """Seconds of plain forwards over the first `tokens` tokens of the shipped mix, in the batches calibration reads
    (`text_batches`: `BATCH` rows of `seq_len` a forward)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    batches, read = [], 0
    for ids, mask in text_batches(default_texts(), tokenizer, seq_len, BATCH):
        if read >= tokens:
            break
        batches.append((ids, mask))
        read += ids.numel()
    start = time.perf_counter()
    with torch.no_grad():
        for ids, mask in batches:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - start


def table(rows: list[dict]) -> str:
    from patchkv.records import markdown

    return markdown(["model", "tokens", "calibrate (s)", "tokens/s", "plain forward (s)", "tokens/s", "ratio",
                     "machine"],
                    [[r["model"], r["tokens"], r["calibrate_s"], r["calibrate_tokens_per_s"], r["forward_s"],
                      r["forward_tokens_per_s"], r["ratio"], r["machine"]] for r in rows])


def main(argv: list[str] | None = None) -> None:
    p = parser("calibration-cost", __doc__, threads=0, name="calibration_cost", table=True)
    p.add_argument("--model", default=".models/gemma-3-270m", help="HF model folder, as `patchkv calibrate` takes")
    args = parse(p, argv)
    path = args.out / f"{args.name}.csv"
    if args.table:
        show_table(args, table)
        return
    tokens, seq_len = cli_defaults()
    calibration = calibrate_seconds(args.model)
    forward = forward_seconds(args.model, tokens, seq_len)
    row = {"model": Path(args.model).name, "tokens": tokens, "calibrate_s": round(calibration, 1),
           "calibrate_tokens_per_s": round(tokens / calibration, 1), "forward_s": round(forward, 1),
           "forward_tokens_per_s": round(tokens / forward, 1), "ratio": round(forward / calibration, 3),
           "threads": torch.get_num_threads(), "machine": machine(), "commit": commit(),
           "command": shlex.join(["python", "-m", "evals", *sys.argv[1:]])}
    rows = read_csv(path) if path.is_file() else []
    write_csv([*rows, row], path, FIELDS)
    print(table([row]))
