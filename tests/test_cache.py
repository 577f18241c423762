"""LatentCache: every cache kind x generation mode x method is exact at full rank or refused clearly.

Logits are compared at float32 tolerance against the unpatched model (never a patched model against
itself): full-rank bases reproduce keys and values to rounding, so any difference is a bug.
"""

import pickle

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model
from transformers import DynamicCache, QuantizedCache

import patchkv

TOL = 1e-5


def score_diff(a_scores, b_scores) -> float:
    """Largest difference between two runs' per-step scores (-inf entries from top-k warping must match)."""
    worst = 0.0
    for a, b in zip(a_scores, b_scores):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        finite = torch.isfinite(a)
        worst = max(worst, (a[finite] - b[finite]).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def setups():
    """(model, full-rank artifact) per mode, built once."""
    out = {}
    for mode in ("pre_rope", "post_rope"):
        model = make_model("llama")
        art = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=16, progress=False)
        out[mode] = (model, art)
    return out


def prompt():
    ids = calibration_ids(2, 11, seed=21)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    return ids, mask


METHODS = {"lowrank": {}, "sinks+window": dict(sink_tokens=2, window=3),
           "salient": dict(methods=[patchkv.SinksWindow(2, 3), patchkv.Novelty(0.25)])}
GENERATION = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=10, temperature=0.8),
    "beam": dict(do_sample=False, num_beams=3),
}
CACHES = ("default", "static", "latent_passed", "latent_offloaded")


def generate(model, cache_kind, gen, **extra):
    ids, mask = prompt()
    kwargs = dict(attention_mask=mask, max_new_tokens=7, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, **GENERATION[gen], **extra)
    if cache_kind == "static":
        kwargs["cache_implementation"] = "static"
    elif cache_kind.startswith("latent"):
        kwargs["cache"] = patchkv.LatentCache(model, offloading=cache_kind.endswith("offloaded"))
    torch.manual_seed(7)
    return model.generate(ids, **kwargs)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("gen", list(GENERATION))
@pytest.mark.parametrize("cache_kind", CACHES)
@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_generation_matrix_is_exact_at_full_rank(setups, mode, cache_kind, gen, method):
    model, art = setups[mode]
    reference = generate(model, "static" if cache_kind == "static" else "default", gen)
    with patchkv.patched(model, art, **METHODS[method]):
        out = generate(model, cache_kind, gen)
        assert isinstance(out.past_key_values, patchkv.LatentCache)
    assert torch.equal(out.sequences, reference.sequences)
    assert score_diff(out.scores, reference.scores) < TOL


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_assisted_decoding_crops_the_latent_cache_exactly(setups, mode, method):
    """The main model verifies an assistant's draft and crops its cache back: results equal plain greedy."""
    model, art = setups[mode]
    assistant = make_model("llama", seed=3)
    ids, mask = prompt()
    ids, mask = ids[:1, 3:], mask[:1, 3:]  # assisted decoding takes one sequence
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kwargs)
    with patchkv.patched(model, art, **METHODS[method]):
        assisted = model.generate(ids, assistant_model=assistant, **kwargs)
        lookup = model.generate(ids, prompt_lookup_num_tokens=3, **kwargs)
    assert torch.equal(assisted, reference) and torch.equal(lookup, reference)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_continuation_with_the_returned_cache(setups, mode, method):
    model, art = setups[mode]
    ids, mask = prompt()
    more = calibration_ids(2, 4, seed=22)
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)  # as generate() numbers left-padded rows
    reference = model(torch.cat([ids, more], dim=1), attention_mask=full_mask, position_ids=positions).logits[:, -4:]
    with patchkv.patched(model, art, **METHODS[method]):
        first = model(ids, attention_mask=mask, position_ids=positions[:, :-4], use_cache=True)
        assert isinstance(first.cache, patchkv.LatentCache)
        second = model(more, attention_mask=full_mask, cache=first.cache, position_ids=positions[:, -4:],
                       use_cache=True)
    assert (second.logits - reference).abs().max() < TOL


def test_pre_rope_rotates_by_true_positions_with_gaps(setups):
    """Custom position_ids with a gap: keys are rotated by the positions given, not by their cache index."""
    model, art = setups["pre_rope"]
    ids = calibration_ids(1, 12, seed=23)
    positions = torch.cat([torch.arange(6), torch.arange(20, 26)]).unsqueeze(0)
    reference = model(ids, position_ids=positions).logits
    with patchkv.patched(model, art):
        head = model(ids[:, :8], position_ids=positions[:, :8], use_cache=True)
        tail = model(ids[:, 8:], position_ids=positions[:, 8:], cache=head.cache, use_cache=True)
    assert (torch.cat([head.logits, tail.logits], 1) - reference).abs().max() < TOL


