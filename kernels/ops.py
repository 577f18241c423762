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
                     sin: torch.Tensor, paired: bool = False, turn: torch.Tensor | None = None) -> torch.Tensor:
    """`[batch, heads, n, rank]` -> rotated keys `[batch, heads, n, head_dim]` (head dims in `reference.pair_order`
    if `paired`; `turn`, the complex rotation, used by the reference only); see `reference`."""
    impl = _triton_for(coeffs)
    if impl is None:
        return reference.reconstruct_rope(coeffs, basis, mean, cos, sin, paired, turn)
    out = impl.reconstruct_rope(coeffs, basis, mean, cos, sin)
    return out[..., reference.pair_order(out.shape[-1], out.device)] if paired else out


__all__ = ["chunked_latent_scores", "latent_scores", "reconstruct_rope", "reference"]
