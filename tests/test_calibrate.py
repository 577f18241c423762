"""Calibration inputs, token accounting, sinks."""

import pytest
import torch
from conftest import calibration_ids, make_model

import patchkv


def test_max_tokens_and_sinks_are_counted_exactly():
    model = make_model("llama")
    art = patchkv.calibrate(model, calibration_ids(8, 48), rank=4, sink_tokens=4, progress=False)
    assert art.calibration["tokens"] == 8 * 44 and art.calibration["sink_tokens"] == 4
    art = patchkv.calibrate(model, calibration_ids(8, 48), rank=4, max_tokens=100, progress=False)
    assert art.calibration["tokens"] == 100


def test_sink_tokens_are_left_out_of_the_statistics():
    """Only the first token differs between two batches. Layer 0's keys depend on their own token alone
    (later layers mix in the first token through attention): with sink_tokens=1 its statistics agree."""
    model = make_model("llama")
    a, b = calibration_ids(4, 32), calibration_ids(4, 32)
    b[:, 0] = (b[:, 0] + 7) % 90 + 3
    with_sinks = [patchkv.calibrate(model, x, rank=4, sink_tokens=1, progress=False) for x in (a, b)]
    assert torch.allclose(with_sinks[0].keys.mean[0], with_sinks[1].keys.mean[0], atol=1e-6)
    assert torch.allclose(with_sinks[0].values.eigenvalues[0], with_sinks[1].values.eigenvalues[0], atol=1e-6)
    without = [patchkv.calibrate(model, x, rank=4, progress=False) for x in (a, b)]
    assert not torch.allclose(without[0].keys.mean[0], without[1].keys.mean[0], atol=1e-4)


def test_dataloader_with_padding_counts_only_real_tokens():
    model = make_model("qwen3")
    ids = calibration_ids(4, 20)
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0
    mask[2, 5:] = 0
    batches = [{"input_ids": ids[:2], "attention_mask": mask[:2]}, {"input_ids": ids[2:], "attention_mask": mask[2:]}]
    art = patchkv.calibrate(model, batches, mode="post_rope", energy=0.9, progress=False)
    assert art.calibration["tokens"] == int(mask.sum())
    # padding must not leak into the statistics: the same real tokens unpadded give the same mean
    rows = [ids[0, :12], ids[1], ids[2, :5], ids[3]]
    unpadded = patchkv.calibrate(model, [r.unsqueeze(0) for r in rows], mode="post_rope", energy=0.9, progress=False)
    assert torch.allclose(art.values.mean, unpadded.values.mean, atol=1e-5)


def test_text_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer=tokenizer"):
        patchkv.calibrate(make_model("llama"), ["some text"], rank=2, progress=False)


def test_bad_mode():
    with pytest.raises(ValueError, match="pre_rope"):
        patchkv.calibrate(make_model("llama"), calibration_ids(), mode="mid_rope", rank=2, progress=False)


def test_sinks_are_the_first_real_tokens_of_left_padded_rows():
    model = make_model("llama")
    ids = calibration_ids(2, 16)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: 11 real tokens after 5 pads
    art = patchkv.calibrate(model, [{"input_ids": ids, "attention_mask": mask}], rank=2, sink_tokens=3,
                            progress=False)
    assert art.calibration["tokens"] == (11 - 3) + (16 - 3)
