"""Budgets for models with sliding-window layers: the artifact records each layer's window (format version 6), a
ratio is quoted against what the unpatched cache really holds, and the global pool can price a layer's bits by the
tokens it holds (`Quantized(..., context=)`, `patchkv.allocation.layer_prices`)."""

from dataclasses import replace

import pytest
import torch
from conftest import calibration_ids, make_model
from test_reliability_artifact import read, write

import patchkv
from patchkv.allocation import (allocate_bits_global, allocate_to_bytes, bit_allocation, code_bytes, held_tokens,
                                layer_prices)
from patchkv.adapters import adapter_for, attention_modules
from patchkv.artifact import Artifact
from patchkv.budgets import EXACT, exact_tokens, parse_budget, sixteen_bit_bytes
from patchkv.errors import ArtifactError, IncompatibleArtifactError
from patchkv.nbytes import cache_nbytes

WINDOWS = {"gemma3": 10, "mistral": 12}


@pytest.fixture(scope="module", params=sorted(WINDOWS))
def sliding(request):
    model = make_model(request.param)
    artifact = patchkv.calibrate(model, calibration_ids(8, 48), mode="pre_rope", rank=16, sink_tokens=2,
                                 fisher_tokens=128, fisher_window=4, progress=False)
    return request.param, model, artifact


def test_the_artifact_records_each_layers_window(sliding, tmp_path):
    name, model, artifact = sliding
    adapter = adapter_for(model)
    windows = [adapter.sliding_window(m) for m in attention_modules(model, adapter)]
    assert artifact.sliding_windows == windows and WINDOWS[name] in windows
    assert artifact.format_version == 6
    back = Artifact.load(artifact.save(tmp_path / "a.safetensors"))
    assert back.sliding_windows == windows and back.format_version == 6
    plain = patchkv.calibrate(make_model("llama"), calibration_ids(4, 24), rank=8, progress=False)
    assert plain.format_version == 1 and "sliding_windows" not in plain.model
    assert plain.sliding_windows == [None] * plain.num_layers


@pytest.mark.parametrize("edit, fragment", [
    (lambda meta: meta.update(format_version=5), "always in format version 6"),
    (lambda meta: meta["model"].pop("sliding_windows"), "always in format version 6"),
    (lambda meta: meta["model"].update(sliding_windows=[None, None]), "at least one an integer"),
    (lambda meta: meta["model"].update(sliding_windows=[10]), "each of the 2"),
    (lambda meta: meta["model"].update(sliding_windows=[0, None]), "positive integer"),
    (lambda meta: meta["model"].update(sliding_windows=[True, None]), "positive integer"),
])
def test_bad_windows_are_refused(sliding, tmp_path, edit, fragment):
    from patchkv.artifact_format import checksum

    tensors, meta = read(sliding[2].save(tmp_path / "a.safetensors"))
    edit(meta)
    meta.pop("checksum")
    meta["checksum"] = checksum(tensors, meta)  # a well-formed file whose content is wrong
    with pytest.raises(ArtifactError, match=fragment):
        Artifact.load(write(tmp_path / "b.safetensors", tensors, meta))


def test_an_artifact_without_the_windows_is_refused_with_the_fix(sliding):
    _, model, artifact = sliding
    old = artifact.with_sliding_windows([None] * artifact.num_layers)
    assert old.format_version != 6
    with pytest.raises(IncompatibleArtifactError, match=r"with_sliding_windows\(\["):
        patchkv.apply(model, old, [patchkv.Quantized(32)])
    assert not patchkv.is_patched(model)
    with patchkv.patched(model, old.with_sliding_windows(artifact.sliding_windows), [patchkv.Quantized(32)]):
        pass


def test_prices_follow_the_tokens_each_layer_holds(sliding):
    _, _, artifact = sliding
    window = max(w for w in artifact.sliding_windows if w is not None)
    assert layer_prices(artifact, window - 1) is None  # every layer still holds every token
    held = held_tokens(artifact, 100)
    assert held == [100 if w is None else w - 1 for w in artifact.sliding_windows]
    prices = layer_prices(artifact, 100)
    if None not in artifact.sliding_windows:
        assert prices is None  # every layer slides: they hold the same tokens
        return
    assert sum(prices) == pytest.approx(len(prices))
    assert all((p < 1) == (w is not None) for p, w in zip(prices, artifact.sliding_windows))


