"""Every task a model is scored on, in one registry: `TASKS`, one `Task` record each, for `patchkv eval` and the
benchmark suite (`python -m evals run`) alike.

Kinds (`Task.kind`):
- `lm-eval`: a YAML task in this folder (data under `data/`, shipped in the wheel), run by lm-eval through the cache
  (`patchkv eval`, `patchkv.evaluate`); its headline metric is byte perplexity for a rolling log-likelihood task and
  accuracy for a multiple-choice one, whether higher is better read from the YAML's own `metric_list`;
- `perplexity`: token perplexity of one held-out 4k document of `data/` at a time, fed in chunks through the cache
  (the suite, `evals/tasks.py`);
- `continuation`: token perplexity of a held-out document's last 512 tokens read in one forward after the rest was
  prefilled and compressed, RULER's protocol with a continuation in place of a question (the suite; the one
  perplexity an evicting press, which compresses once after the prefill, can be scored by);
- `ruler`: lm-eval's RULER subtask `source`, the context compressed after its prefill, question and answer read
  through the cache (the suite);
- `needle`: a number hidden in a held-out document of `source` and asked for after it, by RULER's protocol (the
  suite).

`patchkv eval` runs the `lm-eval` tasks and names the suite's command for the others; the suite runs the others,
sample by sample (`evals/tasks.py` holds how).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DIR = Path(__file__).resolve().parent
DATA = DIR / "data"
#: an lm-eval task's headline metric, by its output type
HEADLINE = {"loglikelihood_rolling": "byte_perplexity", "multiple_choice": "acc"}


@dataclass(frozen=True)
class Task:
    """One task: `name`, `kind` (module doc), `source` (the YAML file of an `lm-eval` task, the RULER subtask of a
    `ruler` one, the data file of the others' documents) and the `metric` a table shows for it, with whether a higher
    value is better."""

    name: str
    kind: str
    source: str
    metric: str
    higher_is_better: bool

    def lm_eval_config(self) -> dict[str, Any]:
        """The task's lm-eval YAML definition, its data file paths made absolute (`lm-eval` tasks only)."""
        if self.kind != "lm-eval":
            raise ValueError(f"{self.name} is a {self.kind} task of the benchmark suite, not an lm-eval one: run it "
                             f"with `python -m evals run --tasks {self.name}`.")
        config = _yaml(DIR / self.source)
        files = config.get("dataset_kwargs", {}).get("data_files", {})
        for split, rel in files.items():
            files[split] = str((DIR / rel).resolve())
        return config


def _yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _lm_eval(path: Path) -> Task:
    """The registry's record of the YAML task at `path`."""
    config = _yaml(path)
    metrics = {m["metric"]: m for m in config["metric_list"]}
    metric = HEADLINE.get(config["output_type"], next(iter(metrics)))
    return Task(config["task"], "lm-eval", path.name, metric, bool(metrics[metric]["higher_is_better"]))


TASKS: dict[str, Task] = {t.name: t for t in (
    *(_lm_eval(path) for path in sorted(DIR.glob("*.yaml"))),
    *(Task(f"ppl_{domain}", "perplexity", f"{domain}_4k.jsonl", "perplexity", False)
      for domain in ("prose", "shakespeare", "milton")),
    *(Task(f"ppl_after_{domain}", "continuation", f"{domain}_4k.jsonl", "perplexity", False)
      for domain in ("prose", "shakespeare", "milton")),
    *(Task(f"ruler_{s.removeprefix('ruler_')}", "ruler", s, "score", True) for s in (
        "niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_fwe", "ruler_vt", "ruler_cwe")),
    # the haystacks: held-out prose (in Milton and Shakespeare SmolLM2-135M unpatched finds few needles)
    Task("needle_text", "needle", "prose_4k.jsonl", "score", True),
)}
#: what `patchkv eval` runs when no --tasks are given
DEFAULT_TASKS = ("patchkv_shakespeare_ppl", "patchkv_milton_ppl", "patchkv_shakespeare_cloze")


def documents(file: str) -> list[str]:
    """The texts of the data file `file` (JSON lines, each `{"text": ...}`)."""
    lines = (DATA / file).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines]


def lm_eval_configs(names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The lm-eval definitions of the tasks `names` (`Task.lm_eval_config`); an unknown name, or one of the suite's,
    is a ValueError that says which tasks there are."""
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        lm_eval = sorted(n for n, t in TASKS.items() if t.kind == "lm-eval")
        raise ValueError(f"Unknown task(s) {unknown}; the lm-eval tasks are {lm_eval} (the others, "
                         f"{sorted(set(TASKS) - set(lm_eval))}, are the benchmark suite's: python -m evals run).")
    return [TASKS[n].lm_eval_config() for n in names]
