"""`patchkv` command line: calibrate, report, eval (with --sweep), info, push.

    patchkv calibrate --model M --out bases/            # bases, effect weights, step scales for 4x, 8x, 16x
    patchkv report --model M --artifact bases/ --text my.txt --out report/
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
import dataclasses
import math
import os
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

from .allocation import BASES, bit_allocation, default_pool, full_kv_bytes_per_token, kv_bytes_per_token
from .artifact_format import FILENAME
from .errors import IncompatibleArtifactError, PatchKVError
from .hub import expand_user

DTYPES = ("float32", "float16", "bfloat16")
#: above this many tokens `calibrate` fits step scales on a restricted vocabulary by default (`--step-top`)
LARGE_VOCABULARY = 65_536


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


def step_grid(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated step multipliers > 0, e.g. 0.5,0.75,1,1.25 (sorted, repeats dropped)."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated step multipliers > 0, e.g. 0.5,0.75,1,1.25, got "
                                         f"{text!r}")
    return tuple(sorted(set(values)))


def rank_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, e.g. 8,16,32."""
    parts = [t.strip() for t in text.split(",")]
    try:
        ranks = [positive_int(t) for t in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, e.g. 8,16,32, got "
                                         f"{text!r}") from None
    return ranks


def budget_list(text: str) -> list:
    """argparse type: comma-separated budgets (`patchkv.budgets.parse_budget`), or 'none'. A budget starts with a
    digit, so a comma inside a method's fields does not split it ("8x,16x+sinks:window=64,bits=8" is two)."""
    from .budgets import parse_budget

    if text.strip().lower() == "none":
        return []
    try:
        return [parse_budget(t) for t in re.split(r",(?=\s*\d)", text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else getattr(torch, dtype),
                                                     **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except ImportError as e:
        raise PatchKVError(f"loading --model {path}{' --gguf-file ' + gguf_file if gguf_file else ''} needs a "
                           f"missing package: {e}" + (" (pip install gguf)" if gguf_file else "")) from e
    except (OSError, ValueError) as e:
        raise PatchKVError(f"could not load the model {path!r}: {' '.join(str(e).split())}") from e
    return model, tokenizer


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Calibrate, then fit step scales for each budget (`--budgets`). Under `torchrun` (WORLD_SIZE > 1) every
    process calibrates its share of the batches in one process group (gloo on CPU, NCCL on CUDA, each rank on GPU
    LOCAL_RANK); rank 0 fits the step scales, writes the artifact and prints."""
    import time

    from . import calibrate
    from .distributed import destroy, init_from_env, is_main_process
    from .retrieval import source_text
    from .step_scales import GRID, fit_step_scales
    from .texts import read_texts

    target = _check_out_file(args.out, args.force)  # before the (slow) calibration: a bad --out would lose it
    texts = read_texts(args.data, column=args.data_column)
    if args.retrieval_rows:  # before the model loads
        if not args.fisher_tokens:
            raise UsageError("--retrieval-rows mixes the retrieval rows' effect weights with the text's, and "
                             "--fisher-tokens 0 measures none: pass --fisher-tokens (e.g. 4096) or drop "
                             "--retrieval-rows.")
        source_text(texts, args.retrieval_seq)
    created = init_from_env()
    try:
        model, tokenizer = _load_model(args.model, args.dtype)
        if created and torch.cuda.is_available():
            model.to(torch.device("cuda", torch.cuda.current_device()))
        head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else \
            model.config.hidden_size // model.config.num_attention_heads
        rank = args.rank if args.rank is not None or args.energy is not None else max(1, head_dim // 4)
        start = time.perf_counter()
        artifact = calibrate(model, texts, tokenizer=tokenizer, mode=args.mode, rank=rank, energy=args.energy,
                             max_tokens=args.max_tokens, sink_tokens=args.sink_tokens, seq_len=args.seq_len,
                             fisher_tokens=args.fisher_tokens, fisher_window=args.window,
                             layer_bases=args.layer_bases, layers_per_basis=args.layers_per_basis,
                             retrieval_rows=args.retrieval_rows,
                             retrieval_seq=args.retrieval_seq,
                             source=args.data or "patchkv general mix (Python docs prose + Shakespeare)")
        artifact.calibration["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        if is_main_process():
            rows = _held_out_rows(texts, tokenizer, args.step_tokens)
            for budget in args.budgets:
                q = budget.quantized(artifact, args.context)
                print(f"fitting step scales for {budget} ({q.bits} bits per head, {q.pool} pool, at {args.context} "
                      "tokens)", flush=True)
                artifact = fit_step_scales(model, artifact, rows, bits=q.bits, pool=q.pool, context=q.context,
                                           sink_tokens=args.sink_tokens, window=args.window, chunk=args.step_chunk,
                                           grid=args.step_grid or GRID, passes=2, top=_step_top(args.step_top, model),
                                           extend=args.step_extend)
                note = _grid_edge_note(budget, artifact, q.bits, q.pool)
                if note:
                    print(note, flush=True)
            try:
                file = artifact.save(target)
            except (OSError, SafetensorError) as e:
                raise PatchKVError(f"--out {args.out}: could not write the artifact ({_one_line(e)}); nothing was "
                                   "written. Free space or choose another --out, and calibrate again.") from e
            pool = default_pool(artifact)
            print(f"wrote {file} in {time.perf_counter() - start:.0f} s\n{artifact}\nuse: patchkv.apply(model, "
                  f"Artifact.load({str(file)!r}), patchkv.budgets.parse_budget('8x').methods(artifact, context)) or "
                  f"`patchkv report --model {args.model} --artifact {file}` ({pool} pool)")
    finally:
        if created:
            destroy()


def _grid_edge_note(budget, artifact, bits: int, pool: str) -> str | None:
    """One line when the step scales just fitted for `budget` sit at an edge of the grid their fit records
    (`grid_edges`): the loss may fall further past it, and a wider --step-grid to try."""
    fit = next((f for f in reversed(artifact.calibration.get("step_scale_fits", []))
                if (f.get("bits"), f.get("pool")) == (bits, pool)), {})
    if not fit.get("edges"):
        return None
    grid = sorted({*fit["grid"], *(s for beyond in fit.get("beyond", {}).values() for s in beyond)})
    wider = set(grid)
    for edge in set(fit["edges"].values()):
        end = min(grid) if edge == "lowest" else max(grid)
        wider |= {round(end * f, 4) for f in ((0.5, 0.625, 0.75, 0.875) if edge == "lowest" else (1.25, 1.5, 2.0))}
    found = ", ".join(f"{kind} {fit[kind]:g} ({edge})" for kind, edge in fit["edges"].items())
    return (f"note: {budget}'s step scales sit at the edge of the grid tried ({found}); the loss may fall further "
            f"past it: --step-grid {','.join(f'{v:g}' for v in sorted(wider))} searches wider, --step-extend 3 "
            "walks on from that end")


def _step_top(flag: int | None, model) -> int | None:
    """`--step-top`: the `top` of `fit_step_scales` (None: the whole vocabulary). Unset: `patchkv.step_scales.TOP` where the
    vocabulary has more than `LARGE_VOCABULARY` tokens, the whole vocabulary otherwise (a small head is cheap, and the
    fits then match those made before the restricted loss existed)."""
    from .step_scales import TOP

    if flag is None:
        return TOP if model.config.vocab_size > LARGE_VOCABULARY else None
    return flag or None


def _held_out_rows(texts: list[str], tokenizer, tokens: int) -> torch.Tensor:
    """`[2, tokens / 2]` ids from the end of the calibration text (the statistics read its beginning): the rows the
    step scales are fitted on."""
    length = max(64, tokens // 2)
    tail, ids = "", []
    for text in reversed(texts):
        tail = text + "\n\n" + tail
        ids = tokenizer(tail[-8 * tokens:], add_special_tokens=False)["input_ids"]
        if len(ids) >= 2 * length:
            break
    if len(ids) < 2 * length:
        raise ValueError(f"--step-tokens {tokens}: the calibration text has only {len(ids)} tokens; pass more text "
                         "or fewer --step-tokens.")
    ids = ids[-2 * length:]
    return torch.tensor([ids[:length], ids[length:]])


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


def _check_out_file(out: str, force: bool) -> Path:
    """The artifact file `calibrate --out` will write (`Artifact.save`'s rule: a .safetensors path, else a folder
    holding patchkv.safetensors), refused before any work unless it can be written, and, without `force` (`--force`),
    when it already exists. Nothing is created."""
    if not out:
        raise UsageError(f"--out '': expected a folder or a .safetensors file ('.' for {FILENAME} in the current "
                         "folder).")
    path = expand_user(out, FileNotFoundError)
    file = path if path.suffix == ".safetensors" else path / FILENAME
    _check_writable_folder(out, file.parent)
    if file.is_dir():
        raise IsADirectoryError(f"--out {out}: {file} is a directory, so the artifact cannot be written there.")
    if file.exists() and not force:
        raise FileExistsError(f"--out {out}: {file} already exists; pass --force to overwrite it, or choose another "
                              "--out.")
    return file


def cmd_eval(args: argparse.Namespace) -> None:
    from .artifact import Artifact
    from .evaluate import evaluate, format_table, plot, write_csv
    from .methods import build_plan, from_options, parse_method
    from .patching import patched
    from .tasks import lm_eval_configs

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
        lm_eval_configs(tasks)
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
            bit_allocation(art, args.bits)  # a budget out of range is a ValueError here, not after the baseline
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


def _layer_bases(span: int) -> str:
    """What `info` says of an artifact's layer bases, each spanning `span` layers (0: none)."""
    if span > 1:
        return f"yes, each spanning {span} layers (quantized:basis=layer codes on them)"
    return "yes (quantized:basis=layer available)" if span else "no"


def cmd_info(args: argparse.Namespace) -> None:
    from .artifact import Artifact

    art = Artifact.from_pretrained(args.artifact, sha256=args.sha256)
    print(art)
    print(f"format version {art.format_version}; effect weights: "
          f"{'yes (quantized:pool=global available)' if art.has_effect_weights else 'no'}; step scales: "
          f"{'yes' if art.has_step_scales else 'no'}; layer bases: "
          f"{_layer_bases(art.layers_per_basis)}")
    local = expand_user(args.artifact)
    if local.exists():
        from .artifact_format import file_sha256

        print(f"file sha256: {file_sha256(local / FILENAME if local.is_dir() else local)}")
    print(f"KV bytes/token: {kv_bytes_per_token(art)} (uncompressed {full_kv_bytes_per_token(art)})")
    print(f"key ranks:   {art.keys.ranks.tolist()}\nvalue ranks: {art.values.ranks.tolist()}")
    print(f"calibration: {art.calibration}")


def cmd_report(args: argparse.Namespace) -> None:
    """Every budget of an artifact on the user's model and text: bytes, perplexity, needle, continuation."""
    import time

    from .artifact import Artifact
    from .provenance import provenance
    from .report import default_text, read_text, report, table, write

    out = _check_out_dir(args.out, "report") if args.out is not None else None
    texts = [read_text(t) for t in args.text] or [default_text()]
    art = Artifact.from_pretrained(args.artifact)
    model, tokenizer = _load_model(args.model, args.dtype)
    art.check_compatible(model)
    start = time.perf_counter()
    budgets = [dataclasses.replace(b, basis=args.basis) for b in args.budgets]
    rows = report(model, tokenizer, art, texts, budgets=budgets, context=args.context, chunk=args.chunk,
                  depths=tuple(args.needle_depths), quantized_cache=not args.no_quantized_cache,
                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(rows))
    if out is not None:
        meta = {"model": args.model, "artifact": args.artifact, "context": args.context, "chunk": args.chunk,
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "texts": ", ".join(name for name, _ in texts), "seconds": round(time.perf_counter() - start),
                **provenance()}
        for file in write(rows, out, meta):
            print(f"wrote {file}", file=sys.stderr)


def cmd_push(args: argparse.Namespace) -> None:
    from .artifact import Artifact

    table = Path(args.eval_table).read_text(encoding="utf-8") if args.eval_table else None  # missing: fail first
    art = Artifact.from_pretrained(args.artifact)
    print(art.push_to_hub(args.repo_id, private=not args.public, eval_table=table))


def build_parser() -> argparse.ArgumentParser:
    from .methods import METHODS
    from .tasks import DEFAULT_TASKS

    p = _Parser(prog="patchkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="calibrate PCA bases, effect weights and per-budget step scales")
    c.add_argument("--model", required=True, help="HF model folder or name")
    c.add_argument("--data", default=None, help="a text file, a folder of .txt files, 'corpus' (the Shakespeare "
                                                "training works), a folder saved by datasets, or a datasets name in "
                                                "the local cache (default: the shipped general mix)")
    c.add_argument("--data-column", default="text", help="the text column of a dataset")
    c.add_argument("--mode", choices=["pre_rope", "post_rope"], default="pre_rope")
    budget = c.add_mutually_exclusive_group()
    budget.add_argument("--rank", type=positive_int, help="components per head kept as floats by the default "
                                                          "lowrank codec (default: head_dim / 4, 4x)")
    budget.add_argument("--energy", type=energy_fraction)
    c.add_argument("--max-tokens", type=positive_int, default=16_384, help="tokens of statistics (16k is the knee "
                                                                          "on SmolLM2)")
    c.add_argument("--sink-tokens", type=non_negative_int, default=4, help="first tokens of each sequence left out "
                                                                           "of the statistics and kept exact")
    c.add_argument("--seq-len", type=positive_int, default=512)
    c.add_argument("--fisher-tokens", type=non_negative_int, default=4096,
                   help="measure effect weights on this many tokens (the global bit pool needs them); 0 skips")
    c.add_argument("--retrieval-rows", type=non_negative_int, default=0,
                   help="also measure effect weights on this many retrieval rows (a number hidden in the calibration "
                        "text, asked for after it) and mix them with the text's at equal say, so the bit pool keeps "
                        "what retrieval reads; about 30 s a row for a 135M model on 2 CPU cores; 0 skips")
    c.add_argument("--retrieval-seq", type=positive_int, default=2048,
                   help="tokens per retrieval row (the calibration text needs 8 characters a token)")
    c.add_argument("--layer-bases", action="store_true",
                   help="also calibrate one basis per layer over its KV heads (artifact version 5), for "
                        "--method quantized:basis=layer")
    c.add_argument("--layers-per-basis", type=positive_int, default=1,
                   help="with --layer-bases, layers each basis spans, consecutive ones of one attention kind "
                        "(dividing each kind's layer count; artifact version 7 when more than 1: bases across layers)")
    c.add_argument("--window", "--fisher-window", dest="window", type=non_negative_int, default=32,
                   help="recent tokens kept exact, for effect weights and step scales (the window you will apply)")
    c.add_argument("--budgets", type=budget_list, default="4x,8x,16x",  # patchkv.budgets.DEFAULT_BUDGETS
                   help="budgets to fit step scales for, e.g. 4x,8x,16x (ratios against the 16-bit cache) or bits "
                        "per head such as 119; 'none' skips")
    c.add_argument("--context", type=positive_int, default=4096, help="the context the ratios are met at")
    c.add_argument("--step-tokens", type=positive_int, default=2048,
                   help="tokens of held-out calibration text the step scales are fitted on")
    c.add_argument("--step-chunk", type=positive_int, default=64,
                   help="tokens per forward while fitting step scales (as `patchkv report` scores; 16 fits closer "
                        "to token-by-token decoding, 4x slower)")
    c.add_argument("--step-grid", type=step_grid, default=None,
                   help="step multipliers tried for keys and for values, comma-separated (default: those of "
                        "patchkv.step_scales.GRID, 1 to 1.75; a fit at either end of the grid says so)")
    c.add_argument("--step-extend", type=non_negative_int, default=0,
                   help="where a fitted scale wins at an end of the grid, try up to N more multipliers past it at the "
                        "grid's spacing there, while the loss falls (default 0: the grid only; the loss moves little "
                        "out there and may rank the scales unlike held-out text)")
    c.add_argument("--step-top", type=non_negative_int, default=None,
                   help="the step-scale loss reads the targets and each position's K likeliest tokens under the "
                        "unpatched model; 0: the whole vocabulary (default: 64 for a vocabulary of more than 65,536 "
                        "tokens, whose head would be most of the fit's time; the whole vocabulary otherwise)")
    c.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="the model's dtype for the forwards (auto: its own); statistics are float64 whatever it is")
    c.add_argument("--out", required=True, help="output directory or .safetensors file")
    c.add_argument("--force", action="store_true", help="overwrite the artifact --out names if it exists")
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

    r = sub.add_parser("report", help="what each budget costs on your model and text: bytes, perplexity, needle")
    r.add_argument("--model", required=True, help="HF model folder or name")
    r.add_argument("--artifact", required=True, help="artifact path or Hub id")
    r.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="a .txt file, or a .jsonl file of {\"text\": ...} (its first document); repeatable "
                        "(default: a held-out prose document shipped with patchkv)")
    r.add_argument("--budgets", type=budget_list, default="4x,8x,16x",
                   help="budgets to report, e.g. 4x,8x,16x or bits per head such as 119")
    r.add_argument("--context", type=positive_int, default=4096, help="tokens of each text scored (and the needle's "
                                                                      "haystack)")
    r.add_argument("--chunk", type=positive_int, default=64, help="tokens per forward through the cache")
    r.add_argument("--basis", choices=BASES, default="head",
                   help="the bases the budgets code on: each KV head's, or the artifact's layer bases ('layer'; "
                        "across layers where it was calibrated with --layers-per-basis)")
    r.add_argument("--needle-depths", type=lambda t: [float(x) for x in t.split(",")], default=[0.5],
                   help="where the needle goes, as fractions of the haystack, e.g. 0.1,0.5,0.9")
    r.add_argument("--no-quantized-cache", action="store_true", help="skip transformers' QuantizedCache rows")
    r.add_argument("--dtype", choices=("auto", *DTYPES), default="auto")
    r.add_argument("--out", help="directory for report.md, report.csv and report.png")
    r.set_defaults(func=cmd_report)

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
