"""apply / remove promises: atomic install, exact restore, pickling, typed options, dispatched models."""

import copy
import io
import types

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks, make_model

import patchkv
from patchkv import attention


@pytest.fixture
def model_and_artifact():
    model = make_model("llama")
    return model, patchkv.calibrate(model, calibration_ids(), rank=16, progress=False)


def test_a_patched_model_pickles_and_loads_patched(model_and_artifact):
    model, art = model_and_artifact
    x = calibration_ids(2, 12, seed=3)
    reference = model(x).logits
    patchkv.apply(model, art.with_ranks(rank=6), sink_tokens=1, window=2)
    expected = fed_in_chunks(model, x, 3)  # a forward's own tokens are exact: later chunks read the latents
    assert not torch.allclose(expected, reference, atol=1e-3)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert patchkv.is_patched(loaded) and torch.allclose(fed_in_chunks(loaded, x, 3), expected, atol=1e-6)
    assert isinstance(loaded.generate(x, max_new_tokens=2, pad_token_id=0, return_dict_in_generate=True)
                      .past_key_values, patchkv.LatentCache)
    patchkv.remove(loaded)
    assert not patchkv.is_patched(loaded) and torch.allclose(loaded(x).logits, reference, atol=1e-6)
    assert set(loaded.state_dict()) == set(model.state_dict())  # save_pretrained stays clean


def test_remove_restores_another_librarys_forward_wrapper(model_and_artifact):
    model, art = model_and_artifact
    attn = model.model.layers[0].self_attn
    calls = []
    original = attn.forward

    def wrapper(self, *args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    attn.forward = types.MethodType(wrapper, attn)
    installed = vars(attn)["forward"]
    hooks = dict(model.model._forward_pre_hooks)
    patchkv.apply(model, art)
    patchkv.remove(model)
    assert vars(attn)["forward"] is installed and "patchkv" not in vars(model)
    assert dict(model.model._forward_pre_hooks) == hooks and "_prepare_cache_for_generation" not in vars(model)
    model(calibration_ids(1, 5))
    assert calls == [1]


def test_an_interrupted_install_leaves_the_model_as_it_was(model_and_artifact, monkeypatch):
    model, art = model_and_artifact
    created = []

    class Interrupting(attention.LatentForward):
        def __init__(self, module):
            if created:
                raise KeyboardInterrupt
            created.append(module)
            super().__init__(module)

    monkeypatch.setattr("patchkv.patching.LatentForward", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        patchkv.apply(model, art)
    assert created and not patchkv.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())
    assert not model.model._forward_pre_hooks and "_prepare_cache_for_generation" not in vars(model)
    monkeypatch.undo()
    patchkv.apply(model, art)  # and it can be patched afterwards
    patchkv.remove(model)


def test_runtime_options_come_from_typed_arguments_only(model_and_artifact):
    model, art = model_and_artifact
    art.calibration["sink_tokens"] = 10 ** 6  # a free-form summary: never read by apply
    low = art.with_ranks(rank=3)
    x = calibration_ids(2, 10, seed=4)
    reference = model(x).logits
    with patchkv.patched(model, low):
        assert (fed_in_chunks(model, x, 2) - reference).abs().max() > 1e-3
    for bad in (dict(bits=0), dict(bits=-8), dict(sink_tokens="4"), dict(sink_tokens=1.5), dict(window=-1),
                dict(top_k=0), dict(top_k_rank=4), dict(bits=True)):
        with pytest.raises((ValueError, TypeError)):
            patchkv.apply(model, art, **bad)
        assert not patchkv.is_patched(model)
    import numpy as np
    with patchkv.patched(model, art, sink_tokens=np.int64(2), window=np.int32(3)):
        pass


def test_methods_compose_through_the_registry(model_and_artifact):
    model, art = model_and_artifact
    methods = [patchkv.parse_method(s) for s in ("sinks:sink_tokens=2,window=4", "quantized:bits=32", "topk:k=8,rank=4")]
    assert [m.name for m in methods] == ["sinks", "quantized", "topk"] and methods[2] == patchkv.TopK(8, 4)
    with patchkv.patched(model, art, methods) as m:
        assert m.patchkv.plan.describe() == "sinks:sink_tokens=2,window=4 + quantized:bits=32 + topk:k=8,rank=4"
    with pytest.raises(ValueError, match="Two codec methods"):
        patchkv.apply(model, art, [patchkv.Quantized(32), patchkv.LowRank(rank=4)])
    for bad in ("nope", "topk:k=x", "topk:q=3", "topk:k"):
        with pytest.raises(ValueError):
            patchkv.parse_method(bad)


def test_flash_attention_is_refused_clearly(model_and_artifact):
    model, art = model_and_artifact
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(patchkv.PatchKVError, match="sdpa"):
        patchkv.apply(model, art)
    assert not patchkv.is_patched(model)


def test_disk_offloaded_model_calibrates_patches_and_generates(tmp_path):
    """accelerate dispatch with layers offloaded to disk: parameters sit on meta between forwards; bases
    follow each layer's execution device."""
    from accelerate import dispatch_model

    model = make_model("llama")
    art = patchkv.calibrate(model, calibration_ids(), rank=16, progress=False)
    x = calibration_ids(2, 10, seed=6)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    reference = model.generate(x, **kwargs)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    assert offloaded.model.layers[0].self_attn.k_proj.weight.device.type == "meta"
    with patchkv.patched(offloaded, art):
        out = offloaded.generate(x, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.scores, reference.scores)) < 1e-5


