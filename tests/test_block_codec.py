"""Blocks as an engine holds them (`patchkv.block_codec`): exact at full rank in every family and mode, the bytes
exactly as counted, damaged or foreign blocks refused, rotations from a config equal to the model's."""

import pytest
import torch
from conftest import FAMILIES, calibration_ids, make_model

import patchkv
from patchkv.block_codec import HEADER_BYTES, BlockCodec, BlockError, Rotations, block_bits, block_method
from patchkv.adapters import attention_modules
from patchkv.allocation import kv_bytes_per_token
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


def test_budgets_and_specs():
    model = engine_model("llama")
    artifact = patchkv.calibrate(model, calibration_ids(), mode="post_rope", energy=1.0, progress=False)
    bits = block_bits(artifact, 8, "head")
    assert block_method(artifact, "8x") == Quantized(bits)
    assert kv_bytes_per_token(artifact, bits) <= sixteen_bit_bytes(artifact) / 8
    assert kv_bytes_per_token(artifact, bits + 1) > sixteen_bit_bytes(artifact) / 8
    assert block_method(artifact, "96") == Quantized(96)
    assert block_method(artifact, "lowrank:rank=8") == LowRank(rank=8)
    with pytest.raises(ValueError, match="no salient tokens"):
        block_method(artifact, "8x+novelty")
    with pytest.raises(ValueError, match="codec method"):
        block_method(artifact, "sinks:sink_tokens=4")
    with pytest.raises(ValueError, match="pass rotations"):
        BlockCodec(patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=4, progress=False), Quantized(8))
