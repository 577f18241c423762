"""Transform coding of latent coefficients: dynamic-programming bit allocation and fixed-rate packing.

PCA coefficients are uncorrelated with variances equal to the calibrated eigenvalues. Each component
j gets b_j bits (0 drops it) of a uniform quantizer matched to a Gaussian of that variance; the
allocation minimises the expected squared error sum_j lambda_j * D(b_j) under a budget of bits per
head and token, by dynamic programming over components. Codes have a fixed bit layout, so the cache
holds exactly `bits` bits per head and token: no per-token scales.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MAX_BITS = 8
ROW_BUCKET = 256
# Optimal uniform quantizer for a unit Gaussian with 2^b levels (Max, 1960): step size and mean squared error.
GAUSSIAN_STEP = (math.inf, 1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)
GAUSSIAN_MSE = (1.0, 0.3634, 0.1188, 0.03744, 0.01154, 0.003490, 0.001035, 0.0003035, 0.0000876)


def allocate_bits(eigenvalues: torch.Tensor, budget: int, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Bits per component minimising sum_j eigenvalues[..., j] * GAUSSIAN_MSE[b_j] with sum_j b_j <= budget.

    eigenvalues: `[..., dim]`. Returns int64 `[..., dim]`. Exact DP over (component, bits used),
    vectorised over the leading dimensions.
    """
    lead, dim = eigenvalues.shape[:-1], eigenvalues.shape[-1]
    if not 1 <= budget <= dim * max_bits:
        raise ValueError(f"bits per head must be in [1, {dim * max_bits}] for head_dim={dim}, got {budget}.")
    lam = eigenvalues.reshape(-1, dim).double().clamp_min(0)
    mse = torch.tensor(GAUSSIAN_MSE[: max_bits + 1], dtype=torch.float64)
    n = lam.shape[0]
    inf = torch.tensor(math.inf, dtype=torch.float64)
    cost = torch.zeros(n, budget + 1, dtype=torch.float64)  # best error of components < j using <= B bits
    choice = torch.zeros(dim, n, budget + 1, dtype=torch.int64)
    spent = torch.arange(budget + 1)
    for j in range(dim):
        best = torch.full_like(cost, math.inf)
        arg = torch.zeros(n, budget + 1, dtype=torch.int64)
        for b in range(max_bits + 1):
            prev = torch.where(spent >= b, cost[:, (spent - b).clamp_min(0)], inf)
            cand = prev + lam[:, j: j + 1] * mse[b]
            better = cand < best
            best, arg = torch.where(better, cand, best), torch.where(better, b, arg)
        cost, choice[j] = best, arg
    bits = torch.zeros(n, dim, dtype=torch.int64)
    left = torch.full((n,), budget, dtype=torch.int64)
    rows = torch.arange(n)
    for j in reversed(range(dim)):
        bits[:, j] = choice[j, rows, left]
        left -= bits[:, j]
    return bits.view(*lead, dim)


class CoefficientQuantizer(nn.Module):
    """Fixed-rate codes for one layer's latents `[batch, heads, seq, max_rank]` -> uint8 `[batch, 1, seq, bytes]`.

    bits: `[heads, max_rank]` per component (0 drops it; a head, or a whole layer, may get none); std: `[heads,
    max_rank]` calibrated standard deviations. A token's code is `bytes_per_token = ceil(total_bits / 8)` bytes:
    component after component (flat over heads), each code's bits least significant first, from bit 0 of
    byte 0; zero padding at the end.
    """

    def __init__(self, bits: torch.Tensor, std: torch.Tensor):
        super().__init__()
        heads, rank = bits.shape
        b = bits.flatten()
        step = torch.tensor([GAUSSIAN_STEP[int(x)] if x else 0.0 for x in b], dtype=torch.float64) * std.flatten()
        self.total_bits = int(b.sum())
        self.bytes_per_token = math.ceil(self.total_bits / 8)
        # bit k of component c sits at position offset[c] + k of the token's bit string
        comp = torch.repeat_interleave(torch.arange(heads * rank), b)
        shift = torch.cat([torch.arange(int(x)) for x in b]) if self.total_bits else torch.zeros(0, dtype=torch.long)
        self.shape = (heads, rank)
        self.register_buffer("levels", (2 ** b).float(), persistent=False)
        self.register_buffer("step", step.float(), persistent=False)
        self.register_buffer("bit_component", comp, persistent=False)
        self.register_buffer("bit_shift", shift, persistent=False)
        self.register_buffer("byte_weights", 2 ** torch.arange(8), persistent=False)
        # a code is linear in its bits: bit k of component c is worth 2^k of idx[c] (exact in bfloat16: idx < 256)
        weight = torch.zeros(self.bytes_per_token * 8, heads * rank)
        weight[torch.arange(self.total_bits), comp] = 2.0 ** shift
        self.register_buffer("bit_weight", weight, persistent=False)
        self.register_buffer("offset", ((0.5 - 2.0 ** b.double() / 2) * step).float(), persistent=False)
        self.register_buffer("byte_bits", ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).float(),
                             persistent=False)

    def encode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """`[batch, heads, seq, max_rank]` -> packed codes uint8 `[batch, 1, seq, bytes_per_token]`."""
        b, h, s, r = coeffs.shape
        flat = coeffs.transpose(1, 2).reshape(b, s, h * r).float()
        safe = torch.where(self.step > 0, self.step, torch.ones_like(self.step))
        # midrise quantizer: level i reconstructs to (i + 0.5 - levels / 2) * step
        idx = torch.floor(flat / safe + self.levels / 2).clamp(torch.zeros_like(self.levels), self.levels - 1)
        idx = idx.long()
        bitstring = (idx[..., self.bit_component] >> self.bit_shift) & 1  # [b, s, total_bits]
        pad = self.bytes_per_token * 8 - self.total_bits
        bitstring = nn.functional.pad(bitstring, (0, pad)).view(b, s, self.bytes_per_token, 8)
        return (bitstring * self.byte_weights).sum(-1).to(torch.uint8).unsqueeze(1)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 `[batch, 1, seq, bytes]` -> coefficients `[batch, heads, seq, max_rank]` in `dtype`.

        A table lookup spreads each byte into its 8 bits and one matrix product sums them into each component's
        idx, both exact in bfloat16 (which CPU matrix units run fastest); values are then `(idx + 0.5 - levels /
        2) * step` in float32."""
        b, _, s, n = codes.shape
        work = torch.bfloat16 if dtype in (torch.float16, torch.bfloat16) else torch.float32
        # CPU bfloat16 matrix kernels are built per shape: rows padded to a multiple of ROW_BUCKET keep the
        # shapes few while the cache grows a token per step
        rows = b * s
        index = nn.functional.pad(codes.reshape(rows, n).int(), (0, 0, 0, -rows % ROW_BUCKET))
        bits = nn.functional.embedding(index, self.byte_bits.to(work)).view(index.shape[0], n * 8)
        values = torch.addcmul(self.offset, (bits @ self.bit_weight.to(work))[:rows].float(), self.step)
        return values.view(b, s, *self.shape).transpose(1, 2).to(dtype)
