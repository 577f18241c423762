"""Mistral: Llama attention with a model-wide sliding window."""

from torch import nn
from transformers.models.mistral.modeling_mistral import MistralAttention

from .base import AttentionAdapter


class MistralAdapter(AttentionAdapter):
    model_types = ("mistral",)
    attention_class = MistralAttention

    def sliding_window(self, attn: nn.Module) -> int | None:
        return getattr(attn.config, "sliding_window", None)
