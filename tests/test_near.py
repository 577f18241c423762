"""`NearCodes`: the newest coded tokens of each layer at a higher rate than the rest of the middle.

At the middle's own rate (factor 1) the cache holds and reads exactly what it does without them; at a higher rate
both attention paths (dense operands and decode steps) read the near region with its own codecs, the newest tokens
stay there and older ones move on into the middle; its bytes are counted and budgets pay for them; saved caches keep
it; generation modes that reorder, crop or batch the cache keep it consistent; sliding layers hold their last
tokens through it. With a salience method the tokens kept exact are chosen over the near tokens and the middle
alike, keep their index as they move from one to the other, and are read exact by both attention paths.
"""

import pytest
import torch
from conftest import calibration_ids, make_model
from test_fast_decode import check_decode

import patchkv
from patchkv.budgets import Budget, parse_budget, salient_bytes, sixteen_bit_bytes
from patchkv.methods import build_plan

REGIONS = [patchkv.SinksWindow(2, 3), patchkv.Quantized(20)]


def lossy(family="llama", mode="pre_rope", dtype=torch.float32):
    model = make_model(family, dtype=dtype)
    rank = model.model.layers[0].self_attn.head_dim // 2
    return model, patchkv.calibrate(model, calibration_ids(), mode=mode, rank=rank, progress=False)


def continued(model, art, methods, ids):
    """Logits of `ids`' last 8 tokens read after the rest went through the cache, and a greedy continuation."""
    with patchkv.patched(model, art, methods):
        cache = model(ids[:, :-8], use_cache=True).cache
        logits = model(ids[:, -8:], cache=cache, use_cache=True).logits
        return logits, model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)


def test_at_the_middles_rate_near_codes_change_nothing(family, mode):
    model, art = lossy(family, mode)
    ids = calibration_ids(2, 40, seed=3)
    plain = continued(model, art, REGIONS, ids)
    same = continued(model, art, [*REGIONS, patchkv.NearCodes(8, factor=1)], ids)
    finer = continued(model, art, [*REGIONS, patchkv.NearCodes(8, factor=2)], ids)
    assert torch.equal(plain[0], same[0]) and torch.equal(plain[1], same[1])
    assert (plain[0] - finer[0]).abs().max() > 1e-4


def test_the_newest_tokens_stay_near_at_the_finer_rate():
    """Post-RoPE (cache space is what the unpatched model caches): after a prefill and every decode step the last 8
    coded tokens are near, read closer to the exact keys than the middle's codes (layer 0, whose keys do not depend
    on the cache); the middle holds the rest, coded again at its rate as they moved on."""
    model, art = lossy(mode="post_rope")
    ids = calibration_ids(1, 40, seed=4)
    plain = model(ids, use_cache=True).past_key_values
    with patchkv.patched(model, art, [*REGIONS, patchkv.NearCodes(8, factor=3)]):
        cache = model(ids[:, :30], use_cache=True).cache
        for t in range(30, 40):
            cache = model(ids[:, t:t + 1], cache=cache, use_cache=True).cache
            assert all((layer.near_len, layer.middle_len) == (8, t + 1 - 2 - 3 - 8) for layer in cache.layers)
        layer = cache.layers[0]
        error = (layer.keys - plain.layers[0].keys).norm(dim=-1)[0].mean(0)  # per token
        near, middle = error[2 + 27:2 + 35], error[2:2 + 27]
        assert near.max() < middle.mean() and error[:2].max() < 1e-5 and error[-3:].max() < 1e-5
        lp = layer.patch
        assert lp.near_keys.width > lp.keys.width and layer.tensors["near_keys"].shape[-1] == lp.near_keys.width


