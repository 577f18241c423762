"""evals/research_retrieval_weights.py (`python -m evals retrieval-weights`): its retrieval rows hide a needle of their
own wordings and end with the answer, and reweighting mixes the two Fisher measures at equal total effect without
touching the rest of the artifact."""

import pytest
import torch
from conftest import calibration_ids, make_model
from transformers import AutoTokenizer

import patchkv
from evals.research_retrieval_weights import NEEDLES, code_bits, retrieval_row, reweighted, weights
from evals.suite import ROOT, SMOLLM2
from evals.tasks import NEEDLES as TEST_NEEDLES


def test_a_retrieval_row_hides_a_needle_and_ends_with_its_answer():
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    text = (ROOT / "evals" / "data" / "prose_calibration.txt").read_text(encoding="utf-8")
    ids, answer = retrieval_row(tokenizer, text, 512, 7)
    again, _ = retrieval_row(tokenizer, text, 512, 7)
    assert torch.equal(ids, again) and ids.shape[1] <= 512
    number = tokenizer.decode(ids[0, answer:]).strip().rstrip(".")
    assert len(number) == 7 and number.isdigit()
    context = tokenizer.decode(ids[0, :answer])
    needle, question = NEEDLES[7 % len(NEEDLES)]
    assert needle.format(n=number) in context and context.rstrip().endswith(question)
    assert not {n for n, _ in NEEDLES} & {n for n, _ in TEST_NEEDLES}  # none of needle_text's wordings


def _fisher(artifact, seed):
    g = torch.Generator().manual_seed(seed)
    out = {"count": 10}
    for kind in ("keys", "values"):
        c = getattr(artifact, kind)
        a = torch.randn(*c.eigenvectors.shape, generator=g, dtype=torch.float64)
        b = torch.randn(*c.layer_eigenvectors.shape, generator=g, dtype=torch.float64)
        out[kind], out[f"layer_{kind}"] = a @ a.mT, b @ b.mT
    return out


def test_reweighting_mixes_the_two_measures_at_equal_total_effect():
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=8, fisher_tokens=64, layer_bases=True, progress=False)
    fisher = _fisher(artifact, 0)
    total = lambda a: sum(float((getattr(a, k).weights.double() * getattr(a, k).eigenvalues.double()).sum())  # noqa
                          for k in ("keys", "values"))
    own = reweighted(artifact, fisher, 1.0, 0.0)
    assert torch.allclose(own.keys.weights.double() * total(artifact), artifact.keys.weights.double(), rtol=1e-5)
    measured = reweighted(artifact, fisher, 0.0, 1.0)
    assert abs(total(own) - 1) < 1e-5 and abs(total(measured) - 1) < 1e-5
    both = reweighted(artifact, fisher, 1.0, 1.0)
    assert abs(total(both) - 2) < 1e-5
    for kind in ("keys", "values"):
        c, b = getattr(artifact, kind), getattr(both, kind)
        assert torch.allclose(b.weights.double(), getattr(own, kind).weights.double() +
                              getattr(measured, kind).weights.double(), rtol=1e-5)
        assert b.eigenvectors is c.eigenvectors and b.layer_eigenvectors is c.layer_eigenvectors
        assert not torch.equal(b.layer_weights, c.layer_weights)
    assert artifact.keys.weights is not both.keys.weights and total(artifact) != 2  # the original is untouched


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


def test_variant_names_give_the_two_shares():
    assert weights("shipped") is None and weights("retrieval") == (0.0, 1.0)
    assert weights("mixed") == (1.0, 1.0) and weights("mixed3") == (1.0, 3.0) and weights("mixed0.5") == (1.0, 0.5)
    with pytest.raises(SystemExit, match="mixedK"):
        weights("mixedmore")
