"""Tiny random-init models of every supported family, built from configs (no download); the `slow` marker."""

import importlib.util
import os

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)
from transformers.utils import logging

logging.set_verbosity_error()

# The real-model checks (SmolLM2, Gemma 3, through evals.suite and the `python -m evals` commands they start) load the
# models in float32: on a CPU without native bf16 arithmetic (AVX2 only) torch's bf16 runs 6-90x slower, which
# would take the suite past its time. bf16 arithmetic is checked on the tiny models (test_exactness, test_fast_decode,
# test_near, test_int8_window); PATCHKV_EVALS_DTYPE=bfloat16 runs the real-model checks in bf16.
os.environ.setdefault("PATCHKV_EVALS_DTYPE", "float32")

# tests/vllm/ needs vLLM, in its own environment (.venv-vllm, scripts/setup_vllm.sh): CI runs it as its own stage
# (a found spec without an origin is tests/vllm/ itself, as a namespace package)
collect_ignore = [] if getattr(importlib.util.find_spec("vllm"), "origin", None) else ["vllm"]


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (the full sizes of the real-model checks; each has a short version that always runs) are
    skipped, with the reason shown, unless PATCHKV_FULL=1 or a `-m` expression names `slow` (`pytest -m slow`)."""
    if os.environ.get("PATCHKV_FULL") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: the short version runs by default; PATCHKV_FULL=1 or `pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 12}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    # fused qkv_proj, partial rotary (half of each head rotates)
    "phi3": (Phi3Config, Phi3ForCausalLM, {"partial_rotary_factor": 0.5}),
    # q/k norms, sliding (window 10) and global layers alternating, one RoPE table per layer type
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 16, "sliding_window": 10, "query_pre_attn_scalar": 24,
                                                     "layer_types": ["sliding_attention", "full_attention"]}),
}


def make_model(family: str = "llama", attn: str = "sdpa", seed: int = 0, dtype=torch.float32, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(config).to(dtype).eval()


def expected_distortion(eigenvalues: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """What the bit allocators minimise: sum_c lam_c * GAUSSIAN_MSE[bits_c] (float64 scalar); eigenvalues, bits `[n]`."""
    from patchkv.quantize import GAUSSIAN_MSE

    mse = torch.tensor(GAUSSIAN_MSE, dtype=torch.float64)
    return (eigenvalues.double().clamp_min(0) * mse[bits.long()]).sum()


def calibration_ids(n: int = 8, seq: int = 48, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, COMMON["vocab_size"], (n, seq), generator=g)


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(params=["pre_rope", "post_rope"])
def mode(request):
    return request.param


def fed_in_chunks(model, ids: torch.Tensor, chunk: int, **kwargs) -> torch.Tensor:
    """Logits `[batch, seq, vocab]` of `ids` fed `chunk` tokens per forward through one cache (the model's own
    kind). A patched model reads each forward's own tokens exact and earlier forwards' from the cache, so this
    is how a test sees what the cache holds (a single forward would read every token exact)."""
    cache, logits = None, []
    for start in range(0, ids.shape[1], chunk):
        out = model(ids[:, start:start + chunk], cache=cache, use_cache=True, **kwargs)
        cache = out.cache
        logits.append(out.logits)
    return torch.cat(logits, dim=1)
