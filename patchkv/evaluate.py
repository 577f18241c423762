"""Accuracy and perplexity of a patched model vs the unpatched one, through lm-eval, against KV bytes: `patchkv eval`,
a client of the task registry (`patchkv.tasks`: its `lm-eval` tasks, their headline metrics) and of `patchkv.records`
(tables, CSV, plots)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from . import records
from .allocation import full_kv_bytes_per_token
from .artifact import Artifact
from .methods import Method
from .patching import patched
from .records import change, difference, markdown
from .tasks import DEFAULT_TASKS, TASKS, lm_eval_configs


def run_tasks(model: nn.Module, tokenizer: Any, tasks: list[str] | tuple[str, ...] = DEFAULT_TASKS,
              limit: int | None = None, batch_size: int = 8, lm: Any = None) -> dict[str, dict[str, float]]:
    """Run lm-eval on the model object as it is (patched or not), through `lm` if given (e.g. a
    `patchkv.streaming.StreamingLM`), else lm-eval's `HFLM` (one forward per sequence: a patched model then
    reads every token exact and scores as the unpatched one). Returns {task: {metric: value}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    lm = lm or HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=lm_eval_configs(tasks), limit=limit, log_samples=False, bootstrap_iters=0,
                          task_manager=TaskManager(include_defaults=False))  # skip indexing lm-eval's own tasks
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for task, metrics in out["results"].items()}


@dataclass
class EvalRow:
    """One configuration: the unpatched baseline (`artifact` None) or an artifact at its ranks."""

    label: str
    mode: str
    budget: str
    kv_bytes_per_token: float
    compression: float
    scores: dict[str, float] = field(default_factory=dict)


def evaluate(model: nn.Module, tokenizer: Any, artifacts: list[Artifact], tasks=DEFAULT_TASKS,
             limit: int | None = None, chunk: int | None = None, methods: Sequence[Method] = (),
             bytes_context: int = 1024) -> list[EvalRow]:
    """Baseline first, then each artifact applied in turn with `methods` (see `patchkv.apply`); the model is
    left unpatched. Every row is scored by lm-eval through the cache (`StreamingLM`), `chunk` tokens per
    forward (None: `patchkv.streaming.default_chunk`, half the methods' exact window, at least 1; 1: every
    scored token a decode step): a forward reads its own tokens exact, so one forward per sequence would score
    a patched model as the unpatched one.
    KV bytes per token are measured on a `bytes_context`-token cache (sinks and window amortised over it)."""
    from .streaming import StreamingLM

    def scores() -> dict[str, float]:
        return _headline(run_tasks(model, tokenizer, tasks, limit, lm=StreamingLM(model, tokenizer, chunk=chunk)))

    first = artifacts[0] if artifacts else None
    full = full_kv_bytes_per_token(first) if first else 0
    rows = [EvalRow("unpatched", "-", "-", full, 1.0, scores())]
    for art in artifacts:
        with patched(model, art, methods) as m:
            plan = m.patchkv.plan.describe()
            per_token = measured_kv_bytes_per_token(model, bytes_context)
            row_scores = scores()
        budget = budget_label(art) + (f" + {plan}" if plan else "")
        rows.append(EvalRow(f"{art.mode} {budget}", art.mode, budget, round(per_token, 1),
                            full_kv_bytes_per_token(art) / per_token, row_scores))
    return rows


def measured_kv_bytes_per_token(model: nn.Module, context: int = 1024) -> float:
    """Bytes per token the model's cache really holds after a `context`-token prefill (patched or not)."""
    import torch

    from .nbytes import cache_nbytes

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids.to(device), use_cache=True).cache
    return cache_nbytes(cache) / cache.get_seq_length()


def budget_label(art: Artifact) -> str:
    sel = art.calibration.get("rank_selection", {})
    if sel.get("rank") is not None:
        return f"rank={sel['rank']}"
    if sel.get("energy") is not None:
        return f"energy={sel['energy']}"
    return "ranks=custom"


def _headline(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """{task: its headline metric's value} from lm-eval's {task: {metric: value}}."""
    return {task: metrics[TASKS[task].metric] for task, metrics in results.items()}


def format_table(rows: list[EvalRow]) -> str:
    """A markdown table: one row per configuration, each task's score and its delta vs the baseline."""
    base = rows[0].scores
    tasks = list(base)
    head = ["config", "mode", "budget", "KV bytes/token", "compression"]
    head += [f"{t.removeprefix('patchkv_')} ({TASKS[t].metric})" for t in tasks]
    lines = []
    for row in rows:
        cells = [row.label, row.mode, row.budget, str(row.kv_bytes_per_token), f"{row.compression:.2f}x"]
        for t in tasks:
            value = row.scores.get(t, float("nan"))
            if row is rows[0]:
                delta = ""
            elif TASKS[t].higher_is_better:  # accuracies: absolute difference
                delta = difference(value, base[t])
            else:  # perplexities: relative change
                delta = change(value, base[t], 2)
            cells.append(f"{value:.4f}{delta}")
        lines.append(cells)
    return markdown(head, lines)


def write_csv(rows: list[EvalRow], path: str | Path) -> None:
    """One line per configuration: its bytes, compression, each task's score and its difference from the baseline."""
    tasks = list(rows[0].scores)
    records.write_csv(Path(path), ["config", "mode", "budget", "kv_bytes_per_token", "compression", *tasks,
                                   *[f"delta_{t}" for t in tasks]],
                      [[row.label, row.mode, row.budget, row.kv_bytes_per_token, f"{row.compression:.4f}",
                        *[f"{row.scores[t]:.6f}" for t in tasks],
                        *[f"{row.scores[t] - rows[0].scores[t]:.6f}" for t in tasks]] for row in rows])


def plot(rows: list[EvalRow], path: str | Path) -> None:
    """Each task's score vs compression ratio, one line per mode, the baseline as a dashed line."""
    tasks = list(rows[0].scores)
    points = [records.Point(t, r.mode.replace("_", "-"), r.compression, r.scores[t], r.budget)
              for r in rows[1:] for t in tasks]
    titles = {}
    for t in tasks:
        titles[t] = (f"{t.removeprefix('patchkv_')}: {TASKS[t].metric} "
                     f"({'higher' if TASKS[t].higher_is_better else 'lower'} is better)")
    records.plot(points, Path(path), xlabel="KV compression (x)", ylabel="score", baselines=rows[0].scores,
                 titles=titles)
