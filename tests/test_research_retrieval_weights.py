"""evals/research_retrieval_weights.py (`python -m evals retrieval-weights`): reweighting mixes the retrieval Fisher
into a shipped artifact as `patchkv.retrieval.mix_effect` does, without touching the rest of the artifact (the rows
themselves: tests/test_retrieval.py)."""

import pytest
import torch
from conftest import calibration_ids, make_model

import patchkv
from evals.research_retrieval_weights import code_bits, reweighted, share
from patchkv.fisher import effect_weights
from patchkv.retrieval import mix_effect


def _fisher(artifact, seed):
    g = torch.Generator().manual_seed(seed)
    out = {"count": 10}
    for kind in ("keys", "values"):
        c = getattr(artifact, kind)
        a = torch.randn(*c.eigenvectors.shape, generator=g, dtype=torch.float64)
        b = torch.randn(*c.layer_eigenvectors.shape, generator=g, dtype=torch.float64)
        out[kind], out[f"layer_{kind}"] = a @ a.mT, b @ b.mT
    return out


def test_reweighting_mixes_the_retrieval_fisher_in_and_touches_nothing_else():
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=8, fisher_tokens=64, layer_bases=True, progress=False)
    fisher = _fisher(artifact, 0)
    kinds = ("keys", "values")
    measured = {k: [effect_weights(fisher[k] / fisher["count"], getattr(artifact, k).eigenvectors),
                    effect_weights(fisher[f"layer_{k}"] / fisher["count"], getattr(artifact, k).layer_eigenvectors)]
                for k in kinds}
    expected = mix_effect({k: [getattr(artifact, k).weights, getattr(artifact, k).layer_weights] for k in kinds},
                          measured, {k: getattr(artifact, k).eigenvalues for k in kinds}, 0.75)
    three = reweighted(artifact, fisher, 0.75)
    for kind in kinds:
        c, b = getattr(artifact, kind), getattr(three, kind)
        assert torch.allclose(b.weights.double(), expected[kind][0], rtol=1e-5)
        assert torch.allclose(b.layer_weights.double(), expected[kind][1], rtol=1e-5)
        assert b.eigenvectors is c.eigenvectors and b.layer_eigenvectors is c.layer_eigenvectors
        assert not torch.equal(b.layer_weights, c.layer_weights)
    own = reweighted(artifact, fisher, 0.0)
    assert torch.allclose(own.keys.weights, artifact.keys.weights) and artifact.keys.weights is not three.keys.weights


def test_code_bits_count_what_each_layers_codes_hold():
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=8, fisher_tokens=64, progress=False)
    methods = [patchkv.SinksWindow(2, 4), patchkv.Quantized(24, pool="global")]
    bits = code_bits(model, (artifact, methods))
    with patchkv.patched(model, artifact, methods):
        widths = [(lp.keys.width, lp.values.width) for lp in model.patchkv.layers]
    assert len(bits) == len(widths)
    for counted, (keys, values) in zip(bits, widths):
        assert 8 * (keys - 1) < counted["keys"] <= 8 * keys or counted["keys"] == keys == 0
        assert 8 * (values - 1) < counted["values"] <= 8 * values or counted["values"] == values == 0
    assert sum(b["keys"] + b["values"] for b in bits) > 0


def test_variant_names_give_the_retrieval_share():
    assert share("shipped") is None and share("retrieval") == 1.0
    assert share("mixed") == 0.5 and share("mixed3") == 0.75 and share("mixed0.5") == pytest.approx(1 / 3)
    with pytest.raises(SystemExit, match="mixedK"):
        share("mixedmore")
