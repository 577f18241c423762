"""The benchmark suite's one runner: named configurations (`evals/suite.py`) x named tasks (`evals/tasks.py`).

    python -m evals list                                       # the registries
    python -m evals run --configs unpatched,8x,16x --tasks ruler_niah_single_1 --context 4096 --samples 100
    python -m evals peers --predictions .cache/ruler/kvpress.jsonl   # score kvpress's answers (evals/peers)
    python -m evals table                                      # the README's accuracy table, from the CSV
    python -m evals throughput --out evals/results             # speed, every path side by side (bench_throughput.py)
    python -m evals profile --out evals/results                # where the time goes, per stage (profile_paths.py)
    python -m evals lossless --out evals/results               # DEFLATE over saved caches' codes (bench_lossless.py)
    python -m evals memory --out evals/results                 # peak memory of one prefill (bench_memory.py)
    python -m evals blocks --out evals/results                 # a prefix store's blocks, pre- vs post-RoPE (bench_blocks.py)
    python -m evals spill --out evals/results                  # its disk tier and lossless stage (bench_spill.py)
    python -m evals scaling --out evals/results                # cost against context, 1k to 128k (bench_scaling.py)
    python -m evals VERB --help                                # every other benchmark, research and build script
                                                               # (`evals/verbs.py` lists them)

`run` scores every configuration on the same samples, sample by sample (interleaved, so a run stopped early
leaves every configuration with the same samples), and appends one record per (configuration, task, context,
sample) to `<results>/samples/<task>@<context>.jsonl` (`--results`, default evals/results) with the commit it ran at; samples already there are
skipped, so a long run resumes and can be split into parts. After every sample the summary CSV
(`<results>/smollm2_accuracy.csv`) is rebuilt from all records: one row per configuration x task x context with
`samples`, the score, its 95% interval (`ci95`: RULER, Wilson; perplexity, bootstrap over documents), the
unpatched score on the same samples, the KV bytes per token held and the commits and command that produced it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import shlex
import sys
from collections import Counter, defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

from patchkv.provenance import commit, machine
from patchkv.records import SAMPLE_FIELDS, Point, Result, change, markdown, write_csv
from patchkv.records import plot as records_plot

from .suite import (CONFIGS, DTYPES, PLOTTED, RESULTS, SMOLLM2, load_artifacts, load_smollm2, models_dtype,
                    sixteen_bit_bytes_per_token)
from .suite import config as suite_config
from .tasks import REGISTRY, TASKS, Ruler, wilson_half_width
from .verbs import VERBS
from .verbs import run as run_verb

FIELDS = ["method", "family", "kv_bytes_per_token", "compression_vs_bf16", "task", "context", "samples", "score",
          "ci95", "unpatched_score", "protocol", "commit", "command"]
RULER_PROTOCOL = "context compressed after its prefill; question and answer read the cache"
PROTOCOL = {"ruler": RULER_PROTOCOL, "needle": RULER_PROTOCOL, "perplexity": "64 tokens per forward through the cache",
            "continuation": "context compressed after its prefill; its last 512 tokens read it in one forward, scored"}  # = peers'

#: the task kinds scored as perplexity (an NLL sum over `count` tokens per record)
PERPLEXITY = ("perplexity", "continuation")


def command() -> str:
    return "python -m evals " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def records_path(results: Path, task: str, context: int) -> Path:
    return results / "samples" / f"{task}@{context}.jsonl"


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def sample_record(result: Result, **stamp: object) -> dict:
    """A per-sample JSONL line: the `Result`'s sample fields, then `stamp` (commit, command, machine, ...)."""
    return {**{name: getattr(result, name) for name in SAMPLE_FIELDS}, **stamp}


