"""patchkv.retrieval and `calibrate(..., retrieval_rows=n)`: rows that hide a number in the calibration text and end
with its answer; the retrieval rows' effect weights mixed with the text's at equal say, and nothing else changed."""

import random
from pathlib import Path

import pytest
import torch
from conftest import make_model
from transformers import AutoTokenizer

import patchkv
from evals.tasks import NEEDLES as EVAL_WORDINGS
from patchkv.adapters import adapter_for, attention_modules
from patchkv.corpus import shakespeare_train
from patchkv.fisher import FisherCapture, effect_weights
from patchkv.retrieval import WORDINGS, hide, mix_effect, retrieval_row

REF = Path(__file__).resolve().parents[1] / "artifacts" / "reference-llama"
SEQ, SINKS, WINDOW = 256, 2, 8


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REF, local_files_only=True)


@pytest.fixture(scope="module")
def text():
    return "\n\n".join(shakespeare_train())[:12_000]


def test_a_row_hides_a_number_and_ends_with_its_answer(tokenizer, text):
    for seed in range(4):
        ids, answer = retrieval_row(tokenizer, text, SEQ, seed)
        again, _ = retrieval_row(tokenizer, text, SEQ, seed)
        assert torch.equal(ids, again) and ids.shape[1] <= SEQ  # seeded
        number = tokenizer.decode(ids[0, answer:]).strip().rstrip(".")
        assert len(number) == 7 and number.isdigit()
        context = tokenizer.decode(ids[0, :answer])
        needle, question = WORDINGS[seed % len(WORDINGS)]
        assert needle.format(n=number) in context and context.rstrip().endswith(question)
    assert not torch.equal(retrieval_row(tokenizer, text, SEQ, 0)[0], retrieval_row(tokenizer, text, SEQ, 4)[0])
    assert not {n for n, _ in WORDINGS} & {n for n, _ in EVAL_WORDINGS}  # none of the evaluation's wordings


def test_hide_puts_the_sentence_on_a_line_of_its_own_inside_the_cut(tokenizer, text):
    hidden, depth = hide(tokenizer, text, "THE NEEDLE", 100, random.Random(3))
    assert "\nTHE NEEDLE\n" in hidden and 0.1 <= depth <= 1.0
    assert len(tokenizer(hidden.replace("\nTHE NEEDLE", ""))["input_ids"]) <= 101


def test_rows_refuse_too_little_text_or_room(tokenizer, text):
    with pytest.raises(ValueError, match="pass more text or a smaller retrieval_seq"):
        retrieval_row(tokenizer, text[:1000], SEQ, 0)
    with pytest.raises(ValueError, match="leaves .* tokens for the text around the needle"):
        retrieval_row(tokenizer, text, 60, 0)


def _weights(seed, shape=(2, 2, 4)):
    g = torch.Generator().manual_seed(seed)
    return {k: [torch.rand(*shape, generator=g, dtype=torch.float64), torch.rand(2, 8, generator=g,
                                                                                 dtype=torch.float64)]
            for k in ("keys", "values")}


def test_mix_effect_gives_each_source_its_share_in_the_texts_unit():
    prose, retrieval, variances = _weights(0), _weights(1), {k: w[0] * 3 for k, w in _weights(2).items()}
    total = lambda w: sum(float((w[k][0] * variances[k]).sum()) for k in w)  # noqa: E731
    none, only, half = (mix_effect(prose, retrieval, variances, s) for s in (0.0, 1.0, 0.5))
    for kind in prose:
        assert all(torch.allclose(a, b) for a, b in zip(none[kind], prose[kind]))
        scale = total(prose) / total(retrieval)
        assert all(torch.allclose(a, scale * b) for a, b in zip(only[kind], retrieval[kind]))  # layer weights too
        assert all(torch.allclose(h, (a + b) / 2) for h, a, b in zip(half[kind], none[kind], only[kind]))
    assert total(only) == pytest.approx(total(prose)) and total(half) == pytest.approx(total(prose))
    with pytest.raises(ValueError, match="share must be in"):
        mix_effect(prose, retrieval, variances, 1.5)
    zero = {k: [torch.zeros_like(w) for w in ws] for k, ws in retrieval.items()}
    with pytest.raises(ValueError, match="all zero"):
        mix_effect(prose, zero, variances)


