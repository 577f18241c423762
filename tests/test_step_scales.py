"""Step scales (artifact format version 3, `patchkv.steps`): stored, validated, read by `Quantized`, fitted on the
model's own loss through the cache."""

import copy

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks
from test_global_pool import model, weighted  # noqa: F401 (the tiny Llama and its effect-weighted bases)
from test_reliability_artifact import read, write

import patchkv
from patchkv.artifact import Artifact
from patchkv.errors import ArtifactError, InvalidArtifactError, PatchKVError
from patchkv.quantize import GAUSSIAN_STEP
from patchkv.steps import token_loss, with_step_scales


@pytest.fixture(scope="module")
def fitted(model, weighted):
    return patchkv.fit_step_scales(model, weighted, calibration_ids(2, 40, seed=9), bits=12, pool="global",
                                   sink_tokens=2, window=4, grid=(1.0, 3.0))


def test_version_3_round_trips_with_and_without_effect_weights(tmp_path, fitted):
    tensors, meta = read(fitted.save(tmp_path / "v3.safetensors"))
    assert meta["format_version"] == 3 and len(tensors) == 12
    back = Artifact.load(tmp_path / "v3.safetensors")
    assert torch.equal(back.keys.step_scales, fitted.keys.step_scales.float())
    assert back.calibration["step_scales"]["bits"] == 12
    plain = copy.deepcopy(fitted)
    plain.keys.weights = plain.values.weights = None
    tensors, meta = read(plain.save(tmp_path / "v3plain.safetensors"))
    assert meta["format_version"] == 3 and len(tensors) == 10
    assert Artifact.load(tmp_path / "v3plain.safetensors").values.weights is None


@pytest.mark.parametrize("version, edit, fragment", [
    (3, lambda t: t.pop("values.step_scales"), "missing ['values.step_scales']"),
    (2, lambda t: None, "unexpected ['keys.step_scales', 'values.step_scales']"),
    (3, lambda t: t.update({"keys.step_scales": torch.zeros_like(t["keys.step_scales"])}),
     "keys.step_scales at layer 0, head 0: step scales must be > 0"),
    (3, lambda t: t.update({"keys.step_scales": t["keys.step_scales"][:, :1].contiguous()}),
     "keys.step_scales has shape"),
    (3, lambda t: t.update({"values.step_scales": t["values.step_scales"] * float("nan")}), "NaN"),
])
def test_bad_step_scales_are_refused(tmp_path, fitted, version, edit, fragment):
    tensors, meta = read(fitted.save(tmp_path / "a.safetensors"))
    edit(tensors)
    meta["format_version"] = version
    with pytest.raises(ArtifactError) as info:
        Artifact.load(write(tmp_path / "b.safetensors", tensors, meta))
    assert fragment in str(info.value)


def test_step_scales_for_keys_only_are_refused(fitted):
    keys_only = copy.deepcopy(fitted)
    keys_only.values.step_scales = None
    with pytest.raises(InvalidArtifactError, match="step scales must be given for keys and values both"):
        keys_only._validate()


def test_quantized_codes_read_the_scales(model, weighted):
    """Scale 1 is the Gaussian-matched quantizer exactly; scale s multiplies every step of that kind by s."""
    methods = [patchkv.SinksWindow(2, 4), patchkv.Quantized(32)]
    ids = calibration_ids(1, 30, seed=3)
    key_bits, layer = weighted.bit_allocation(32)[0], 1
    logits = {}
    for name, artifact in (("none", weighted), ("one", with_step_scales(weighted, 1.0, 1.0)),
                           ("wide", with_step_scales(weighted, 2.0, 1.0))):
        with patchkv.patched(model, artifact, methods):
            patch = model.model.layers[layer].self_attn.patchkv
            codecs = patch.keys, patch.values
            logits[name] = fed_in_chunks(model, ids, 3)
            if name == "wide":
                quantizer = codecs[0].quantizer
                rank = quantizer.shape[1]
                bits = key_bits[layer][:, :rank].flatten()
                std = weighted.keys.eigenvalues[layer][:, :rank].flatten().sqrt()
                coded = bits > 0
                expected = 2.0 * torch.tensor([GAUSSIAN_STEP[int(b)] for b in bits[coded]]) * std[coded]
                assert coded.any() and torch.allclose(quantizer.step[coded], expected.float(), rtol=1e-5)
    assert torch.equal(logits["none"], logits["one"])
    assert not torch.allclose(logits["none"], logits["wide"])