def test_remove_refuses_through_a_hook_added_after_apply(model_and_artifact):
    """accelerate wraps an attention module's forward after apply: remove refuses before changing anything (the
    wrapper calls patchkv's forward, which needs its state); once the hook is removed, remove works."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    model, art = model_and_artifact
    x = calibration_ids(2, 8, seed=7)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    reference = model.generate(x, **kwargs)
    attn = model.model.layers[1].self_attn
    patchkv.apply(model, art.with_ranks(rank=4))
    patched_out = model.generate(x, **kwargs)
    add_hook_to_module(attn, ModelHook())
    wrapper = vars(attn)["forward"]
    with pytest.raises(patchkv.PatchKVError) as info:
        patchkv.remove(model)
    message = str(info.value)
    assert "model.layers.1.self_attn.forward" in message and "remove_hook_from_module" in message
    assert "Nothing was changed" in message
    assert patchkv.is_patched(model) and vars(attn)["forward"] is wrapper and "patchkv" in vars(attn)
    assert torch.equal(model.generate(x, **kwargs), patched_out)  # still patched, and still works
    remove_hook_from_module(attn)
    patchkv.remove(model)
    assert not patchkv.is_patched(model) and "forward" not in vars(attn)
    assert torch.equal(model.generate(x, **kwargs), reference)


def test_remove_refuses_a_replaced_cache_preparer(model_and_artifact):
    model, art = model_and_artifact
    patchkv.apply(model, art)
    ours = model._prepare_cache_for_generation

    def wrapped(*args, **kwargs):
        return ours(*args, **kwargs)

    model._prepare_cache_for_generation = wrapped
    with pytest.raises(patchkv.PatchKVError, match="model._prepare_cache_for_generation"):
        patchkv.remove(model)
    assert patchkv.is_patched(model) and model._prepare_cache_for_generation is wrapped
    model._prepare_cache_for_generation = ours
    patchkv.remove(model)
    assert not patchkv.is_patched(model) and "_prepare_cache_for_generation" not in vars(model)


@pytest.mark.parametrize("method", [patchkv.LowRank(), patchkv.Quantized(24)])
def test_the_patch_follows_the_model_into_another_dtype(model_and_artifact, method):
    """`model.to(dtype)` after `apply` gives what applying after the change gives (bytes and tokens), a cache written
    before the change is refused in one clear error, and float64 runs too."""
    model, art = model_and_artifact
    methods = [patchkv.SinksWindow(2, 4), method]
    ids = calibration_ids(1, 24, seed=3)
    first = copy.deepcopy(model).to(torch.bfloat16)
    with patchkv.patched(first, art, methods):
        want = first.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    moved = copy.deepcopy(model)
    with patchkv.patched(moved, art, methods):
        stale = moved(ids, use_cache=True).cache  # written in float32
        moved.to(torch.bfloat16)
        got = moved.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(got.sequences, want.sequences)
        assert got.past_key_values.nbytes() == want.past_key_values.nbytes()
        with pytest.raises(patchkv.PatchKVError, match="start a new cache"):
            moved(ids[:, :4], cache=stale, use_cache=True)
        moved.to(torch.float64)
        assert moved(ids, use_cache=True).logits.dtype == torch.float64
    full = make_model("llama").to(torch.float64)
    with patchkv.patched(full, art, [patchkv.SinksWindow(2, 4), patchkv.LowRank(rank=art.head_dim)]):
        patched = fed_in_chunks(full, ids, 5)
    assert torch.allclose(patched, fed_in_chunks(make_model("llama").to(torch.float64), ids, 5), atol=1e-5)


def test_the_rope_table_follows_the_model_into_another_dtype(model_and_artifact):
    """A pre-RoPE patch whose table was built by a float32 forward covering every position, then moved to bfloat16
    (which rounds the rotary module's inverse frequencies), gives the logits of one applied after the move."""
    model, art = model_and_artifact
    assert art.mode == "pre_rope"
    methods = [patchkv.SinksWindow(2, 4), patchkv.LowRank()]
    ids = calibration_ids(1, 200, seed=3)
    first = copy.deepcopy(model).to(torch.bfloat16)
    with patchkv.patched(first, art, methods):
        want = fed_in_chunks(first, ids, 50)
    moved = copy.deepcopy(model)
    with patchkv.patched(moved, art, methods):
        moved(ids, use_cache=True)  # the table now covers all 200 positions, in float32's frequencies
        moved.to(torch.bfloat16)
        assert torch.equal(fed_in_chunks(moved, ids, 50), want)


def test_torch_compile_leaves_patched_attention_uncompiled_and_exact(model_and_artifact, monkeypatch):
    """`torch.compile(model)` after `apply` compiles the rest of the model and never traces patched attention
    (`torch.compiler.disable`: its data-dependent shapes, Python-side cache and C++ kernels are no graph): a prefill
    and decode steps through the cache give the uncompiled logits exactly (the eager backend: the same kernels)."""
    model, art = model_and_artifact
    traced = []
    forward = attention.latent_attention_forward
    monkeypatch.setattr(attention, "latent_attention_forward",
                        lambda *a, **k: traced.append(torch.compiler.is_compiling()) or forward(*a, **k))
    ids = calibration_ids(1, 20, seed=3)

    def prefill_and_decode(m):
        out = m(ids[:, :16], use_cache=True)
        logits = [out.logits]
        for t in range(16, 20):
            out = m(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            logits.append(out.logits)
        return torch.cat(logits, dim=1)

    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24)]):
        want = prefill_and_decode(model)
        try:
            got = prefill_and_decode(torch.compile(model, backend="eager"))
        finally:
            torch.compiler.reset()
    assert torch.equal(got, want)
    assert traced and not any(traced)
