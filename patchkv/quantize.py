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

from .artifact_format import MAX_BITS
from .kernels import ops as kernels
from .kernels.reference import ComponentTable

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


class CoefficientQuantizer:
    """Fixed-rate codes for one layer's latents `[batch, heads, seq, max_rank]` -> uint8 `[batch, 1, seq, bytes]`.

    bits: `[heads, max_rank]` per component (0 drops it; a head, or a whole layer, may get none); std: `[heads,
    max_rank]` calibrated standard deviations. A token's code is `bytes_per_token = ceil(total_bits / 8)` bytes:
    component after component (flat over heads), each code's bits least significant first, from bit 0 of
    byte 0; zero padding at the end. `step`, `offset` `[heads * max_rank]`: level i of a component reconstructs to
    `i * step + offset` (`offset = (0.5 - levels / 2) * step`); `table` is where each coded component sits, for
    the kernels (`patchkv.kernels`), `components` their flat indices.
    """

    def __init__(self, bits: torch.Tensor, std: torch.Tensor):
        heads, rank = bits.shape
        b = bits.flatten()
        step = torch.tensor([GAUSSIAN_STEP[int(x)] if x else 0.0 for x in b], dtype=torch.float64) * std.flatten()
        self.total_bits = int(b.sum())
        self.bytes_per_token = math.ceil(self.total_bits / 8)
        self.shape = (heads, rank)
        self.step = step.float()
        self.offset = ((0.5 - 2.0 ** b.double() / 2) * step).float()
        start = torch.cumsum(b, 0) - b  # bit k of component c sits at position start[c] + k of the token's bits
        coded = (b > 0).nonzero().squeeze(1)
        self.components = coded
        layout = {"shift": start[coded] % 8, "mask": 2 ** b[coded] - 1, "step": self.step[coded],
                  "offset": self.offset[coded], "wide": (start[coded] % 8 + b[coded] > 8).int()}
        self.table = ComponentTable.build(heads, rank, coded, torch.div(start[coded], 8, rounding_mode="floor"), layout)

    def to(self, device: torch.device) -> CoefficientQuantizer:
        self.step, self.offset, self.components = (t.to(device) for t in (self.step, self.offset, self.components))
        self.table = self.table.to(device)
        return self

    def encode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """`[batch, heads, seq, max_rank]` -> packed codes uint8 `[batch, 1, seq, bytes_per_token]` (midrise quantizer:
        level i reconstructs to `(i + 0.5 - levels / 2) * step`; written through `patchkv.kernels`)."""
        return kernels.encode(coeffs, self.table, self.components, self.bytes_per_token).unsqueeze(1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 `[batch, 1, seq, bytes]` -> float32 coefficients `[batch, heads, seq, max_rank]`: `(idx + 0.5 -
        levels / 2) * step`, 0 for components without bits (read through `patchkv.kernels`)."""
        return self.table.spread(kernels.unpack(codes.squeeze(1), self.table), self.components, self.shape[1])
