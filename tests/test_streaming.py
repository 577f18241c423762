"""StreamingLM scores through the cache: token by token or in chunks, the same log-likelihood as one forward."""

import pytest
import torch
from conftest import calibration_ids, make_model

import patchkv
from patchkv.streaming import StreamingLM


class Tokenizer:
    bos_token_id, eos_token_id = 2, 1


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_scoring_equals_one_forward(chunk):
    model = make_model("llama")
    ids = calibration_ids(1, 40, seed=3)[0].tolist()
    logprobs = model(torch.tensor([[2, *ids]])).logits[0].log_softmax(-1)
    expected = sum(logprobs[i, t].item() for i, t in enumerate(ids))
    assert StreamingLM(model, Tokenizer(), chunk=chunk).score([2], ids)[0] == pytest.approx(expected, abs=1e-4)
    art = patchkv.calibrate(model, calibration_ids(), rank=16, progress=False)
    with patchkv.patched(model, art, sink_tokens=2, window=4):  # full rank: still exact through the LatentCache
        lm = StreamingLM(model, Tokenizer(), chunk=chunk)
        assert lm.score([2], ids)[0] == pytest.approx(expected, abs=1e-4)
        assert lm.tokens_held == 40  # the prefix and all targets but the last, which is never fed back


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="chunk"):
        StreamingLM(make_model("llama"), Tokenizer(), chunk=0)


def test_default_chunk_is_half_the_exact_window():
    """Half the exact window, at least 1 (a forward reads its own tokens and the window before it exact); large
    for an unpatched model."""
    from patchkv.streaming import UNPATCHED_CHUNK, default_chunk

    model = make_model("llama")
    ids = calibration_ids(1, 30, seed=4)[0].tolist()
    art = patchkv.calibrate(model, calibration_ids(), rank=4, progress=False)
    assert default_chunk(model) == UNPATCHED_CHUNK
    for options, chunk in (({}, 1), (dict(window=1), 1), (dict(sink_tokens=2, window=9), 4)):
        with patchkv.patched(model, art, **options):
            assert default_chunk(model) == chunk
            auto = StreamingLM(model, Tokenizer(), chunk=None).score([2], ids)[0]
            assert auto == StreamingLM(model, Tokenizer(), chunk=chunk).score([2], ids)[0]
            assert auto != StreamingLM(model, Tokenizer(), chunk=chunk + 5).score([2], ids)[0]
