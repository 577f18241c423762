"""Salience methods (`Novelty`, `CodeError`, `KeyNorm`, `AttentionMass`): a fraction of each KV head's middle kept exact beside its codes.

Exact at full precision in every family and mode; the kept tokens are the best scored and are read exact by both
attention paths (dense operands and decode steps); their bytes are counted and budgets pay for them; saved caches
keep them; generation modes that reorder, crop or batch the cache keep them consistent.
"""

import pytest
import torch
from conftest import calibration_ids, make_model
from test_fast_decode import check_decode

import patchkv
from patchkv.budgets import Budget, parse_budget, salient_bytes, sixteen_bit_bytes
from patchkv.methods import build_plan, parse_method

SCORERS = [patchkv.CodeError, patchkv.KeyNorm, patchkv.Novelty, patchkv.AttentionMass]


def lossy(family="llama", mode="pre_rope", dtype=torch.float32):
    model = make_model(family, dtype=dtype)
    rank = model.model.layers[0].self_attn.head_dim // 2
    return model, patchkv.calibrate(model, calibration_ids(), mode=mode, rank=rank, progress=False)


@pytest.mark.parametrize("scorer", SCORERS)
def test_full_rank_with_salience_generates_as_unpatched(family, mode, scorer):
    model = make_model(family)
    dim = model.model.layers[0].self_attn.head_dim
    art = patchkv.calibrate(model, calibration_ids(), mode=mode, rank=dim, progress=False)
    ids = calibration_ids(2, 24, seed=3)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kwargs)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 3), scorer(0.25)]):
        assert torch.equal(model.generate(ids, **kwargs), reference)


@pytest.mark.parametrize("scope", ["layer", "head"])
@pytest.mark.parametrize("scorer", SCORERS[:3])
def test_kept_tokens_are_the_best_scored_and_read_exact(scorer, scope):
    """One prefill (post-RoPE, so cache space is what the unpatched model caches): each KV head keeps the
    `capacity` tokens of the middle its scorer ranks highest (scope "layer": by the score averaged over the layer's
    heads, so every head keeps the same), and the cache's view of the middle is their exact keys and values there
    and the codes' reconstruction elsewhere."""
    model, art = lossy(mode="post_rope")
    ids = calibration_ids(1, 40, seed=4)
    plain = model(ids, use_cache=True).past_key_values
    method = scorer(0.25, scope=scope)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 3), patchkv.Quantized(20), method]):
        cache = model(ids, use_cache=True).cache
        for i, layer in enumerate(cache.layers):
            middle = slice(2, 37)
            keys, values = plain.layers[i].keys[:, :, middle], plain.layers[i].values[:, :, middle]
            lp = layer.patch
            stored = (lp.keys.encode(keys), lp.values.encode(values))
            scores = method.score(lp, keys, values, stored)
            if scope == "layer":
                scores = scores.mean(1, keepdim=True).expand_as(scores)
            ranked = scores.sort(dim=-1, descending=True, stable=True).indices  # equal scores: the earlier first
            expected = ranked[..., :method.capacity(35)].sort(-1).values
            index = layer.tensors["salient_index"].squeeze(-1).long()
            assert layer.salient_len == 8 and torch.equal(index, expected)
            assert (scope == "layer") == torch.equal(index[:, :1].expand_as(index), index)
            for view, exact in ((layer.keys, keys), (layer.values, values)):
                got = view[:, :, middle]
                kept = torch.zeros(got.shape[:3], dtype=torch.bool).scatter_(2, index, True)
                assert torch.allclose(got[kept], exact[kept], atol=1e-6)
                assert (got[~kept] - exact[~kept]).abs().max() > 1e-3  # the rest is read from lossy codes


@pytest.mark.parametrize("scorer", SCORERS)
def test_decode_steps_read_the_kept_tokens_exact_in_every_family(family, mode, scorer, monkeypatch):
    """A decode step (kept tokens merged with sinks and window, their codes masked out of the middle) gives the
    logits of the model's attention function over the dense middle with the kept tokens written in, left padding
    included."""
    check_decode(family, "sdpa", mode, dict(sink_tokens=2, window=3, bits=40), monkeypatch, extra=(scorer(0.3),))


