"""Beyond plain rank: sinks and recent window, DP-allocated quantized latents, latent top-k decoding."""

import itertools

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model

import patchkv
from patchkv.allocation import kv_bytes_per_token
from patchkv.kernels import ops as kernels
from patchkv.key_space import SCORE_CHUNK
from patchkv.quantize import GAUSSIAN_MSE, CoefficientQuantizer, allocate_bits


def full_and_low(family, mode, low_rank=4):
    model = make_model(family)
    dim = model.model.layers[0].self_attn.head_dim
    full = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=dim, progress=False)
    return model, full, full.with_ranks(rank=low_rank)


def max_error(model, artifact, x, reference, chunk=4, **options):
    """Largest logit error with x fed `chunk` tokens per forward: a forward reads its own tokens exact, so what
    the cache holds is seen by the later chunks."""
    with patchkv.patched(model, artifact, **options):
        return (fed_in_chunks(model, x, chunk) - reference).abs().max().item()


# ----- sinks and recent window ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sinks_and_window_full_rank_is_exact(family, mode):
    model, full, _ = full_and_low(family, mode)
    x = calibration_ids(2, 30, seed=3)
    assert max_error(model, full, x, model(x).logits, sink_tokens=3, window=5) < 1e-4
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    reference = model.generate(x, **kwargs)
    with patchkv.patched(model, full, sink_tokens=3, window=5):
        assert torch.equal(model.generate(x, **kwargs), reference)


def test_tokens_move_from_window_to_latents_across_generate_steps(mode):
    """After generation the cache holds the sinks and the last `window` tokens exactly, and the middle as
    latents of the very keys the unpatched model computed at those positions."""
    model, full, _ = full_and_low("llama", mode)
    x = calibration_ids(2, 9, seed=5)
    kwargs = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    plain = model.generate(x, **kwargs).past_key_values
    with patchkv.patched(model, full, sink_tokens=2, window=4):
        cache = model.generate(x, **kwargs).past_key_values
        layer = cache.layers[1]
        assert isinstance(cache, patchkv.LatentCache) and isinstance(layer, patchkv.LatentLayer)
        total = 9 + 14 - 1
        assert layer.get_seq_length() == total
        assert (layer.sink_len, layer.middle_len, layer.window_len) == (2, total - 6, 4)
        assert layer.tensors["latent_keys"].shape == (2, 1, total - 6, 2 * 16)  # packed latents
        # the read-only views reconstruct the middle and rotate pre-RoPE keys by their true positions
        assert torch.allclose(layer.keys, plain.layers[1].keys, atol=1e-5)
        assert torch.allclose(layer.values, plain.layers[1].values, atol=1e-5)


def test_sinks_and_window_cut_the_error_of_a_low_rank_cache(mode):
    model, _, low = full_and_low("llama", mode)
    x = calibration_ids(2, 32, seed=6)
    reference = model(x).logits
    plain = max_error(model, low, x, reference)
    assert max_error(model, low, x, reference, sink_tokens=2, window=8) < plain
    assert max_error(model, low, x, reference, window=40) < 1e-4  # everything in the window: exact


def test_sliding_layers_keep_their_window_exact_and_drop_sinks_that_left_it(mode):
    """Sinks and window apply to every layer; a sliding layer holds its last sliding_window - 1 tokens, the recent
    window exact, the sinks gone once they left the sliding window."""
    model, full, _ = full_and_low("gemma3", mode)
    x = calibration_ids(2, 30, seed=3)
    assert max_error(model, full, x, model(x).logits, sink_tokens=2, window=4) < 1e-4
    with patchkv.patched(model, full, sink_tokens=2, window=4):
        cache = model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True).past_key_values
    sliding, global_ = cache.layers
    assert sliding.is_sliding and (sliding.sink_len, sliding.window_len, sliding.middle_len) == (0, 4, 5)
    assert (global_.sink_len, global_.window_len, global_.middle_len) == (2, 4, 32 - 6)


# ----- DP bit allocation and quantized latents -----------------------------------------------------
def test_dp_allocation_is_optimal_against_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        lam = torch.rand(5, generator=g).sort(descending=True).values * 10
        for budget in (1, 3, 6, 9):
            bits = allocate_bits(lam, budget, max_bits=3)
            cost = sum(lam[j] * GAUSSIAN_MSE[b] for j, b in enumerate(bits.tolist()))
            best = min(sum(lam[j] * GAUSSIAN_MSE[b] for j, b in enumerate(combo))
                       for combo in itertools.product(range(4), repeat=5) if sum(combo) <= budget)
            assert int(bits.sum()) <= budget and cost == pytest.approx(float(best))


