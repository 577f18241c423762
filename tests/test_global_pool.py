"""Effect weights in the artifact (format version 2) and `Quantized(pool="global")`: one bit pool for every
layer, head, key and value, allocated by calibrated effect weight, at exactly the bytes it declares."""

import copy

import pytest
import torch
from conftest import calibration_ids, make_model
from safetensors.torch import load_file
from test_reliability_artifact import read, write

import patchkv
from patchkv.allocation import bit_allocation, cost_variances, kv_bytes_per_token
from patchkv.artifact import Artifact
from patchkv.errors import ArtifactError, InvalidArtifactError
from patchkv.methods import parse_method


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


@pytest.fixture(scope="module")
def weighted(model):
    return patchkv.calibrate(model, calibration_ids(8, 48), mode="pre_rope", rank=16, sink_tokens=2,
                             fisher_tokens=128, fisher_window=4, progress=False)


def test_version_2_round_trips_and_version_1_is_still_written_without_weights(tmp_path, model, weighted):
    file = weighted.save(tmp_path / "v2.safetensors")
    tensors, meta = read(file)
    assert meta["format_version"] == 2 and {"keys.weights", "values.weights"} <= set(tensors)
    back = Artifact.load(file)
    assert torch.equal(back.values.weights, weighted.values.weights.float())
    plain = copy.deepcopy(weighted)
    plain.keys.weights = plain.values.weights = None
    tensors, meta = read(plain.save(tmp_path / "v1.safetensors"))
    assert meta["format_version"] == 1 and len(tensors) == 8
    assert Artifact.load(tmp_path / "v1.safetensors").format_version == 1


@pytest.mark.parametrize("version, edit, fragment", [
    (2, lambda t: t.pop("values.weights"), "missing ['values.weights']"),
    (1, lambda t: None, "unexpected ['keys.weights', 'values.weights']"),
    (2, lambda t: t.update({"keys.weights": -t["keys.weights"] - 1}), "keys.weights at layer 0, head 0"),
    (2, lambda t: t.update({"keys.weights": t["keys.weights"][:, :, :3].contiguous()}), "keys.weights has shape"),
])
def test_bad_effect_weights_are_refused(tmp_path, weighted, version, edit, fragment):
    tensors, meta = read(weighted.save(tmp_path / "a.safetensors"))
    edit(tensors)
    meta["format_version"] = version
    with pytest.raises(ArtifactError, match=None) as info:
        Artifact.load(write(tmp_path / "b.safetensors", tensors, meta))
    assert fragment in str(info.value)


def test_weights_for_keys_only_are_refused(weighted):
    keys_only = copy.deepcopy(weighted)
    keys_only.values.weights = None
    with pytest.raises(InvalidArtifactError, match="keys and values both"):
        keys_only._validate()


@pytest.mark.parametrize("bits", [8, 21, 64])
def test_global_pool_holds_exactly_its_bytes(model, weighted, bits):
    layers, heads = weighted.num_layers, weighted.num_kv_heads
    keys, values = bit_allocation(weighted, bits, "global")
    per_codec = [int(a[layer].sum()) for a in (keys, values) for layer in range(layers)]
    declared = kv_bytes_per_token(weighted, bits, "global")
    assert declared == sum(-(-b // 8) for b in per_codec) <= bits * layers * heads * 2 // 8
    assert declared >= bits * layers * heads * 2 // 8 - 2 * layers  # less than a byte per codec is left over
    x = calibration_ids(2, 14, seed=5)
    with patchkv.patched(model, weighted, [patchkv.Quantized(bits, pool="global")]):
        out = model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    tokens = 14 + 4 - 1
    held = sum(layer.nbytes() for layer in out.past_key_values.layers)
    assert held == 2 * tokens * declared  # batch 2; the layers hold codes only (positions are counted once)


def test_global_pool_spends_bits_where_the_loss_is_sensitive(weighted):
    """Scaling one layer's value weights up pulls bits to it; the per-head pool does not look at weights."""
    loud = copy.deepcopy(weighted)
    loud.values.weights[1] *= 1e4
    before, after = bit_allocation(weighted, 32, "global")[1], bit_allocation(loud, 32, "global")[1]
    assert after[1].sum() > before[1].sum()
    assert torch.equal(bit_allocation(weighted, 32, "head")[1], bit_allocation(loud, 32, "head")[1])


def test_global_pool_lowers_the_weighted_error_it_optimises(weighted):
    """At equal bits, the expected loss increase (sum of cost-variance x quantizer MSE) is lower with one pool."""
    from conftest import expected_distortion

    def cost(pool):
        k, v = bit_allocation(weighted, 24, pool)
        return sum(float(expected_distortion(cost_variances(c).flatten(), b.flatten()))
                   for c, b in ((weighted.keys, k), (weighted.values, v)))

    assert cost("global") < cost("head")


def test_global_pool_needs_effect_weights(model):
    plain = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=16, progress=False)
    with pytest.raises(ValueError, match="fisher_tokens"):
        patchkv.apply(model, plain, [patchkv.Quantized(32, pool="global")])
    assert not patchkv.is_patched(model)
    with pytest.raises(ValueError, match="pool must be one of"):
        parse_method("quantized:bits=32,pool=layer")
    assert parse_method("quantized:bits=32,pool=global") == patchkv.Quantized(32, pool="global")
