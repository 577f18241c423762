"""A forward reads its own tokens exact, as transformers' `QuantizedCache` does; later forwards read the middle
from its latents, and the cache holds only the latents.

References are the unpatched model: over no cache (a single forward), or over a `DynamicCache` filled with
what the latent cache serves for the earlier tokens (its read-only `keys`/`values` views)."""

import pytest
import torch
from conftest import calibration_ids, make_model
from transformers import DynamicCache

import patchkv
from patchkv.allocation import full_kv_bytes_per_token, kv_bytes_per_token
from patchkv.cache import LatentLayer

TOL = 1e-5
OPTIONS = {"lowrank": {}, "sinks+window": dict(sink_tokens=2, window=3), "bits": dict(bits=24, sink_tokens=1, window=2)}


def low_rank(model, mode):
    return patchkv.calibrate(model, calibration_ids(), mode=mode, rank=4, progress=False)


@pytest.mark.parametrize("family", ["llama", "mistral", "phi3", "gemma3"])  # gemma3, mistral: sliding layers
def test_a_single_forward_equals_the_unpatched_model(family, mode):
    model = make_model(family)
    art = low_rank(model, mode)
    x = calibration_ids(2, 30, seed=31)  # longer than every window, so every layer encodes tokens
    reference = model(x).logits
    for options in OPTIONS.values():
        with patchkv.patched(model, art, **options):
            out = model(x, use_cache=True)
            no_cache = model(x, use_cache=False).logits
        assert out.cache.layers[-1].middle_len > 0  # tokens were encoded during the forward
        assert (out.logits - reference).abs().max() < TOL and (no_cache - reference).abs().max() < TOL


def served_prefix(cache: patchkv.LatentCache, n: int) -> DynamicCache:
    """The first n tokens as the latent cache serves them now (sinks and window exact, the middle decoded),
    as a plain DynamicCache."""
    plain = DynamicCache()
    for i, layer in enumerate(cache.layers):
        plain.update(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone(), i)
    return plain


@pytest.mark.parametrize("family", ["llama", "phi3"])
@pytest.mark.parametrize("method", list(OPTIONS))
@pytest.mark.parametrize("step", [1, 6])  # a decode step, a chunk longer than the window
def test_a_later_forward_reads_earlier_tokens_from_the_latents(family, mode, method, step):
    """The second forward equals the unpatched model over the earlier tokens as the cache holds them before it
    (sinks and window exact, the middle decoded from its latents) and its own tokens exact; it differs from the
    unpatched model over exact earlier tokens."""
    model = make_model(family)
    art = low_rank(model, mode)
    x = calibration_ids(2, 20 + step, seed=32)
    reference = model(x).logits[:, 20:]
    with patchkv.patched(model, art, **OPTIONS[method]):
        first = model(x[:, :20], use_cache=True)
        prefix = served_prefix(first.cache, 20)
        second = model(x[:, 20:], cache=first.cache, use_cache=True).logits
    expected = model(x[:, 20:], cache=prefix, use_cache=True).logits
    assert (second - expected).abs().max() < TOL
    assert (second - reference).abs().max() > 1e-3


def test_a_chunked_prefill_reads_each_chunk_exact_and_the_earlier_ones_from_the_latents(mode):
    """Chunk by chunk, each forward equals the unpatched model over the earlier chunks as the cache serves them."""
    model = make_model("llama")
    art = low_rank(model, mode)
    x = calibration_ids(2, 24, seed=33)
    runs = []
    with patchkv.patched(model, art, sink_tokens=1, window=2):
        cache = model(x[:, :8], use_cache=True).cache
        for start in (8, 16):
            prefix = served_prefix(cache, start)
            runs.append((start, model(x[:, start:start + 8], cache=cache, use_cache=True).logits, prefix))
    for start, out, prefix in runs:
        expected = model(x[:, start:start + 8], cache=prefix, use_cache=True).logits
        assert (out - expected).abs().max() < TOL


def test_tokens_are_encoded_after_attention_and_views_follow_what_attention_reads(mode, monkeypatch):
    """During the forward its tokens sit exact in the recent region (the views show them exact, as attention
    reads them); after it every token beyond the window is encoded, the views decode the middle, and the bytes
    are the sinks, the window and the latents."""
    model = make_model("llama")
    art = low_rank(model, mode)
    x = calibration_ids(2, 30, seed=34)
    plain = model(x, use_cache=True).cache
    during = {}
    release = LatentLayer.after_attention

    def record(layer, observed=None):
        during[len(during)] = (layer.middle_len, layer.window_len, layer.keys, layer.values)
        release(layer, observed)

    monkeypatch.setattr(LatentLayer, "after_attention", record)
    with patchkv.patched(model, art, bits=24, sink_tokens=2, window=3):
        cache = model(x, use_cache=True).cache
    tokens, middle = 30, 30 - 2 - 3
    exact_bytes = full_kv_bytes_per_token(art) // art.num_layers  # one layer's exact K and V per token
    for i, layer in enumerate(cache.layers):
        middle_during, window_during, keys, values = during[i]
        assert (middle_during, window_during) == (0, tokens - 2)
        assert layer.nbytes() == sum(t.nbytes for t in layer.tensors.values())
        assert (layer.sink_len, layer.middle_len, layer.window_len) == (2, middle, 3)
        assert torch.allclose(keys, plain.layers[i].keys, atol=TOL)  # what attention read: every token exact
        assert torch.allclose(values, plain.layers[i].values, atol=TOL)
        assert not torch.allclose(layer.keys, plain.layers[i].keys, atol=1e-3)  # now: the middle decoded
        assert torch.allclose(layer.keys[:, :, :2], plain.layers[i].keys[:, :, :2], atol=TOL)
        assert torch.allclose(layer.values[:, :, -3:], plain.layers[i].values[:, :, -3:], atol=TOL)
    assert cache.nbytes() == sum(layer.nbytes() for layer in cache.layers) + 2 * tokens * 4
    assert sum(layer.nbytes() - 2 * 5 * exact_bytes for layer in cache.layers) == \
        2 * middle * kv_bytes_per_token(art, bits=24)
