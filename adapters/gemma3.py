"""Gemma 3 (text): q/k RMSNorm, sliding and global layers alternating, one RoPE table per layer type,
scaling by `query_pre_attn_scalar`."""

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention

from .base import AttentionAdapter


class Gemma3Adapter(AttentionAdapter):
    model_types = ("gemma3_text",)
    attention_class = Gemma3Attention

    def normalize_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attn.q_norm(q), attn.k_norm(k)

    def sliding_window(self, attn: nn.Module) -> int | None:
        return attn.sliding_window

    def rope_key(self, attn: nn.Module) -> str:
        return attn.layer_type

    def cos_sin(self, rotary: nn.Module, attn: nn.Module, like: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(like, positions, attn.layer_type)
