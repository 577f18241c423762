"""The prefix store inside vLLM: a stored prefix hit gives the tokens recomputing it gives (full rank), also when it
is read back from disk, the store keeps to its byte budgets on both sides, a damaged or foreign block is refused and
recomputed, two requests on one prefix, an aborted request stores nothing."""

from types import SimpleNamespace

import pytest
import torch
from conftest import ARTIFACT, BLOCK, SMOLLM2, documents, engine
from transformers import AutoConfig
from vllm import SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.v1.request import RequestStatus

from patchkv import Artifact
from patchkv.block_codec import HEADER_BYTES, BlockCodec, Rotations
from patchkv.methods import LowRank
from patchkv.integrations.vllm import Settings, build_codec, kv_transfer_config
from patchkv.prefix_store import SPILL_HEADER_BYTES, block_keys

#: blocks the store holds: more than one 1k prompt (31 blocks), fewer than two
CAPACITY_BLOCKS = 40
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def llm():
    from patchkv.integrations.vllm import PatchKVConnector  # noqa: F401  (an import error fails here, named)

    return engine("lowrank:rank=64", CAPACITY_BLOCKS * engine_codec_bytes())


def engine_codec_bytes() -> int:
    """Bytes of one stored block past the sinks at full rank (float32 latents), from the artifact alone."""
    rotations = Rotations.from_config(AutoConfig.from_pretrained(SMOLLM2))
    codec = BlockCodec(Artifact.load(ARTIFACT), LowRank(rank=64), rotations)
    return codec.block_bytes(torch.arange(BLOCK, 2 * BLOCK))


def sides(llm):
    """(the scheduler's connector, the worker's): both live in this process."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group()


def prompt(llm, text: str, tokens: int = 1000) -> list[int]:
    return llm.get_tokenizer()(text)["input_ids"][:tokens]


def generate(llm, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def settle(llm) -> None:
    """Run one engine step with nothing to store, so the worker saves what finished before (vLLM hands a finished
    request's blocks to the worker in the next step)."""
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)


def check_budget(llm) -> None:
    scheduler, worker = sides(llm)
    for side in (scheduler, worker):
        assert side.store.held_bytes <= side.store.capacity
        if side.store.spill is not None:
            assert side.store.disk_bytes <= side.store.spill.capacity
    assert set(worker.store.keys()) == set(scheduler.store.keys())


def test_hit_gives_the_tokens_of_recompute(llm):
    ids = prompt(llm, documents()[0])
    computed = generate(llm, [ids])[0]
    assert computed.num_cached_tokens == 0
    stored = generate(llm, [ids])[0]
    assert stored.num_cached_tokens == (len(ids) - 1) // BLOCK * BLOCK   # every full block but the last token's
    assert stored.outputs[0].token_ids == computed.outputs[0].token_ids
    settle(llm)
    check_budget(llm)


