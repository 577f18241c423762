"""The fast paths against the straightforward ones.

- DP codes: the kernels' decode against the dequantization formula on a bit-by-bit packed layout;
- decode steps read from the stored codes (`decode_attention`) against the model's own attention function over
  the dense keys and values of the same cache, every family, mode and method;
- pre-RoPE top-k: latent scoring at each chunk's reference rotation against scores of keys rotated there,
  and attention over the chosen tokens against dense attention over exactly those tokens;
- post-RoPE top-k: latent scoring against the scores of the truncated keys, mean term included;
- float32 operands on CPU for half-precision models against the unpatched model.
(The C++ kernels against their PyTorch references: `test_cpu_kernels.py`.)
"""

import math

import pytest
import torch
from conftest import calibration_ids, make_model

import patchkv
from patchkv import key_space
from patchkv.rope import rotate_at
from patchkv.kernels import reference
from patchkv.quantize import GAUSSIAN_STEP, CoefficientQuantizer, allocate_bits


# ----- DP codes --------------------------------------------------------------------------------------
def pack_bit_by_bit(idx: list[int], bits: list[int]) -> list[int]:
    """One token's codes (flat components) -> bytes: each component's bits in turn, least significant first,
    from bit 0 of byte 0."""
    stream = [(code >> k) & 1 for code, b in zip(idx, bits) for k in range(b)]
    stream += [0] * (-len(stream) % 8)
    return [sum(bit << k for k, bit in enumerate(stream[i:i + 8])) for i in range(0, len(stream), 8)]


ALLOCATIONS = {
    "every width": torch.tensor([[8, 7, 6, 5, 4, 3, 2, 1, 0]]),
    "random": torch.randint(0, 9, (3, 13), generator=torch.Generator().manual_seed(0)),
    "a head with none": torch.tensor([[3, 3, 2, 1], [0, 0, 0, 0]]),
    "a layer with none": torch.zeros(2, 3, dtype=torch.long),
    "dp": allocate_bits(torch.linspace(4, 0.01, 16).repeat(2, 1), 20),
}


@pytest.mark.parametrize("name", list(ALLOCATIONS))
def test_codes_decode_exactly_at_a_fixed_rate(name):
    bits = ALLOCATIONS[name]
    std = torch.rand(bits.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    q = CoefficientQuantizer(bits, std)
    x = torch.randn(2, bits.shape[0], 37, bits.shape[1], generator=torch.Generator().manual_seed(2)) * 2
    codes = q.encode(x)
    assert q.total_bits == int(bits.sum()) and q.bytes_per_token == math.ceil(q.total_bits / 8)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 1, 37, q.bytes_per_token)
    flat_bits = bits.flatten().tolist()
    step = torch.tensor([GAUSSIAN_STEP[b] if b else 0.0 for b in flat_bits]) * std.flatten()
    levels = 2.0 ** bits.flatten()
    idx = torch.floor(x.transpose(1, 2).reshape(2, 37, -1) / torch.where(step > 0, step, 1) + levels / 2)
    idx = idx.clamp(torch.zeros_like(levels), levels - 1).long()
    by_reference = reference.encode(x, q.table, q.components, q.bytes_per_token)
    for b, t in [(0, 0), (1, 5), (1, 36)]:
        assert codes[b, 0, t].tolist() == pack_bit_by_bit(idx[b, t].tolist(), flat_bits)
        assert by_reference[b, t].tolist() == pack_bit_by_bit(idx[b, t].tolist(), flat_bits)
    expected = ((idx.float() + 0.5 - levels / 2) * step).view(2, 37, *bits.shape).transpose(1, 2)
    decoded = q.decode(codes)
    assert decoded.dtype == torch.float32 and torch.allclose(decoded, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(q.encode(decoded), codes)


# ----- pre-RoPE latent top-k ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pre_rope():
    model = make_model("llama")
    return model, patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=16, progress=False)


