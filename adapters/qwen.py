"""Qwen2 (biased q/k/v, per-layer sliding window) and Qwen3 (adds RMSNorm on q and k before RoPE)."""

import torch
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from .base import AttentionAdapter


class Qwen2Adapter(AttentionAdapter):
    model_types = ("qwen2",)
    attention_class = Qwen2Attention

    def sliding_window(self, attn: nn.Module) -> int | None:
        return attn.sliding_window


class Qwen3Adapter(Qwen2Adapter):
    model_types = ("qwen3",)
    attention_class = Qwen3Attention

    def normalize_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attn.q_norm(q), attn.k_norm(k)