def test_other_caches_are_refused_clearly(setups):
    model, art = setups["pre_rope"]
    ids, mask = prompt()
    written = model(ids, attention_mask=mask, use_cache=True).cache  # unpatched: a DynamicCache
    with patchkv.patched(model, art):
        for cache in (DynamicCache(), written):
            with pytest.raises(patchkv.PatchKVError, match="LatentCache"):
                model(ids, attention_mask=mask, cache=cache, use_cache=True)
        with pytest.raises(patchkv.PatchKVError, match="bits="):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                           cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4})
        with pytest.raises(patchkv.PatchKVError, match="LatentCache"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                           cache=QuantizedCache(backend="quanto", config=model.config, nbits=4))
        latent = model(ids, attention_mask=mask, use_cache=True).cache
    with pytest.raises(patchkv.PatchKVError, match="not patched"):  # continued by the unpatched model
        model(ids[:, :1], cache=latent, use_cache=True)
    with pytest.raises(patchkv.PatchKVError, match="patched model"):
        patchkv.LatentCache(model)


def test_a_cache_written_with_one_artifact_is_refused_by_another(setups):
    model, art = setups["pre_rope"]
    ids, mask = prompt()
    with patchkv.patched(model, art):
        cache = model(ids, attention_mask=mask, use_cache=True).cache
    for other, options in ((art.with_ranks(rank=8), {}), (art, dict(window=4))):
        with patchkv.patched(model, other, **options):
            with pytest.raises(patchkv.PatchKVError, match="another patch"):
                model(ids[:, :1], cache=cache, use_cache=True)


