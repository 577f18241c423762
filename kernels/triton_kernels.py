"""Triton kernels for the latent hot paths. Same signatures as `reference.py`, which is their oracle.

Tested on CPU under `TRITON_INTERPRET=1`; on a GPU they run compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunked_latent_scores_kernel(q_ptr, bias_ptr, lat_ptr, out_ptr, seq, rank, groups, heads, chunk,
                                  sq_b, sq_h, sq_c, sb_b, sb_h, sl_b, sl_h, sl_t, so_b, so_h,
                                  BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    kv = h // groups
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    inside = t < seq
    c = t // chunk  # each token's query: the one of its chunk
    q = tl.load(q_ptr + b * sq_b + h * sq_h + c[:, None] * sq_c + r[None, :],
                mask=inside[:, None] & (r[None, :] < rank), other=0.0)
    lat = tl.load(lat_ptr + b * sl_b + kv * sl_h + t[:, None] * sl_t + r[None, :],
                  mask=inside[:, None] & (r[None, :] < rank), other=0.0)
    bias = tl.load(bias_ptr + b * sb_b + h * sb_h + c, mask=inside, other=0.0)
    scores = tl.sum(lat.to(tl.float32) * q.to(tl.float32), axis=1) + bias.to(tl.float32)
    tl.store(out_ptr + b * so_b + h * so_h + t, scores, mask=inside)


def chunked_latent_scores(q_latent: torch.Tensor, bias: torch.Tensor, latents: torch.Tensor, groups: int,
                          chunk: int) -> torch.Tensor:
    batch, heads, _, rank = q_latent.shape
    seq = latents.shape[2]
    q_latent, bias, latents = q_latent.contiguous(), bias.contiguous(), latents.contiguous()
    out = torch.empty(batch, heads, seq, device=q_latent.device, dtype=torch.float32)
    block_t = 64
    grid = (batch * heads, triton.cdiv(seq, block_t))
    _chunked_latent_scores_kernel[grid](
        q_latent, bias, latents, out, seq, rank, groups, heads, chunk,
        q_latent.stride(0), q_latent.stride(1), q_latent.stride(2), bias.stride(0), bias.stride(1),
        latents.stride(0), latents.stride(1), latents.stride(2), out.stride(0), out.stride(1),
        BLOCK_T=block_t, BLOCK_R=triton.next_power_of_2(rank))
    return out.to(q_latent.dtype)


def latent_scores(q_latent: torch.Tensor, latents: torch.Tensor, groups: int) -> torch.Tensor:
    """One chunk holding every token: the chunked kernel with a single query per head and no bias."""
    seq = latents.shape[2]
    return chunked_latent_scores(q_latent.unsqueeze(2), q_latent.new_zeros(q_latent.shape[:2] + (1,)), latents,
                                 groups, max(seq, 1))


@triton.jit
def _reconstruct_rope_kernel(c_ptr, basis_ptr, mean_ptr, cos_ptr, sin_ptr, out_ptr, n, rank, heads,
                             sc_b, sc_h, sc_n, sb_h, sb_d, sm_h, sx_b, sx_h, sx_n, so_b, so_h, so_n,
                             HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, HALF)
    c = tl.load(c_ptr + b * sc_b + h * sc_h + i[:, None] * sc_n + r[None, :],
                mask=(i[:, None] < n) & (r[None, :] < rank), other=0.0).to(tl.float32)
    # basis rows for the two halves of the head dimension, as [rank, HALF] for the matmul
    rows = basis_ptr + h * sb_h + r[:, None]
    b1 = tl.load(rows + d[None, :] * sb_d, mask=r[:, None] < rank, other=0.0).to(tl.float32)
    b2 = tl.load(rows + (d[None, :] + HALF) * sb_d, mask=r[:, None] < rank, other=0.0).to(tl.float32)
    x1 = tl.dot(c, b1, input_precision="ieee") + tl.load(mean_ptr + h * sm_h + d).to(tl.float32)[None, :]
    x2 = tl.dot(c, b2, input_precision="ieee") + tl.load(mean_ptr + h * sm_h + HALF + d).to(tl.float32)[None, :]
    rot = b * sx_b + h * sx_h + i[:, None] * sx_n
    m = i[:, None] < n
    cos1 = tl.load(cos_ptr + rot + d[None, :], mask=m, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + rot + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + rot + d[None, :], mask=m, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + rot + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
    out = out_ptr + b * so_b + h * so_h + i[:, None] * so_n
    tl.store(out + d[None, :], x1 * cos1 - x2 * sin1, mask=m)  # rotate_half(x) = [-x2, x1]
    tl.store(out + HALF + d[None, :], x2 * cos2 + x1 * sin2, mask=m)


def reconstruct_rope(coeffs: torch.Tensor, basis: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    batch, heads, n, rank = coeffs.shape
    dim = basis.shape[1]
    coeffs, basis, mean = coeffs.contiguous(), basis.contiguous(), mean.contiguous()
    cos, sin = cos.expand(batch, heads, n, dim).contiguous(), sin.expand(batch, heads, n, dim).contiguous()
    out = torch.empty(batch, heads, n, dim, device=coeffs.device, dtype=torch.float32)
    block_n, block_r = 32, max(16, triton.next_power_of_2(rank))  # tl.dot needs every dimension >= 16
    grid = (batch * heads, triton.cdiv(n, block_n))
    _reconstruct_rope_kernel[grid](
        coeffs, basis, mean, cos, sin, out, n, rank, heads,
        coeffs.stride(0), coeffs.stride(1), coeffs.stride(2), basis.stride(0), basis.stride(1), mean.stride(0),
        cos.stride(0), cos.stride(1), cos.stride(2), out.stride(0), out.stride(1), out.stride(2),
        HALF=dim // 2, BLOCK_N=block_n, BLOCK_R=block_r)
    return out.to(coeffs.dtype)
