"""`cache_nbytes` counts what transformers' quantized caches really hold: quanto's packed tensors and HQQ's codes
with their scales and zeros, against the sizes their formats imply."""

import pytest
import torch
from conftest import COMMON, make_model
from transformers import DynamicCache, QuantizedCache

from patchkv.memory import cache_nbytes


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