@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_top_k_with_left_padded_batch(setups, mode):
    """top-k over exactly the middle equals dense attention; smaller k never selects padding (finite, close)."""
    model, art = setups[mode]
    ids = calibration_ids(3, 30, seed=24)
    mask = torch.ones_like(ids)
    ids[0, :7], mask[0, :7] = 0, 0
    ids[2, :2], mask[2, :2] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)

    def last_logits(**options):
        with patchkv.patched(model, art, **options):
            head = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True)
            return model(ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:], cache=head.cache,
                         use_cache=True).logits[:, -1]

    reference = model(ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    middle = 30 - 1 - 3  # sinks 1, window 3
    assert (last_logits(sink_tokens=1, window=3, top_k=middle) - reference).abs().max() < TOL
    sparse = last_logits(sink_tokens=1, window=3, top_k=middle - 6, top_k_rank=8)
    assert torch.isfinite(sparse).all()
    assert (sparse - reference).abs().max() < 0.5 * reference.abs().max()


def test_bits_together_with_top_k(setups):
    """Top-k over all of the middle on quantized codes equals dense attention on the same codes."""
    model, art = setups["post_rope"]
    ids = calibration_ids(2, 25, seed=25)

    def last_logits(**options):
        with patchkv.patched(model, art, bits=48, **options):
            head = model(ids[:, :-1], use_cache=True)
            return model(ids[:, -1:], cache=head.cache, use_cache=True).logits[:, -1]

    dense = last_logits(window=2)
    assert (last_logits(window=2, top_k=25 - 2) - dense).abs().max() < TOL
    assert not torch.allclose(last_logits(window=2, top_k=5), dense, atol=TOL)


def test_quantized_codes_agree_across_cache_kinds(setups):
    """A lossy method gives the same result whichever way its cache is made (generate, static, passed in)."""
    model, art = setups["pre_rope"]
    with patchkv.patched(model, art, bits=40, sink_tokens=1, window=2):
        runs = [generate(model, kind, "greedy") for kind in CACHES]
    for run in runs[1:]:
        assert torch.equal(run.sequences, runs[0].sequences)
        assert score_diff(run.scores, runs[0].scores) < TOL


def test_crop_then_continue_equals_a_fresh_forward(setups):
    model, art = setups["post_rope"]
    ids = calibration_ids(2, 20, seed=26)
    reference = model(ids[:, :15]).logits[:, -3:]
    with patchkv.patched(model, art, sink_tokens=2, window=3):
        cache = model(ids, use_cache=True).cache
        cache.crop(-8)  # back to 12 tokens: through the window into the latent middle
        assert cache.get_seq_length() == 12 and cache.track.length == 12
        out = model(ids[:, 12:15], cache=cache, use_cache=True).logits
    assert (out - reference).abs().max() < TOL


def test_cache_layer_contract(setups):
    """What transformers and users read from a cache works on a LatentCache."""
    model, art = setups["pre_rope"]
    ids, mask = prompt()
    plain = model(ids, attention_mask=mask, use_cache=True).cache
    with patchkv.patched(model, art, sink_tokens=2, window=3):
        cache = model(ids, attention_mask=mask, use_cache=True).cache
    assert cache.batch_size == 2 and cache.get_seq_length() == 11 and cache.is_croppable
    assert torch.allclose(cache.layers[0].keys, plain.layers[0].keys, atol=TOL)
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 4 and cache.track.positions.shape == (4, 11)
    cache.batch_select_indices(torch.tensor([0, 3]))
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.allclose(cache.layers[0].keys, plain.layers[0].keys.flip(0), atol=TOL)
    for layer in cache.layers:
        layer.offload()
    assert all(t.device.type == "cpu" for layer in cache.layers for t in layer.tensors.values())
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    assert "layer 1" in pickle.loads(pickle.dumps(cache)).describe()


def test_decode_steps_write_one_token_into_a_paged_middle(setups):
    """The middle is a buffer that grows by pages: decode steps do not copy it; `nbytes` counts the tokens held,
    `allocated_nbytes` the buffer (under a page more), and after a crop the storage the buffer still keeps; the
    layer contract (`update` with true positions) returns what attention reads."""
    from patchkv.cache import PAGE

    model, art = setups["pre_rope"]
    ids = calibration_ids(1, 40, seed=27)
    with patchkv.patched(model, art, bits=40, sink_tokens=2, window=3):
        cache = model(ids[:, :30], use_cache=True).cache
        layer = cache.layers[0]
        start = layer.tensors["latent_keys"].data_ptr()
        for i in range(30, 40):
            cache = model(ids[:, i:i + 1], cache=cache, use_cache=True).cache
        assert layer.tensors["latent_keys"].shape[2] == 40 - 2 - 3
        assert layer.tensors["latent_keys"].data_ptr() == start  # the same buffer: no copy per step
        per_token = layer.tensors["latent_keys"].shape[-1] + layer.tensors["latent_values"].shape[-1]
        assert layer.allocated_nbytes() - layer.nbytes() == (PAGE - 35) * per_token
        assert cache.allocated_nbytes() > cache.nbytes()
        cache.crop(-10)  # the window's 3 tokens, then 7 of the middle
        assert layer.tensors["latent_keys"].shape[2] == 28
        assert layer.allocated_nbytes() - layer.nbytes() == (PAGE - 28) * per_token  # cropped tokens still held
        with pytest.raises(patchkv.PatchKVError, match="not patched"):
            layer.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))  # an unpatched writer
        keys, values = layer.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16),
                                    {"positions": torch.tensor([[30]])})
        assert keys.shape == values.shape == (1, 2, 2 + 28 + 1, 16)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_layers_keep_sinks_and_window_exact_while_in_their_window(family):
    """A sliding layer reads its sinks (while inside its sliding window) and its recent window exact: at a low rank
    the patched model equals the unpatched one while the context fits in sinks + window, its cache holds more exact
    bytes with `SinksWindow` than without, and far past the sliding window it holds the same number of tokens as
    transformers' sliding layers and matches a full-rank patch's exactness."""
    model = make_model(family)
    art = patchkv.calibrate(model, calibration_ids(), rank=2, progress=False)
    ids = calibration_ids(1, 40, seed=11)
    plain = fed_in_chunks(model, ids, 1)
    window = [patchkv.SinksWindow(2, 5), patchkv.LowRank(rank=2)]
    with patchkv.patched(model, art, window):
        windowed = fed_in_chunks(model, ids, 1)
        cache = model(ids, use_cache=True).cache
        sliding = [layer for layer in cache.layers if layer.is_sliding]
        assert sliding and all(layer.kept == model.config.sliding_window - 1 for layer in sliding)
        assert all(layer.sink_len == 0 for layer in sliding)  # the sinks left with the sliding window
        with_exact = cache.nbytes()
    assert torch.allclose(windowed[:, :7], plain[:, :7], atol=1e-5)  # 2 sinks + 5 window: every token exact
    with patchkv.patched(model, art, [patchkv.LowRank(rank=2)]):
        lossy = fed_in_chunks(model, ids, 1)
        assert model(ids, use_cache=True).cache.nbytes() < with_exact
    assert not torch.allclose(lossy[:, 1:7], plain[:, 1:7], atol=1e-3)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 5), patchkv.LowRank(rank=art.head_dim)]):
        assert torch.allclose(fed_in_chunks(model, ids, 3), fed_in_chunks(make_model(family), ids, 3), atol=1e-4)