def append_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run(args: argparse.Namespace) -> None:
    configs = [CONFIGS[c] for c in args.configs.split(",")]
    unknown = [t for t in args.tasks.split(",") if t not in TASKS]
    if unknown:
        raise SystemExit(f"--tasks: {unknown} are not tasks of the suite (python -m evals list names them; lm-eval "
                         "tasks run with patchkv eval)")
    tasks = [TASKS[t] for t in args.tasks.split(",")]
    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = getattr(torch, args.dtype) if args.dtype else models_dtype()
    model, tokenizer = load_smollm2(dtype)
    artifacts = load_artifacts(dtype)
    stamp = {"commit": commit(), "command": command(), "machine": machine(), "threads": torch.get_num_threads(),
             "dtype": str(dtype).removeprefix("torch.")}
    import patchkv

    for task in tasks:
        path = records_path(args.results, task.name, args.context)
        done = {(r["config"], r["index"]) for r in read_records(path)}
        if isinstance(task, Ruler):
            samples = task.samples(args.context, args.samples, SMOLLM2)
        else:
            samples = list(range(min(args.samples, task.available(args.context))))
        for sample in samples:
            index = sample["index"] if isinstance(sample, dict) else sample
            for config in configs:
                if (config.name, index) in done:
                    continue
                patch = config.patch(artifacts, args.context)
                cache = config.cache(model) if config.cache else None
                with patchkv.patched(model, *patch) if patch else nullcontext():
                    if isinstance(task, Ruler):
                        scored = task.run(model, tokenizer, sample, cache, config.name)
                    else:
                        scored = task.run(model, tokenizer, index, args.context, cache, config.name)
                append_record(path, sample_record(scored, **stamp, date=datetime.datetime.now(
                    datetime.timezone.utc).isoformat(timespec="seconds")))
                print(f"{task.name}@{args.context} #{index} {config.name}: score {scored.score:.4g} "
                      f"({scored.kv_bytes_per_token:.0f} B/token, {scored.seconds:.1f} s) {scored.prediction[:40]!r}",
                      flush=True)
            write_summary(args.results)


def peers(args: argparse.Namespace) -> None:
    """Score evals/peers' (or evals/vllm's) answers with the same task scorer and add them as sample records, with
    their protocol where they name one (the summary's `protocol` then says it, not the suite's)."""
    from .tasks import ruler_score

    stamp, here = {"machine": machine()}, commit()
    by_file: dict[Path, set] = {}
    for line in Path(args.predictions).read_text().splitlines():
        p = json.loads(line)
        task = TASKS[p["task"] if p["task"] in TASKS else f"ruler_{p['task'].removeprefix('ruler_')}"]
        sample = task.samples(p["context_length"], p["index"] + 1, SMOLLM2)[p["index"]]
        path = records_path(args.results, task.name, p["context_length"])
        done = by_file.setdefault(path, {(r["config"], r["index"]) for r in read_records(path)})
        if (p["method"], p["index"]) in done:
            continue
        done.add((p["method"], p["index"]))
        # a continuation's prediction carries its NLL sum over `count` tokens; an answer is scored here
        score, count = (p["nll"], p["count"]) if sample["scorer"] == "nll" else (ruler_score(sample, p["prediction"]), 1)
        scored = Result(config=p["method"], task=task.name, context=p["context_length"], index=p["index"],
                        score=score, count=count, kv_bytes_per_token=p["kv_bytes_per_token"],
                        seconds=p["seconds"], prediction=p["prediction"])
        made_by = p.get("command") or f"evals/peers/kvpress_ruler.py --out {args.predictions} (.venv-peers), scored by " \
            f"{command()}"
        append_record(path, sample_record(scored, commit=p.get("commit") or here, dtype=p.get("dtype", "bfloat16"),
                                          command=made_by, **stamp, threads=p.get("threads", 1), date=p.get("date", ""),
                                          **({"protocol": p["protocol"]} if "protocol" in p else {})))
    write_summary(args.results)