def test_calibrate_mixes_the_retrieval_rows_effect_and_nothing_else(tokenizer, text):
    model = make_model("llama", vocab_size=len(tokenizer))
    options = dict(tokenizer=tokenizer, rank=4, seq_len=64, max_tokens=512, sink_tokens=SINKS, fisher_tokens=128,
                   fisher_window=WINDOW, layer_bases=True, progress=False)
    plain = patchkv.calibrate(model, text, **options)
    mixed = patchkv.calibrate(model, text, retrieval_rows=3, retrieval_seq=SEQ, **options)
    # the oracle: the answers' Fisher measured by hand on the same rows
    adapter = adapter_for(model)
    with torch.no_grad(), FisherCapture(model, adapter, attention_modules(model, adapter), mode="pre_rope",
                                        sink_tokens=SINKS, window=WINDOW, layers=1) as fisher:
        for seed in range(3):
            ids, answer = retrieval_row(tokenizer, text, SEQ, seed)
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            fisher.step(ids, torch.ones_like(ids), positions, (positions >= SINKS) & (positions < answer - WINDOW),
                        torch.device("cpu"), scored=positions >= answer)
    kinds = ("keys", "values")
    measured = {k: [effect_weights(getattr(fisher, k) / fisher.count, getattr(plain, k).eigenvectors),
                    effect_weights(getattr(fisher, f"layer_{k}") / fisher.count, getattr(plain, k).layer_eigenvectors)]
                for k in kinds}
    expected = mix_effect({k: [getattr(plain, k).weights, getattr(plain, k).layer_weights] for k in kinds}, measured,
                          {k: getattr(plain, k).eigenvalues for k in kinds})
    for kind in kinds:
        a, b = getattr(plain, kind), getattr(mixed, kind)
        assert torch.equal(a.eigenvectors, b.eigenvectors) and torch.equal(a.layer_eigenvectors, b.layer_eigenvectors)
        assert torch.equal(a.mean, b.mean) and torch.equal(a.ranks, b.ranks)
        assert torch.allclose(b.weights.double(), expected[kind][0], rtol=1e-5, atol=1e-12)
        assert torch.allclose(b.layer_weights.double(), expected[kind][1], rtol=1e-5, atol=1e-12)
        assert not torch.allclose(a.weights, b.weights)
    assert mixed.calibration["effect_weights"]["retrieval"] == {"rows": 3, "seq": SEQ, "tokens": fisher.count,
                                                                "share": 0.5}
    assert "retrieval" not in plain.calibration["effect_weights"]


def test_a_mixed_artifact_saves_loads_and_serves(tokenizer, text, tmp_path):
    model = make_model("llama", vocab_size=len(tokenizer))
    artifact = patchkv.calibrate(model, text, tokenizer=tokenizer, rank=4, seq_len=64, max_tokens=256,
                                 sink_tokens=SINKS, fisher_tokens=64, fisher_window=WINDOW, retrieval_rows=1,
                                 retrieval_seq=SEQ, progress=False)
    loaded = patchkv.Artifact.load(artifact.save(tmp_path / "mixed.safetensors"))
    assert loaded.calibration["effect_weights"]["retrieval"]["rows"] == 1
    assert torch.allclose(loaded.keys.weights, artifact.keys.weights.float())
    ids = retrieval_row(tokenizer, text, SEQ, 9)[0]
    with torch.no_grad(), patchkv.patched(model, loaded, [patchkv.SinksWindow(SINKS, WINDOW),
                                                          patchkv.Quantized(32, pool="global")]):
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3


def test_calibrate_refuses_retrieval_rows_it_cannot_measure(tokenizer, text):
    model = make_model("llama", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="fisher_tokens=0 measures none"):
        patchkv.calibrate(model, text, tokenizer=tokenizer, retrieval_rows=2, rank=4, progress=False)
    with pytest.raises(ValueError, match="needs the calibration data as text"):
        patchkv.calibrate(model, torch.randint(3, 90, (4, 64)), retrieval_rows=2, fisher_tokens=64, rank=4,
                          progress=False)
    with pytest.raises(ValueError, match="which has 1,500"):
        patchkv.calibrate(model, text[:1500], tokenizer=tokenizer, retrieval_rows=2, retrieval_seq=SEQ,
                          fisher_tokens=64, rank=4, progress=False)
    with pytest.raises(ValueError, match="longer than the 512 positions this model was trained on"):
        patchkv.calibrate(model, text, tokenizer=tokenizer, retrieval_rows=1, retrieval_seq=1024, fisher_tokens=64,
                          rank=4, progress=False)
    with pytest.raises(ValueError, match="retrieval_rows must be an integer >= 0"):
        patchkv.calibrate(model, text, tokenizer=tokenizer, retrieval_rows=-1, rank=4, progress=False)
