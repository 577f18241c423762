"""The two ways keys enter the latent cache, one small class each, behind one interface.

- `PreRoPE`: keys are projected before the rotary embedding, where they are most compressible. At attention
  time cached keys are reconstructed and rotated by their true positions (recorded by the cache).
- `PostRoPE`: rotated keys are projected. Queries are projected onto the same basis, so scores against
  latent tokens are computed in the latent space and keys are never reconstructed.

Values are the same in both modes (see `patchkv.attention`). Exact tokens (sinks, window) and latent tokens
are scored together by augmenting features, `[exact dims | latent dims | 1]`, so any attention function
(eager, sdpa) sees one key tensor whose dot products are the true scores, mean term included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .context import LayerPatch
from .kernels import ops as kernels
from .latent import augmented


@dataclass
class Visible:
    """What one attention step reads, in position order (sinks, middle, window).

    sink_*/recent_*: exact `[batch, kv_heads, n, head_dim]` in cache space; key_coeffs/value_coeffs: the
    middle's coefficients `[batch, kv_heads, m, max_rank]`; *_positions: true positions `[batch, n]`
    (`[batch, kv_heads, m]` for a middle selected per KV head).
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    key_coeffs: torch.Tensor
    value_coeffs: torch.Tensor
    sink_positions: torch.Tensor
    middle_positions: torch.Tensor
    recent_positions: torch.Tensor


def rotate_at(lp: LayerPatch, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE on x `[batch, heads, n, head_dim]` at positions `[batch, n]` or per head `[batch, heads, n]`."""
    cos, sin = lp.rope.at(positions, like=x)
    rotate = lp.patch.adapter.rotate
    if positions.dim() == 2:
        return rotate(x, cos, sin)
    b, h, n, d = x.shape
    flat = rotate(x.reshape(b * h, 1, n, d), cos.reshape(b * h, n, -1), sin.reshape(b * h, n, -1))
    return flat.reshape(b, h, n, d)


class Mode:
    """Which keys the basis describes, and what the attention function dots queries with."""

    name: str

    def to_cache_space(self, lp: LayerPatch, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Un-rotated q `[batch, heads, s, d]`, k `[batch, kv_heads, s, d]` and this step's cos/sin -> (q, k) in
        the space the key basis was calibrated in."""
        raise NotImplementedError

    def score_operands(self, lp: LayerPatch, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       seen: Visible) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries `[batch, heads, s, D]`, keys `[batch, kv_heads, n, D]`) whose dot products are the true
        attention scores of q (in cache space) against every visible token."""
        raise NotImplementedError

    def approximate_scores(self, lp: LayerPatch, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           coeffs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Scores of a single query `[batch, heads, 1, d]` against middle tokens from their first r components
        `coeffs` `[batch, kv_heads, m, r]` (up to a per-query constant) -> `[batch, heads, m]`."""
        raise NotImplementedError

    def cached_keys_as_rotated(self, lp: LayerPatch, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cached keys `[batch, kv_heads, n, d]` at `positions` -> as the unpatched model would cache them."""
        raise NotImplementedError


class PreRoPE(Mode):
    name = "pre_rope"

    def to_cache_space(self, lp, q, k, cos, sin):
        return q, k

    def score_operands(self, lp, q, cos, sin, seen):
        middle = lp.keys.basis.reconstruct(seen.key_coeffs).to(q.dtype)
        keys = torch.cat([rotate_at(lp, seen.sink_keys, seen.sink_positions),
                          rotate_at(lp, middle, seen.middle_positions),
                          rotate_at(lp, seen.recent_keys, seen.recent_positions)], dim=2)
        return lp.patch.adapter.rotate(q, cos, sin), keys

    def approximate_scores(self, lp, q, cos, sin, coeffs, positions):
        basis = lp.keys.basis
        r = coeffs.shape[-1]
        q_rot = lp.patch.adapter.rotate(q, cos, sin)[:, :, 0]
        b, m = coeffs.shape[0], coeffs.shape[2]
        if lp.patch.adapter.rope_convention == "rotate_half" and cos.shape[-1] == basis.head_dim:
            c, s = lp.rope.at(positions, like=q)
            approx = kernels.reconstruct_rope(coeffs.contiguous(), basis.basis[..., :r].contiguous(), basis.mean,
                                              c.unsqueeze(1), s.unsqueeze(1))
        else:
            approx = rotate_at(lp, coeffs @ basis.basis[..., :r].transpose(1, 2) + basis.mean.unsqueeze(1), positions)
        grouped = q_rot.view(b, basis.heads, basis.query_groups, -1)
        return torch.einsum("bhgd,bhmd->bhgm", grouped, approx.to(q.dtype)).reshape(b, -1, m)

    def cached_keys_as_rotated(self, lp, keys, positions):
        return rotate_at(lp, keys, positions)


class PostRoPE(Mode):
    name = "post_rope"

    def to_cache_space(self, lp, q, k, cos, sin):
        rotate = lp.patch.adapter.rotate
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def score_operands(self, lp, q, cos, sin, seen):
        keys, has_exact, has_latent = augmented(seen.sink_keys, seen.key_coeffs.to(q.dtype), seen.recent_keys)
        basis = lp.keys.basis
        parts = ([q] if has_exact else []) + ([basis.project_queries(q), basis.mean_scores(q)] if has_latent else [])
        return torch.cat(parts, dim=-1), keys

    def approximate_scores(self, lp, q, cos, sin, coeffs, positions):
        q_latent = lp.keys.basis.project_queries(q)[:, :, 0, : coeffs.shape[-1]]
        return kernels.latent_scores(q_latent.contiguous(), coeffs.contiguous(), lp.keys.basis.query_groups)

    def cached_keys_as_rotated(self, lp, keys, positions):
        return keys


MODES: dict[str, Mode] = {mode.name: mode for mode in (PreRoPE(), PostRoPE())}
