"""The simulations behind `python -m evals shared-basis --needles / --chunked-docs`: group effect weights carry each
head's Fisher to any grouping, the captured keys rotate into exactly what the cache holds, a coder that changes
nothing leaves the chunked perplexity exact (so what the simulations measure is the codes), and the tokens an
`Evict` drops are found and kept out of every query's reach; the `spanned` grouping codes on a calibrated artifact's
bases across layers."""

import math

import torch
from conftest import calibration_ids, make_model

import patchkv
from evals.research_shared_basis import (Capture, Masked, bases, cached_vectors, coded_nll, coder, dropped,
                                         group_weights, grouped_bases, write_codes)


def head_fisher(layers=2, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(layers, heads, dim, dim, generator=g, dtype=torch.float64)
    return a @ a.transpose(-1, -2)                       # symmetric, positive semi-definite


def test_group_weights_are_the_fisher_along_each_component():
    fisher = head_fisher()
    x = torch.randn(200, 2, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for grouping, groups in (("head", 4), ("layer", 2), ("layers2", 1)):
        fitted = bases(x, grouping, 8)
        w = group_weights(fitted, grouping, fisher)
        assert len(w) == groups
        # an orthonormal basis of the whole group keeps the trace: the weights sum to the heads' Fisher traces
        torch.testing.assert_close(torch.cat(w).sum(), fisher.diagonal(dim1=-2, dim2=-1).sum())
    # a head's weights along its own eigenvectors are u^T F u, component by component
    vec = bases(x, "head", 8)[3][2]
    torch.testing.assert_close(group_weights([(None, None, vec)], "head", fisher[1:, 1:])[0],
                               torch.einsum("ij,ik,kj->j", vec, fisher[1, 1], vec))


def test_write_codes_rotates_as_the_model_does():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = make_model("llama")
    with torch.no_grad():
        cache = model(input_ids=torch.randint(3, 96, (1, 10)), use_cache=True).cache
    keys = torch.randn(7, 2, 2 * 16, dtype=torch.float64)           # [tokens, layers, heads * head_dim], pre-RoPE
    write_codes(model, cache, keys, torch.zeros_like(keys), 3)
    cos, sin = model.model.rotary_emb(keys.float(), torch.arange(3, 10)[None])
    for l, layer in enumerate(cache.layers):
        pre = keys[:, l].view(1, 7, 2, 16).transpose(1, 2)
        _, expected = apply_rotary_pos_emb(pre, pre, cos.double(), sin.double())
        torch.testing.assert_close(layer.keys[:, :, 3:], expected.float())


def test_capture_and_write_codes_rebuild_the_cache_the_model_wrote():
    model = make_model("llama")
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), Capture(model) as capture:
        cache = model(input_ids=ids[:, :12], use_cache=True).cache
        model(input_ids=ids[:, 12:], cache=cache, use_cache=True)
    clean = {kind: x[0] for kind, x in capture.take().items()}
    assert clean["keys"].shape == (20, 2, 2 * 16)
    exact = [layer.keys.clone() for layer in cache.layers]
    for layer in cache.layers:
        layer.keys[0, :, 5:] = 0
    write_codes(model, cache, clean["keys"][5:], clean["values"][5:], 5)
    for layer, keys in zip(cache.layers, exact):
        torch.testing.assert_close(layer.keys, keys, atol=1e-5, rtol=0)


def test_cached_vectors_of_a_batch_are_those_of_its_rows_in_order():
    model = make_model("llama")
    rows = calibration_ids(3, 12, seed=8)
    batched = cached_vectors(model, rows, sinks=2)
    assert batched["keys"].shape == (3 * 10, 2, 2 * 16)
    for kind in ("keys", "values"):
        one_by_one = torch.cat([cached_vectors(model, rows[r:r + 1], sinks=2)[kind] for r in range(3)])
        torch.testing.assert_close(batched[kind], one_by_one)


def test_a_coder_that_changes_nothing_leaves_the_chunked_perplexity_exact():
    model = make_model("llama")
    ids = torch.randint(3, 96, (1, 150), generator=torch.Generator().manual_seed(3))
    base, count = coded_nll(model, ids, None)
    assert count == 149
    same, _ = coded_nll(model, ids, lambda k, v: (k, v))
    assert math.isclose(same, base, rel_tol=1e-5)
    zeroed, _ = coded_nll(model, ids, lambda k, v: (torch.zeros_like(k), torch.zeros_like(v)))
    assert not math.isclose(zeroed, base, rel_tol=1e-5)       # what it writes is what later forwards read


def test_dropped_is_what_the_caches_evict_drops_and_masked_hides_it():
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=16, progress=False)
    ids = torch.randint(3, 96, (1, 100), generator=torch.Generator().manual_seed(4))
    assert dropped(model, artifact, "40", ids) is None
    gone = dropped(model, artifact, "40+evict", ids)
    for layer in gone:   # 30% of the 64 tokens between the 4 sinks and the 32-token window, none outside them
        assert int(layer.sum()) == 19 and not layer[:4].any() and not layer[-32:].any()
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).cache
        for layer, g in zip(cache.layers, gone):
            layer.values[0, :, g] = 100.0    # what a dropped token holds no query may read
        question = torch.tensor([[5, 6, 7]])
        with Masked(model, gone):
            masked = model(input_ids=question, cache=cache, use_cache=True).logits
        cache.crop(-3)
        for layer, g in zip(cache.layers, gone):
            layer.values[0, :, g] = -100.0
        with Masked(model, gone):
            again = model(input_ids=question, cache=cache, use_cache=True).logits
        cache.crop(-3)
        unmasked = model(input_ids=question, cache=cache, use_cache=True).logits
    torch.testing.assert_close(masked, again)
    assert not torch.allclose(unmasked, again, atol=1e-3)


def test_the_spanned_grouping_codes_on_the_artifacts_bases_across_layers():
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=16, sink_tokens=2, fisher_tokens=128, fisher_window=4,
                                 layer_bases=True, layers_per_basis=2, progress=False)
    grouped = grouped_bases(model, None, artifact, ["spanned"], 0, artifact)
    fitted, weights, form = grouped["keys", "spanned"]
    assert form == "layers2" and len(fitted) == 1 and torch.equal(weights[0], artifact.keys.layer_weights[0].double())
    torch.testing.assert_close(fitted[0][2], artifact.keys.layer_eigenvectors[0].double())
    with torch.no_grad(), Capture(model) as capture:
        model(input_ids=calibration_ids(1, 60, seed=7))
    clean = {kind: x[0] for kind, x in capture.take().items()}
    errors = []
    for budget in ("2x", "16x"):
        bits, read, code = coder(artifact, grouped, "spanned", budget)
        keys, values = code(clean["keys"], clean["values"])
        assert keys.shape == clean["keys"].shape and read > 0
        errors.append(float((keys - clean["keys"]).norm() / clean["keys"].norm()))
    assert errors[0] < 0.1 < errors[1]     # 2x codes the span's latent nearly exactly, 16x coarsely