@pytest.mark.parametrize("attn,layer", [("eager", False), ("sdpa", True)], ids=["eager", "layer-bases"])
def test_decode_with_eager_attention_and_layer_bases(mode, attn, layer, monkeypatch):
    check_decode("llama", attn, mode, dict(sink_tokens=2, window=3, bits=40), monkeypatch, layer=layer,
                 extra=(patchkv.CodeError(0.3),))


def test_decode_steps_displace_the_lowest_and_sliding_layers_keep_none():
    model, art = lossy("gemma3")
    ids = calibration_ids(1, 30, seed=5)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 3), patchkv.Quantized(20), patchkv.CodeError(0.25)]):
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        sliding, full = out.past_key_values.layers
        assert sliding.is_sliding and sliding.salient_len == 0
        middle = full.middle_len
        assert full.salient_len == int(0.25 * middle)
        index = full.tensors["salient_index"].squeeze(-1)
        assert bool((index < middle).all()) and bool((index.diff(dim=-1) > 0).all())  # distinct, in middle order


def test_a_decode_token_that_ranks_below_every_kept_one_leaves_them_as_they_are(monkeypatch):
    """Novelty scores a decode step's single token 0: while the capacity holds, the kept tokens stay as they are (the
    very tensors, nothing gathered again); once it grows by one, the newcomer fills the place, and a later 0 does not
    displace it (equal scores keep the earlier). Decoding with the shortcut and without it (every step concatenating
    and ranking) holds the same tokens, batch of 2."""
    model, art = lossy()
    ids = calibration_ids(2, 86, seed=5)
    methods = [patchkv.SinksWindow(2, 3), patchkv.Quantized(20), patchkv.Novelty(1 / 16)]

    def decode(start: int, stop: int, cache) -> None:
        for i in range(start, stop):
            model(ids[:, i:i + 1], cache=cache, use_cache=True)

    with patchkv.patched(model, art, methods):
        cache = model(ids[:, :54], use_cache=True).cache  # 49 coded: 3 kept per head
        layer = cache.layers[0]
        before = {name: layer.tensors[name] for name in ("salient_keys", "salient_index", "salient_score")}
        assert layer.salient_len == 3 and bool((before["salient_score"] > 0).all())
        decode(54, 68, cache)  # one token coded a step, 50 to 63: the capacity stays 3
        assert all(layer.tensors[name] is x for name, x in before.items())
        decode(68, 69, cache)  # 64 coded: capacity 4, the newcomer kept
        assert layer.middle_len == 64 and layer.salient_len == 4
        assert torch.equal(layer.tensors["salient_index"][:, :, :3], before["salient_index"])
        assert bool((layer.tensors["salient_score"][:, :, 3] == 0).all())
        grown = {name: layer.tensors[name] for name in before}
        decode(69, 86, cache)  # 65 to 81 coded: capacity 5 at 80, then a 0 against a kept 0
        assert layer.salient_len == 5 and torch.equal(layer.tensors["salient_index"][:, :, :4], grown["salient_index"])
        shortcut = [{name: x.clone() for name, x in layer.tensors.items()} for layer in cache.layers]
    monkeypatch.setattr(patchkv.cache, "_unmoved", lambda kept, score, capacity: False)
    with patchkv.patched(model, art, methods):
        cache = model(ids[:, :54], use_cache=True).cache
        decode(54, 86, cache)
    for mine, theirs in zip(cache.layers, shortcut):
        assert all(torch.equal(mine.tensors[name], theirs[name]) for name in theirs)


def test_bytes_are_counted_and_budgets_pay_for_them():
    model, art = lossy(dtype=torch.bfloat16)
    art = art.to_dtype(torch.bfloat16)
    context = 400
    method = patchkv.CodeError(1 / 16)
    plain = Budget(ratio=4, pool="head").methods(art, context)
    salient = Budget(ratio=4, pool="head", salience=method).methods(art, context)
    assert salient[-1] == method and salient[1].bits < plain[1].bits  # the codes get what the kept tokens leave
    ids = calibration_ids(1, context, seed=6)
    with patchkv.patched(model, art, salient):
        cache = model(ids, use_cache=True).cache
    kept = sum(t.nbytes for layer in cache.layers for name, t in layer.tensors.items() if name.startswith("salient"))
    assert kept == salient_bytes(art, method, context - 4 - 32) > 0
    assert cache.nbytes() == sum(t.nbytes for layer in cache.layers for t in layer.tensors.values()) + context * 4
    assert cache.nbytes() / context <= sixteen_bit_bytes(art) / 4


