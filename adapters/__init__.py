"""One adapter per architecture family; `adapter_for(model)` picks it from `config.model_type`."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import AttentionAdapter
from .gemma3 import Gemma3Adapter
from .llama import LlamaAdapter
from .mistral import MistralAdapter
from .phi3 import Phi3Adapter
from .qwen import Qwen2Adapter, Qwen3Adapter

ADAPTERS: dict[str, AttentionAdapter] = {
    model_type: adapter
    for adapter in (LlamaAdapter(), MistralAdapter(), Qwen2Adapter(), Qwen3Adapter(), Phi3Adapter(), Gemma3Adapter())
    for model_type in adapter.model_types
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(ADAPTERS)


def adapter_for(model: nn.Module) -> AttentionAdapter:
    """The adapter for `model`, or an `UnsupportedModelError` naming the supported architectures."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"patchkv has no adapter for model_type={model_type!r}. "
            f"Supported architectures: {', '.join(SUPPORTED_MODEL_TYPES)}. "
            "Use a model of one of these families, or add an adapter module in adapters/ (see adapters/base.py)."
        )
    return ADAPTERS[model_type]


def attention_modules(model: nn.Module, adapter: AttentionAdapter) -> list[nn.Module]:
    """The model's attention modules in layer order."""
    modules = [m for m in model.modules() if isinstance(m, adapter.attention_class)]
    return sorted(modules, key=lambda m: m.layer_idx)


__all__ = ["ADAPTERS", "SUPPORTED_MODEL_TYPES", "AttentionAdapter", "adapter_for", "attention_modules"]