def summarise(records: list[dict], task: str) -> list[dict]:
    """One row per configuration from one task x context's records; `unpatched_score` over the same samples."""
    kind = TASKS[task].kind if task in TASKS else "ruler"
    by_config: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in records:
        by_config[r["config"]][r["index"]] = r  # the newest record of a sample wins
    rows = []
    for config, got in by_config.items():
        indices = sorted(got)
        score, ci = aggregate(kind, [got[i] for i in indices])
        base = by_config.get("unpatched", {})
        same = [base[i] for i in indices if i in base]
        unpatched = aggregate(kind, same)[0] if len(same) == len(indices) else math.nan
        held = sum(got[i]["kv_bytes_per_token"] for i in indices) / len(indices)
        rows.append({"method": config, "family": suite_config(config).family, "kv_bytes_per_token": round(held, 1),
                     "compression_vs_bf16": round(sixteen_bit_bytes_per_token() / held, 3), "task": task,
                     "context": records[0]["context"], "samples": len(indices), "score": round(score, 4),
                     "ci95": round(ci, 4), "unpatched_score": round(unpatched, 4),
                     "protocol": got[indices[0]].get("protocol", PROTOCOL[kind]),
                     "commit": " ".join(sorted({got[i]["commit"][:7] for i in indices})),
                     "command": " | ".join(sorted({got[i]["command"] for i in indices}))})
    return rows


def aggregate(kind: str, records: list[dict]) -> tuple[float, float]:
    """(score, ci95 half-width): RULER (and the needle) mean x 100 with a Wilson interval; perplexity over all tokens
    with a bootstrap interval over documents (1000 resamples, seeded; nan for one document)."""
    if not records:
        return math.nan, math.nan
    if kind not in PERPLEXITY:
        mean = sum(r["score"] for r in records) / len(records)
        return 100 * mean, 100 * wilson_half_width(mean, len(records))

    def ppl(rs):
        return math.exp(sum(r["score"] for r in rs) / sum(r["count"] for r in rs))

    if len(records) == 1:
        return ppl(records), math.nan
    rng = random.Random(0)
    boot = sorted(ppl([rng.choice(records) for _ in records]) for _ in range(1000))
    return ppl(records), (boot[974] - boot[24]) / 2


def write_summary(results: Path) -> list[dict]:
    """Rebuild `<results>/smollm2_accuracy.csv` from every record under `<results>/samples/`."""
    rows = []
    for file in sorted((results / "samples").glob("*.jsonl")):
        task = file.stem.split("@")[0]
        rows += summarise(read_records(file), task)
    order = {name: i for i, name in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (r["task"], int(r["context"]), order.get(r["method"], len(order)), r["method"]))
    write_csv(results / "smollm2_accuracy.csv", FIELDS, [[r[f] for f in FIELDS] for r in rows])
    return rows


def table(rows: list[dict], tasks: list[str] | None = None) -> str:
    """Markdown: one line per method, one column per task@context (those of `tasks` only, when given). RULER:
    score ±ci95 (n); perplexity: ppl (change against unpatched on the same documents) (n documents)."""
    rows = [r for r in rows if tasks is None or r["task"] in tasks]
    columns = sorted({(r["task"], int(r["context"])) for r in rows},
                     key=lambda tc: (tasks.index(tc[0]) if tasks else 0, tc[0], tc[1]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["task"], int(r["context"])): r for r in rows}
    head = ["method", "KV bytes/token", "vs bf16"] + [f"{t.removeprefix('ruler_')} {c // 1024}k" for t, c in columns]
    lines = []
    for m in methods:
        first = next(r for r in rows if r["method"] == m)
        cells = []
        for t, c in columns:
            r = cell.get((m, t, c))
            if r is None:
                cells.append("—")
                continue
            score, ci, base = float(r["score"]), float(r["ci95"]), float(r["unpatched_score"])
            if t.startswith("ppl"):
                against = "" if math.isnan(base) or m == "unpatched" else change(score, base)
                cells.append(f"{score:.2f}{against} (n={r['samples']})")
            else:
                cells.append(f"{score:.1f}" + ("" if math.isnan(ci) else f" ±{ci:.1f}") + f" (n={r['samples']})")
        lines.append([m, f"{float(first['kv_bytes_per_token']):.0f}", f"{float(first['compression_vs_bf16']):.2f}x",
                      *cells])
    return markdown(head, lines)


def plotted(rows: list[dict], tasks: list[str] | None, families: str) -> list[dict]:
    """The summary rows the plot draws: those of `tasks` (None: every task) whose family `families` names
    ("plotted": `evals.suite.PLOTTED`, "all": every family, or comma-separated family names)."""
    chosen = {"plotted": PLOTTED, "all": None}.get(families, families.split(","))
    return [r for r in rows if (tasks is None or r["task"] in tasks) and (chosen is None or r["family"] in chosen)]


