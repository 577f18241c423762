"""Llama: the reference attention layout; nothing to override."""

from transformers.models.llama.modeling_llama import LlamaAttention

from .base import AttentionAdapter


class LlamaAdapter(AttentionAdapter):
    model_types = ("llama",)
    attention_class = LlamaAttention