def test_priced_allocation_equals_the_plain_one_at_equal_prices_and_keeps_its_budget():
    torch.manual_seed(0)
    eigen = torch.rand(40).double() ** 4
    for budget in (0, 7, 33, 90):
        assert torch.equal(allocate_bits_global(eigen, budget), allocate_bits_global(eigen, budget,
                                                                                     prices=torch.ones(40)))
        prices = torch.where(torch.arange(40) < 20, 0.25, 1.75)
        bits = allocate_bits_global(eigen, budget, prices=prices)
        assert float((bits * prices).sum()) <= budget + 1e-9
        assert bits[:20].sum() >= allocate_bits_global(eigen, budget)[:20].sum()  # the cheap ones gain
    groups = [eigen[:20], eigen[20:]]
    for byte_budget in (3, 10):
        bits = allocate_to_bytes(groups, byte_budget, prices=[0.25, 1.75])
        assert sum(p * -(-int(b.sum()) // 8) for p, b in zip((0.25, 1.75), bits)) <= byte_budget


def test_sliding_layers_get_more_bits_when_priced(sliding):
    _, _, artifact = sliding
    slide = torch.tensor([w is not None for w in artifact.sliding_windows])
    if slide.all():
        pytest.skip("every layer slides: they hold the same tokens, and are priced alike")
    plain = bit_allocation(artifact, 24, "global")
    priced = bit_allocation(artifact, 24, "global", context=120)
    for a, b in zip(plain, priced):
        assert b[slide].sum() > a[slide].sum()
    held = torch.tensor(held_tokens(artifact, 120)).view(-1, 1, 1)
    stored = sum(int((b * held).sum()) for b in priced)  # keys and values: 24 bits per head on average over what
    assert stored <= 24 * int(held.sum()) * artifact.num_kv_heads * 2  # the cache holds


@pytest.mark.parametrize("budget", ["4x", "8x"])
def test_a_ratio_holds_against_what_the_unpatched_cache_holds(sliding, budget):
    """Measured bytes per token after a prefill of `context` tokens: the unpatched cache's (sliding layers hold
    their last window - 1) equal `sixteen_bit_bytes(artifact, context)` (the model in bf16, as ratios are quoted);
    the patched cache holds at most that / ratio, and uses most of it."""
    _, model, artifact = sliding
    context = 1000
    ids = calibration_ids(1, context, seed=3)
    bf16 = make_model(sliding[0], dtype=torch.bfloat16)
    unpatched = bf16(ids, use_cache=True).past_key_values
    reference = sixteen_bit_bytes(artifact, context)
    assert cache_nbytes(unpatched) / context == pytest.approx(reference)
    assert reference < sixteen_bit_bytes(artifact)
    ratio = float(budget[:-1])
    if None not in artifact.sliding_windows:  # every layer holds only its last window - 1 tokens, all kept exact
        with pytest.raises(ValueError, match="cannot be met"):
            parse_budget(budget).methods(artifact, context=context)
        return
    methods = parse_budget(budget).methods(artifact, context=context)
    assert methods[1].context is None and methods[1].pool == "global"  # every layer priced alike
    with patchkv.patched(bf16, artifact, methods):  # exact tokens in bf16, as the budget counts them
        cache = bf16(ids, use_cache=True).past_key_values
    assert cache_nbytes(cache) / context <= reference / ratio
    more = [methods[0], replace(methods[1], bits=methods[1].bits + 1)]  # one more bit per head does not fit
    with patchkv.patched(bf16, artifact, more):
        assert cache_nbytes(bf16(ids, use_cache=True).past_key_values) / context > reference / ratio
    for q in (methods[1], replace(methods[1], context=context)):  # alike and priced: bytes as the budget counts them
        with patchkv.patched(bf16, artifact, [methods[0], q]):
            cache = bf16(ids, use_cache=True).past_key_values
        held = held_tokens(artifact, context)
        exact = [exact_tokens(h, context, *EXACT) for h in held]
        codes = code_bytes(artifact, q.bits, q.pool, context=q.context)
        layer_token = 2 * artifact.num_kv_heads * artifact.head_dim * 2
        assert [layer.nbytes() for layer in cache.layers] == [
            (h - e) * c + e * layer_token for h, e, c in zip(held, exact, codes)]
