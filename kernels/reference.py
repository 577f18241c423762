"""PyTorch reference implementations of the hot paths: the CPU path and the oracle for the Triton kernels."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[..., 2m]` -> `[-x[m:], x[:m]]`: the rotate-half RoPE convention of the transformers families."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def latent_scores(q_latent: torch.Tensor, latents: torch.Tensor, groups: int) -> torch.Tensor:
    """Scores of queries against cached latents, in the latent space.

    q_latent: `[batch, heads, rank]`; latents: `[batch, kv_heads, seq, rank]` with heads = kv_heads * groups.
    Returns `[batch, heads, seq]`: q_latent[b, h] . latents[b, h // groups, t].
    """
    return torch.einsum("bhr,bhtr->bht", q_latent, latents.repeat_interleave(groups, dim=1))


def reconstruct_rope(coeffs: torch.Tensor, basis: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """Rebuild keys from latent coefficients and rotate them, fused in the Triton kernel.

    coeffs: `[batch, heads, n, rank]`; basis: `[heads, head_dim, rank]`; mean: `[heads, head_dim]`;
    cos, sin: `[batch, heads, n, head_dim]` (the rotation of each token, gathered by position).
    Returns `[batch, heads, n, head_dim]`: RoPE(mean + basis @ coeffs).
    """
    keys = coeffs @ basis.transpose(1, 2) + mean.unsqueeze(1)
    return keys * cos + rotate_half(keys) * sin