def test_decode_steps_move_near_tokens_into_the_middle_a_block_at_a_time():
    """Once the near region is full, a decode step's newcomer moves the oldest `near_block` (a sixty-fourth of the
    region) into the middle at once: the region never holds more than its tokens, nor fewer than a block less one,
    and every token holds the codes it would have held moving one at a time (its codes at the near rate, or the
    middle's recoded from them: layer 0, whose keys and values do not depend on the cache), so only where the boundary
    falls differs; a multi-token forward moves what left."""
    model, art = lossy()
    ids = calibration_ids(1, 200, seed=6)
    methods = [*REGIONS, patchkv.NearCodes(128, factor=3)]
    with patchkv.patched(model, art, methods):
        caches = [model(ids[:, :150], use_cache=True).cache for _ in range(2)]
        for layer in caches[1].layers:
            layer.near_block = 1  # the reference: one token at a time
        assert caches[0].layers[0].near_block == 2
        ahead = 0
        for t in range(150, 190):
            caches = [model(ids[:, t:t + 1], cache=c, use_cache=True).cache for c in caches]
            for blocked, single in zip(*(c.layers for c in caches)):
                assert single.near_len == 128 and 127 <= blocked.near_len <= 128
                assert blocked.middle_len + blocked.near_len == single.middle_len + single.near_len
            blocked, single = (c.layers[0] for c in caches)
            m, ms = blocked.middle_len, single.middle_len  # the blocked cache moves first, by a block
            assert ms <= m < ms + 2
            ahead += m > ms
            for kind in ("keys", "values"):
                assert torch.equal(blocked.tensors[f"latent_{kind}"][:, :, :ms], single.tensors[f"latent_{kind}"])
                assert torch.equal(blocked.tensors[f"near_{kind}"], single.tensors[f"near_{kind}"][:, :, m - ms:])
        assert ahead == 20  # every other step
        caches = [model(ids[:, 190:], cache=c, use_cache=True).cache for c in caches]
        assert all(layer.near_len == 128 for c in caches for layer in c.layers)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_decode_steps_read_the_near_codes_as_the_dense_path_does(family, mode, attn, monkeypatch):
    """A decode step (the near region in a pass of its own, merged with the middle and the exact tokens) gives the
    logits of the model's attention function over the dense operands, left padding included."""
    check_decode(family, attn, mode, dict(sink_tokens=2, window=3, bits=40), monkeypatch,
                 extra=(patchkv.NearCodes(6, factor=2),))


def test_bytes_are_counted_and_budgets_pay_for_them():
    model, art = lossy(dtype=torch.bfloat16)
    art = art.to_dtype(torch.bfloat16)
    context = 400
    near = patchkv.NearCodes(64, factor=2)
    plain = Budget(ratio=4, pool="head").methods(art, context)
    methods = Budget(ratio=4, pool="head", near=near).methods(art, context)
    assert methods[-1] == near and methods[1].bits < plain[1].bits  # the middle gets what the near codes leave
    ids = calibration_ids(1, context, seed=6)
    with patchkv.patched(model, art, methods):
        cache = model(ids, use_cache=True).cache
    held = sum(t.nbytes for layer in cache.layers for name, t in layer.tensors.items() if name.startswith("near"))
    lp = cache.layers[0].patch
    assert held == len(cache.layers) * 64 * (lp.near_keys.width + lp.near_values.width) > 0
    assert cache.nbytes() == sum(t.nbytes for layer in cache.layers for t in layer.tensors.values()) + context * 4
    assert 0.9 * sixteen_bit_bytes(art) / 4 < cache.nbytes() / context <= sixteen_bit_bytes(art) / 4


def test_a_saved_cache_keeps_its_near_tokens(tmp_path):
    model, art = lossy()
    ids = calibration_ids(1, 40, seed=7)
    with patchkv.patched(model, art, [*REGIONS, patchkv.NearCodes(8, factor=2)]):
        cache = model(ids[:, :-4], use_cache=True).cache
        saved = patchkv.save_cache(cache, tmp_path / "c.safetensors")
        loaded = patchkv.load_cache(model, saved.path)
        for a, b in zip(cache.layers, loaded.layers):
            assert a.near_len == b.near_len == 8 and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
        assert torch.equal(model(ids[:, -4:], cache=cache, use_cache=True).logits,
                           model(ids[:, -4:], cache=loaded, use_cache=True).logits)
    with patchkv.patched(model, art, REGIONS), pytest.raises(patchkv.PatchKVError, match="another patch"):
        patchkv.load_cache(model, saved.path)


def test_sliding_layers_hold_their_last_tokens_through_the_near_region():
    model, art = lossy("gemma3")
    with patchkv.patched(model, art, [*REGIONS, patchkv.NearCodes(8, factor=2)]):
        sliding, full = model(calibration_ids(1, 40, seed=7), use_cache=True).cache.layers
    assert sliding.is_sliding and sliding.kept == sliding.sliding_window - 1 == 9
    assert (sliding.sink_len, sliding.middle_len, sliding.near_len, sliding.window_len) == (0, 0, 6, 3)
    assert (full.sink_len, full.middle_len, full.near_len, full.window_len) == (2, 27, 8, 3)


