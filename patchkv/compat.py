"""Every private `transformers` / `accelerate` / `torch` / `vllm` interface patchkv touches, in one place.

A new release can rename or drop any of these: `tests/test_compat.py` checks each one by name against the installed
versions, so a break names the touchpoint instead of surfacing as a wrong result somewhere else. Nothing else in
patchkv reads a private attribute of those libraries.

- `GenerationMixin._prepare_cache_for_generation`: where `generate()` builds its cache (patchkv swaps in a
  `LatentCache`), and a cache's `_is_user_defined` flag (a cache the user passed is left alone);
- `PreTrainedConfig._attn_implementation`: the attention implementation the model runs;
- the modeling module's `eager_attention_forward` and `ALL_ATTENTION_FUNCTIONS`: the model's own attention
  function (family details such as Gemma's softcap live in its eager one);
- the one `*RotaryEmbedding` module of a model, and its `rope_type`;
- `nn.Module._forward_pre_hooks(_with_kwargs)`: removing a kwargs pre-hook by id;
- accelerate's `_hf_hook` on a dispatched module (`pre_forward`, `execution_device`);
- where transformers' quantized cache layers (`QuantizedLayer`: quanto, HQQ) keep their codes;
- what `CacheLayerMixin.__init__` sets on a cache layer (a `LatentLayer`, whose `keys` and `values` are read-only
  views, cannot run it and sets the rest through `init_cache_layer`);
- what vLLM's `KVConnectorBase_V1` keeps for its subclasses (`PatchKVConnector`): its `_kv_transfer_config` and the
  step's metadata (`_get_connector_metadata`), checked by `tests/vllm` in vLLM's environment.

`tests/test_layout.py` holds the rest of the code to it: outside this file, no private name is read that patchkv does
not define itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PREPARE_CACHE = "_prepare_cache_for_generation"


def attn_implementation(config: Any) -> str:
    """The attention implementation a model is configured with ("eager" when unset)."""
    return getattr(config, "_attn_implementation", None) or "eager"


def attention_function(attn: nn.Module) -> Callable:
    """The attention function `attn`'s model runs, defaulting to its family's own eager one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(attn).__module__], "eager_attention_forward")
    return ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation(attn.config), eager)


def rotary_modules(model: nn.Module) -> list[nn.Module]:
    """The model's rotary embedding modules (every supported family has exactly one)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def prepare_cache(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's own `_prepare_cache_for_generation` (not an instance override)."""
    return getattr(type(model), PREPARE_CACHE)(model, *args, **kwargs)


def installed_cache_preparer(model: nn.Module) -> Any:
    """What is set on the model instance in place of `_prepare_cache_for_generation`, or None."""
    return vars(model).get(PREPARE_CACHE)


def set_cache_preparer(model: nn.Module, preparer: Any) -> None:
    """Install `preparer` on the instance, or with None take the instance's override off."""
    if preparer is None:
        vars(model).pop(PREPARE_CACHE, None)
    else:
        setattr(model, PREPARE_CACHE, preparer)


def is_user_defined(cache: Any) -> bool:
    """Whether `generate()` got this cache from the user (it leaves such a cache as it is)."""
    return bool(getattr(cache, "_is_user_defined", False))


def remove_pre_hook(module: nn.Module, hook_id: int) -> None:
    """Remove the forward pre-hook `hook_id` (registered with or without kwargs) from `module`."""
    module._forward_pre_hooks.pop(hook_id, None)
    module._forward_pre_hooks_with_kwargs.pop(hook_id, None)


def accelerate_hook(module: nn.Module) -> Any:
    """The accelerate hook of a dispatched module (`pre_forward`, `execution_device`), or None."""
    return getattr(module, "_hf_hook", None)


def execution_device(module: nn.Module) -> torch.device | None:
    """The device accelerate runs `module` on when it is dispatched with a hook, else None."""
    device = getattr(accelerate_hook(module), "execution_device", None)
    if device is None:
        return None
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def quantized_storage(layer: Any) -> tuple[Any, Any]:
    """The quantized keys and values a transformers quantized cache layer holds (each a tensor, a tuple of tensors or
    None; both None for a layer that keeps none), beside its float residual `keys` / `values`."""
    return getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)


def init_cache_layer(layer: Any) -> None:
    """What `CacheLayerMixin.__init__` sets on `layer` (`keys`, `values`, `is_initialized`) but `keys` and `values`,
    for a layer whose `keys` and `values` are read-only views of what it holds: not yet initialized."""
    layer.is_initialized = False


def connector_transfer_config(connector: Any) -> Any:
    """The `KVTransferConfig` a vLLM KV connector was built with (`KVConnectorBase_V1` keeps it for subclasses)."""
    return connector._kv_transfer_config


def connector_metadata(connector: Any) -> Any:
    """The metadata the scheduler built for this step, as a vLLM KV connector's worker side reads it."""
    return connector._get_connector_metadata()