def test_fit_takes_the_scales_of_lowest_loss_and_records_them(model, fitted):
    fit = fitted.calibration["step_scales"]
    tried = {(k, v): nll for k, v, nll in fit["tried"]}
    best = (fit["keys"], fit["values"])
    assert set(best) <= {1.0, 3.0} and (1.0, 1.0) in tried
    assert tried[best] == min(tried[c] for c in tried if c[1] == best[1] or c[0] == best[0])
    assert torch.equal(fitted.keys.step_scales, torch.full((2, 2), best[0]))
    assert torch.equal(fitted.values.step_scales, torch.full((2, 2), best[1]))
    # the recorded loss is the patched model's own, token by token through the cache (an independent count)
    ids = calibration_ids(2, 40, seed=9)
    with patchkv.patched(model, fitted, [patchkv.SinksWindow(2, 4), patchkv.Quantized(12, pool="global")]):
        logprobs = fed_in_chunks(model, ids, fit["chunk"]).log_softmax(-1)[:, :-1]
    nll = -logprobs.gather(-1, ids[:, 1:, None]).mean().item()
    assert nll == pytest.approx(tried[best], abs=1e-5)


def test_token_loss_of_an_unpatched_model_is_its_cross_entropy(model):
    ids = calibration_ids(2, 20, seed=4)
    with torch.no_grad():
        expected = model(ids, labels=ids).loss.item()
    assert token_loss(model, ids, 7) == pytest.approx(expected, abs=1e-5)


def test_fit_refuses_a_patched_model_and_short_text(model, weighted):
    with pytest.raises(ValueError, match="seq > sink_tokens"):
        patchkv.fit_step_scales(model, weighted, calibration_ids(1, 6), bits=12, sink_tokens=2, window=4)
    with patchkv.patched(model, weighted):
        with pytest.raises(PatchKVError, match="patchkv.remove"):
            patchkv.fit_step_scales(model, weighted, calibration_ids(1, 40), bits=12)


def test_scales_apply_only_to_the_pool_they_were_fitted_for(model, fitted):
    """`fitted` was fitted for the global pool: the per-head pool codes with the Gaussian-matched steps."""
    wide = with_step_scales(fitted, 3.0, 3.0)
    wide.calibration["step_scales"] = dict(fitted.calibration["step_scales"])
    assert patchkv.Quantized(12, pool="global").reads_step_scales(wide)
    assert not patchkv.Quantized(12).reads_step_scales(wide)
    unfitted = copy.deepcopy(wide)
    del unfitted.calibration["step_scales"]  # scales without a record of their fit apply to either pool
    assert patchkv.Quantized(12).reads_step_scales(unfitted)
    ids = calibration_ids(1, 30, seed=3)
    plain = copy.deepcopy(fitted)
    plain.keys.step_scales = plain.values.step_scales = None
    logits = []
    for artifact in (wide, plain):
        with patchkv.patched(model, artifact, [patchkv.SinksWindow(2, 4), patchkv.Quantized(32)]):
            logits.append(fed_in_chunks(model, ids, 3))
    assert torch.equal(logits[0], logits[1])  # per-head codes ignore scales fitted for the global pool


def test_refitting_for_the_other_pool_measures_scaled_codes(model, fitted):
    """Refitting an artifact fitted for the global pool, for the per-head pool: every trial reads its own scales
    (the earlier fit's record, whose pool would switch them off, is not carried into the trials)."""
    refit = patchkv.fit_step_scales(model, fitted, calibration_ids(2, 40, seed=9), bits=32, pool="head",
                                    sink_tokens=2, window=4, grid=(1.0, 3.0))
    losses = [nll for _, _, nll in refit.calibration["step_scales"]["tried"]]
    assert refit.calibration["step_scales"]["pool"] == "head" and len(set(losses)) == len(losses)
    assert patchkv.Quantized(32).reads_step_scales(refit)
