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
    """Which keys the basis describes, and what the attention kernel dots queries with."""

    name: str
    #: whether cached keys carry their rotation (post-RoPE) or get it at attention time (pre-RoPE)
    rotated_in_cache: bool

    def keys_for_cache(self, state: LatentAttentionState, q: torch.Tensor, k: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Un-rotated q `[batch, heads, seq, head_dim]` and k `[batch, kv_heads, seq, head_dim]` ->
        (q, k) in the space the key basis was calibrated in."""
        raise NotImplementedError

    def rotate_for_attention(self, state: LatentAttentionState, q: torch.Tensor,
                             keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q for the last `q.shape[2]` positions and all full keys `[batch, kv_heads, kv_seq, head_dim]`
        (as cached) -> rotated queries and keys."""
        raise NotImplementedError

    def score_inputs(self, state: LatentAttentionState, q: torch.Tensor,
                     key_latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and all cached key latents `[batch, 1, kv_seq, total_rank]` -> (queries, keys) whose dot
        products are the attention scores: `[batch, heads, seq, D]` and `[batch, kv_heads, kv_seq, D]`."""
        raise NotImplementedError


class PreRoPE(Mode):
    name = "pre_rope"
    rotated_in_cache = False

    def keys_for_cache(self, state, q, k, position_embeddings):
        return q, k

    def rotate_for_attention(self, state, q, keys):
        length, new = keys.shape[2], q.shape[2]
        cos, sin = state.rope(length, like=q)
        rotate = state.adapter.rotate
        return rotate(q, cos[:, length - new:], sin[:, length - new:]), rotate(keys, cos, sin)

    def score_inputs(self, state, q, key_latents):
        return self.rotate_for_attention(state, q, state.keys.decode(state.keys.unpack(key_latents)))


class PostRoPE(Mode):
    name = "post_rope"
    rotated_in_cache = True

    def keys_for_cache(self, state, q, k, position_embeddings):
        cos, sin = position_embeddings
        rotate = state.adapter.rotate
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def rotate_for_attention(self, state, q, keys):
        return q, keys

    def score_inputs(self, state, q, key_latents):
        return state.keys.project_queries(q), state.keys.unpack(key_latents)


MODES: dict[str, Mode] = {mode.name: mode for mode in (PreRoPE(), PostRoPE())}
