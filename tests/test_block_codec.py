"""Blocks as an engine holds them (`patchkv.block_codec`): exact at full rank in every family and mode, the bytes
exactly as counted, damaged or foreign blocks refused, rotations from a config equal to the model's."""

import pytest
import torch
from conftest import FAMILIES, calibration_ids, make_model

import patchkv
from patchkv.block_codec import HEADER_BYTES, BlockCodec, BlockError, Rotations, block_bits, block_method, prefix_bytes
from patchkv.adapters import attention_modules
from patchkv.budgets import sixteen_bit_bytes
from patchkv.methods import LowRank, Quantized


def engine_model(family: str):
    """A tiny model whose cache keeps every token (sliding windows wider than the test's sequences)."""
    wide = {"sliding_window": 64} if "sliding_window" in FAMILIES[family][2] else {}
    return make_model(family, **wide)


def engine_blocks(model, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys (rotated) and values `[n, kv_heads, head_dim]` of every layer at `positions`, as an engine holds them:
    from the model's own cache after one forward."""
    ids = calibration_ids(1, int(positions.max()) + 1, seed=5)
    cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys[0, :, positions].transpose(0, 1), layer.values[0, :, positions].transpose(0, 1))
            for layer in cache.layers]


def codec_for(model, mode: str, method, **kwargs) -> BlockCodec:
    artifact = patchkv.calibrate(model, calibration_ids(), mode=mode, energy=1.0, progress=False)
    return BlockCodec(artifact, method(artifact), Rotations.from_model(model), **kwargs)


@pytest.mark.parametrize("start", [0, 9])
def test_full_rank_is_exact(family, mode, start):
    """Every head's whole basis in float32: each block decodes to the keys and values it was given, the sinks (block
    at 0) stored exact, the pre-RoPE keys turned back and forward by their true positions."""
    model = engine_model(family)
    codec = codec_for(model, mode, lambda a: LowRank(rank=a.head_dim), dtype=torch.float32)
    positions = torch.arange(start, start + 12)
    layers = engine_blocks(model, positions)
    decoded = codec.decode(codec.encode(layers, positions), positions)
    for (k, v), (dk, dv) in zip(layers, decoded):
        torch.testing.assert_close(dk, k, atol=2e-5, rtol=0)
        torch.testing.assert_close(dv, v, atol=2e-5, rtol=0)