def test_dp_allocation_favours_high_variance_components():
    lam = torch.tensor([[100.0, 10.0, 1.0, 0.1, 0.01, 0.001]])
    bits = allocate_bits(lam, 12)[0].tolist()
    assert sum(bits) == 12 and bits == sorted(bits, reverse=True) and bits[-1] == 0 and bits[0] > bits[2]


def test_quantizer_error_matches_gaussian_theory_and_round_trips_codes():
    lam = torch.tensor([[9.0, 4.0, 1.0, 0.25], [1.0, 1.0, 0.5, 0.1]])
    bits = allocate_bits(lam, 10)
    q = CoefficientQuantizer(bits, lam.sqrt())
    x = torch.randn(2, 2, 40_000, 4, generator=torch.Generator().manual_seed(1)) * lam.sqrt().unsqueeze(1)
    codes = q.encode(x)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 1, 40_000, 3)  # 20 bits -> 3 bytes per token
    y = q.decode(codes)
    assert torch.equal(q.encode(y), codes)  # reconstruction points map back to their own codes
    measured = ((x - y) ** 2).mean(dim=(0, 2))
    expected = torch.tensor([[GAUSSIAN_MSE[b] for b in row] for row in bits.tolist()]) * lam
    assert torch.allclose(measured, expected, rtol=0.1)


@pytest.mark.parametrize("ratio", [16, 32])
def test_quantized_cache_reaches_16x_and_32x_vs_fp16(mode, ratio):
    model, full, _ = full_and_low("llama", mode)
    dim = 16
    bits = 16 * dim // ratio  # bits per head and token for K (and for V)
    x = calibration_ids(2, 12, seed=8)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    with patchkv.patched(model, full, bits=bits):
        cache = model.generate(x, **kwargs).past_key_values
    tokens = 12 + 6 - 1
    held = sum(layer.nbytes() for layer in cache.layers)
    assert held == 2 * tokens * kv_bytes_per_token(full, bits=bits)
    fp16_bytes = 2 * tokens * 2 * 2 * 2 * dim * 2  # batch, layers, K and V, kv_heads, head_dim, 2 bytes
    assert fp16_bytes / held == pytest.approx(ratio)


def test_more_bits_less_error(mode):
    model, full, _ = full_and_low("llama", mode)
    x = calibration_ids(2, 24, seed=9)
    reference = model(x).logits
    errors = [max_error(model, full, x, reference, bits=b) for b in (8, 32, 128)]
    assert errors[0] > errors[1] > errors[2]


# ----- latent top-k sparse decoding ----------------------------------------------------------------
def decode_step_logits(model, artifact, prompt, **options):
    with patchkv.patched(model, artifact, **options):
        out = model(prompt[:, :-1], use_cache=True)
        return model(prompt[:, -1:], cache=out.cache, use_cache=True).logits[:, -1]


def test_top_k_over_every_middle_token_equals_dense(mode):
    model, full, low = full_and_low("llama", mode)
    prompt = calibration_ids(2, 31, seed=10)
    for art in (full, low):
        dense = decode_step_logits(model, art, prompt, sink_tokens=2, window=4)
        middle = 31 - 6  # after appending the decoded token
        sparse = decode_step_logits(model, art, prompt, sink_tokens=2, window=4, top_k=middle)
        assert torch.allclose(sparse, dense, atol=1e-5)


def test_top_k_uses_latent_scoring_and_error_grows_as_k_shrinks(mode, monkeypatch):
    model, full, _ = full_and_low("llama", mode)
    prompt = calibration_ids(2, 41, seed=11)
    dense = decode_step_logits(model, full, prompt, sink_tokens=1, window=2)
    calls = []
    errors = []
    for k in (38, 24, 4):  # the decode step's middle holds 37 tokens: k = 38 selects nothing, it is dense
        if k < 38:
            original = kernels.leading_scores
            monkeypatch.setattr(kernels, "leading_scores", lambda *a, _f=original: calls.append(a[4].shape[2]) or _f(*a))
        logits = decode_step_logits(model, full, prompt, sink_tokens=1, window=2, top_k=k, top_k_rank=8)
        errors.append((logits - dense).abs().max().item())
        monkeypatch.undo()
    assert errors[0] < 1e-5 < errors[2] and errors[1] <= errors[2]
    # candidates are scored in the latent space from the codes (no dense scores of every middle token): post-RoPE
    # one query for the whole middle, pre-RoPE one per chunk
    assert calls and set(calls) == ({1} if mode == "post_rope" else {-(-37 // SCORE_CHUNK)})