@pytest.mark.parametrize("bits", [8, 4])
def test_int8_and_int4_copies_are_read_within_half_a_step_and_budgets_count_them(bits):
    """`bits=8` / `bits=4`: each kept key and value is held as int8 (int4 two to a byte) with a float32 scale, read
    back within half a step of the exact one (and still not from the codes); the cache's bytes are what budgets count,
    so at equal bytes the codes keep more bits than with exact copies of the same tokens (int4 more than int8), and a
    decode step reads them as the dense path does."""
    model, art = lossy(mode="post_rope")
    ids = calibration_ids(1, 40, seed=4)
    plain = model(ids, use_cache=True).past_key_values
    method = patchkv.KeyNorm(0.25, bits=bits)
    held, top = (torch.int8, 127) if bits == 8 else (torch.uint8, 7)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 3), patchkv.Quantized(20), method]):
        cache = model(ids, use_cache=True).cache
    for i, layer in enumerate(cache.layers):
        copies = layer.tensors["salient_keys"]
        assert copies.dtype == held and copies.shape[-1] == plain.layers[i].keys.shape[-1] * bits // 8
        assert layer.tensors["salient_scale"].shape[-1] == 2
        index = layer.tensors["salient_index"].squeeze(-1).long()
        for view, full in ((layer.keys, plain.layers[i].keys), (layer.values, plain.layers[i].values)):
            got, exact = view[:, :, 2:37], full[:, :, 2:37]
            kept = torch.zeros(got.shape[:3], dtype=torch.bool).scatter_(2, index, True)
            step = exact.abs().amax(-1, keepdim=True).expand_as(exact)[kept] / top
            assert bool(((got[kept] - exact[kept]).abs() <= step / 2 + 1e-6).all())
            assert (got[~kept] - exact[~kept]).abs().max() > 1e-3
    model, art = lossy(dtype=torch.bfloat16)
    art, context = art.to_dtype(torch.bfloat16), 400
    coarse, int8, exact = (patchkv.CodeError(1 / 16, bits=b) for b in (bits, 8, 16))
    with patchkv.patched(model, art, Budget(ratio=4, pool="head", salience=coarse).methods(art, context)):
        cache = model(calibration_ids(1, context, seed=6), use_cache=True).cache
    kept = sum(t.nbytes for layer in cache.layers for name, t in layer.tensors.items() if name.startswith("salient"))
    assert kept == salient_bytes(art, coarse, context - 4 - 32) <= salient_bytes(art, int8, context - 4 - 32) \
        < salient_bytes(art, exact, context - 4 - 32)
    bits_of = {m: Budget(ratio=4, pool="head", salience=m).methods(art, context)[1].bits for m in (coarse, int8, exact)}
    assert bits_of[coarse] > bits_of[exact] and (bits == 8 or bits_of[coarse] > bits_of[int8])
    assert parse_budget(f"16x+near+novelty:bits={bits}").salience == patchkv.Novelty(bits=bits)
    with pytest.raises(ValueError, match="bits"):
        patchkv.Novelty(bits=2)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_decode_steps_read_int8_and_int4_copies_as_the_dense_path_does(mode, bits, monkeypatch):
    check_decode("llama", "sdpa", mode, dict(sink_tokens=2, window=3, bits=40), monkeypatch,
                 extra=(patchkv.CodeError(0.3, bits=bits),))


