"""Effect-weighted transform coding: weighted PCA and one global bit pool over every coded component.

The error that matters for a cached key or value is not its squared error but its effect on what the model
computes. With a positive semi-definite weight `W` per vector space (for example the Fisher matrix
E[g g^T] of the loss gradient with respect to the cached vector, the query covariance for keys, or
W_o^T W_o for values), the expected cost of an error e is e^T W e. Writing W = L L^T, the coordinates
z = L^T (x - mean) turn that cost into a plain squared error, so the optimal orthogonal transform is the PCA
of z (eigenvectors of L^T C L), and its eigenvalues are the variances *in cost units*: they can be compared
across layers, heads, keys and values, and bits can be allocated from one pool.

Each component with cost-variance `lam` coded at b bits by the uniform quantizer matched to a Gaussian
(patchkv.quantize.GAUSSIAN_STEP) costs lam * GAUSSIAN_MSE[b] (b = 0 drops it). These distortion steps are
strictly decreasing and convex in b, so taking the `budget` largest marginal gains
lam_c * (GAUSSIAN_MSE[b] - GAUSSIAN_MSE[b + 1]) over all (component, b) is an exact optimum of the integer
allocation (the gains of each component are already sorted, so a greedy choice is always feasible).
"""

from __future__ import annotations

import torch

from .quantize import GAUSSIAN_MSE, MAX_BITS


def marginal_gains(eigenvalues: torch.Tensor, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Distortion saved by each extra bit: `[n]` -> `[n, max_bits]`, entry (c, b) = lam_c * (D[b] - D[b+1])."""
    mse = torch.tensor(GAUSSIAN_MSE[: max_bits + 1], dtype=torch.float64)
    return eigenvalues.double().clamp_min(0)[:, None] * (mse[:-1] - mse[1:])[None, :]


def expected_distortion(eigenvalues: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """sum_c lam_c * GAUSSIAN_MSE[bits_c] (float64 scalar). eigenvalues, bits: `[n]`."""
    mse = torch.tensor(GAUSSIAN_MSE, dtype=torch.float64)
    return (eigenvalues.double().clamp_min(0) * mse[bits.long()]).sum()


def allocate_bits_global(eigenvalues: torch.Tensor, budget: int, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Bits per component minimising sum_c eigenvalues[c] * GAUSSIAN_MSE[b_c] subject to sum_c b_c <= budget.

    eigenvalues: `[n]` cost-variances of every component in the pool (all layers, heads, keys and values
    concatenated; they must share one unit, e.g. from `weighted_pca` with effect weights). budget: total
    bits (0 <= budget; at most n * max_bits are used). Returns int64 `[n]`. Exact: the budget largest
    marginal gains (ties broken towards the lower index, then fewer bits), which is optimal because each
    component's gains decrease with b.
    """
    if eigenvalues.dim() != 1:
        raise ValueError(f"eigenvalues must be 1-d [n], got shape {tuple(eigenvalues.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    n = eigenvalues.shape[0]
    gains = marginal_gains(eigenvalues, max_bits).flatten()          # index c * max_bits + b
    budget = min(int(budget), n * max_bits)
    if budget == 0:
        return torch.zeros(n, dtype=torch.int64)
    # stable descending sort: equal gains keep (component, bit) order, so a component's bits stay a prefix
    order = torch.sort(gains, descending=True, stable=True).indices[:budget]
    return torch.bincount(order // max_bits, minlength=n).to(torch.int64)


def allocate_bits_grouped(eigenvalues: list[torch.Tensor], budget: int, max_bits: int = MAX_BITS
                          ) -> list[torch.Tensor]:
    """`allocate_bits_global` over a list of groups (e.g. one per layer, head and K/V): `[n_g]` each -> bits `[n_g]`."""
    sizes = [int(e.numel()) for e in eigenvalues]
    bits = allocate_bits_global(torch.cat([e.flatten() for e in eigenvalues]), budget, max_bits)
    return list(torch.split(bits, sizes))


def weighted_pca(cov: torch.Tensor, weight: torch.Tensor | None = None, ridge: float = 1e-6,
                 return_decoder: bool = False):
    """PCA minimising the weighted reconstruction error E[(x - x_hat)^T W (x - x_hat)].

    cov: `[d, d]` covariance of the vectors; weight: `[d, d]` PSD cost matrix W, or None for plain PCA
    (W = I). A ridge of `ridge * trace(W) / d` keeps W invertible. Returns
      enc `[d, d]`: coefficients y = (x - mean) @ enc, components by descending cost-variance;
      lam `[d]`: the cost-variance of each component (eigenvalues of L^T C L, W = L L^T), descending;
      and, if return_decoder, dec `[d, d]` with x_hat = mean + y @ dec (dec = enc^-1; enc.T for plain PCA).
    Truncating or quantizing component c costs lam[c] times its normalised error, in the units of W.
    """
    c = cov.double()
    d = c.shape[0]
    if weight is None:
        lam, vec = torch.linalg.eigh(c)
        lam, vec = lam.flip(0).clamp_min(0), vec.flip(1)
        return (vec, lam, vec.T) if return_decoder else (vec, lam)
    w = weight.double()
    w = (w + w.T) / 2 + torch.eye(d, dtype=torch.float64) * (ridge * torch.trace(w).abs() / d + 1e-30)
    chol = torch.linalg.cholesky(w)                                   # W = L L^T
    lam, u = torch.linalg.eigh(chol.T @ c @ chol)                     # z = L^T x has covariance L^T C L
    lam, u = lam.flip(0).clamp_min(0), u.flip(1)
    enc = chol @ u                                                    # y = z @ u = x @ L @ u
    dec = torch.linalg.solve(chol.T, u).T                             # x = y @ u^T @ L^-1
    return (enc, lam, dec) if return_decoder else (enc, lam)


def allocate_to_bytes(costs: list[torch.Tensor], byte_budget: int, max_bits: int = MAX_BITS) -> list[torch.Tensor]:
    """Bits per component for groups that are each packed to whole bytes (one group = one layer's key or value
    codes), with at most `byte_budget` bytes in all: sum_g ceil(sum(bits_g) / 8) <= byte_budget.

    costs: one `[n_g]` tensor of cost-variances per group (one shared unit). The pool is the largest number of
    bits whose global allocation fits once each group is rounded up to whole bytes (found by bisection: the
    greedy allocation only grows with the pool); then each group's padding bits (up to 7) go to its own best
    next bits, so no byte holds bits it could use. Returns int64 `[n_g]` per group.
    """
    if byte_budget < 0:
        raise ValueError(f"byte_budget must be >= 0, got {byte_budget}")

    def used_bytes(budget: int) -> int:
        return sum(-(-int(b.sum()) // 8) for b in allocate_bits_grouped(costs, budget, max_bits))

    low, high = 0, byte_budget * 8  # used_bytes(0) == 0 fits; find the largest pool that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if used_bytes(mid) <= byte_budget else (low, mid - 1)
    bits = allocate_bits_grouped(costs, low, max_bits)
    for cost, b in zip(costs, bits):
        gains = marginal_gains(cost.flatten(), max_bits)
        rows = torch.arange(len(b))
        for _ in range(-int(b.sum()) % 8):
            room = b < max_bits
            if not room.any():
                break
            nxt = torch.where(room, gains[rows, b.clamp(max=max_bits - 1)], -1.0)
            b[int(nxt.argmax())] += 1
    return bits
