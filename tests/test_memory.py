"""`cache_nbytes` counts what transformers' quantized caches really hold: quanto's packed tensors and HQQ's codes
with their scales and zeros, against the sizes their formats imply; a `LatentCache`'s `allocated_nbytes` is the real
storage of everything it holds, and the patch's RoPE tables are counted by `rope_nbytes`."""

import pytest
import torch
from conftest import COMMON, calibration_ids, make_model
from transformers import DynamicCache, QuantizedCache

import patchkv
from patchkv.cache import PAGE
from patchkv.patch import LayerPatch
from patchkv.nbytes import cache_nbytes, rope_nbytes


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def fill(model, cache, tokens: int):
    ids = torch.randint(3, COMMON["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


def test_dynamic_cache_bytes_are_its_keys_and_values(model):
    heads, dim = COMMON["num_key_value_heads"], COMMON["hidden_size"] // COMMON["num_attention_heads"]
    held = cache_nbytes(fill(model, DynamicCache(config=model.config), 40))
    assert held == 2 * COMMON["num_hidden_layers"] * heads * 40 * dim * 4  # float32


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_quantized_caches_count_codes_and_scales(model, backend):
    """A 192-token prefill is quantized whole at 4 bits (codes: 1/8 of float32); 10 more tokens wait in the
    float32 residual. Scales and zeros (a pair per group of 16 values) add up to twice the codes again."""
    pytest.importorskip("optimum.quanto" if backend == "quanto" else "hqq")
    heads, dim, layers = COMMON["num_key_value_heads"], 16, COMMON["num_hidden_layers"]
    cache = fill(model, QuantizedCache(backend=backend, config=model.config, nbits=4, q_group_size=16,
                                       residual_length=64), 192)
    cache = fill(model, cache, 10)
    codes = 2 * layers * heads * 192 * dim // 2
    residual = 2 * layers * heads * 10 * dim * 4
    assert codes + residual < cache_nbytes(cache) <= 3 * codes + residual


def real_storage(obj) -> int:
    """Bytes of every tensor storage reachable from `obj` through its attributes, dicts, lists and tuples (each
    storage whole, once by its data pointer), not counting what the patch holds (`LayerPatch`: codecs, RoPE table)
    nor the model's modules."""
    seen, storages = set(), {}

    def walk(x):
        if id(x) in seen or isinstance(x, (LayerPatch, torch.nn.Module)):
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for item in x.values():
                walk(item)
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
        elif hasattr(x, "__dict__"):
            walk(vars(x))

    walk(obj)
    return sum(storages.values())


@pytest.fixture(scope="module")
def gemma3():
    model = make_model("gemma3")  # a sliding layer (window 10), then a full one
    return model, patchkv.calibrate(model, calibration_ids(), rank=8, progress=False)


@pytest.mark.parametrize("methods", [[patchkv.Quantized(24)], [patchkv.LowRank(rank=4)],
                                     [patchkv.Quantized(24), patchkv.TopK(k=4)],
                                     [patchkv.Quantized(24), patchkv.Novelty(0.25)]],
                         ids=["quantized", "lowrank", "topk", "salience"])
def test_allocated_bytes_are_the_real_storage_of_everything_a_cache_holds(gemma3, methods):
    """After prefill, decode steps, reorder and crop, in full and sliding layers: `allocated_nbytes` equals the storage
    of every tensor the cache reaches, and beyond its tokens (`nbytes`) it keeps only the middles' unused pages (no
    old buffer of a sliding layer, no forward's keys behind an empty region); the RoPE tables are in `rope_nbytes`."""
    model, art = gemma3
    ids = calibration_ids(2, 40, seed=9)

    def check(cache, paged: bool = True):
        assert real_storage(cache) == cache.allocated_nbytes()
        if paged:  # under a page of each middle past its tokens, nothing else
            middles = [layer.tensors[f"latent_{kind}"] for layer in cache.layers for kind in ("keys", "values")]
            spare = sum(m.shape[0] * PAGE * m.shape[3] * m.element_size() for m in middles)
            assert cache.nbytes() <= cache.allocated_nbytes() < cache.nbytes() + spare

    with patchkv.patched(model, art, [patchkv.SinksWindow(2, 3), *methods]), torch.no_grad():
        cache = model(ids[:, :30], use_cache=True).cache
        assert {layer.is_sliding for layer in cache.layers} == {True, False}
        check(cache)
        for i in range(30, 36):
            cache = model(ids[:, i:i + 1], cache=cache, use_cache=True).cache
            check(cache)
        cache.reorder_cache(torch.tensor([1, 0]))
        check(cache)
        cache = model(ids[:, 36:37], cache=cache, use_cache=True).cache
        check(cache)

        recording = patchkv.LatentCache(model)
        recording.activate_past_recording()  # a sliding layer keeps what crop may need
        recording = model(ids[:, :30], cache=recording, use_cache=True).cache
        for i in range(30, 34):
            recording = model(ids[:, i:i + 1], cache=recording, use_cache=True).cache
        recording.crop(-6)  # the window and some of the middle
        check(recording, paged=False)  # the middle's cropped tokens stay in its buffer, counted
        recording = model(ids[:, 28:29], cache=recording, use_cache=True).cache
        check(recording)
        tables = {id(lp.rope): lp.rope for lp in model.patchkv.layers}.values()
        assert rope_nbytes(model) == sum(real_storage(vars(t)) for t in tables) >= 2 * 4 * 37 * art.head_dim // 2
        assert f"RoPE tables, shared by its caches, {rope_nbytes(model)})" in cache.describe()
