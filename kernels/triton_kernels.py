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


@triton.jit
def _unpack_kernel(lat_ptr, byte_ptr, shift_ptr, mask_ptr, step_ptr, offset_ptr, wide_ptr, head_ptr, slot_ptr, out_ptr,
                   tokens, width, comps, heads, widest, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = t < tokens
    for start in range(0, comps, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        real = c < comps
        byte = tl.load(byte_ptr + c, mask=real, other=0)
        wide = tl.load(wide_ptr + c, mask=real, other=0)
        row = lat_ptr + (b * tokens + t[:, None]) * width
        both = inside[:, None] & real[None, :]
        low = tl.load(row + byte[None, :], mask=both, other=0).to(tl.int32)
        high = tl.load(row + byte[None, :] + 1, mask=both & (wide[None, :] != 0), other=0).to(tl.int32)
        shift = tl.load(shift_ptr + c, mask=real, other=0)
        value = ((low | (high << 8)) >> shift[None, :]) & tl.load(mask_ptr + c, mask=real, other=0)[None, :]
        coeff = value.to(tl.float32) * tl.load(step_ptr + c, mask=real, other=0.0)[None, :] + \
            tl.load(offset_ptr + c, mask=real, other=0.0)[None, :]
        head = tl.load(head_ptr + c, mask=real, other=0)
        slot = tl.load(slot_ptr + c, mask=real, other=0)
        tl.store(out_ptr + ((b * heads + head[None, :]) * tokens + t[:, None]) * widest + slot[None, :], coeff,
                 mask=both)


def unpack(latents: torch.Tensor, table) -> torch.Tensor:
    """uint8 codes `[batch, tokens, width]` -> float32 coefficients `[batch, heads, tokens, widest]` in table order
    (`reference.unpack`; float latents are a gather, left to the reference)."""
    batch, tokens, width = latents.shape
    latents = latents.contiguous()
    out = torch.zeros(batch, table.heads, tokens, table.widest, device=latents.device, dtype=torch.float32)
    comps = table.byte.numel()
    if comps and tokens:
        block_t = 32
        _unpack_kernel[(batch, triton.cdiv(tokens, block_t))](
            latents, table.byte, table.shift, table.mask, table.step, table.offset, table.wide, table.head, table.slot,
            out, tokens, width, comps, table.heads, table.widest, BLOCK_T=block_t,
            BLOCK_C=min(64, triton.next_power_of_2(comps)))
    return out
