"""The kvpress peer harness (evals/peers/kvpress_ruler.py, run in its own .venv-peers) as far as it runs without
kvpress: bytes counted as patchkv counts them, samples and resumption; and `python -m evals peers`, which scores its
predictions with the suite's own RULER scorer into the same records and summary as patchkv's configs."""

import argparse
import csv
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import patchkv
from patchkv.allocation import full_kv_bytes_per_token

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("kvpress_ruler", ROOT / "evals" / "peers" / "kvpress_ruler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMOLLM2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                          head_dim=64)


def test_an_uncompressed_press_costs_what_patchkv_counts_for_the_bf16_cache(harness):
    artifact = patchkv.Artifact.load(ROOT / "artifacts" / "smollm2-bases" / "pre_rope.safetensors")
    assert harness.kv_bytes_per_token(SMOLLM2, 0.0, 3801, 34) == full_kv_bytes_per_token(artifact, 2) == 23040


def test_an_evicting_press_keeps_its_share_of_the_context_and_the_whole_question(harness):
    full = 23040
    assert harness.kv_bytes_per_token(SMOLLM2, 0.875, 4000, 0) == pytest.approx(full / 8)
    with_question = harness.kv_bytes_per_token(SMOLLM2, 0.875, 3801, 34)
    assert with_question == pytest.approx(full * (0.125 * 3801 + 34) / 3835)
    assert with_question > full / 8  # the question's tokens are counted whole


def test_samples_are_limited_per_task_and_length_and_a_run_resumes(harness, tmp_path):
    samples = tmp_path / "s.jsonl"
    rows = [{"task": t, "context_length": c, "index": i} for t in ("b", "a") for c in (8192, 4096) for i in (2, 0, 1)]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = harness.read_samples([str(samples)], 2)
    assert [(s["task"], s["context_length"], s["index"]) for s in kept] == [
        (t, c, i) for t in ("a", "b") for c in (4096, 8192) for i in (0, 1)]
    out = tmp_path / "out.jsonl"
    assert harness.done_keys(out) == set()
    name = harness.method_name("kvzip", 0.9375)
    assert name == "kvpress KVzipPress r=0.9375"
    out.write_text(json.dumps({"method": name, "task": "a", "context_length": 4096, "index": 1}) + "\n")
    assert harness.done_keys(out) == {(name, "a", 4096, 1)}


def test_peers_predictions_are_scored_by_the_suites_scorer_into_its_records(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    import evals.__main__ as runner
    from evals import tasks

    monkeypatch.setattr(tasks, "RULER_CACHE", tmp_path / "ruler")
    (tmp_path / "ruler").mkdir()
    sample = {"task": "niah_single_1", "context_length": 4096, "context_ids": [1], "question_ids": [2],
              "max_new_tokens": 128, "scorer": "process_results"}
    needles = ("4430567", "1235580")
    (tmp_path / "ruler" / "niah_single_1@4096.jsonl").write_text("".join(
        json.dumps({**sample, "index": i, "outputs": [answer]}) + "\n" for i, answer in enumerate(needles)))
    predictions = tmp_path / "kvpress.jsonl"
    method = "kvpress KVzipPress r=0.9375"
    predictions.write_text("".join(json.dumps(
        {"task": "niah_single_1", "context_length": 4096, "index": i, "method": method, "prediction": text,
         "kv_bytes_per_token": 1629.0, "seconds": 1.0}) + "\n" for i, text in enumerate((" 4430567.", " 123558."))))
    results = tmp_path / "results"
    for _ in range(2):  # scoring twice adds nothing
        runner.peers(argparse.Namespace(results=results, predictions=str(predictions)))
    records = runner.read_records(results / "samples" / "ruler_niah_single_1@4096.jsonl")
    assert [(r["config"], r["index"], r["score"]) for r in records] == [(method, 0, 1.0), (method, 1, 0.0)]
    with open(results / "smollm2_accuracy.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["method"] == method)
    assert (row["samples"], float(row["score"]), float(row["kv_bytes_per_token"])) == ("2", 50.0, 1629.0)


def test_a_continuations_nll_is_recorded_as_perplexity_with_its_bytes(tmp_path, monkeypatch):
    """A press's continuation line (scorer "nll") becomes a record holding its NLL sum over its tokens; the summary
    reads it as perplexity over all tokens, at the bytes the press held after the prefill."""
    import math

    import evals.__main__ as runner
    from evals import tasks

    monkeypatch.setattr(tasks, "RULER_CACHE", tmp_path / "ruler")
    (tmp_path / "ruler").mkdir()
    (tmp_path / "ruler" / "ppl_after_prose@4096.jsonl").write_text("".join(
        json.dumps({"task": "ppl_after_prose", "context_length": 4096, "index": i, "context_ids": [1, 2],
                    "question_ids": [3, 4], "scorer": "nll"}) + "\n" for i in range(2)))
    method = "kvpress TOVAPress r=0.9375"
    predictions = tmp_path / "kvpress.jsonl"
    predictions.write_text("".join(json.dumps(
        {"task": "ppl_after_prose", "context_length": 4096, "index": i, "method": method, "prediction": "",
         "nll": nll, "count": 512, "kv_bytes_per_token": 1440.0, "seconds": 1.0}) + "\n"
        for i, nll in enumerate((1000.0, 1200.0))))
    runner.peers(argparse.Namespace(results=tmp_path / "results", predictions=str(predictions)))
    records = runner.read_records(tmp_path / "results" / "samples" / "ppl_after_prose@4096.jsonl")
    assert [(r["score"], r["count"]) for r in records] == [(1000.0, 512), (1200.0, 512)]
    with open(tmp_path / "results" / "smollm2_accuracy.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["score"]) == pytest.approx(math.exp(2200 / 1024), rel=1e-4)
    assert float(row["kv_bytes_per_token"]) == 1440.0
