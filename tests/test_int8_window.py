"""`SinksWindow(bits=8)`: the window held as int8 with a float32 scale per token, head and kind between forwards
(`bits=4`: int4, two to a byte).

A forward reads its own tokens exact and the window before them within half a step of the exact keys and values; the
sinks stay exact; the window's bytes are what budgets count, so at equal bytes the codes keep more bits; both
attention paths read it alike; saved caches keep it (and files written before it load with an exact window);
generation modes that reorder, crop or batch the cache keep it consistent; sliding layers hold their last tokens.
"""

import pytest
import torch
from conftest import calibration_ids, make_model
from test_fast_decode import check_decode

import patchkv
from patchkv.allocation import held_tokens
from patchkv.budgets import Budget, exact_bytes, parse_budget, sixteen_bit_bytes
from patchkv.cli import budget_list

INT8 = [patchkv.SinksWindow(2, 6, bits=8), patchkv.Quantized(20)]
EXACT = [patchkv.SinksWindow(2, 6), patchkv.Quantized(20)]


def lossy(family="llama", mode="pre_rope", dtype=torch.float32):
    model = make_model(family, dtype=dtype)
    rank = model.model.layers[0].self_attn.head_dim // 2
    return model, patchkv.calibrate(model, calibration_ids(), mode=mode, rank=rank, progress=False)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_window_is_read_within_half_a_step_and_a_forward_reads_its_own_tokens_exact(bits):
    """Post-RoPE (cache space is what the unpatched model caches): after a prefill the window is int8 (int4) and reads
    back within half a step of the exact keys and values, the sinks exact; the prefill's own logits are those of an
    exact window, the next forward's differ."""
    model, art = lossy(mode="post_rope")
    ids = calibration_ids(1, 40, seed=4)
    plain = model(ids[:, :36], use_cache=True).past_key_values
    logits, views = {}, {}
    held, top = (torch.int8, 127) if bits == 8 else (torch.uint8, 7)
    for name, methods in (("int8", [patchkv.SinksWindow(2, 6, bits=bits), patchkv.Quantized(20)]), ("exact", EXACT)):
        with patchkv.patched(model, art, methods):
            out = model(ids[:, :36], use_cache=True)
            views[name] = [(layer.keys, layer.values, layer.tensors) for layer in out.cache.layers]
            logits[name] = out.logits, model(ids[:, 36:], cache=out.cache, use_cache=True).logits
    assert torch.equal(logits["int8"][0], logits["exact"][0])
    assert 1e-6 < (logits["int8"][1] - logits["exact"][1]).abs().max() < (1e-1 if bits == 8 else 1.0)
    for i, (keys, values, t) in enumerate(views["int8"]):
        assert t["recent_keys"].dtype == held and t["recent_scale"].shape == (1, 2, 6, 2)
        assert t["recent_keys"].shape[-1] == plain.layers[i].keys.shape[-1] * bits // 8
        for view, full in ((keys, plain.layers[i].keys), (values, plain.layers[i].values)):
            got, exact = view[:, :, -6:], full[:, :, 30:36]
            step = exact.abs().amax(-1, keepdim=True) / top
            assert bool(((got - exact).abs() <= step / 2 + 1e-6).all()) and (got - exact).abs().max() > 0
            assert torch.equal(view[:, :, :2], full[:, :, :2])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_decode_steps_read_the_int8_window_as_the_dense_path_does(mode, attn, bits, monkeypatch):
    check_decode("llama", attn, mode, dict(bits=40), monkeypatch, extra=(patchkv.SinksWindow(2, 3, bits=bits),))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_window_token_keeps_its_levels_and_scale_while_it_is_there(bits):
    """The window is read back in the model's dtype at every forward and held quantized again after it: a token's
    levels and scale do not drift on the way (its largest entry, a bf16 value, is the scale times 127 or 7 again, and
    every other level is read back within a quarter of a step), in bf16 too."""
    model, art = lossy(dtype=torch.bfloat16)
    art = art.to_dtype(torch.bfloat16)
    ids = calibration_ids(1, 40, seed=3)
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 6, bits=bits), patchkv.Quantized(20)]):
        cache = model(ids[:, :30], use_cache=True).cache
        first = [{n: layer.tensors[n].clone() for n in ("recent_keys", "recent_values", "recent_scale")}
                 for layer in cache.layers]
        for step in range(4):  # one token enters and one leaves at each
            model(ids[:, 30 + step:31 + step], cache=cache, use_cache=True)
    for layer, stored in zip(cache.layers, first):
        for name, x in stored.items():
            assert torch.equal(layer.tensors[name][:, :, :2], x[:, :, 4:])


