"""The cache on layer bases across layers (artifact format version 7, `Quantized(basis="layer")`): a span's codes, one
latent per token for all its layers, are made by the span's last layer from every layer's leaving tokens and held
there; each layer reads them through its own rows of the span's basis (`patchkv.cache`, `SpanQuantizedCodec`)."""

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model
from test_fast_decode import check_decode

import patchkv
from patchkv.allocation import kv_bytes_per_token
from patchkv.errors import PatchKVError
from patchkv.latent import LayerBasis
from patchkv.methods.quantized import LayerQuantizedCodec

OPTIONS = dict(rank=16, sink_tokens=2, fisher_tokens=128, fisher_window=4, layer_bases=True, progress=False)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", num_hidden_layers=4)  # two spans of 2 layers


@pytest.fixture(scope="module")
def spanned(model):
    return patchkv.calibrate(model, calibration_ids(32, 64), mode="pre_rope", layers_per_basis=2, **OPTIONS)


@pytest.fixture(scope="module")
def spanned_post(model):
    return patchkv.calibrate(model, calibration_ids(32, 64), mode="post_rope", layers_per_basis=2, **OPTIONS)


def views(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values as the unpatched model would hold them (the middle rebuilt)."""
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("pool", ["head", "global"])
def test_a_span_is_coded_once_holds_its_bytes_and_approaches_exact_at_full_rate(model, spanned, pool):
    ids = calibration_ids(2, 40, seed=3)
    for bits in (12, 48):
        with patchkv.patched(model, spanned, methods=[patchkv.Quantized(bits, pool, "layer")]):
            cache = model(ids, use_cache=True).cache
        coded = [int(layer.tensors["latent_keys"].numel() + layer.tensors["latent_values"].numel())
                 for layer in cache.layers]
        assert coded[0] == coded[2] == 0  # the members hold none: their middle is their span's
        assert sum(coded) // ids.numel() == kv_bytes_per_token(spanned, bits, pool, "layer")
        assert all(layer.middle_len == 40 for layer in cache.layers)
        assert cache.nbytes() == sum(coded) + cache.track.positions.nbytes
    reference = fed_in_chunks(model, ids, 8)
    errors = {}
    for bits in (12, 128):
        with patchkv.patched(model, spanned, methods=[patchkv.Quantized(bits, pool, "layer")]):
            errors[bits] = float((fed_in_chunks(model, ids, 8) - reference).abs().max() / reference.abs().max())
    assert errors[128] < 0.02 < errors[12]


@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_each_layer_reads_its_rows_of_the_codes_its_span_made_from_every_layers_tokens(model, spanned, spanned_post,
                                                                                       mode):
    """A forward reads its own tokens exact, so what it writes is the unpatched model's keys and values; each layer's
    middle must be those of the whole span coded together and read back through that layer's rows."""
    art = spanned if mode == "pre_rope" else spanned_post
    ids = calibration_ids(2, 24, seed=7)
    exact = model(ids, use_cache=True).cache  # a DynamicCache: values, and keys rotated (post-RoPE cache space)
    with patchkv.patched(model, art, methods=[patchkv.Quantized(40, "head", "layer")]):
        held = views(model(ids, use_cache=True).cache)
    kinds = ("keys", "values") if mode == "post_rope" else ("values",)  # pre-RoPE codes un-rotated keys
    for unit in range(2):
        for kind in kinds:
            c = getattr(art, kind)
            bits = patchkv.allocation.layer_bit_allocation(art, 40, "head")[kinds.index(kind) if mode == "post_rope"
                                                                              else 1][unit]
            rank = int(bits.nonzero().max()) + 1
            heads = art.num_kv_heads
            whole = LayerQuantizedCodec(LayerBasis(c.layer_mean[unit], c.layer_eigenvectors[unit], rank, 2 * heads, 2,
                                                   torch.float32), bits, c.layer_eigenvalues[unit])
            layers = [getattr(exact.layers[2 * unit + i], kind) for i in range(2)]
            coded = whole.basis.reconstruct(whole.decode(whole.encode(torch.cat(layers, dim=1))))
            for i in range(2):
                read = held[2 * unit + i][kind == "values"]
                assert torch.allclose(read, coded[:, i * heads:(i + 1) * heads], atol=1e-5)
                assert not torch.allclose(read, layers[i], atol=1e-3)  # coded, not exact


@pytest.mark.parametrize("options", [dict(bits=40), dict(sink_tokens=2, window=3, bits=24)])
def test_decode_attention_on_span_codes_equals_the_attention_over_dense_keys(mode, options, monkeypatch):
    check_decode("llama", "sdpa", mode, options, monkeypatch, layer=True, layers_per_basis=2)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])