def test_chunked_latent_scores_reference_against_a_loop():
    g = torch.Generator().manual_seed(3)
    for seq, chunk in [(37, 16), (32, 16), (5, 16)]:
        chunks = -(-seq // chunk)
        q, bias, lat = torch.randn(2, 6, chunks, 4, generator=g), torch.randn(2, 6, chunks, generator=g), torch.randn(
            2, 3, seq, 4, generator=g)
        out = reference.chunked_latent_scores(q, bias, lat, 2, chunk)
        loop = torch.stack([(q[:, :, t // chunk] * lat[:, torch.arange(6) // 2, t]).sum(-1) + bias[:, :, t // chunk]
                            for t in range(seq)], dim=-1)
        assert torch.allclose(out, loop, atol=1e-5)


def test_pre_rope_latent_scores_equal_keys_rotated_to_their_chunk_reference(pre_rope):
    """The approximation is exactly: every token's key rotated by its chunk centre's position."""
    model, art = pre_rope
    seq = 45
    ids = calibration_ids(1, seq, seed=4)
    with patchkv.patched(model, art) as m:
        lp = m.model.layers[1].self_attn.patchkv.on(torch.device("cpu"))
        cache = m(ids, use_cache=True).cache
        layer = cache.layers[1]
        coeffs = lp.keys.decode(layer.tensors["latent_keys"])
        positions = layer._positions(seq)
        q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(5))
        cos, sin = lp.rope.at(torch.tensor([[seq]]), like=q)
        q_rot = lp.patch.mode.queries(lp, q, cos, sin)
        scores = key_space.PreRoPE().approximate_scores(lp, q_rot, layer.tensors["latent_keys"].squeeze(1), 8,
                                                        positions)
        centres = (torch.arange(seq) // key_space.SCORE_CHUNK * key_space.SCORE_CHUNK + key_space.SCORE_CHUNK // 2).clamp_max(seq - 1)
        keys = lp.keys.basis.reconstruct(torch.nn.functional.pad(coeffs[..., :8], (0, 8)))
        rotated = rotate_at(lp.rope, keys, positions[:, centres])
        expected = (q_rot.view(1, 2, 2, 16) @ rotated.transpose(-1, -2)).view(1, 4, seq)
    assert torch.allclose(scores, expected, atol=1e-4)


def test_post_rope_latent_scores_are_the_scores_of_the_truncated_keys():
    """Post-RoPE scoring is q . (mean + basis[:, :r] c[:r]), the mean term included: the query heads of one KV
    head have different q . mean, and the KV head keeps the tokens best for any of them."""
    model = make_model("llama")
    art = patchkv.calibrate(model, calibration_ids(), mode="post_rope", rank=16, progress=False)
    seq = 45
    with patchkv.patched(model, art) as m:
        lp = m.model.layers[1].self_attn.patchkv.on(torch.device("cpu"))
        layer = m(calibration_ids(1, seq, seed=4), use_cache=True).cache.layers[1]
        coeffs = lp.keys.decode(layer.tensors["latent_keys"])
        q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(5))
        means = (q * lp.keys.basis.query_mean.unsqueeze(1)).sum(-1).view(2, 2)
        assert (means[:, 0] - means[:, 1]).abs().min() > 1e-3  # the term matters within each group
        for r in (16, 8):
            scores = key_space.PostRoPE().approximate_scores(lp, q, layer.tensors["latent_keys"].squeeze(1), r,
                                                             layer._positions(seq))
            keys = lp.keys.basis.reconstruct(torch.nn.functional.pad(coeffs[..., :r], (0, 16 - r)))
            expected = (q.view(1, 2, 2, 16) @ keys.transpose(-1, -2)).view(1, 4, seq)
            assert torch.allclose(scores, expected, atol=1e-4)


def test_pre_rope_top_k_attends_exactly_over_the_chosen_tokens(pre_rope, monkeypatch):
    """Top-k logits equal dense attention with every middle token the selection left out masked away."""
    model, art = pre_rope
    ids = calibration_ids(2, 40, seed=6)
    sinks, window, k = 2, 3, 6
    picks = []  # one [batch, kv_heads, k] per layer, in layer order (prefill never selects)
    select = patchkv.TopK.select
    monkeypatch.setattr(patchkv.TopK, "select", lambda self, s, g: picks.append(select(self, s, g)) or picks[-1])
    with patchkv.patched(model, art, sink_tokens=sinks, window=window, top_k=k, top_k_rank=8):
        cache = model(ids[:, :-1], use_cache=True).cache
        sparse = model(ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
    assert len(picks) == len(model.model.layers) and picks[0].shape == (2, 2, k)
    middle = ids.shape[1] - 1 - sinks - window  # the decode step reads the window before it and its own token exact
    forward = patchkv.attention.latent_attention_forward

    def masked(attn, hidden, pe, mask, cache_, **kw):
        if hidden.shape[1] > 1:
            return forward(attn, hidden, pe, mask, cache_, **kw)
        keep = torch.ones(2, 2, 1, sinks + middle + window + 1, dtype=torch.bool)
        keep[..., sinks:sinks + middle] = False
        keep[..., sinks:sinks + middle].scatter_(3, picks[attn.layer_idx].unsqueeze(2), True)
        return forward(attn, hidden, pe, keep.repeat_interleave(2, dim=1), cache_, **kw)

    monkeypatch.setattr(patchkv.attention, "latent_attention_forward", masked)
    with patchkv.patched(model, art, sink_tokens=sinks, window=window):
        cache = model(ids[:, :-1], use_cache=True).cache
        dense = model(ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
    monkeypatch.undo()
    with patchkv.patched(model, art, sink_tokens=sinks, window=window):
        cache = model(ids[:, :-1], use_cache=True).cache
        unmasked = model(ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
    assert torch.allclose(sparse, dense, atol=1e-5) and not torch.allclose(sparse, unmasked, atol=1e-3)


@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("options", [{}, dict(sink_tokens=2, window=3, top_k=8, top_k_rank=4), dict(bits=40)])
def test_half_precision_models(mode, options):
    """A bfloat16 model, patched: full rank stays within bfloat16 rounding of the unpatched model, and every method
    runs (dense operands in bfloat16, decode steps accumulated in float32)."""
    model = make_model("llama", dtype=torch.bfloat16)
    art = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=16, progress=False)
    ids = calibration_ids(2, 30, seed=7)
    head = model(ids[:, :-1], use_cache=True)
    reference = model(ids[:, -1:], cache=head.cache, use_cache=True).logits.float()
    with patchkv.patched(model, art, **options):
        cache = model(ids[:, :-1], use_cache=True).cache
        out = model(ids[:, -1:], cache=cache, use_cache=True).logits
    assert out.dtype == torch.bfloat16
    if not options:
        assert (out.float() - reference).abs().max() < 0.05 * reference.abs().max()
    assert torch.isfinite(out).all()


# ----- decode steps read from the stored codes -----------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("options", [{}, dict(sink_tokens=2, window=3), dict(sink_tokens=2, window=3, top_k=6,
                                                                              top_k_rank=4), dict(bits=40),
                                     dict(sink_tokens=2, window=3, bits=40)])
def test_decode_attention_equals_the_attention_function_over_dense_keys(mode, attn, options, monkeypatch):
    """A decode step by `decode_attention` (scores and value sums read from the stored middle) gives the logits of
    the model's attention function over the dense keys and values of the same cache, left padding (a mask)
    included; prefill never takes it."""
    check_decode("llama", attn, mode, options, monkeypatch)


def test_decode_attention_in_every_family(family, mode, monkeypatch):
    """Every family (sliding-window layers of Mistral, Qwen2 and Gemma 3 past their window included)."""
    check_decode(family, "sdpa", mode, dict(sink_tokens=2, window=3), monkeypatch)


def check_decode(family, attn, mode, options, monkeypatch, layer=False, extra=(), layers_per_basis=1):
    """`layer`: the options' `bits` as `Quantized(bits, basis="layer")` codes (`test_layer_basis`), on bases spanning
    `layers_per_basis` layers (`test_span_cache`); `extra`: methods beside the options (`test_salience`)."""
    model = make_model(family, attn)
    rank = model.model.layers[0].self_attn.head_dim // 2
    art = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=rank, progress=False, layer_bases=layer,
                            layers_per_basis=layers_per_basis)
    methods = []
    if layer:
        options = dict(options)
        methods = [patchkv.Quantized(options.pop("bits"), basis="layer")]
    methods = [*methods, *extra]
    ids = calibration_ids(2, 30, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second row left-padded

    def decode_logits():
        with patchkv.patched(model, art, methods, **options):
            cache = model(ids[:, :-2], attention_mask=mask[:, :-2], use_cache=True).cache
            cache = model(ids[:, -2:-1], attention_mask=mask[:, :-1], cache=cache, use_cache=True).cache
            return model(ids[:, -1:], attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]

    taken = []
    decode = patchkv.attention.decode_attention
    monkeypatch.setattr(patchkv.attention, "decode_attention", lambda lp, q, *a: taken.append(q.shape[2]) or decode(
        lp, q, *a))
    fast = decode_logits()
    assert taken and set(taken) == {1}
    monkeypatch.setattr(patchkv.attention, "decode_applies", lambda *a: False)
    assert torch.allclose(fast, decode_logits(), atol=1e-5)
