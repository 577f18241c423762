"""evals/research_eviction.py (`python -m evals eviction`): after a prefill, the dropped middle tokens are never read
again (the question's forward and a decode step alike) while every kept one is, the drop takes the asked fraction of
the coded tokens and never a sink or a window token, the bytes freed are the dropped codes', and attention is as
it was once the simulation ends."""

import pytest
import torch
from conftest import calibration_ids, make_model

import patchkv
from evals.research_eviction import Dropping, dropping, parse_variant
from patchkv import attention


def run(model, artifact, methods, state, spoil=None):
    """Prefill 60 tokens, then a 5-token question and one decode step, under `dropping(state)`; `spoil(cache)` may
    overwrite stored codes after the prefill -> (the question's logits, the decode step's, the cache)."""
    ids = calibration_ids(1, 66)
    with torch.no_grad(), patchkv.patched(model, artifact, methods), dropping(state):
        cache = patchkv.LatentCache(model)
        model(input_ids=ids[:, :60], cache=cache, use_cache=True)
        if spoil is not None:
            spoil(cache)
        question = model(input_ids=ids[:, 60:65], cache=cache, use_cache=True).logits
        step = model(input_ids=ids[:, 65:66], cache=cache, use_cache=True).logits
    return question, step, cache


@pytest.mark.parametrize("scorer", ["novelty", "random"])
def test_dropped_tokens_are_never_read_and_kept_ones_are(scorer):
    model = make_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), rank=8, progress=False)
    methods = [patchkv.SinksWindow(2, 4), patchkv.Quantized(24)]
    state = Dropping(scorer, 0.5, seed=3)
    question, step, cache = run(model, artifact, methods, state)
    layers = model.config.num_hidden_layers
    assert attention.attention_forward.__name__ == "attention_forward"  # restored on exit
    assert sorted(state.dropped) == list(range(layers))
    coded = 60 - 2 - 4
    for dropped in state.dropped.values():
        assert int(dropped.sum()) == coded // 2
        assert not dropped[:2].any() and not dropped[2 + coded:].any()  # sinks and window kept
    per_token = sum(cache.layer(i).tensors["latent_keys"][0, 0, 0].nbytes
                    + cache.layer(i).tensors["latent_values"][0, 0, 0].nbytes for i in range(layers))
    assert state.freed == pytest.approx(per_token * coded // 2)
    assert state.bitmap == layers * -(-coded // 8)

    def spoil(kept: bool):
        def overwrite(cache):
            for i, dropped in state.dropped.items():
                columns = dropped[2:2 + coded] if not kept else ~dropped[2:2 + coded]
                for kind in ("latent_keys", "latent_values"):
                    stored = cache.layer(i).tensors[kind]
                    stored[:, :, columns] = torch.randint_like(stored[:, :, columns], 0, 255)
        return overwrite

    again = Dropping(scorer, 0.5, seed=3)
    q_dropped, s_dropped, _ = run(model, artifact, methods, again, spoil(kept=False))
    torch.testing.assert_close(q_dropped, question)
    torch.testing.assert_close(s_dropped, step)
    q_kept, s_kept, _ = run(model, artifact, methods, Dropping(scorer, 0.5, seed=3), spoil(kept=True))
    assert not torch.allclose(q_kept, question) and not torch.allclose(s_kept, step)


def test_variants_parse_and_refuse():
    assert parse_variant("16x") == ("16x", None, 0.0)
    assert parse_variant("8x:novelty_pool:0.6") == ("8x", "novelty_pool", 0.6)
    for bad in ("8x:keynorm:0.5", "8x:novelty:1.5", "8x:novelty"):
        with pytest.raises(SystemExit, match="eviction"):
            parse_variant(bad)
