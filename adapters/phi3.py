"""Phi-3: one fused `qkv_proj`, partial rotary embedding (`partial_rotary_factor`), optional sliding window."""

import torch
from torch import nn
from transformers.models.phi3.modeling_phi3 import Phi3Attention

from .base import AttentionAdapter


class Phi3Adapter(AttentionAdapter):
    model_types = ("phi3",)
    attention_class = Phi3Attention

    def key_weight(self, attn: nn.Module) -> torch.Tensor:
        return attn.qkv_proj.weight

    def linear_qkv(self, attn: nn.Module, hidden_states: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_width = attn.config.num_attention_heads * attn.head_dim
        kv_width = attn.num_key_value_heads * attn.head_dim
        return attn.qkv_proj(hidden_states).split([q_width, kv_width, kv_width], dim=-1)

    def sliding_window(self, attn: nn.Module) -> int | None:
        return getattr(attn.config, "sliding_window", None)