def test_bytes_are_counted_and_budgets_pay_for_them():
    model, art = lossy(dtype=torch.bfloat16)
    art, context = art.to_dtype(torch.bfloat16), 400
    int8 = patchkv.SinksWindow(4, 32, bits=8)
    methods = Budget(ratio=4, pool="head", regions=int8).methods(art, context)
    plain = Budget(ratio=4, pool="head").methods(art, context)
    assert methods[0] == int8 and methods[1].bits > plain[1].bits  # half the window's bytes go to the codes
    with patchkv.patched(model, art, methods):
        cache = model(calibration_ids(1, context, seed=6), use_cache=True).cache
    exact = sum(t.nbytes for layer in cache.layers for name, t in layer.tensors.items()
                if name.startswith(("sink", "recent")))
    assert exact == exact_bytes(art, held_tokens(art, context), context, 4, 32, 8) \
        < exact_bytes(art, held_tokens(art, context), context, 4, 32)
    assert 0.9 * sixteen_bit_bytes(art) / 4 < cache.nbytes() / context <= sixteen_bit_bytes(art) / 4
    assert parse_budget("16x+sinks:window=64,bits=8+near").regions == patchkv.SinksWindow(4, 64, bits=8)
    assert str(parse_budget("16x+sinks:window=64,bits=8")) == "16x+sinks:sink_tokens=4,window=64,bits=8"
    assert patchkv.SinksWindow(4, 32).spec() == "sinks:sink_tokens=4,window=32"
    assert [str(b) for b in budget_list("8x, 16x+sinks:window=64,bits=8+near,119")] == [  # the CLI's --budgets
        "8x", "16x+sinks:sink_tokens=4,window=64,bits=8+near", "119 bits"]
    int4 = Budget(ratio=4, pool="head", regions=patchkv.SinksWindow(4, 32, bits=4)).methods(art, context)
    assert int4[1].bits > methods[1].bits  # half the int8 window's bytes again
    with patchkv.patched(model, art, int4):
        cache = model(calibration_ids(1, context, seed=6), use_cache=True).cache
    held = sum(t.nbytes for layer in cache.layers for name, t in layer.tensors.items()
               if name.startswith(("sink", "recent")))
    assert held == exact_bytes(art, held_tokens(art, context), context, 4, 32, 4) < exact
    assert cache.nbytes() / context <= sixteen_bit_bytes(art) / 4
    with pytest.raises(ValueError, match="bits"):
        patchkv.SinksWindow(4, 32, bits=2)


def test_int4_needs_an_even_head_dim():
    from patchkv.cache import _copies

    x = torch.randn(1, 2, 3, 7)
    with pytest.raises(patchkv.PatchKVError, match="head_dim must be even"):
        _copies(x, x, 4)


def test_a_saved_cache_keeps_its_int8_window_and_a_version_4_file_loads_exact(tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from patchkv.cache_file import FORMAT

    model, art = lossy()
    ids = calibration_ids(1, 40, seed=7)
    with patchkv.patched(model, art, INT8):
        cache = model(ids[:, :-4], use_cache=True).cache
        saved = patchkv.save_cache(cache, tmp_path / "c.safetensors")
        loaded = patchkv.load_cache(model, saved.path)
        for a, b in zip(cache.layers, loaded.layers):
            assert a.tensors["recent_keys"].dtype == torch.int8
            assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
        assert torch.equal(model(ids[:, -4:], cache=cache, use_cache=True).logits,
                           model(ids[:, -4:], cache=loaded, use_cache=True).logits)
    with patchkv.patched(model, art, EXACT):
        cache = model(ids[:, :-4], use_cache=True).cache
        saved = patchkv.save_cache(cache, tmp_path / "v6.safetensors")
        with safe_open(str(saved.path), framework="pt") as f:
            meta, tensors = json.loads(f.metadata()[FORMAT]), {k: f.get_tensor(k) for k in f.keys()}
        meta["format_version"] = 4  # written before window scales and the kept-token bitmap
        for layer in meta["layers"]:
            del layer["regions"]["recent_scale"], layer["regions"]["evict_kept"]
        save_file({k: v for k, v in tensors.items() if not k.endswith(("recent_scale", "evict_kept"))},
                  str(tmp_path / "v4.safetensors"), metadata={FORMAT: json.dumps(meta)})
        old = patchkv.load_cache(model, tmp_path / "v4.safetensors")
        assert torch.equal(model(ids[:, -4:], cache=cache, use_cache=True).logits,
                           model(ids[:, -4:], cache=old, use_cache=True).logits)
    with patchkv.patched(model, art, INT8), pytest.raises(patchkv.PatchKVError, match="another patch"):
        patchkv.load_cache(model, tmp_path / "v4.safetensors")


def test_crop_reorder_batch_selection_and_beams_keep_the_window_consistent():
    model, art = lossy()
    ids = calibration_ids(2, 40, seed=7)
    with patchkv.patched(model, art, INT8):
        cache = model(ids, use_cache=True).cache
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.crop(-4)  # from the int8 window, its scales with it
        layer = cache.layers[0]
        assert layer.window_len == 2 and layer.tensors["recent_scale"].shape[2] == 2
        more = model(ids[:, :5], cache=cache, use_cache=True).logits  # one of them leaves the window
        assert torch.isfinite(more).all() and (layer.middle_len, layer.window_len) == (33, 6) and layer.tensors["recent_keys"].dtype == torch.int8
        cache.crop(-10)  # the window and 4 middle tokens
        assert (layer.middle_len, layer.window_len, layer.tensors["recent_scale"].shape[2]) == (29, 0, 0)
        cache.batch_select_indices(torch.tensor([1]))
        assert all(t.shape[0] == 1 for layer in cache.layers for t in layer.tensors.values())
        beams = model.generate(ids[:1], max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
        sampled = model.generate(ids[:1], max_new_tokens=6, do_sample=True, pad_token_id=0)
        assert beams.shape == sampled.shape == (1, 46)


@pytest.mark.parametrize("bits", [8, 4])
def test_sliding_layers_hold_their_last_tokens_in_an_int8_window(bits):
    model, art = lossy("gemma3")
    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 6, bits=bits), patchkv.Quantized(20)]):
        sliding, full = model(calibration_ids(1, 40, seed=7), use_cache=True).cache.layers
    assert sliding.is_sliding and sliding.kept == sliding.sliding_window - 1 == 9
    assert (sliding.sink_len, sliding.middle_len, sliding.window_len) == (0, 3, 6)
    assert (full.sink_len, full.middle_len, full.window_len) == (2, 32, 6)
    held = torch.int8 if bits == 8 else torch.uint8
    assert sliding.tensors["recent_keys"].dtype == full.tensors["recent_keys"].dtype == held