def test_crop_reorder_and_batch_selection_keep_the_regions_consistent():
    model, art = lossy()
    ids = calibration_ids(2, 40, seed=7)
    with patchkv.patched(model, art, [*REGIONS, patchkv.NearCodes(8, factor=2)]):
        cache = model(ids, use_cache=True).cache
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.crop(-6)  # the window and 3 near tokens go
        layer = cache.layers[0]
        assert (layer.middle_len, layer.near_len, layer.window_len) == (27, 5, 0)
        more = model(ids[:, :5], cache=cache, use_cache=True).logits  # 2 of them leave the window: near again
        assert torch.isfinite(more).all() and (layer.middle_len, layer.near_len, layer.window_len) == (27, 7, 3)
        cache.crop(-12)  # into the middle
        assert (layer.middle_len, layer.near_len, layer.window_len) == (25, 0, 0)
        cache.batch_select_indices(torch.tensor([1]))
        assert all(t.shape[0] == 1 for layer in cache.layers for t in layer.tensors.values())
        beams = model.generate(ids[:1], max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
        assert beams.shape == (1, 46)


def test_budgets_name_near_codes_after_a_plus_and_plans_refuse_what_does_not_fit():
    assert parse_budget("16x+near") == Budget(ratio=16, near=patchkv.NearCodes())
    assert parse_budget("8x+near:tokens=480,factor=3") == Budget(ratio=8, near=patchkv.NearCodes(480, 3))
    assert str(parse_budget("16x+near:tokens=96")) == "16x+near:tokens=96" and str(parse_budget("8x+near")) == "8x+near"
    assert parse_budget(str(parse_budget("8x+near:factor=3"))) == Budget(ratio=8, near=patchkv.NearCodes(factor=3))
    for bad in (dict(tokens=0), dict(factor=0), dict(tokens=True)):
        with pytest.raises((ValueError, TypeError)):
            patchkv.NearCodes(**bad)
    with pytest.raises(ValueError, match="cannot be combined"):
        build_plan([patchkv.NearCodes(), patchkv.TopK(8)])
    model, art = lossy()
    with pytest.raises(ValueError, match="need a Quantized codec"):
        patchkv.apply(model, art, [patchkv.LowRank(), patchkv.NearCodes()])
    assert not patchkv.is_patched(model)


def test_near_codes_on_layer_bases(monkeypatch):
    check_decode("llama", "sdpa", "pre_rope", dict(sink_tokens=2, window=3, bits=40), monkeypatch, layer=True,
                 extra=(patchkv.NearCodes(6, factor=2),))


# ----- with a salience method: exact copies of coded tokens, near or in the middle -------------------------------
@pytest.mark.parametrize("scorer", [patchkv.CodeError, patchkv.AttentionMass])
def test_decode_steps_read_kept_near_and_middle_tokens_exact(family, mode, scorer, monkeypatch):
    """A decode step (kept tokens merged with the exact ones, their codes masked out of both coded passes) gives the
    logits of the model's attention function over the dense operands with the kept tokens written in."""
    check_decode(family, "sdpa", mode, dict(sink_tokens=2, window=3, bits=40), monkeypatch,
                 extra=(patchkv.NearCodes(6, factor=2), scorer(0.3)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_decode_steps_read_kept_tokens_when_every_coded_token_is_near(mode, attn, monkeypatch):
    """An empty middle: the kept tokens' copies stand in for near codes only, and the middle's pass is skipped."""
    check_decode("llama", attn, mode, dict(sink_tokens=2, window=3, bits=40), monkeypatch,
                 extra=(patchkv.NearCodes(40, factor=2), patchkv.CodeError(0.3)))


def test_kept_tokens_are_chosen_over_near_and_middle_and_keep_their_index_as_they_move():
    """Post-RoPE, layer 0 (whose keys do not depend on the cache): after a prefill and every decode step each KV head
    keeps exact the `capacity` best by key norm of the tokens it kept and the newcomer (all coded tokens at the
    prefill), wherever they are held, read exact by the cache's view; tokens moving from the near region into the
    middle keep their index."""
    model, art = lossy(mode="post_rope")
    ids = calibration_ids(1, 48, seed=4)
    plain = model(ids, use_cache=True).past_key_values.layers[0]
    method = patchkv.KeyNorm(0.25, scope="head")
    where = set()
    with patchkv.patched(model, art, [*REGIONS, patchkv.NearCodes(8, factor=2), method]):
        cache = model(ids[:, :36], use_cache=True).cache
        expected = None
        for t in range(36, 48):
            layer = cache.layers[0]
            coded = slice(2, 2 + layer.coded_len)
            exact = plain.keys[:, :, coded]
            score = -exact.norm(dim=-1)
            candidates = torch.arange(layer.coded_len).expand_as(score) if expected is None else \
                torch.cat([expected, torch.full_like(expected[..., :1], layer.coded_len - 1)], dim=-1)
            ranked = score.gather(2, candidates).sort(dim=-1, descending=True, stable=True).indices  # ties: the earlier
            best = ranked[..., :method.capacity(layer.coded_len)]
            expected = candidates.gather(2, best).sort(-1).values
            index = layer.tensors["salient_index"].squeeze(-1).long()
            assert torch.equal(index, expected)
            where |= {"near" if i >= layer.middle_len else "middle" for i in index.flatten().tolist()}
            got = layer.keys[:, :, coded]
            kept = torch.zeros(got.shape[:3], dtype=torch.bool).scatter_(2, index, True)
            assert torch.allclose(got[kept], exact[kept], atol=1e-6) and (got[~kept] - exact[~kept]).abs().max() > 1e-3
            cache = model(ids[:, t:t + 1], cache=cache, use_cache=True).cache
    assert where == {"near", "middle"}


def test_kept_tokens_survive_save_load_and_crop_into_the_near_region(tmp_path):
    model, art = lossy()
    ids = calibration_ids(2, 40, seed=7)
    methods = [*REGIONS, patchkv.NearCodes(8, factor=2), patchkv.CodeError(0.25)]
    with patchkv.patched(model, art, methods):
        cache = model(ids[:, :-4], use_cache=True).cache
        loaded = patchkv.load_cache(model, patchkv.save_cache(cache, tmp_path / "c.safetensors").path)
        for a, b in zip(cache.layers, loaded.layers):
            assert a.salient_len > 0 and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
        assert torch.equal(model(ids[:, -4:], cache=cache, use_cache=True).logits,
                           model(ids[:, -4:], cache=loaded, use_cache=True).logits)
        before = [layer.salient_len for layer in loaded.layers]
        loaded.crop(-10)  # the window and 7 of the near tokens go, and the copies of those
        for layer, held in zip(loaded.layers, before):
            assert layer.near_len == 1 and 0 < layer.salient_len < held
            assert bool((layer.tensors["salient_index"] < layer.coded_len).all())
        beams = model.generate(ids[:1], max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
        assert beams.shape == (1, 46)


def test_budgets_pay_for_near_codes_and_kept_tokens_together():
    model, art = lossy(dtype=torch.bfloat16)
    art = art.to_dtype(torch.bfloat16)
    context, near, kept = 400, patchkv.NearCodes(64, factor=2), patchkv.CodeError(1 / 16)
    assert parse_budget("4x+near:tokens=64+code_error:fraction=0.0625") == parse_budget(
        "4x+code_error:fraction=0.0625+near:tokens=64") == Budget(ratio=4, near=near, salience=kept)
    assert parse_budget("119+near+novelty") == Budget(bits=119, near=patchkv.NearCodes(), salience=patchkv.Novelty())
    with pytest.raises(ValueError, match="two salience"):
        parse_budget("16x+novelty+key_norm")
    alone = Budget(ratio=4, pool="head", near=near).methods(art, context)
    methods = Budget(ratio=4, pool="head", near=near, salience=kept).methods(art, context)
    assert methods[-2:] == [near, kept] and methods[1].bits < alone[1].bits
    with patchkv.patched(model, art, methods):
        cache = model(calibration_ids(1, context, seed=6), use_cache=True).cache
    copies = sum(t.nbytes for layer in cache.layers for name, t in layer.tensors.items() if name.startswith("salient"))
    assert copies == salient_bytes(art, kept, context - 4 - 32) > 0
    assert 0.9 * sixteen_bit_bytes(art) / 4 < cache.nbytes() / context <= sixteen_bit_bytes(art) / 4


def test_layer_bases_pay_for_near_codes_and_kept_tokens_within_the_budget():
    model = make_model(dtype=torch.bfloat16)
    art = patchkv.calibrate(model, calibration_ids(), rank=model.model.layers[0].self_attn.head_dim // 2,
                            progress=False, layer_bases=True).to_dtype(torch.bfloat16)
    context = 400
    methods = Budget(ratio=4, pool="head", basis="layer", near=patchkv.NearCodes(64), salience=patchkv.Novelty(1 / 16)
                     ).methods(art, context)
    assert methods[1].basis == "layer"
    with patchkv.patched(model, art, methods):
        cache = model(calibration_ids(1, context, seed=6), use_cache=True).cache
    assert all(layer.near_len == 64 and layer.salient_len > 0 for layer in cache.layers)
    assert 0.9 * sixteen_bit_bytes(art) / 4 < cache.nbytes() / context <= sixteen_bit_bytes(art) / 4
