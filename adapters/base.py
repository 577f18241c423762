"""What every adapter shares: how q/k/v come out of an attention module, before RoPE.

An architecture family differs from Llama in a few lines (a sliding window, a norm on q/k);
an adapter for it subclasses `AttentionAdapter` and overrides only those lines. The patched
forward itself lives in `patchkv.attention` and is the same for every family.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half


class AttentionAdapter:
    """Llama-style attention: `q_proj`, `k_proj`, `v_proj`, `o_proj`, rotate-half RoPE."""

    #: `config.model_type` values this adapter handles.
    model_types: tuple[str, ...] = ()
    #: The attention module class the adapter patches.
    attention_class: type[nn.Module]

    def project_qkv(
        self, attn: nn.Module, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project hidden states to un-rotated queries, keys and values.

        hidden_states: `[batch, seq, hidden]`.
        Returns q `[batch, heads, seq, head_dim]`, k and v `[batch, kv_heads, seq, head_dim]`.
        """
        shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(hidden_states).view(shape)
        k = attn.k_proj(hidden_states).view(shape)
        v = attn.v_proj(hidden_states).view(shape)
        q, k = self.normalize_qk(attn, q, k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def normalize_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation applied before RoPE (none for Llama). q, k: `[batch, seq, heads, head_dim]`."""
        return q, k

    def sliding_window(self, attn: nn.Module) -> int | None:
        """The attention window of this layer, or None for full attention."""
        return None

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply RoPE. x: `[batch, heads, seq, head_dim]`; cos, sin: `[batch or 1, seq, head_dim]`."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + rotate_half(x) * sin

    @property
    def name(self) -> str:
        return self.model_types[0]