def test_decode_attention_on_span_codes_in_other_families(family, monkeypatch):
    check_decode(family, "sdpa", "pre_rope", dict(sink_tokens=2, window=3, bits=24), monkeypatch, layer=True,
                 layers_per_basis=2)


@pytest.mark.parametrize("operation", ["crop", "reorder", "select", "repeat"])
def test_whole_cache_operations_keep_every_layer_of_a_span_in_step(model, spanned, operation):
    ids = calibration_ids(2, 30, seed=8)
    with patchkv.patched(model, spanned, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24, "global", "layer")]):
        cache = model(ids[:, 10:], cache=model(ids[:, :10], use_cache=True).cache, use_cache=True).cache
        before = views(cache)
        if operation == "crop":  # past the window, into the span's middle
            cache.crop(-10)  # the last 10 of 30 tokens
            expected = [(k[:, :, :20], v[:, :, :20]) for k, v in before]
        elif operation == "reorder":
            cache.reorder_cache(torch.tensor([1, 0]))
            expected = [(k.flip(0), v.flip(0)) for k, v in before]
        elif operation == "select":
            cache.batch_select_indices(torch.tensor([1]))
            expected = [(k[1:], v[1:]) for k, v in before]
        else:
            cache.batch_repeat_interleave(2)
            expected = [(k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)) for k, v in before]
        for (k, v), (ek, ev) in zip(views(cache), expected):
            assert torch.equal(k, ek) and torch.equal(v, ev)
        assert cache.nbytes() < sum(k.nbytes + v.nbytes for k, v in expected)  # the members copied no codes
        batch = expected[0][0].shape[0]
        more = calibration_ids(batch, 3, seed=9)
        step = model(more, cache=cache, use_cache=True)  # every layer agrees on the tokens leaving its window
        assert torch.isfinite(step.logits).all() and cache.get_seq_length() == expected[0][0].shape[2] + 3


def test_generate_on_span_codes_greedy_and_beam(model, spanned):
    ids = calibration_ids(2, 20, seed=10)
    with patchkv.patched(model, spanned, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24, "global", "layer")]):
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
        cache, step, manual = None, ids, []
        for _ in range(6):  # the same decoding, one forward at a time on the cache
            out = model(step, cache=cache, use_cache=True)
            cache, step = out.cache, out.logits[:, -1:].argmax(-1)
            manual.append(step)
        beam = model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=3)
    assert torch.equal(greedy[:, 20:], torch.cat(manual, dim=1))
    assert beam.shape == (2, 26)


@pytest.mark.parametrize("method", [patchkv.NearCodes(8), patchkv.Evict(0.5), patchkv.Novelty(0.1), patchkv.TopK(8)])
def test_methods_on_each_layers_coded_tokens_are_refused_on_span_codes(model, spanned, method):
    with pytest.raises(PatchKVError, match="span 2 layers, and the cache codes each span's tokens once"):
        patchkv.apply(model, spanned, methods=[patchkv.Quantized(24, "head", "layer"), method])
    assert not patchkv.is_patched(model)


def test_a_saved_cache_of_span_codes_continues_exactly_and_a_member_with_a_middle_of_its_own_is_refused(
        tmp_path, model, spanned):
    ids, more = calibration_ids(2, 40, seed=5), calibration_ids(2, 3, seed=6)
    with patchkv.patched(model, spanned, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24, "global", "layer")]):
        cache = model(ids[:, 20:], cache=model(ids[:, :20], use_cache=True).cache, use_cache=True).cache
        saved = patchkv.save_cache(cache, tmp_path / "span.safetensors")
        restored = patchkv.load_cache(model, saved.path)
        assert [layer.middle_len for layer in restored.layers] == [34] * 4 and restored.nbytes() == cache.nbytes()
        for c in (cache, restored):
            c.logits = [model(more[:, i:i + 1], cache=c, use_cache=True).logits for i in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(cache.logits, restored.logits))
        member = cache.layers[0]
        member.tensors["latent_keys"], member.tensors["latent_values"] = member.middle().values()  # a copy of its own
        patchkv.save_cache(cache, tmp_path / "doubled.safetensors")
        with pytest.raises(PatchKVError, match="layer 0 holds a middle of 37 tokens, and its codes are its span's"):
            patchkv.load_cache(model, tmp_path / "doubled.safetensors")


