"""The prefix store's budget and keys (`patchkv.prefix_store`), engine-independent."""

import random

import pytest

from patchkv.prefix_store import PrefixStore, block_keys


def test_keys_chain_from_the_root_and_cover_full_blocks_only():
    keys = block_keys(b"codec", list(range(40)), 16)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    assert block_keys(b"codec", list(range(32)), 16) == keys              # the partial tail names nothing
    assert block_keys(b"other", list(range(40)), 16)[0] != keys[0]        # another codec: other keys
    changed = block_keys(b"codec", [99] + list(range(1, 40)), 16)
    assert changed[0] != keys[0] and changed[1] != keys[1]                # a block's key names every token before it


def test_never_over_budget_and_least_recently_used_goes_first():
    store = PrefixStore(capacity=100)
    rng = random.Random(0)
    for i in range(500):
        size = rng.randint(1, 40)
        store.put(bytes([i % 256, i // 256]), b"x" * size, size)
        if rng.random() < 0.3 and len(store):
            store.get(rng.choice(store.keys()))
        assert store.held_bytes <= 100
        assert store.held_bytes == sum(len(store.get(k)) for k in store.keys())
    store = PrefixStore(capacity=30)
    for key in (b"a", b"b", b"c"):
        assert store.put(key, None, 10) == []
    store.touch([b"a"])
    assert store.put(b"d", None, 10) == [b"b"]
    assert store.keys() == [b"c", b"a", b"d"]


def test_too_large_is_refused_and_leading_counts_without_gaps():
    store = PrefixStore(capacity=30)
    assert store.put(b"big", None, 31) is None and len(store) == 0
    store.put(b"a", None, 10)
    store.put(b"c", None, 10)
    assert store.leading([b"a", b"b", b"c"]) == 1
    assert store.discard(b"a") and not store.discard(b"a")
    assert store.leading([b"a"]) == 0 and store.held_bytes == 10
    with pytest.raises(ValueError, match="bytes >= 0"):
        PrefixStore(-1)


def test_patchkv_imports_without_vllm_and_the_integration_says_where_it_runs():
    """In this environment vLLM is absent (it has its own, .venv-vllm): patchkv imports, the connector names it."""
    import importlib
    import importlib.util

    import patchkv  # noqa: F401
    import patchkv.integrations  # noqa: F401

    if getattr(importlib.util.find_spec("vllm"), "origin", None):
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match="setup_vllm.sh"):
        importlib.import_module("patchkv.integrations.vllm")