@pytest.mark.parametrize("bits", [16, 4])
def test_crop_reorder_and_batch_selection_keep_the_kept_tokens_consistent(bits):
    model, art = lossy()
    ids = calibration_ids(2, 40, seed=7)
    methods = [patchkv.SinksWindow(2, 3, bits=bits), patchkv.Quantized(20), patchkv.CodeError(0.25, bits=bits)]
    with patchkv.patched(model, art, methods):
        cache = model(ids, use_cache=True).cache
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.crop(-12)  # back into the middle: kept tokens past its end go
        for layer in cache.layers:
            assert bool((layer.tensors["salient_index"] < layer.middle_len).all()) and layer.salient_len > 0
        more = model(ids[:, :5], cache=cache, use_cache=True).logits
        assert torch.isfinite(more).all()
        cache.batch_select_indices(torch.tensor([1]))
        assert all(t.shape[0] == 1 for layer in cache.layers for t in layer.tensors.values())
        beams = model.generate(ids[:1], max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
        sampled = model.generate(ids[:1], max_new_tokens=6, do_sample=True, pad_token_id=0)
        assert beams.shape == sampled.shape == (1, 46)
        held = torch.uint8 if bits == 4 else model.dtype
        assert all(layer.tensors[f"{region}_keys"].dtype == held for layer in cache.layers
                   for region in ("salient", "recent"))


def test_methods_parse_and_refuse_what_does_not_fit():
    assert parse_method("code_error:fraction=0.05") == patchkv.CodeError(0.05)
    assert patchkv.KeyNorm(0.1).spec() == "key_norm:fraction=0.1" and patchkv.Novelty().spec() == "novelty"
    assert parse_method(patchkv.Novelty(0.01, "head", 64).spec()) == patchkv.Novelty(0.01, "head", 64)
    assert parse_method("novelty:fraction=0.01,scope=head,references=64") == patchkv.Novelty(0.01, "head", 64)
    for fraction in (0, 1, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match="fraction"):
            patchkv.CodeError(fraction)
    with pytest.raises(ValueError, match="scope"):
        patchkv.KeyNorm(0.1, scope="token")
    with pytest.raises(ValueError, match="cannot be combined"):
        build_plan([patchkv.CodeError(0.1), patchkv.TopK(8)])
    _, art = lossy()
    with pytest.raises(ValueError, match="salient fraction"):
        Budget(ratio=32, salience=patchkv.CodeError(0.5)).methods(art, 4096)


def test_novelty_ranks_a_token_unlike_the_rest_first():
    """Keys and values repeating one pattern, one token elsewhere: that token scores highest; references cap the
    comparison set; a lone token (a decode step) scores 0."""
    model, art = lossy()
    with patchkv.patched(model, art, [patchkv.Quantized(20)]):
        lp = model.model.layers[0].self_attn.patchkv
    pattern = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(8))
    keys = pattern.repeat(1, 1, 20, 1)
    keys[:, :, 57] = 10 * torch.randn(2, 16, generator=torch.Generator().manual_seed(9))
    for references in (256, 16):
        scores = patchkv.Novelty(0.1, references=references).score(lp, keys, keys.clone(), None)
        assert scores.shape == (1, 2, 100) and torch.equal(scores.argmax(-1), torch.tensor([[57, 57]]))
    assert torch.equal(patchkv.Novelty(0.1).score(lp, keys[:, :, :1], keys[:, :, :1], None), torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match="references"):
        patchkv.Novelty(0.1, references=0)


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_attention_mass_keeps_what_the_last_queries_attend_to(scope):
    """The unpatched model's own attention weights (eager), renormalised over the tokens leaving the window and
    averaged over the last `observe` queries and each KV head's query heads, rank the tokens kept."""
    model = make_model("llama", "eager")
    art = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=8, progress=False)
    ids = calibration_ids(1, 40, seed=4)
    weights = model(ids, output_attentions=True).attentions  # per layer [1, heads, 40, 40]
    method = patchkv.AttentionMass(0.25, scope=scope, observe=3)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 3), patchkv.Quantized(20), method]):
        cache = model(ids, use_cache=True).cache
    for layer, w in zip(cache.layers, weights):
        seen = w[0, :, -3:, 2:37]  # the last 3 queries on the 35 tokens leaving the window
        score = (seen / seen.sum(-1, keepdim=True)).view(2, 2, 3, 35).mean((1, 2))  # [kv_heads, 35]
        if scope == "layer":
            score = score.mean(0, keepdim=True).expand_as(score)
        expected = score.sort(dim=-1, descending=True, stable=True).indices[..., :8].sort(-1).values
        assert torch.equal(layer.tensors["salient_index"][0].squeeze(-1).long(), expected)


def test_budgets_name_a_salience_method_after_a_plus():
    assert parse_budget("16x+novelty") == Budget(ratio=16, salience=patchkv.Novelty())
    assert parse_budget(" 119 + code_error:fraction=0.01 ") == Budget(bits=119, salience=patchkv.CodeError(0.01))
    assert str(parse_budget("8x+key_norm")) == "8x+key_norm" and str(parse_budget("8x+novelty:scope=head")) == \
        "8x+novelty:scope=head"
    with pytest.raises(ValueError, match="salience method"):
        parse_budget("16x+topk")
    with pytest.raises(ValueError, match="Unknown method"):
        parse_budget("16x+nothing")
