"""`patchkv report`: what each budget costs on your model and your text, before you deploy it.

For each configuration (unpatched, transformers' `QuantizedCache` quanto int4 where it applies, and each budget of
the artifact: `SinksWindow(4, 32)` + `Quantized` codes meeting the ratio at the context, with the step scales
fitted for it):

- KV bytes per token, measured on the cache after the text (everything: codes, exact sinks and window, positions;
  quanto's scales and residual), and the compression against the 16-bit cache the unpatched model holds after that
  text (`patchkv.budgets.sixteen_bit_bytes`: a sliding-window layer holds its last `window - 1` tokens);
- token perplexity of each text, fed `chunk` tokens per forward through the cache (`patchkv.perplexity`);
- a needle-in-a-haystack check at the context: a sentence holding a random 7-digit number is put at several depths
  of the first text, the question at its end, greedy decoding through the cache must write the number;
- a greedy continuation of the first text from the cache, side by side.

`QuantizedCache` refuses models with sliding-window layers (Mistral and Qwen2 configs with a window, Gemma 3):
those rows say so, where patchkv runs.
"""

from __future__ import annotations

import json
import math
import random
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .artifact import Artifact
from .budgets import Budget, sixteen_bit_bytes
from .configs import Config, budget, quantized_cache, unpatched
from .nbytes import cache_nbytes
from .patching import patched
from .perplexity import token_nll
from .records import Point, Result, change, markdown, plot, write_csv

NEEDLE = "The special magic number is {number}."
QUESTION = "\n\nWhat is the special magic number mentioned in the text above? The special magic number is"


@dataclass
class Row:
    """One configuration (`config`, its `note` saying what ran, or why it did not) and what was measured of it: a
    `patchkv.records.Result` per text (its perplexity, the KV bytes per token after it and their compression; the
    first text's also holds the greedy continuation) and one for the needle check (`score` found of `count` tried)."""

    config: Config
    texts: list[Result] = field(default_factory=list)
    needle: Result | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def note(self) -> str:
        return self.config.note

    @property
    def perplexity(self) -> dict[str, float]:
        """{text: perplexity}; empty for a configuration that did not run."""
        return {r.task: r.score for r in self.texts}


def default_text() -> tuple[str, str]:
    """(name, text): the first held-out prose document shipped with the package (never calibrated on)."""
    line = (Path(__file__).parent / "tasks" / "data" / "prose_4k.jsonl").read_text().splitlines()[0]
    return "prose (held out)", json.loads(line)["text"]


def read_text(path: str) -> tuple[str, str]:
    """(name, text) from a .txt file, or the first document of a .jsonl file of {"text": ...} lines."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--text {path}: no such file.")
    if file.suffix == ".jsonl":
        text = _first_document(file, path)
    else:
        text = file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"--text {path}: the text is empty; give a text of at least --context tokens.")
    return file.stem, text


def _first_document(file: Path, path: str) -> str:
    """The "text" of the first non-blank line of a .jsonl file (named `path` in errors)."""
    expected = 'expected lines of {"text": "..."}'
    line = next((line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()), None)
    if line is None:
        raise ValueError(f"--text {path}: the file holds no document; {expected}.")
    try:
        document = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"--text {path}: its first document is not JSON ({e}); {expected}.") from None
    if not isinstance(document, dict) or not isinstance(document.get("text"), str):
        found = line.strip()[:60] if not isinstance(document, dict) else f"the keys {sorted(document)}" \
            if "text" not in document else f'"text": {json.dumps(document["text"])[:40]}'
        raise ValueError(f"--text {path}: its first document has no \"text\" string (found {found}); {expected}.")
    return document["text"]


def _ids(tokenizer: Any, name: str, text: str, tokens: int) -> torch.Tensor:
    """`[1, tokens]` ids: the BOS token (where the tokenizer has one), then the text's. Raises ValueError for a
    text with fewer tokens: bytes per token and perplexity are measured at the context, not below it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    if len(start + ids) < tokens:
        raise ValueError(f"text {name!r} has {len(start + ids)} tokens, fewer than the context of {tokens} it is "
                         f"scored at; give a longer text or a smaller context (--context {len(start + ids)} or less).")
    return torch.tensor([(start + ids)[:tokens]])


@torch.no_grad()
def _greedy(model: nn.Module, logits: torch.Tensor, cache: Any, new: int) -> list[int]:
    """Greedy-decode `new` tokens through `cache`, starting from the next-token `logits` `[1, vocab]`."""
    out = []
    for _ in range(new):
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
        logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return out


def _haystack(tokenizer: Any, text: str, context: int, depth: float, number: int) -> torch.Tensor:
    """`[1, <= context]` ids: the text cut so that it, the needle sentence at `depth` and the question fit."""
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    needle = tokenizer(" " + NEEDLE.format(number=number) + " ", add_special_tokens=False)["input_ids"]
    hay = tokenizer(text, add_special_tokens=False)["input_ids"][: context - len(question) - len(needle) - 1]
    at = int(len(hay) * depth)
    start = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return torch.tensor([start + hay[:at] + needle + hay[at:] + question])


def configs(budgets: list[Budget], quantized: bool = True) -> list[Config]:
    """The report's configurations: unpatched, `QuantizedCache` quanto int4 and int2 (unless not `quantized`), then
    patchkv at each of `budgets`."""
    return [unpatched(), *([quantized_cache(4), quantized_cache(2)] if quantized else []), *map(budget, budgets)]


