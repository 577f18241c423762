"""generate() through the patched model, and the bytes the cache really holds."""

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model
from transformers import DynamicCache

import patchkv
from patchkv.allocation import compression_ratio, full_kv_bytes_per_token, kv_bytes_per_token


def left_padded_batch():
    ids = calibration_ids(3, 14, seed=11)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # left padding, as generate expects for decoder-only models
    ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def full_rank(model, mode):
    dim = model.model.layers[0].self_attn.head_dim
    return patchkv.calibrate(model, calibration_ids(), mode=mode, rank=dim, progress=False)


def test_greedy_generate_full_rank_matches_unpatched(family, mode):
    model = make_model(family)
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kwargs)
    with patchkv.patched(model, full_rank(model, mode)):
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, reference)


def test_sampling_generate_full_rank_matches_unpatched(mode):
    model = make_model("qwen2")
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9, pad_token_id=0)
    torch.manual_seed(123)
    reference = model.generate(ids, **kwargs)
    with patchkv.patched(model, full_rank(model, mode)):
        torch.manual_seed(123)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, reference)


def cache_bytes(cache) -> int:
    """K/V bytes held by the layers (a LatentCache also holds the positions: 4 bytes per token, counted apart)."""
    if isinstance(cache, patchkv.LatentCache):
        return sum(layer.nbytes() for layer in cache.layers)
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("budget", [{"rank": 4}, {"rank": 11}, {"energy": 0.7}])
def test_cache_holds_latents_and_shrinks_by_the_artifact_ratio(mode, budget):
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), mode=mode, progress=False, **budget)
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True)
    full = model.generate(ids, **kwargs).past_key_values
    with patchkv.patched(model, artifact):
        latent = model.generate(ids, **kwargs).past_key_values
    tokens = ids.shape[1] + 9 - 1  # the last generated token is never fed back
    assert full.get_seq_length() == latent.get_seq_length() == tokens
    for layer_idx, layer in enumerate(latent.layers):
        total = int(artifact.keys.ranks[layer_idx].sum())
        # packed latents, not [3, kv_heads, tokens, head_dim]
        assert layer.tensors["latent_keys"].shape == (3, 1, tokens, total)
        assert layer.tensors["latent_values"].shape[-1] == int(artifact.values.ranks[layer_idx].sum())
    assert cache_bytes(full) / cache_bytes(latent) == pytest.approx(compression_ratio(artifact))
    assert cache_bytes(latent) == 3 * tokens * kv_bytes_per_token(artifact)
    assert cache_bytes(full) == 3 * tokens * full_kv_bytes_per_token(artifact)
    assert latent.nbytes() == cache_bytes(latent) + 3 * tokens * 4  # int32 true positions, once for all layers


def test_sliding_window_cache_stays_bounded_with_latents(mode):
    model = make_model("mistral")  # window of 12
    artifact = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=6, progress=False)
    ids = calibration_ids(2, 20, seed=4)
    with patchkv.patched(model, artifact):
        out = model.generate(ids, max_new_tokens=15, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    layer = out.past_key_values.layers[0]
    assert layer.tensors["latent_keys"].shape == (2, 1, 11, 2 * 6)  # sliding_window - 1 latent tokens kept


class BakedStore(DynamicCache):
    """A plain cache that stores, for each token, the keys and values `baked` computes from the same hidden state
    (filled in `pending` by a hook) while a forward attends its own tokens exact, as QuantizedCache does."""

    def __init__(self, pending: dict):
        super().__init__()
        self.pending = pending

    def update(self, keys, values, layer_idx, *args, **kwargs):
        stored_keys, stored_values = super().update(*self.pending.pop(layer_idx), layer_idx, *args, **kwargs)
        n = keys.shape[2]
        return torch.cat([stored_keys[:, :, :-n], keys], 2), torch.cat([stored_values[:, :, :-n], values], 2)


@pytest.mark.parametrize("chunk", [1, 5])  # decode steps; a chunked prefill
def test_low_rank_pre_rope_equals_an_unpatched_model_with_projected_weights(chunk):
    """An independent reference: pre-RoPE reconstruction mean + U U^T (x - mean) is affine in the hidden
    state, so it can be baked into k_proj/v_proj of a plain transformers model. The patched model, fed in
    chunks, must match the plain model whose cache stores the baked model's keys and values of the earlier
    chunks (each chunk's own tokens exact), not just itself."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = make_model("llama", attention_bias=True)
    artifact = patchkv.calibrate(model, calibration_ids(), rank=5, progress=False)
    baked = make_model("llama", attention_bias=True)
    for layer, attn in enumerate(baked.model.layers):
        for proj, comps in ((attn.self_attn.k_proj, artifact.keys), (attn.self_attn.v_proj, artifact.values)):
            u = comps.eigenvectors[layer][:, :, :5].float()  # [kv_heads, head_dim, rank]
            keep = torch.block_diag(*(h @ h.T for h in u))  # projector on the kept subspace, per head
            mean = comps.mean[layer].reshape(-1).float()
            proj.weight.data = keep @ proj.weight.data
            proj.bias.data = keep @ proj.bias.data + (torch.eye(len(mean)) - keep) @ mean
    pending = {}

    def bake(attn, args, kwargs):  # the baked layer's keys (rotated) and values for the hidden state attn sees
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        twin = baked.model.layers[attn.layer_idx].self_attn
        shape = (*hidden.shape[:-1], -1, twin.head_dim)
        k, v = (proj(hidden).view(shape).transpose(1, 2) for proj in (twin.k_proj, twin.v_proj))
        pending[attn.layer_idx] = (apply_rotary_pos_emb(k, k, cos, sin)[0], v)

    x = calibration_ids(2, 16, seed=5)
    hooks = [layer.self_attn.register_forward_pre_hook(bake, with_kwargs=True) for layer in model.model.layers]
    try:
        cache, logits = BakedStore(pending), []
        for start in range(0, 16, chunk):
            logits.append(model(x[:, start:start + chunk], cache=cache, use_cache=True).logits)
        reference = torch.cat(logits, 1)
    finally:
        for hook in hooks:
            hook.remove()
    with patchkv.patched(model, artifact):
        out = fed_in_chunks(model, x, chunk)
    assert (out - reference).abs().max() < 1e-5
    assert (out - model(x).logits).abs().max() > 1e-3  # and the truncation matters
