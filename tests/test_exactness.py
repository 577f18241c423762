"""Full-rank bases must reproduce the unpatched model; removal must restore it bit for bit.

A forward reads its own tokens exact, so the patched logits are measured on tokens fed a few at a time
(`fed_in_chunks`): each forward reads the earlier ones from the latent cache."""

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model

import patchkv
from patchkv.allocation import compression_ratio


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_rank_logits_match_unpatched(family, mode, attn):
    model = make_model(family, attn)
    head_dim = model.model.layers[0].self_attn.head_dim
    artifact = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=head_dim, progress=False)
    x = calibration_ids(3, 40, seed=7)  # longer than Mistral's window of 12
    reference = model(x).logits
    with patchkv.patched(model, artifact):
        patched = fed_in_chunks(model, x, 3)
    assert (patched - reference).abs().max() < 1e-4


def test_low_rank_changes_logits(family, mode):
    """The control for the test above: a truncated basis does change the output."""
    model = make_model(family)
    artifact = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=4, progress=False)
    x = calibration_ids(2, 24, seed=7)
    reference = model(x).logits
    with patchkv.patched(model, artifact):
        assert (fed_in_chunks(model, x, 3) - reference).abs().max() > 1e-3


def test_remove_is_bit_identical(family, mode):
    model = make_model(family)
    x = calibration_ids(2, 30, seed=3)
    reference = model(x).logits
    forwards = [type(m).forward for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patchkv.apply(model, patchkv.calibrate(model, calibration_ids(), mode=mode, rank=5, progress=False))
    assert patchkv.is_patched(model)
    assert set(model.state_dict()) == set(state)  # bases are not persistent buffers
    patchkv.remove(model)
    assert not patchkv.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())
    assert [type(m).forward for m in model.modules()] == forwards
    assert torch.equal(model(x).logits, reference)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_low_rank_projections_are_recovered_exactly(mode):
    """k_proj and v_proj of rank 4 put keys and values in a 4-dim subspace (pre-RoPE; post-RoPE keys span
    more). An energy budget must find rank 4 and the patched model must then be exact."""
    model = make_model("llama")
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.k_proj, attn.v_proj):
            w = proj.weight.data.view(2, 16, 64)  # [kv_heads, head_dim, hidden]
            low = torch.randn(2, 16, 4, generator=g) @ torch.randn(2, 4, 64, generator=g) / 8
            w.copy_(low)
    artifact = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", energy=0.9999, progress=False)
    assert artifact.keys.ranks.eq(4).all() and artifact.values.ranks.eq(4).all()
    assert compression_ratio(artifact) == pytest.approx(4.0)
    x = calibration_ids(2, 32, seed=9)
    reference = model(x).logits
    with patchkv.patched(model, artifact):
        assert (fed_in_chunks(model, x, 4) - reference).abs().max() < 1e-4
    if mode == "post_rope":  # rotation mixes pairs of dimensions: rotated keys need more than 4 components
        post = patchkv.calibrate(model, calibration_ids(), mode="post_rope", energy=0.9999, progress=False)
        assert (post.keys.ranks > 4).all() and post.values.ranks.eq(4).all()


def test_bfloat16_model(mode):
    model = make_model("llama", dtype=torch.bfloat16)
    artifact = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=16, progress=False)
    assert artifact.model["dtype"] == "bfloat16" and artifact.element_size == 2
    x = calibration_ids(2, 20, seed=2)
    reference = model(x).logits.float()
    with patchkv.patched(model, artifact):
        out = model.generate(x, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        assert out.past_key_values.layers[0].keys.dtype == torch.bfloat16
        assert (fed_in_chunks(model, x, 4).float() - reference).abs().max() < 0.1
