"""Layer bases across layers (artifact format version 7, `calibrate(..., layer_bases=True, layers_per_basis=S)`): one
PCA per span of S consecutive layers over their KV heads concatenated, with effect weights from the span's whole
Fisher matrix, stored and validated (the cache on them: `test_span_cache`)."""

import copy

import pytest
import torch
from conftest import calibration_ids
from test_global_pool import model  # noqa: F401 (the tiny Llama, 2 layers)
from test_reliability_artifact import edited_refusal, read

import patchkv
from patchkv.adapters import adapter_for, attention_modules
from patchkv.allocation import layer_bit_allocation
from patchkv.artifact import Artifact
from patchkv.errors import ArtifactError
from patchkv.fisher import FisherCapture, effect_weights

OPTIONS = dict(mode="pre_rope", rank=16, sink_tokens=2, fisher_tokens=128, fisher_window=4, layer_bases=True,
               progress=False)


@pytest.fixture(scope="module")
def per_layer(model):  # noqa: F811
    return patchkv.calibrate(model, calibration_ids(8, 48), **OPTIONS)


@pytest.fixture(scope="module")
def spanned(model):  # noqa: F811
    return patchkv.calibrate(model, calibration_ids(8, 48), layers_per_basis=2, **OPTIONS)


def covariance(c) -> torch.Tensor:
    v = c.layer_eigenvectors.double()
    return v @ torch.diag_embed(c.layer_eigenvalues.double()) @ v.mT


def test_each_layers_block_of_the_span_covariance_is_that_layers_covariance(per_layer, spanned):
    assert per_layer.layers_per_basis == 1 and per_layer.format_version == 5
    assert spanned.layers_per_basis == 2 and spanned.format_version == 7
    width = spanned.num_kv_heads * spanned.head_dim
    for kind in ("keys", "values"):
        one, span = getattr(per_layer, kind), getattr(spanned, kind)
        assert span.layer_mean.shape == (1, 2 * width) and span.layer_eigenvectors.shape == (1, 2 * width, 2 * width)
        whole, layers = covariance(span)[0], covariance(one)
        for layer in range(2):
            block = whole[layer * width:(layer + 1) * width, layer * width:(layer + 1) * width]
            assert torch.allclose(block, layers[layer], atol=1e-9 * layers.abs().max())
        assert whole[:width, width:].abs().max() > 1e-3 * layers.abs().max()  # the layers are correlated
        assert torch.allclose(span.layer_mean.view(2, width), one.layer_mean)
        assert torch.equal(span.eigenvectors, one.eigenvectors)  # the heads' bases are untouched


def test_the_span_fisher_matrix_holds_each_layers_fisher_matrix_and_the_cross_layer_terms(model, spanned):  # noqa: F811
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    ids = calibration_ids(2, 24, seed=4)
    sums = {}
    for span in (1, 2):
        with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=2, window=4, layers=span) as fisher:
            for row in range(2):
                one = ids[row:row + 1]
                fisher.step(one, torch.ones_like(one), torch.arange(24)[None], torch.ones_like(one, dtype=torch.bool),
                            torch.device("cpu"))
        sums[span] = fisher
    width = spanned.num_kv_heads * spanned.head_dim
    for kind in ("layer_keys", "layer_values"):
        whole, layers = getattr(sums[2], kind)[0], getattr(sums[1], kind)
        for layer in range(2):
            block = whole[layer * width:(layer + 1) * width, layer * width:(layer + 1) * width]
            assert torch.allclose(block, layers[layer], rtol=1e-10, atol=1e-14)
        assert whole[:width, width:].abs().max() > 0
    c = spanned.keys
    assert c.layer_weights.shape == c.layer_mean.shape and (c.layer_weights >= 0).all()
    assert effect_weights(sums[2].layer_keys, c.layer_eigenvectors).shape == c.layer_weights.shape


def test_version_7_round_trips(tmp_path, spanned):
    tensors, meta = read(spanned.save(tmp_path / "v7.safetensors"))
    assert meta["format_version"] == 7 and tensors["keys.layer_eigenvectors"].shape == (1, 64, 64)
    back = Artifact.load(tmp_path / "v7.safetensors")
    assert back.layers_per_basis == 2 and torch.equal(back.values.layer_weights, spanned.values.layer_weights.float())


@pytest.mark.parametrize("edit, fragment", [
    (lambda t, m: m.update(format_version=5), "span several layers exactly in format version 7"),
    (lambda t, m: t.update({"values.layer_mean": t["values.layer_mean"][:, :40].contiguous()}),
     "expected [2 / S, S x 32]"),
])
def test_bad_spanned_bases_are_refused(tmp_path, spanned, edit, fragment):
    assert fragment in edited_refusal(tmp_path, spanned, edit)


def test_one_basis_per_layer_is_refused_at_version_7(tmp_path, per_layer):
    assert "version 7 and its layer bases span 1 layer(s)" in edited_refusal(
        tmp_path, per_layer, lambda t, m: m.update(format_version=7))


def test_keys_and_values_spanning_different_layers_are_refused(per_layer, spanned):
    mixed = copy.deepcopy(spanned)
    mixed.values = copy.deepcopy(per_layer.values)
    with pytest.raises(ArtifactError, match="both kinds must span the same layers"):
        mixed.save("unused.safetensors")


def test_a_span_must_divide_the_layers(model):  # noqa: F811
    with pytest.raises(ValueError, match=r"must divide the number of layers of each \(2 full-attention\); pass one "
                                         r"of \[1, 2\]"):
        patchkv.calibrate(model, calibration_ids(2, 16), layers_per_basis=3, **OPTIONS)
    with pytest.raises(ValueError, match="layers_per_basis must be an integer >= 1"):
        patchkv.calibrate(model, calibration_ids(2, 16), layers_per_basis=0, **OPTIONS)


@pytest.mark.parametrize("pool", ["head", "global"])
def test_the_pool_spends_the_budget_over_the_spans(spanned, pool):
    keys, values = layer_bit_allocation(spanned, 24, pool)
    assert keys.shape == values.shape == (1, 64)
    if pool == "head":  # each span's keys get bits x kv_heads x layers, as two layers' bases would
        assert int(keys.sum()) == int(values.sum()) == 24 * 2 * 2
    else:
        assert 0 < int(keys.sum() + values.sum()) <= 24 * 2 * 2 * 2