def point_labels(rows: list[dict]) -> list[str]:
    """Each plotted point's label, what its family's name in the legend does not say: a press's ratio ("r=0.9375"), a
    patchkv configuration's budget ("16x"), any other method's name; the whole name where the short one would be
    another point's of the same family and task ("8x-post" beside "8x")."""
    def short(row: dict) -> str:
        if row["method"].startswith("kvpress "):
            return row["method"].rsplit(" ", 1)[-1]
        return row["method"].split("-")[0] if row["family"].startswith("patchkv") else row["method"]

    place = [(r["task"], r["context"], r["family"], short(r)) for r in rows]
    taken = Counter(place)
    return [short(r) if taken[p] == 1 else r["method"].removeprefix("kvpress ") for r, p in zip(rows, place)]


def plot(rows: list[dict], path: Path) -> Path:
    """Score vs KV bytes per token, one panel per task x context, one curve per method family (patchkv's
    budgets joined by a line; each kvpress press its own curve over its ratios), 95% intervals as error bars."""
    rows = sorted(rows, key=lambda r: (r["task"], int(r["context"])))  # panels in this order
    panels = {(r["task"], int(r["context"])): f"{r['task']} @ {r['context']}" for r in rows}
    points = [Point(panels[r["task"], int(r["context"])], r["family"], float(r["kv_bytes_per_token"]), float(r["score"]),
                    label, 0 if math.isnan(float(r["ci95"])) else float(r["ci95"]))
              for r, label in zip(rows, point_labels(rows))]
    titles = {name: f"{name} (n = {min(int(r['samples']) for r in rows if (r['task'], int(r['context'])) == key)}+)"
              for key, name in panels.items()}
    ylabels = {name: "perplexity" if task.startswith("ppl") else "score (0-100)" for (task, _), name in panels.items()}
    return records_plot(points, path, xlabel="KV bytes per token", ylabel=ylabels, titles=titles) or path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in VERBS:  # their own options, parsed by their own main
        run_verb(argv[0], argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m evals", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of samples/ records and the summary CSV (default evals/results)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the configurations and tasks")
    for name, module in VERBS.items():
        sub.add_parser(name, help=f"evals/{module}.py ({name} -h: its options)")
    r = sub.add_parser("run", help="score configurations on tasks, resumable")
    r.add_argument("--configs", default="unpatched,quanto-int4,4x,8x,16x")
    r.add_argument("--tasks", default="ruler_niah_single_1")
    r.add_argument("--context", type=int, default=4096)
    r.add_argument("--samples", type=int, default=100)
    r.add_argument("--dtype", default=None, choices=DTYPES,
                   help="the models' dtype (default: PATCHKV_EVALS_DTYPE where set, else bfloat16)")
    r.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p = sub.add_parser("peers", help="score evals/peers' kvpress answers into the same records")
    p.add_argument("--predictions", required=True)
    t = sub.add_parser("table", help="rebuild the summary CSV from the records, print it as a markdown table, plot it")
    t.add_argument("--tasks", default=None, help="comma-separated: only these tasks' columns (and plot panels)")
    t.add_argument("--families", default="plotted",
                   help="the families the plot draws: 'plotted' (evals.suite.PLOTTED), 'all', or comma-separated names")
    args = parser.parse_args(argv)
    if args.command == "list":
        for c in CONFIGS.values():
            print(f"config {c.name:14s} {c.kind:16s} {c.note}")
        for name, task in REGISTRY.items():  # lm-eval's are patchkv eval's
            print(f"task   {name:26s} {task.kind:10s} {task.metric}{'' if name in TASKS else ' (patchkv eval)'}")
    elif args.command == "run":
        run(args)
    elif args.command == "peers":
        peers(args)
    else:
        rows = write_summary(args.results)
        tasks = args.tasks.split(",") if args.tasks else None
        print(table(rows, tasks))
        print(f"wrote {plot(plotted(rows, tasks, args.families), args.results / 'smollm2_accuracy.png')}")


if __name__ == "__main__":
    main()
