"""Accuracy and perplexity of a patched model vs the unpatched one, through lm-eval, against KV bytes: `patchkv eval`,
a client of the task registry (`patchkv.tasks`: its `lm-eval` tasks, their headline metrics) and of `patchkv.records`
(tables, CSV, plots)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from . import records
from .allocation import full_kv_bytes_per_token
from .artifact import Artifact
from .configs import Config, unpatched
from .methods import Method
from .patching import patched
from .records import Result, change, difference, markdown
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


def evaluate(model: nn.Module, tokenizer: Any, artifacts: list[Artifact], tasks=DEFAULT_TASKS,
             limit: int | None = None, chunk: int | None = None, methods: Sequence[Method] = (),
             bytes_context: int = 1024) -> list[tuple[Config, list[Result]]]:
    """Baseline first, then each artifact applied in turn with `methods` (see `patchkv.apply`); the model is
    left unpatched. Each configuration (unpatched, or an artifact's mode at its ranks: its `mode`, and its budget as
    its `note`) with a `Result` per task: the task's headline metric, the KV bytes per token and the compression.
    Every configuration is scored by lm-eval through the cache (`StreamingLM`), `chunk` tokens per
    forward (None: `patchkv.streaming.default_chunk`, half the methods' exact window, at least 1; 1: every
    scored token a decode step): a forward reads its own tokens exact, so one forward per sequence would score
    a patched model as the unpatched one.
    KV bytes per token are measured on a `bytes_context`-token cache (sinks and window amortised over it)."""
    from .streaming import StreamingLM

    def results(config: str, per_token: float, compression: float) -> list[Result]:
        scores = _headline(run_tasks(model, tokenizer, tasks, limit, lm=StreamingLM(model, tokenizer, chunk=chunk)))
        return [Result(config=config, task=task, score=score, kv_bytes_per_token=per_token, compression=compression)
                for task, score in scores.items()]

    first = artifacts[0] if artifacts else None
    full = full_kv_bytes_per_token(first) if first else 0
    rows = [(unpatched(), results("unpatched", full, 1.0))]
    for art in artifacts:
        with patched(model, art, methods) as m:
            plan = m.patchkv.plan.describe()
            per_token = measured_kv_bytes_per_token(model, bytes_context)
            budget = budget_label(art) + (f" + {plan}" if plan else "")
            config = Config(f"{art.mode} {budget}", "patchkv", art.mode, mode=art.mode, note=budget)
            rows.append((config, results(config.name, round(per_token, 1), full_kv_bytes_per_token(art) / per_token)))
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


def _by_task(results: list[Result]) -> dict[str, Result]:
    return {r.task: r for r in results}


def _columns(config: Config) -> list[str]:
    """A configuration's name, mode and budget ("-" for the unpatched model)."""
    return [config.name, config.mode or "-", config.note or "-"]


def format_table(rows: list[tuple[Config, list[Result]]]) -> str:
    """A markdown table: one row per configuration, each task's score and its delta vs the baseline."""
    base = _by_task(rows[0][1])
    tasks = list(base)
    head = ["config", "mode", "budget", "KV bytes/token", "compression"]
    head += [f"{t.removeprefix('patchkv_')} ({TASKS[t].metric})" for t in tasks]
    lines = []
    for config, results in rows:
        got = _by_task(results)
        first = results[0]
        cells = [*_columns(config), str(first.kv_bytes_per_token), f"{first.compression:.2f}x"]
        for t in tasks:
            value = got[t].score if t in got else float("nan")
            if results is rows[0][1]:
                delta = ""
            elif TASKS[t].higher_is_better:  # accuracies: absolute difference
                delta = difference(value, base[t].score)
            else:  # perplexities: relative change
                delta = change(value, base[t].score, 2)
            cells.append(f"{value:.4f}{delta}")
        lines.append(cells)
    return markdown(head, lines)


def write_csv(rows: list[tuple[Config, list[Result]]], path: str | Path) -> None:
    """One line per configuration: its bytes, compression, each task's score and its difference from the baseline."""
    base = _by_task(rows[0][1])
    tasks = list(base)
    lines = []
    for config, results in rows:
        got, first = _by_task(results), results[0]
        lines.append([*_columns(config), first.kv_bytes_per_token, f"{first.compression:.4f}",
                      *[f"{got[t].score:.6f}" for t in tasks], *[f"{got[t].score - base[t].score:.6f}" for t in tasks]])
    records.write_csv(Path(path), ["config", "mode", "budget", "kv_bytes_per_token", "compression", *tasks,
                                   *[f"delta_{t}" for t in tasks]], lines)


def plot(rows: list[tuple[Config, list[Result]]], path: str | Path) -> None:
    """Each task's score vs compression ratio, one line per mode, the baseline as a dashed line."""
    base = _by_task(rows[0][1])
    points = [records.Point(r.task, config.family.replace("_", "-"), r.compression, r.score, config.note)
              for config, results in rows[1:] for r in results]
    titles = {}
    for t in base:
        titles[t] = (f"{t.removeprefix('patchkv_')}: {TASKS[t].metric} "
                     f"({'higher' if TASKS[t].higher_is_better else 'lower'} is better)")
    records.plot(points, Path(path), xlabel="KV compression (x)", ylabel="score",
                 baselines={t: r.score for t, r in base.items()}, titles=titles)
