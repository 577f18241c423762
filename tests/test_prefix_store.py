"""The prefix store (`patchkv.prefix_store`), engine-independent: keys, the memory budget, the disk tier (spill,
reload, budgets, damaged files, reopening a folder) and its lossless stage."""

import random

import pytest

from patchkv.prefix_store import SPILL_HEADER_BYTES, PrefixStore, Spill, block_keys


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
        assert store.put(key, None, 10)
    store.touch([b"a"])
    assert store.put(b"d", None, 10) and store.take_evicted() == [b"b"]
    assert store.keys() == [b"c", b"a", b"d"]


def test_too_large_is_refused_and_leading_counts_without_gaps():
    store = PrefixStore(capacity=30)
    assert not store.put(b"big", None, 31) and len(store) == 0
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


# ----- the disk tier ---------------------------------------------------------------------------------------------
def k(name: bytes | int) -> bytes:
    """A 16-byte key, as `block_keys` makes."""
    return (name if isinstance(name, bytes) else name.to_bytes(2, "little")).ljust(16, b".")


def block(i: int, size: int) -> bytes:
    """A block's bytes that DEFLATE shrinks (a repeated pattern), distinct per `i`."""
    return (bytes([i % 251]) * 7 + i.to_bytes(4, "little")) * (size // 11) + bytes(size % 11)


def spilling(tmp_path, memory: int, disk: int, compress: str | None = None) -> PrefixStore:
    return PrefixStore(memory, Spill(tmp_path / "spill", disk, compress=compress))


def file_bytes(store: PrefixStore) -> int:
    return sum(p.stat().st_size for p in store.spill.folder.iterdir())


@pytest.mark.parametrize("compress", [None, "deflate"])
def test_spilled_blocks_come_back_bit_exact_within_both_budgets(tmp_path, compress):
    store = spilling(tmp_path, memory=1000, disk=3000, compress=compress)
    mirror = PrefixStore(1000, Spill(tmp_path / "spill", 3000), sizes_only=True)  # what an engine's scheduler runs
    rng = random.Random(1)
    values = {}
    for i in range(300):
        key = k(i)
        if rng.random() < 0.6 or not len(store):
            values[key] = block(i, rng.randint(50, 400))
            assert store.put(key, values[key], len(values[key])) == mirror.put(key, None, len(values[key]))
        else:
            key = rng.choice(store.keys())
            assert store.get(key) == values[key]                     # from memory or read back from disk
            mirror.touch([key])
        assert store.held_bytes <= 1000 and store.disk_bytes <= 3000
        assert store.held_bytes == sum(len(values[k]) for k in store.keys() if k not in store.disk_keys())
        assert store.disk_bytes == file_bytes(store)                 # every byte on disk counted, headers included
        if compress is None:                                         # the sizes-only mirror holds exactly the same
            assert store.keys() == mirror.keys() and store.disk_bytes == mirror.disk_bytes
        else:                                                        # compressed files: fewer bytes, never more
            assert set(mirror.keys()) <= set(store.keys())
        store.take_evicted(), mirror.take_evicted()
    assert store.disk_keys() and len(store) > len(store.disk_keys())


def test_least_recently_used_moves_down_the_tiers_and_a_hit_comes_back_up(tmp_path):
    store = spilling(tmp_path, memory=200, disk=2 * (100 + SPILL_HEADER_BYTES))
    for key in (k(b"a"), k(b"b"), k(b"c"), k(b"d")):
        assert store.put(key, block(key[0], 100), 100)
    assert store.disk_keys() == [k(b"a"), k(b"b")] and store.keys() == [k(b"a"), k(b"b"), k(b"c"), k(b"d")]
    assert store.get(k(b"a")) == block(ord("a"), 100)                   # read back: memory [d, a], c pushed down
    assert store.disk_keys() == [k(b"b"), k(b"c")] and store.keys() == [k(b"b"), k(b"c"), k(b"d"), k(b"a")]
    assert not (store.spill.folder / f"{k(b'a').hex()}.pkvs").exists()
    store.put(k(b"e"), block(5, 100), 100)                              # d pushed down, b (disk's oldest) evicted
    assert store.take_evicted() == [k(b"b")] and store.keys() == [k(b"c"), k(b"d"), k(b"a"), k(b"e")]
    assert store.discard(k(b"c")) and store.disk_keys() == [k(b"d")] and store.take_evicted() == []
    assert store.leading([k(b"d"), k(b"a"), k(b"x"), k(b"e")]) == 2
    assert store.peek(k(b"d")) == block(ord("d"), 100) and store.disk_keys() == [k(b"d")]   # read, left on disk


def test_a_hit_larger_than_memory_moves_its_leading_blocks_up_and_pushes_none_of_its_own_out(tmp_path):
    store = spilling(tmp_path, memory=300, disk=10_000)
    hit = [k(i) for i in range(8)]
    for key in reversed(hit):                                        # saved last block first, as the connector does
        store.put(key, block(key[0], 100), 100)
    store.put(k(b"other"), block(9, 100), 100)
    assert store.disk_keys() == hit[7:2:-1] + [hit[2]] and store.keys()[-3:] == [hit[1], hit[0], k(b"other")]
    reads = []
    read = store._read
    store._read = lambda key: reads.append(key) or read(key)
    store.touch(hit)                                                 # memory holds 3: the first 3 there, the rest stay
    assert store.keys()[-3:] == [hit[2], hit[1], hit[0]] and reads == [hit[2]]
    assert store.disk_keys()[-6:] == [k(b"other")] + hit[7:2:-1]     # refreshed on disk, the first of them last
    assert all(store.peek(key) == block(key[0], 100) for key in hit) and sorted(reads) == sorted(hit[2:])


def test_blocks_too_large_for_the_disk_are_evicted_and_blocks_too_large_for_memory_refused(tmp_path):
    store = spilling(tmp_path, memory=500, disk=300)
    assert not store.put(k(b"huge"), block(1, 501), 501) and len(store) == 0
    store.put(k(b"big"), block(2, 400), 400)
    store.put(k(b"next"), block(3, 200), 200)                           # big cannot fit on disk: evicted, no file
    assert store.take_evicted() == [k(b"big")] and store.disk_bytes == 0 and not list(store.spill.folder.iterdir())


def corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[-3] ^= 0x10
    elif how == "truncated":
        data = data[:-5]
    elif how == "foreign":
        data[:4] = b"PK\x03\x04"                                     # some other file under the block's name
    elif how == "renamed":                                          # another block's intact file under this name
        data = bytearray((path.parent / f"{k(b'k1').hex()}.pkvs").read_bytes())
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("compress", [None, "deflate"])
@pytest.mark.parametrize("how", ["flipped", "truncated", "foreign", "renamed", "empty"])
def test_a_damaged_or_foreign_spill_file_is_a_miss_never_a_wrong_block(tmp_path, how, compress):
    store = spilling(tmp_path, memory=100, disk=10_000, compress=compress)
    for key in (k(b"k0"), k(b"k1"), k(b"k2")):
        store.put(key, block(key[1], 100), 100)
    assert store.disk_keys() == [k(b"k0"), k(b"k1")]
    path = store.spill.folder / f"{k(b'k0').hex()}.pkvs"
    corrupt(path, how)
    assert store.get(k(b"k0")) is None and k(b"k0") not in store and not path.exists()
    assert store.take_evicted() == [k(b"k0")]
    assert store.get(k(b"k1")) == block(ord("1"), 100)                  # the others still come back
    assert store.disk_bytes == file_bytes(store)


def test_a_deflate_bomb_in_a_spill_file_stops_at_its_declared_size(tmp_path):
    import zlib

    from patchkv.prefix_store import _SPILL, SPILL_MAGIC, SPILL_VERSION, _digest

    store = spilling(tmp_path, memory=100, disk=10 << 20, compress="deflate")
    store.put(k(b"k0"), block(0, 100), 100)
    store.put(k(b"k1"), block(1, 100), 100)
    bomb = zlib.compress(bytes(50 << 20), 9)
    header = _SPILL.pack(SPILL_MAGIC, SPILL_VERSION, 1, k(b"k0"), 100, _digest(k(b"k0"), bytes(100)))
    (store.spill.folder / f"{k(b'k0').hex()}.pkvs").write_bytes(header + bomb)
    assert store.get(k(b"k0")) is None and store.take_evicted() == [k(b"k0")]


def test_a_reopened_folder_finds_its_spilled_blocks_within_the_new_budgets(tmp_path):
    import os

    store = spilling(tmp_path, memory=100, disk=10_000, compress="deflate")
    for i in range(6):
        store.put(k(i), block(i, 100), 100)
    folder = store.spill.folder
    for i, path in enumerate(sorted(folder.iterdir())):              # written in key order: keep it the LRU order
        os.utime(path, ns=(i * 10**9, i * 10**9))
    (folder / f".{bytes(16).hex()}.123.tmp").write_bytes(b"half a file")   # a write cut short
    (folder / f"{bytes(range(16)).hex()}.pkvs").write_bytes(b"not a spill file")
    (folder / "notes.txt").write_text("the user's")                  # not the store's: left alone, not counted
    mirror = PrefixStore(100, Spill(folder, 10_000), sizes_only=True)   # reads headers, changes nothing
    reopened = spilling(tmp_path, memory=100, disk=10_000)
    assert reopened.keys() == mirror.keys() == [k(i) for i in range(5)]
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".pkvs")) == ["notes.txt"]
    assert reopened.disk_bytes == mirror.disk_bytes == file_bytes(reopened) - len("the user's")
    assert all(reopened.get(k(i)) == block(i, 100) for i in range(5))
    one = (folder / f"{k(1).hex()}.pkvs").stat().st_size
    smaller = spilling(tmp_path, memory=100, disk=2 * one)           # a smaller disk budget: the oldest go
    assert len(smaller.disk_keys()) == 2 and smaller.disk_bytes <= 2 * one


def test_spill_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="bytes >= 0"):
        Spill("x", -1)
    with pytest.raises(ValueError, match="'deflate' or None"):
        Spill("x", 10, compress="zstd")
    with pytest.raises(ValueError, match="0 to 9"):
        Spill("x", 10, compress="deflate", level=12)
    store = spilling(tmp_path, memory=10, disk=100)
    with pytest.raises(ValueError, match="16-byte keys"):
        store.put(b"short", b"x", 1)
    store.put(k(b"a"), [1], 10)
    with pytest.raises(TypeError, match="holds bytes"):                # pushing a non-bytes value to disk
        store.put(k(b"b"), [2], 10)
