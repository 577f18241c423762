"""A RoPE scaling given to vLLM as `hf_overrides` (how evals/vllm/store.py runs SmolLM2 past its 8k context) reaches
the connector's codec: it turns stored keys by the engine's own rotation, not the model folder's."""

import pytest
import torch
from conftest import ARTIFACT, BLOCK, SMOLLM2
from transformers import AutoConfig
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.rotary_embedding import get_rope

from patchkv.block_codec import Rotations
from patchkv.integrations.vllm import Settings, build_codec, store_root


@pytest.mark.parametrize("factor", [4.0, 3.0])
def test_the_codec_rotates_keys_as_the_engine_does(factor):
    if not SMOLLM2.is_dir():
        pytest.skip(f"{SMOLLM2} is missing: bash scripts/setup.sh writes it")
    rope = {**AutoConfig.from_pretrained(SMOLLM2).rope_parameters, "rope_type": "linear", "factor": factor}
    config = EngineArgs(model=str(SMOLLM2), dtype="bfloat16", enforce_eager=True, block_size=BLOCK,
                        max_model_len=16 * 1024, hf_overrides={"rope_parameters": rope}).create_engine_config()
    codec = build_codec(config, Settings(str(ARTIFACT), "lowrank:rank=64"))
    hf, head_dim = config.model_config.hf_config, config.model_config.get_head_size()
    with set_current_vllm_config(config):  # as vLLM's Llama builds its rotary embedding
        engine = get_rope(head_dim, max_position=hf.max_position_embeddings,
                          rope_parameters=hf.rope_parameters, is_neox_style=True, dtype=torch.float32)
    positions = torch.arange(16 * 1024 - BLOCK, 16 * 1024)
    keys = torch.randn(BLOCK, hf.num_key_value_heads, head_dim, generator=torch.Generator().manual_seed(0))
    _, rotated = engine.forward_native(positions, torch.zeros(BLOCK, keys[0].numel()), keys.flatten(1).clone())
    rotated = rotated.view_as(keys)
    # vLLM divides the positions by the factor, transformers the frequencies: float32 angles rounded apart by up to
    # ~1e-3 at 16k (none at a power of two), under half a step of the bf16 cache the keys are read from
    close = {"atol": 2e-3, "rtol": 2 ** -8}
    for layer in (0, hf.num_hidden_layers - 1):
        torch.testing.assert_close(codec.rotations.rotate(layer, keys, positions), rotated, **close)
        torch.testing.assert_close(codec.rotations.unrotate(layer, rotated, positions), keys, **close)
    unscaled = Rotations.from_config(AutoConfig.from_pretrained(SMOLLM2)).rotate(0, keys, positions)
    assert (unscaled - rotated).abs().max() > 1  # the folder's own RoPE would turn them elsewhere


def test_blocks_stored_under_one_rope_are_not_read_under_another():
    """The store's root (what every block key chains from) names the engine's RoPE: the same model served with its
    RoPE scaled reads none of the blocks stored without, and the same settings give the same root."""
    if not SMOLLM2.is_dir():
        pytest.skip(f"{SMOLLM2} is missing: bash scripts/setup.sh writes it")
    rope = {**AutoConfig.from_pretrained(SMOLLM2).rope_parameters, "rope_type": "linear", "factor": 4.0}
    settings = Settings(str(ARTIFACT), "8x")

    def root(**overrides):
        config = EngineArgs(model=str(SMOLLM2), dtype="bfloat16", enforce_eager=True, block_size=BLOCK,
                            **overrides).create_engine_config()
        return store_root(config, build_codec(config, settings))

    plain = root()
    assert plain == root() != root(max_model_len=16 * 1024, hf_overrides={"rope_parameters": rope})
