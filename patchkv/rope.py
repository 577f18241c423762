"""cos/sin of the model's own rotary embedding at any integer positions, shared by the layers that use it."""

from __future__ import annotations

import torch
from torch import nn

from .adapters import AttentionAdapter


class RopeTable:
    """cos/sin for positions `0 .. n-1` of one rotary table, computed by the model's rotary module through
    the adapter, grown on demand, gathered at true positions (pre-RoPE mode rotates cached keys by them)."""

    def __init__(self, adapter: AttentionAdapter, rotary: nn.Module, attn: nn.Module):
        self.adapter, self.rotary, self.attn = adapter, rotary, attn
        # a "dynamic" RoPE rescales with the longest position seen, so it must never see more than asked
        self.exact = "dynamic" in str(getattr(rotary, "rope_type", ""))
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self._turn: torch.Tensor | bool | None = None  # built on demand; False: the halves differ

    def at(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: integer tensor of any shape `[...]` -> cos, sin `[..., rotary_dim]` in `like`'s dtype/device."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        cached = self.cos
        if cached is None or cached.shape[0] < need or cached.dtype != like.dtype or cached.device != like.device:
            size = need if self.exact or cached is None else max(need, 2 * cached.shape[0])
            grid = torch.arange(size, device=like.device).unsqueeze(0)
            cos, sin = self.adapter.cos_sin(self.rotary, self.attn, like, grid)
            self.cos, self.sin, self._turn = cos[0], sin[0], None
        index = positions.to(self.cos.device).long()
        return self.cos[index], self.sin[index]

    def turn(self) -> torch.Tensor | None:
        """`cos + i sin` of the table's first half, `[n, rotary_dim / 2]` complex, when both halves are the same
        rotation (rotate-half RoPE) and the table is float32 or float64; None otherwise. Kept until the table is
        rebuilt: a pre-RoPE decode step turns every cached key pair by one complex product with its rows."""
        if self._turn is None:
            half = self.cos.shape[-1] // 2
            cos, sin = self.cos, self.sin
            same = cos.dtype in (torch.float32, torch.float64) and torch.equal(cos[:, :half], cos[:, half:]) \
                and torch.equal(sin[:, :half], sin[:, half:])
            self._turn = torch.complex(cos[:, :half], sin[:, :half]) if same else False
        return self._turn if self._turn is not False else None
