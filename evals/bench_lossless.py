"""The lossless stage, measured: how much DEFLATE takes off each budget's codes when a cache leaves the device
(`patchkv.save_cache`; results in evals/results/lossless.csv).

    .venv/bin/python -m evals lossless --out evals/results          # a few minutes on 2 cores

SmolLM2-135M-Instruct in bfloat16, the suite's configurations (`evals/suite.py`). Each held-out 4k document of the
perplexity tasks (prose, Shakespeare, Milton: the first `--docs` of each) is prefilled in one forward into the
configuration's cache, which is saved with and without the lossless stage and loaded back (the restored cache is
checked equal, region by region). Per configuration and document: the bytes per token held in memory (fixed
rate, what the compression ratio counts), the file's bytes per token with and without DEFLATE, the codes' own
ratio (raw / deflated), and the seconds to save and to load. The in-memory cache stays fixed-rate; these bytes only
matter for a cache that is offloaded or saved.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

import patchkv
from patchkv.budgets import sixteen_bit_bytes
from patchkv.records import markdown

from .suite import CONFIGS, load_artifacts, load_smollm2, write_csv
from .tasks import TASKS
from .verbs import parse, parser, show_table

FIELDS = ("method", "document", "tokens", "held_bytes_per_token", "file_bytes_per_token_raw",
          "file_bytes_per_token_deflate", "code_ratio", "compression_vs_bf16_held", "compression_vs_bf16_file",
          "save_seconds", "load_seconds")


@torch.no_grad()
def measure(model, tokenizer, artifacts, config: str, document: str, index: int, context: int, folder: Path) -> dict:
    task = TASKS[f"ppl_{document}"]
    ids = tokenizer(task.documents()[index], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([([tokenizer.bos_token_id] + ids)[:context]])
    with patchkv.patched(model, *CONFIGS[config].patch(artifacts, context)):
        cache = model(ids, use_cache=True).cache
        raw = patchkv.save_cache(cache, folder / "raw.safetensors", compress=None)
        began = time.perf_counter()
        packed = patchkv.save_cache(cache, folder / "deflate.safetensors")
        saved = time.perf_counter() - began
        began = time.perf_counter()
        restored = patchkv.load_cache(model, packed.path)
        loaded = time.perf_counter() - began
        for mine, theirs in zip(restored.layers, cache.layers):
            if not all(torch.equal(mine.tensors[n], theirs.tensors[n]) for n in theirs.tensors):
                raise AssertionError(f"{config} {document}: the restored cache differs from the saved one")
    n, full = ids.shape[1], sixteen_bit_bytes(artifacts["pre_rope"])
    held, file_raw, file_packed = raw.held_bytes / n, raw.path.stat().st_size / n, packed.path.stat().st_size / n
    return {"method": config, "document": f"{document}#{index}", "tokens": n, "held_bytes_per_token": round(held, 1),
            "file_bytes_per_token_raw": round(file_raw, 1), "file_bytes_per_token_deflate": round(file_packed, 1),
            "code_ratio": round(packed.code_ratio, 4), "compression_vs_bf16_held": round(full / held, 3),
            "compression_vs_bf16_file": round(full / file_packed, 3), "save_seconds": round(saved, 3),
            "load_seconds": round(loaded, 3)}


def table(rows: list[dict]) -> str:
    """Markdown: per configuration, the mean over documents."""
    lines = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        mean = {key: sum(float(r[key]) for r in mine) / len(mine) for key in FIELDS[3:9]}
        lines.append([method, f"{mean['held_bytes_per_token']:.0f} ({mean['compression_vs_bf16_held']:.2f}x)",
                      f"{mean['file_bytes_per_token_deflate']:.0f} ({mean['compression_vs_bf16_file']:.2f}x)",
                      f"{mean['code_ratio']:.3f}", len(mine)])
    return markdown(["config", "held B/token (vs bf16)", "file B/token, DEFLATE (vs bf16)", "codes raw / DEFLATE",
                     "documents"], lines)


def main(argv: list[str] | None = None) -> None:
    p = parser("lossless", __doc__, threads=2, name="lossless", table=True)
    p.add_argument("--configs", default="4x,8x,16x,32x")
    p.add_argument("--documents", default="prose,shakespeare,milton")
    p.add_argument("--docs", type=int, default=1, help="documents per domain")
    p.add_argument("--context", type=int, default=4096)
    args = parse(p, argv)
    if args.table:
        return show_table(args, table)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for config in args.configs.split(","):
            for document in args.documents.split(","):
                for index in range(args.docs):
                    rows.append(measure(model, tokenizer, artifacts, config, document, index, args.context,
                                        Path(folder)))
                    print(rows[-1], flush=True)
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS)
    print(table(rows))
