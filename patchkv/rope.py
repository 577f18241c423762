"""cos/sin tables for cache positions, computed by the model's own rotary embedding."""

from __future__ import annotations

import torch
from torch import nn


class RopeTable:
    """cos/sin for positions `0 .. n-1`, from the model's rotary module, grown on demand, shared by all layers.

    Pre-RoPE mode rotates reconstructed keys by their index in the cache and queries by theirs:
    scores depend only on the distance between the two, so this equals rotating by absolute positions
    for contiguous sequences (left padding only shifts both by the same amount).
    """

    def __init__(self, rotary_emb: nn.Module):
        self.rotary_emb = rotary_emb
        # a "dynamic" RoPE rescales with the longest position seen, so it must never see more than asked
        self.exact = "dynamic" in str(getattr(rotary_emb, "rope_type", ""))
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def __call__(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[1, length, head_dim]` in `like`'s dtype and device."""
        cached = self.cos
        if cached is None or cached.shape[1] < length or cached.dtype != like.dtype or cached.device != like.device:
            size = length if self.exact or cached is None else max(length, 2 * cached.shape[1])
            positions = torch.arange(size, device=like.device).unsqueeze(0)
            self.cos, self.sin = self.rotary_emb(like, positions)
        return self.cos[:, :length], self.sin[:, :length]


def find_rotary_embedding(model: nn.Module) -> nn.Module:
    """The model's single rotary embedding module."""
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(found) != 1:
        raise ValueError(f"Expected one rotary embedding module in the model, found {len(found)}.")
    return found[0]
