"""Calibration inputs, token accounting, sinks."""

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import calibration_ids, make_model
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, BatchEncoding

import patchkv
from patchkv.errors import PatchKVError


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


# ----- what a transformers user passes ------------------------------------------------------------------

REF = Path(__file__).resolve().parents[1] / "artifacts" / "reference-llama"
TEXTS = ["To be, or not to be, that is the question.", "Friends, Romans, countrymen, lend me your ears;",
         "All the world's a stage, and all the men and women merely players.", "Now is the winter of our discontent"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REF, local_files_only=True)


def _rows_unpadded(enc):
    """The real tokens of each row of a padded encoding, one unpadded single-row batch each."""
    return [ids[mask.bool()].unsqueeze(0) for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]


def _assert_same(a, b, atol=1e-5):
    assert a.calibration["tokens"] == b.calibration["tokens"]
    for kind in ("keys", "values"):
        x, y = getattr(a, kind), getattr(b, kind)
        assert torch.allclose(x.mean, y.mean, atol=atol), kind
        assert torch.allclose(x.eigenvalues, y.eigenvalues, atol=atol, rtol=1e-4), kind


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_encoding(tokenizer, side):
    """`tok(texts, return_tensors="pt", padding=True)` as is: padded positions stay out of the statistics and, with
    left padding, real tokens keep the positions they have unpadded (post-RoPE keys depend on them)."""
    model = make_model("llama", vocab_size=len(tokenizer))
    tokenizer.padding_side = side
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    assert isinstance(enc, BatchEncoding) and not isinstance(enc, dict) and (enc["attention_mask"] == 0).any()
    art = patchkv.calibrate(model, enc, mode="post_rope", rank=4, sink_tokens=1, batch_size=3, progress=False)
    ref = patchkv.calibrate(model, _rows_unpadded(enc), mode="post_rope", rank=4, sink_tokens=1, progress=False)
    assert art.calibration["tokens"] == int(enc["attention_mask"].sum()) - len(TEXTS)
    _assert_same(art, ref)


class Batch(Mapping):
    """A mapping that is not a dict."""

    def __init__(self, **entries):
        self._entries = entries

    def __getitem__(self, key):
        return self._entries[key]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)


def test_mappings_lists_of_them_and_dataloaders(tokenizer):
    model = make_model("llama", vocab_size=len(tokenizer))
    tokenizer.padding_side = "left"
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    ref = patchkv.calibrate(model, _rows_unpadded(enc), rank=4, progress=False)
    plain = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    lists = tokenizer(TEXTS)  # no padding: ragged lists of ints
    halves = [tokenizer(TEXTS[:2], return_tensors="pt", padding=True), tokenizer(TEXTS[2:], return_tensors="pt",
                                                                                 padding=True)]
    fixed = tokenizer(TEXTS, padding="max_length", max_length=24, return_tensors="pt")
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(fixed["input_ids"], fixed["attention_mask"])]
    loader = DataLoader(rows, batch_size=3)  # default collate stacks the dicts of tensors into dicts of [3, 24]
    for data in (plain, Batch(**plain), lists, halves, [Batch(**h) for h in halves], loader, iter(halves)):
        _assert_same(patchkv.calibrate(model, data, rank=4, progress=False), ref)


def test_bad_batches_say_what_is_expected():
    model = make_model("llama")
    with pytest.raises(TypeError, match="input_ids"):
        patchkv.calibrate(model, [{"ids": calibration_ids(2, 8)}], rank=2, progress=False)
    with pytest.raises(ValueError, match="shape"):
        patchkv.calibrate(model, {"input_ids": calibration_ids(2, 8), "attention_mask": torch.ones(2, 7)}, rank=2,
                          progress=False)
    with pytest.raises(TypeError, match="integers"):
        patchkv.calibrate(model, calibration_ids(2, 8).float(), rank=2, progress=False)


# ----- validation ---------------------------------------------------------------------------------------


def _untouchable():
    raise AssertionError("the data was read before the options were checked")
    yield