@pytest.mark.parametrize("start", [0, 2, 16])
def test_bytes_are_exactly_the_count(start):
    """The serialized block is `block_bytes` long: header, exact sinks (dtype), codes of the rest."""
    model = engine_model("llama")
    codec = codec_for(model, "pre_rope", lambda a: Quantized(40))
    positions = torch.arange(start, start + 16)
    data = codec.encode(engine_blocks(model, positions), positions)
    sinks = max(0, 4 - start)
    layer_codes = sum(-(-bits // 8) for bits in [40 * codec.artifact.num_kv_heads] * 2)
    assert codec.token_bytes == layer_codes * codec.artifact.num_layers
    assert len(data) == codec.block_bytes(positions) == HEADER_BYTES + sinks * codec.sink_bytes \
        + (16 - sinks) * codec.token_bytes
    assert codec.sink_bytes == sixteen_bit_bytes(codec.artifact)  # bfloat16, the engine's dtype


def test_lossy_budget_decodes_close_and_in_dtype():
    model = engine_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", energy=1.0, progress=False)
    codec = BlockCodec.from_budget(artifact, "4x", Rotations.from_model(model))
    positions = torch.arange(8, 24)
    layers = engine_blocks(model, positions)
    decoded = codec.decode(codec.encode(layers, positions), positions)
    error = sum(((dk.float() - k) ** 2).sum() for (k, _), (dk, _) in zip(layers, decoded))
    assert decoded[0][0].dtype == torch.bfloat16
    assert error / sum((k ** 2).sum() for k, _ in layers) < 0.05


def test_damaged_foreign_or_misplaced_blocks_are_refused():
    model = engine_model("llama")
    codec = codec_for(model, "pre_rope", lambda a: Quantized(40))
    positions = torch.arange(16, 32)
    data = codec.encode(engine_blocks(model, positions), positions)
    damaged = bytearray(data)
    damaged[HEADER_BYTES + 5] ^= 1
    with pytest.raises(BlockError, match="damaged"):
        codec.decode(bytes(damaged), positions)
    with pytest.raises(BlockError, match="truncated"):
        codec.decode(data[:-1], positions)
    with pytest.raises(BlockError, match="other positions"):
        codec.decode(data, positions + 16)
    other = BlockCodec(codec.artifact, Quantized(48), codec.rotations)
    with pytest.raises(BlockError, match="another artifact, method"):
        other.decode(data[:HEADER_BYTES] + bytes(other.block_bytes(positions) - HEADER_BYTES), positions)
    with pytest.raises(BlockError, match="not a patchkv block"):
        codec.decode(b"XXXX" + data[4:], positions)


def test_rotations_from_config_match_the_model(family):
    """What an engine builds from the config alone rotates as the loaded model does (Gemma 3: both tables)."""
    model = engine_model(family)
    mine, theirs = Rotations.from_model(model), Rotations.from_config(model.config)
    head_dim = mine.adapter.head_dim(attention_modules(model, mine.adapter)[0])
    keys = torch.randn(5, model.config.num_key_value_heads, head_dim)
    positions = torch.tensor([0, 3, 7, 40, 41])
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(theirs.rotate(layer, keys, positions), mine.rotate(layer, keys, positions))
        torch.testing.assert_close(mine.unrotate(layer, mine.rotate(layer, keys, positions), positions), keys,
                                   atol=1e-5, rtol=0)


def stored_prefix(codec: BlockCodec, tokens: int, block_tokens: int) -> int:
    """Bytes of a prefix of `tokens` stored from position 0, as `encode` writes its blocks (`block_bytes`)."""
    return sum(codec.block_bytes(torch.arange(start, min(start + block_tokens, tokens)))
               for start in range(0, tokens, block_tokens))


@pytest.mark.parametrize("ratio", [4, 8, 16])
def test_ratio_budget_counts_headers_and_sinks(ratio):
    """A ratio budget holds with everything stored counted: every prefix of whole blocks from `prefix_tokens` on
    takes at most the 16-bit cache's bytes / ratio per token (headers and exact sinks included), and one bit more
    per head would not."""
    model = engine_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), mode="post_rope", energy=1.0, progress=False)
    block, shortest = 32, 500
    codec = BlockCodec.from_budget(artifact, f"{ratio}x", block_tokens=block, prefix_tokens=shortest)
    allowed = sixteen_bit_bytes(artifact) / ratio
    for tokens in range(512, 1024, block):
        assert stored_prefix(codec, tokens, block) <= tokens * allowed
        assert stored_prefix(codec, tokens, block) == prefix_bytes(tokens, codec.token_bytes, codec.sink_bytes,
                                                                    block_tokens=block, sink_tokens=4)
    finer = BlockCodec(artifact, Quantized(codec.method.bits + 1))
    assert stored_prefix(finer, 512, block) > 512 * allowed
    longer = BlockCodec.from_budget(artifact, f"{ratio}x", block_tokens=block, prefix_tokens=4 * shortest)
    assert longer.method.bits >= codec.method.bits
    with pytest.raises(ValueError, match=f"less than {block} exact sinks"):  # a prefix of sinks alone is 16-bit
        block_bits(artifact, ratio, "head", block_tokens=block, prefix_tokens=block, sink_tokens=block)


def test_budgets_and_specs():
    model = engine_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), mode="post_rope", energy=1.0, progress=False)
    assert block_method(artifact, "8x", block_tokens=32) == Quantized(block_bits(artifact, 8, "head", block_tokens=32))
    assert block_method(artifact, "96") == Quantized(96)
    assert block_method(artifact, "96", basis="layer") == Quantized(96, basis="layer")
    with pytest.raises(ValueError, match="layer bases"):  # calibrated without them
        block_method(artifact, "8x", basis="layer")
    assert block_method(artifact, "lowrank:rank=8") == LowRank(rank=8)
    for extra in ("novelty", "near", "evict"):
        with pytest.raises(ValueError, match=f"without salient or near tokens; drop '\\+{extra}'"):
            block_method(artifact, f"8x+{extra}")
    with pytest.raises(ValueError, match="codec method"):
        block_method(artifact, "sinks:sink_tokens=4")
    with pytest.raises(ValueError, match="pass rotations"):
        BlockCodec(patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=4, progress=False), Quantized(8))
