"""Pre-RoPE mode rotates every cached key exactly as the unpatched model did, for every RoPE type transformers
ships, at positions inside and past the original context; types whose frequencies change with the sequence length
(dynamic NTK, longrope) are refused in pre-RoPE mode with a clear error and are exact in post-RoPE mode."""

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model

import patchkv

ORIGINAL = 24  # positions of the "original" context; the tests run to 56
HALF = 16 // 2  # head_dim 16 (64 hidden / 4 heads): 8 frequencies
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0,
                 "short_factor": [1.0] * HALF, "long_factor": [4.0] * HALF},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0},
}
LENGTH_DEPENDENT = {"dynamic", "longrope"}


def rope_model(kind: str):
    # dynamic NTK rescales past max_position_embeddings: let the test run past it
    limit = ORIGINAL if kind == "dynamic" else 512
    return make_model("llama", rope_parameters=dict(ROPE[kind]), max_position_embeddings=limit)


@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("kind", list(ROPE))
def test_every_rope_type_is_exact_at_full_rank_or_refused(kind, mode):
    model = rope_model(kind)
    art = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=16, progress=False)
    ids = calibration_ids(1, 56, seed=7)  # past the original context, fed 5 tokens per forward
    want = fed_in_chunks(rope_model(kind), ids, 5)
    methods = [patchkv.SinksWindow(2, 3), patchkv.LowRank(rank=16)]
    if mode == "pre_rope" and kind in LENGTH_DEPENDENT:
        with pytest.raises(patchkv.PatchKVError, match=f"rope_type='{kind}'.*post_rope"):
            patchkv.apply(model, art, methods)
        assert not patchkv.is_patched(model)
        return
    with patchkv.patched(model, art, methods):
        got = fed_in_chunks(model, ids, 5)
        steps = model.generate(ids[:, :20], max_new_tokens=40, do_sample=False)
    assert torch.allclose(got, want, atol=2e-4), (got - want).abs().max()
    assert torch.equal(steps, rope_model(kind).generate(ids[:, :20], max_new_tokens=40, do_sample=False))


def test_gemma3_per_layer_type_rope_is_exact_at_full_rank():
    """Gemma 3: a table per layer type (local layers at their own theta, global layers linearly scaled)."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
    model = make_model("gemma3", rope_parameters=rope)
    art = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=16, progress=False)
    ids = calibration_ids(1, 40, seed=8)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 3), patchkv.LowRank(rank=16)]):
        got = fed_in_chunks(model, ids, 5)
    assert torch.allclose(got, fed_in_chunks(make_model("gemma3", rope_parameters=rope), ids, 5), atol=2e-4)