@pytest.mark.parametrize("option", [dict(sink_tokens=-1), dict(sink_tokens=1.5), dict(sink_tokens=True),
                                    dict(seq_len=0), dict(batch_size=0), dict(batch_size=2.0), dict(batch_size="4"),
                                    dict(max_tokens=0), dict(max_tokens=-5), dict(max_tokens=1e4)])
def test_bad_options_are_refused_before_any_work(option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"{name} must be an integer"):
        patchkv.calibrate(make_model("llama"), _untouchable(), rank=2, progress=False, **option)


@pytest.mark.parametrize("energy", ["0.9", True, float("nan"), 0.0, 1.5, -0.1, None])
def test_energy_must_be_a_real_number_in_0_1(energy):
    budget = dict(energy=energy) if energy is not None else dict(energy=complex(0.5, 0))
    with pytest.raises(ValueError, match="energy must be a real number"):
        patchkv.calibrate(make_model("llama"), _untouchable(), progress=False, **budget)


def test_numpy_integers_and_floats_are_accepted(tmp_path):
    model = make_model("llama")
    art = patchkv.calibrate(model, calibration_ids(2, 16), rank=np.int64(8), sink_tokens=np.int32(1),
                            max_tokens=np.int64(20), progress=False)
    assert art.keys.ranks.tolist() == [[8, 8], [8, 8]] and art.calibration["tokens"] == 20
    art.save(tmp_path / "a")  # the metadata stays JSON (plain ints)
    art = patchkv.calibrate(model, calibration_ids(2, 16), energy=np.float32(0.9), progress=False)
    art.save(tmp_path / "b")
    with pytest.raises(ValueError, match="rank must be an integer"):
        patchkv.calibrate(model, _untouchable(), rank=True, progress=False)


def test_a_patched_model_is_refused():
    model = make_model("llama")
    model.model.layers[1].self_attn.patchkv = object()  # what patchkv.apply leaves on a module
    with pytest.raises(PatchKVError, match=r"patchkv\.remove\(model\)"):
        patchkv.calibrate(model, _untouchable(), rank=2, progress=False)


# ----- accelerate-dispatched models -----------------------------------------------------------------------

DEVICE_MAPS = {
    # whole decoder layers on disk: the projections' own hooks load their weights when called
    "layers_on_disk": {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "disk",
                       "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"},
    # the attention module itself in the map (it then has its own hook), embeddings on disk
    "attention_on_disk": {"model.embed_tokens": "disk", "model.layers.0.self_attn": "disk",
                          "model.layers.0.mlp": "cpu", "model.layers.0.input_layernorm": "cpu",
                          "model.layers.0.post_attention_layernorm": "cpu", "model.layers.1": "disk",
                          "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"},
}


@pytest.mark.parametrize("device_map", list(DEVICE_MAPS))
def test_accelerate_dispatched_model_with_disk_offload(tmp_path, device_map):
    accelerate = pytest.importorskip("accelerate")
    data = calibration_ids(4, 24)
    ref = patchkv.calibrate(make_model("llama"), data, mode="post_rope", rank=4, sink_tokens=1, progress=False)
    model = accelerate.dispatch_model(make_model("llama"), device_map=DEVICE_MAPS[device_map], offload_dir=tmp_path)
    assert model.model.layers[0].self_attn.k_proj.weight.device.type == "meta"  # really offloaded
    art = patchkv.calibrate(model, data, mode="post_rope", rank=4, sink_tokens=1, progress=False)
    for kind in ("keys", "values"):
        x, y = getattr(art, kind), getattr(ref, kind)
        assert torch.allclose(x.mean, y.mean, atol=1e-6) and torch.allclose(x.eigenvalues, y.eigenvalues, atol=1e-6)
        assert torch.allclose(x.eigenvectors[..., :4], y.eigenvectors[..., :4], atol=1e-4)
    assert model.model.layers[0].self_attn.k_proj.weight.device.type == "meta"  # offloaded again afterwards
