"""A one-shot prefill of a patched model allocates no more than the unpatched one, and its cache keeps no storage
beyond what it counts. Nothing is timed: the peak is of the tensors alive at once, from torch's memory profiler
(every CPU allocation and free, in order: the same in every run), not the process's resident memory, which the C
allocator's reuse makes vary between identical runs (`python -m evals memory` measures that, in processes of their
own, on the real model; docs/results.md)."""

import pytest
import torch
from conftest import COMMON, calibration_ids, make_model
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import patchkv
from patchkv import heap

TOKENS = 512


@pytest.fixture(scope="module")
def setup():
    """(model with 4 layers, pre-RoPE artifact, prompt ids `[1, TOKENS]`)."""
    model = make_model("llama", num_hidden_layers=4)
    art = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=16, progress=False)
    ids = torch.randint(3, COMMON["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(0))
    return model, art, ids


def peak_tensor_bytes(model, ids: torch.Tensor, cache) -> int:
    """The most bytes of CPU tensors alive at once during one forward of `ids` into `cache` (`logits_to_keep=1`,
    as generate prefills), the cache's own tensors included. Reads the profiler's memory timeline
    (`profile._memory_profile`, torch's private API behind `export_memory_timeline`)."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                  with_stack=True) as prof:
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    live, peak, sizes = 0, 0, {}
    for _, action, key, size in prof._memory_profile().timeline:
        if action.name == "CREATE":
            live, sizes[key] = live + size, size
        elif action.name == "DESTROY":
            live -= sizes.pop(key, 0)  # blocks made before profiling started were never counted
        peak = max(peak, live)
    return peak


def test_a_patched_prefill_peaks_no_higher_than_the_unpatched_one(setup):
    """A cache that kept the prompt's keys and values alive (as zero-token views of them once did) peaks above the
    unpatched model, which holds just those; compressed, it peaks lower."""
    model, art, ids = setup
    unpatched = peak_tensor_bytes(model, ids, DynamicCache())
    with patchkv.patched(model, art, [patchkv.SinksWindow(4, 16), patchkv.Quantized(bits=16)]):
        patched = peak_tensor_bytes(model, ids, patchkv.LatentCache(model))
    assert patched <= unpatched


@pytest.mark.parametrize("methods", [[patchkv.SinksWindow(4, 16), patchkv.Quantized(bits=16)],
                                     [patchkv.SinksWindow(4, 16), patchkv.Novelty(1 / 16)]])
def test_after_a_prefill_the_cache_keeps_only_the_storage_it_counts(setup, methods):
    """Every region, empty ones included, owns storage of its own (or a prefix of the middle's buffer): no tensor of
    the forward is kept alive through a view."""
    model, art, ids = setup
    with patchkv.patched(model, art, methods):
        cache = patchkv.LatentCache(model)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        for layer in cache.layers:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in layer.tensors.values()}
            assert sum(storages.values()) == layer.allocated_nbytes()


def test_a_long_forward_hands_freed_heap_pages_back_around_every_layer_and_a_short_one_never(setup, monkeypatch):
    """`heap.release` runs before and after each patched layer of a forward of at least `heap.TOKENS` tokens
    (the glibc heap's holes are what made a prefill's process peak above the unpatched one), and never in a decode
    step, where it would cost time for nothing."""
    model, art, ids = setup
    calls = []
    monkeypatch.setattr(heap, "_TRIM", lambda pad: calls.append(pad))
    monkeypatch.setattr(heap, "TOKENS", ids.shape[1])
    with patchkv.patched(model, art, [patchkv.SinksWindow(4, 16), patchkv.Quantized(bits=16)]), torch.no_grad():
        cache = patchkv.LatentCache(model)
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        assert calls == [0] * 2 * model.config.num_hidden_layers
        model(out.logits.argmax(-1), cache=cache, use_cache=True)
        model(ids[:, : ids.shape[1] - 1], cache=patchkv.LatentCache(model), use_cache=True)
    assert len(calls) == 2 * model.config.num_hidden_layers