def report(model: nn.Module, tokenizer: Any, artifact: Artifact, texts: list[tuple[str, str]], *, budgets: list[Budget],
           context: int = 4096, chunk: int = 64, depths: tuple[float, ...] = (0.5,), continuation: int = 24,
           quantized_cache: bool = True, seed: int = 0, progress: Any = print) -> list[Row]:
    """Every configuration on every text (see the module doc); `progress(str)` gets a line per finished row."""
    rng = random.Random(seed)
    numbers = [rng.randrange(1_000_000, 9_999_999) for _ in depths]
    encoded = [(name, _ids(tokenizer, name, text, context)) for name, text in texts]
    planned = [(c, c.patch(artifact, context)) for c in configs(budgets, quantized_cache)]  # a budget refused first
    rows = []
    for config, patch in planned:
        name = config.name
        note = config.unavailable(model) or (config.spec(artifact, context) if patch else "")
        row = Row(replace(config, note=note))
        rows.append(row)
        if row.note.startswith("not run"):
            progress(f"{name}: {row.note}")
            continue
        with patched(model, *patch) if patch else nullcontext():
            def new_cache() -> Any:
                return config.cache(model) if config.cache else None

            for label, ids in encoded:
                scored = token_nll(model, ids, chunk, new_cache())
                held = cache_nbytes(scored.cache) / ids.shape[1]
                first = label == encoded[0][0]
                said = tokenizer.decode(_greedy(model, scored.last_logits, scored.cache, continuation)) if first else ""
                row.texts.append(Result(config=name, task=label, context=ids.shape[1], score=scored.perplexity,
                                        count=scored.count, kv_bytes_per_token=held, prediction=said,
                                        compression=sixteen_bit_bytes(artifact, ids.shape[1]) / held))
            found = 0
            for depth, number in zip(depths, numbers):
                scored = token_nll(model, _haystack(tokenizer, texts[0][1], context, depth, number), chunk, new_cache())
                answer = tokenizer.decode(_greedy(model, scored.last_logits, scored.cache, 10))
                found += str(number) in answer.replace(" ", "").replace(",", "")
            row.needle = Result(config=name, task="needle", context=context, score=found, count=len(depths),
                                kv_bytes_per_token=math.nan)
        progress(f"{name}: {row.texts[0].kv_bytes_per_token:.0f} bytes/token, " + ", ".join(
            f"{k} {v:.3f}" for k, v in row.perplexity.items()) + f", needle {found}/{len(depths)}")
    return rows


def table(rows: list[Row]) -> str:
    """Markdown: a line per configuration, perplexity changes against unpatched."""
    texts = list(rows[0].perplexity)
    base = rows[0].perplexity
    head = ["configuration", "KV bytes/token", "vs 16-bit", *[f"{t} ppl" for t in texts], "needle", "continuation"]
    lines = []
    for r in rows:
        if not r.perplexity:
            lines.append([r.name, "—", "—", *("—" for _ in texts), "—", r.note])
            continue
        first, ppl = r.texts[0], r.perplexity
        cells = [r.name, f"{first.kv_bytes_per_token:.0f}", f"{first.compression:.2f}x"]
        cells += [f"{ppl[t]:.3f}" + ("" if r is rows[0] else change(ppl[t], base[t])) for t in texts]
        cells += [f"{r.needle.score}/{r.needle.count}", first.prediction.replace("\n", " ").replace("|", "/")[:80]]
        lines.append(cells)
    return markdown(head, lines)


def write(rows: list[Row], out: Path, meta: dict[str, Any]) -> list[Path]:
    """report.md (the table and how it was made), report.csv, report.png into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text("# patchkv report\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta.items()) + "\n\n" + table(rows)
                  + "\n\n" + "\n".join(f"- {r.name}: {r.note}" for r in rows if r.note) + "\n")
    write_csv(out / "report.csv", ["configuration", "kv_bytes_per_token", "compression", "text", "perplexity",
                                   "needle_found", "needle_tried", "note"],
              [[r.name, *_held(r), t, round(ppl, 4), *_needle(r), r.note]
               for r in rows for t, ppl in (r.perplexity or {"": math.nan}).items()])
    base = rows[0].perplexity
    points = [Point(t, r.config.family, r.texts[0].compression, r.perplexity[t],
                    _short(r) + change(r.perplexity[t], base[t])) for r in rows[1:] for t in base if t in r.perplexity]
    png = plot(points, out / "report.png", xlabel="KV compression vs 16-bit cache (x)", ylabel="token perplexity",
               baselines=base)
    return [md, out / "report.csv", *([png] if png else [])]


def _held(row: Row) -> tuple[float, float]:
    """A row's KV bytes per token and compression as report.csv writes them: after the first text (nan: not run)."""
    first = row.texts[0] if row.texts else Result(config=row.name, task="", score=math.nan, kv_bytes_per_token=math.nan)
    return round(first.kv_bytes_per_token, 1), round(first.compression, 3)


def _needle(row: Row) -> tuple[int, int]:
    """(found, tried) of a row's needle check; (0, 0) where it did not run."""
    return (int(row.needle.score), row.needle.count) if row.needle else (0, 0)


def _short(row: Row) -> str:
    """A configuration as a plot label beside its family's line: "quanto int2", a budget's size ("8x")."""
    target = row.config.budget
    if target is not None:
        return f"{target.ratio:g}x" if target.ratio is not None else f"{target.bits} bits"
    return row.name.replace("QuantizedCache ", "")
