"""The two ways keys enter the latent cache. One small class per mode, one common interface.

- `PreRoPE`: keys are projected before rotary embedding, where they are most compressible; at
  attention time the cached latents are reconstructed to full keys and rotated.
- `PostRoPE`: rotated keys are projected; queries are projected onto the same basis and scores are
  computed in the latent space directly, so keys are never reconstructed.

Values are handled identically in both modes (see `patchkv.attention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .attention import LatentAttentionState


class Mode:
    """How keys are compressed into the cache and what the attention kernel dots queries with."""

    name: str

    def compress_keys(self, state: LatentAttentionState, q: torch.Tensor, k: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Un-rotated q `[batch, heads, seq, head_dim]` and k `[batch, kv_heads, seq, head_dim]` ->
        (q for `score_inputs`, packed key latents `[batch, 1, seq, total_rank]` for the cache)."""
        raise NotImplementedError

    def score_inputs(self, state: LatentAttentionState, q: torch.Tensor,
                     key_latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and all cached key latents `[batch, 1, kv_seq, total_rank]` -> (queries, keys) whose dot
        products are the attention scores: `[batch, heads, seq, D]` and `[batch, kv_heads, kv_seq, D]`."""
        raise NotImplementedError


class PreRoPE(Mode):
    name = "pre_rope"

    def compress_keys(self, state, q, k, position_embeddings):
        return q, state.keys.encode(k)

    def score_inputs(self, state, q, key_latents):
        keys = state.keys.decode(state.keys.unpack(key_latents))
        length, new = keys.shape[2], q.shape[2]
        cos, sin = state.rope(length, like=q)
        rotate = state.adapter.rotate
        return rotate(q, cos[:, length - new:], sin[:, length - new:]), rotate(keys, cos, sin)


class PostRoPE(Mode):
    name = "post_rope"

    def compress_keys(self, state, q, k, position_embeddings):
        cos, sin = position_embeddings
        rotate = state.adapter.rotate
        return rotate(q, cos, sin), state.keys.encode(rotate(k, cos, sin))

    def score_inputs(self, state, q, key_latents):
        return state.keys.project_queries(q), state.keys.unpack(key_latents)


MODES: dict[str, Mode] = {mode.name: mode for mode in (PreRoPE(), PostRoPE())}
