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


def chunked_latent_scores(q_latent: torch.Tensor, bias: torch.Tensor, latents: torch.Tensor, groups: int,
                          chunk: int) -> torch.Tensor:
    """Scores in the latent space with one query per chunk of `chunk` consecutive tokens.

    q_latent: `[batch, heads, chunks, rank]`; bias: `[batch, heads, chunks]`; latents: `[batch, kv_heads, seq,
    rank]` with chunks = ceil(seq / chunk), heads = kv_heads * groups. Returns `[batch, heads, seq]`:
    q_latent[b, h, t // chunk] . latents[b, h // groups, t] + bias[b, h, t // chunk].
    """
    batch, heads, chunks, rank = q_latent.shape
    kv_heads, seq = latents.shape[1], latents.shape[2]
    padded = torch.nn.functional.pad(latents, (0, 0, 0, chunks * chunk - seq)).view(batch, kv_heads, chunks, chunk, rank)
    queries = q_latent.view(batch, kv_heads, groups, chunks, rank).transpose(2, 3)  # [b, kv, chunks, groups, r]
    scores = queries @ padded.transpose(-1, -2) + bias.view(batch, kv_heads, groups, chunks, 1).transpose(2, 3)
    return scores.permute(0, 1, 3, 2, 4).reshape(batch, heads, chunks * chunk)[..., :seq]


def pair_order(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices `0, half, 1, half + 1, ...`: head dims ordered so that each pair RoPE rotates together is adjacent."""
    return torch.arange(head_dim, device=device).view(2, head_dim // 2).t().flatten()


def reconstruct_rope(coeffs: torch.Tensor, basis: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, paired: bool = False, turn: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild keys from latent coefficients and rotate them, fused in the Triton kernel.

    coeffs: `[batch, heads, n, rank]`; basis: `[heads, head_dim, rank]`; mean: `[heads, head_dim]`;
    cos, sin: `[batch, heads, n, head_dim]` (the rotation of each token, gathered by position).
    Returns `[batch, heads, n, head_dim]`: RoPE(mean + basis @ coeffs), head dims in `pair_order` if `paired`
    (for a consumer that orders its query the same way: dot products are unchanged).

    In pair order, when both halves of the table are the same rotation (every rotate-half RoPE of transformers)
    and coeffs are float32 or float64, keys are rebuilt in that order and each pair turned by one complex
    product: one pass over the keys instead of five. turn: that rotation, `cos + i sin` of the first half
    (broadcastable to `[batch, heads, n, head_dim / 2]`), when the caller has it (then cos and sin are not read).
    """
    half = basis.shape[1] // 2
    order = pair_order(2 * half, basis.device)
    if paired and coeffs.dtype in (torch.float32, torch.float64) and (turn is not None or (
            torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:]))):
        keys = coeffs @ basis[:, order].transpose(1, 2)
        keys += mean[:, order].unsqueeze(1)
        turn = torch.complex(cos[..., :half], sin[..., :half]) if turn is None else turn
        return torch.view_as_real(torch.view_as_complex(keys.view(*keys.shape[:-1], half, 2)) * turn).view(keys.shape)
    keys = coeffs @ basis.transpose(1, 2)
    keys += mean.unsqueeze(1)
    # RoPE(x) = x * cos + rotate_half(x) * sin, half by half (no rotated copy of the keys)
    x1, x2 = keys[..., :half], keys[..., half:]
    first = (x1 * cos[..., :half]).addcmul_(x2, sin[..., :half], value=-1)
    second = (x2 * cos[..., half:]).addcmul_(x1, sin[..., half:])
    out = torch.cat([first, second], dim=-1)
    return out[..., order] if paired else out