def test_offloading_is_refused_on_span_codes(model, spanned):
    with patchkv.patched(model, spanned, methods=[patchkv.Quantized(24, "head", "layer")]):
        with pytest.raises(PatchKVError, match="use offloading=False"):
            patchkv.LatentCache(model, offloading=True)


GEMMA_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.fixture(scope="module")
def gemma():
    return make_model("gemma3", num_hidden_layers=6, layer_types=GEMMA_TYPES)


@pytest.fixture(scope="module")
def gemma_spanned(gemma):
    return patchkv.calibrate(gemma, calibration_ids(32, 64), mode="pre_rope", layers_per_basis=2, **OPTIONS)


def test_a_span_holds_layers_of_one_attention_kind(gemma, gemma_spanned):
    assert gemma_spanned.layer_groups == [[0, 1], [3, 4], [2, 5]]  # sliding, sliding, full: by each span's last layer
    with pytest.raises(ValueError, match=r"must divide the number of layers of each \(4 sliding \(10\), 2 "
                                         r"full-attention\); pass one of \[1, 2\]"):
        patchkv.calibrate(gemma, calibration_ids(2, 16), mode="pre_rope", layers_per_basis=3, **OPTIONS)
    codecs = patchkv.Quantized(24, "head", "layer").codecs(gemma_spanned, [2] * 6, torch.float32)
    assert [(k.span_layers, k.position) for k, _ in codecs] == [((0, 1), 0), ((0, 1), 1), ((2, 5), 0),
                                                               ((3, 4), 0), ((3, 4), 1), ((2, 5), 1)]


def test_sliding_spans_keep_their_window_and_approach_exact_at_full_rate(gemma, gemma_spanned):
    ids = calibration_ids(2, 48, seed=3)  # past the sliding window of 10
    reference = fed_in_chunks(gemma, ids, 8)
    errors = {}
    for bits in (12, 128):
        with patchkv.patched(gemma, gemma_spanned, [patchkv.SinksWindow(2, 4), patchkv.Quantized(bits, "head",
                                                                                                  "layer")]):
            errors[bits] = float((fed_in_chunks(gemma, ids, 8) - reference).abs().max() / reference.abs().max())
            cache = gemma(ids, use_cache=True).cache
            kept = [layer.kept for layer in cache.layers]
            coded = [layer.tensors["latent_keys"].shape[2] for layer in cache.layers]
    assert kept == [9, 9, 48, 9, 9, 48]  # the sliding layers their last window - 1 tokens, the full ones every token
    assert coded == [0, 5, 0, 0, 5, 42]  # held by each span's last layer: 9 less a window of 4 (the sinks gone)
    assert [layer.sink_len for layer in cache.layers] == [0, 0, 2, 0, 0, 2]
    assert errors[128] < 0.02 < errors[12]


def test_decode_and_generate_on_sliding_spans(gemma, gemma_spanned):
    ids = calibration_ids(2, 30, seed=10)
    with patchkv.patched(gemma, gemma_spanned, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24, "global", "layer")]):
        greedy = gemma.generate(ids, max_new_tokens=6, do_sample=False)
        cache, step, manual = None, ids, []
        for _ in range(6):
            out = gemma(step, cache=cache, use_cache=True)
            cache, step = out.cache, out.logits[:, -1:].argmax(-1)
            manual.append(step)
    assert torch.equal(greedy[:, 30:], torch.cat(manual, dim=1))


def test_a_span_member_never_codes_on_its_rows(spanned):
    codecs = patchkv.Quantized(24, "head", "layer").codecs(spanned, [2] * 4, torch.float32)
    member, owner = codecs[0][0], codecs[1][0]
    assert (member.span, member.position, owner.position) == (2, 0, 1)
    x = torch.randn(1, 2, 3, 16)
    for codec in (member, owner):
        with pytest.raises(PatchKVError, match="cannot code its own vectors"):
            codec.encode(x)
    with pytest.raises(PatchKVError, match="does not code the span"):
        member.encode_span(torch.randn(1, 4, 3, 16))
    assert owner.encode_span(torch.randn(1, 4, 3, 16)).shape == (1, 1, 3, owner.width)
