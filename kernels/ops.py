"""Hot-path kernels: Triton on CUDA tensors (or under TRITON_INTERPRET=1), the PyTorch reference otherwise."""

from __future__ import annotations

import os

import torch

from . import reference


def _triton_for(x: torch.Tensor):
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    try:
        from . import triton_kernels
    except ImportError:  # triton is an optional extra: patchkv[triton]
        return None
    return triton_kernels


def latent_scores(q_latent: torch.Tensor, latents: torch.Tensor, groups: int) -> torch.Tensor:
    """`[batch, heads, rank]` x `[batch, kv_heads, seq, rank]` -> `[batch, heads, seq]`; see `reference`."""
    impl = _triton_for(latents) or reference
    return impl.latent_scores(q_latent, latents, groups)


def chunked_latent_scores(q_latent: torch.Tensor, bias: torch.Tensor, latents: torch.Tensor, groups: int,
                          chunk: int) -> torch.Tensor:
    """`[batch, heads, chunks, rank]`, `[batch, heads, chunks]` x `[batch, kv_heads, seq, rank]` -> `[batch, heads,
    seq]`, one query per chunk of tokens; see `reference`."""
    impl = _triton_for(latents) or reference
    return impl.chunked_latent_scores(q_latent, bias, latents, groups, chunk)


def reconstruct_rope(coeffs: torch.Tensor, basis: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """`[batch, heads, n, rank]` -> rotated keys `[batch, heads, n, head_dim]`; see `reference`."""
    impl = _triton_for(coeffs) or reference
    return impl.reconstruct_rope(coeffs, basis, mean, cos, sin)


__all__ = ["chunked_latent_scores", "latent_scores", "reconstruct_rope", "reference"]