def test_a_hit_leaves_its_last_blocks_to_compute(llm, monkeypatch):
    """recompute_tokens=40 in 32-token blocks: a hit loads all its blocks but the last 2, which vLLM computes."""
    scheduler, _ = sides(llm)
    ids = prompt(llm, documents()[1])
    computed = generate(llm, [ids])[0]
    settle(llm)
    blocks = Settings(str(ARTIFACT), recompute_tokens=40).recompute_blocks(BLOCK)
    monkeypatch.setattr(scheduler, "recompute_blocks", blocks)
    stored = generate(llm, [ids])[0]
    assert stored.num_cached_tokens == ((len(ids) - 1) // BLOCK - 2) * BLOCK
    assert stored.outputs[0].token_ids == computed.outputs[0].token_ids
    settle(llm)
    check_budget(llm)


def test_store_keeps_to_its_budget_and_the_leading_blocks(llm):
    scheduler, worker = sides(llm)
    first, *others = [prompt(llm, text) for text in documents("shakespeare")[:3]]
    generate(llm, [first])
    for ids in others:
        generate(llm, [ids])
        settle(llm)
        check_budget(llm)
        assert worker.store.held_bytes > (CAPACITY_BLOCKS - 2) * engine_codec_bytes()
    kept = scheduler.store.leading(block_keys(scheduler.root, others[-1], BLOCK))
    assert kept == len(others[-1]) // BLOCK  # the newest prompt whole; older ones lose their last blocks first


@pytest.mark.parametrize("defect", ["damaged", "foreign"])
def test_a_refused_block_is_recomputed(llm, defect):
    scheduler, worker = sides(llm)
    ids = prompt(llm, documents()[1 if defect == "damaged" else 2])
    computed = generate(llm, [ids])[0]
    settle(llm)
    key = block_keys(scheduler.root, ids, BLOCK)[3]
    data = bytearray(worker.store.get(key))
    if defect == "damaged":
        data[HEADER_BYTES + 100] ^= 0x40
    else:
        data[8:24] = bytes(16)  # another codec's fingerprint
    worker.store.put(key, bytes(data), len(data))
    again = generate(llm, [ids])[0]
    assert again.outputs[0].token_ids == computed.outputs[0].token_ids
    settle(llm)  # the block, recomputed, is stored again, intact
    worker.codec.decode(worker.store.get(key), torch.arange(3 * BLOCK, 4 * BLOCK))
    check_budget(llm)


def test_two_requests_on_one_prefix(llm):
    scheduler, _ = sides(llm)
    shared = prompt(llm, documents("milton")[0], 600)
    tails = [prompt(llm, text, 64) for text in documents("milton")[1:3]]
    prompts = [shared + tail for tail in tails]
    computed = generate(llm, prompts)
    settle(llm)
    keys = block_keys(scheduler.root, shared, BLOCK)
    assert scheduler.store.leading(keys) == len(keys)  # stored once, by whichever finished first
    hit = generate(llm, prompts)
    for mine, theirs in zip(hit, computed):
        assert mine.num_cached_tokens >= len(keys) * BLOCK
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
    settle(llm)
    check_budget(llm)


def test_an_aborted_request_stores_nothing(llm):
    scheduler, _ = sides(llm)
    ids = prompt(llm, documents("milton")[3])
    aborted = SimpleNamespace(request_id="aborted", status=RequestStatus.FINISHED_ABORTED, all_token_ids=ids,
                              num_tokens=len(ids), num_computed_tokens=len(ids))
    before = scheduler.store.keys()
    assert scheduler.request_finished(aborted, list(range(len(ids) // BLOCK))) == (False, None)
    assert scheduler.store.keys() == before


def test_spill_settings_are_read_from_the_extra_config(tmp_path):
    config = kv_transfer_config(ARTIFACT, store_bytes=1000, spill_dir=tmp_path, spill_bytes=5000,
                                spill_compress="deflate")
    store = Settings.read(dict(config.kv_connector_extra_config)).store(sizes_only=True)
    assert (store.capacity, store.spill.folder, store.spill.capacity, store.spill.compress) == (
        1000, tmp_path, 5000, "deflate")
    with pytest.raises(ValueError, match="both spill_dir"):
        Settings.read({"artifact": str(ARTIFACT), "spill_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="spill_compress"):
        Settings.read({"artifact": str(ARTIFACT), "spill_dir": str(tmp_path), "spill_bytes": 10,
                       "spill_compress": "zstd"})
    with pytest.raises(ValueError, match="prefix_tokens must be an integer >= 1"):
        Settings.read({"artifact": str(ARTIFACT), "prefix_tokens": 0})


@pytest.mark.parametrize("ratio", [8, 16])
def test_a_ratio_budget_holds_against_vllms_own_pages(llm, ratio):
    """"8x" in vLLM's terms: a prefix of `prefix_tokens` stored in the engine's blocks, headers and exact sinks
    included, takes at most 1/8 of the bytes vLLM's own bf16 pages hold for it (its page size, every layer)."""
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    pages = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups) // BLOCK  # bytes per token
    tokens = 1024
    codec = build_codec(llm.llm_engine.vllm_config, Settings(str(ARTIFACT), f"{ratio}x", prefix_tokens=tokens))
    stored = sum(codec.block_bytes(torch.arange(start, start + BLOCK)) for start in range(0, tokens, BLOCK))
    assert stored <= tokens * pages / ratio
    finer = BlockCodec(codec.artifact, type(codec.method)(codec.method.bits + 1, pool=codec.method.pool),
                       codec.rotations)
    assert sum(finer.block_bytes(torch.arange(start, start + BLOCK)) for start in range(0, tokens, BLOCK)) \
        > tokens * pages / ratio


def test_a_hit_read_back_from_disk_gives_the_tokens_of_recompute(llm, tmp_path, monkeypatch):
    """Memory for 8 blocks, the rest of a 31-block prompt spilled (DEFLATE): the hit reads each of the 23 spilled
    blocks back once, none refused, and continues as recomputing does; both sides keep the same tiers."""
    scheduler, worker = sides(llm)
    block = engine_codec_bytes()
    settings = Settings(str(ARTIFACT), "lowrank:rank=64", 8 * block, spill_dir=str(tmp_path / "spill"),
                        spill_bytes=40 * (block + SPILL_HEADER_BYTES), spill_compress="deflate")
    for side, sizes_only in ((scheduler, True), (worker, False)):
        monkeypatch.setattr(side, "store", settings.store(sizes_only))
    reads, errors = [], set()
    read, load_errors = worker.store._read, worker.get_block_ids_with_load_errors
    monkeypatch.setattr(worker.store, "_read", lambda key: reads.append(key) or read(key))

    def recorded():
        failed = load_errors()
        errors.update(failed)
        return failed

    monkeypatch.setattr(worker, "get_block_ids_with_load_errors", recorded)
    ids = prompt(llm, documents()[3])
    computed = generate(llm, [ids])[0]
    settle(llm)
    keys = block_keys(scheduler.root, ids, BLOCK)
    assert set(worker.store.disk_keys()) == set(scheduler.store.disk_keys()) == set(keys[8:])
    assert len(list((tmp_path / "spill").iterdir())) == len(keys) - 8
    stored = generate(llm, [ids])[0]
    assert stored.num_cached_tokens == (len(ids) - 1) // BLOCK * BLOCK
    assert stored.outputs[0].token_ids == computed.outputs[0].token_ids
    assert sorted(reads) == sorted(keys[8:]) and not errors
    assert worker.store.disk_keys() == scheduler.store.disk_keys()
    settle(llm)
    check_budget(llm)
