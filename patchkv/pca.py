"""Per-head PCA: streaming moments in float64, eigen-decomposition, rank selection."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass
class PCA:
    """Principal components of per-head vectors.

    mean: `[heads, dim]`; eigenvalues: `[heads, dim]`, descending;
    eigenvectors: `[heads, dim, dim]`, column j is component j.
    """

    mean: torch.Tensor
    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor


class CovarianceAccumulator:
    """Streaming first and second moments of `[heads, n, dim]` samples, accumulated in float64."""

    def __init__(self, heads: int, dim: int):
        self.total = torch.zeros(heads, dim, dtype=torch.float64)
        self.outer = torch.zeros(heads, dim, dim, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """x: `[heads, n, dim]`, on any device. The sums are formed in float64 where `x` lives (so a GPU sends
        `[heads, dim, dim]` per call, not the samples; MPS has no float64 and sends the samples) and kept on CPU."""
        x = x.detach()
        if x.device.type == "mps":
            x = x.cpu()
        x = x.to(torch.float64)
        self.total += x.sum(dim=1).cpu()
        self.outer += (x.transpose(1, 2) @ x).cpu()
        self.count += x.shape[1]

    def moments(self) -> torch.Tensor:
        """count, sums and outer-product sums as one flat float64 vector (counts are exact below 2**53)."""
        count = torch.tensor([float(self.count)], dtype=torch.float64)
        return torch.cat([count, self.total.flatten(), self.outer.flatten()])

    def load_moments(self, vector: torch.Tensor) -> None:
        """The inverse of `moments` (e.g. after summing the vectors of several processes)."""
        heads, dim = self.total.shape
        vector = vector.to("cpu", torch.float64)
        if vector.numel() != 1 + heads * dim + heads * dim * dim:
            raise ValueError(f"expected {1 + heads * dim + heads * dim * dim} moments for {heads} heads of dim {dim}, "
                             f"got {vector.numel()}")
        self.count = int(round(float(vector[0])))
        self.total = vector[1:1 + heads * dim].reshape(heads, dim).clone()
        self.outer = vector[1 + heads * dim:].reshape(heads, dim, dim).clone()

    def pca(self) -> PCA:
        if self.count < 2:
            raise ValueError(f"PCA needs at least 2 samples per head, got {self.count}; calibrate on more tokens.")
        mean = self.total / self.count
        cov = self.outer / self.count - mean.unsqueeze(2) * mean.unsqueeze(1)
        return principal_components(mean, cov)


def principal_components(mean: torch.Tensor, cov: torch.Tensor) -> PCA:
    """Eigen-decompose `cov` `[heads, dim, dim]` (float64), components sorted by decreasing variance.

    Signs are fixed (largest-magnitude entry of each eigenvector positive) so results are reproducible.
    """
    cov = 0.5 * (cov + cov.transpose(1, 2)).double()
    eigenvalues, eigenvectors = torch.linalg.eigh(cov)
    eigenvalues, eigenvectors = eigenvalues.flip(-1).clamp_min(0.0), eigenvectors.flip(-1)
    pivot = eigenvectors.abs().argmax(dim=1, keepdim=True)
    signs = torch.sign(torch.gather(eigenvectors, 1, pivot))
    signs[signs == 0] = 1.0
    return PCA(mean.double(), eigenvalues, eigenvectors * signs)


def select_ranks(eigenvalues: torch.Tensor, rank: int | None = None, energy: float | None = None) -> torch.Tensor:
    """Ranks per head from a fixed `rank` or an explained-variance `energy` budget.

    eigenvalues: `[..., dim]`, descending. Returns an int64 tensor of shape `[...]`, each in `[1, dim]`.
    """
    dim = eigenvalues.shape[-1]
    if (rank is None) == (energy is None):
        raise ValueError(f"Pass exactly one of rank= (an int in [1, {dim}]) or energy= (a float in (0, 1]).")
    if rank is not None:
        # any integer type (int, numpy.int64, ...), but not bool
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 1 <= int(rank) <= dim:
            raise ValueError(
                f"rank must be an integer in [1, head_dim={dim}], got {rank!r} ({type(rank).__name__}); "
                f"a rank above head_dim would store more than the uncompressed cache."
            )
        return torch.full(eigenvalues.shape[:-1], int(rank), dtype=torch.int64)
    if (isinstance(energy, bool) or not isinstance(energy, numbers.Real) or not math.isfinite(float(energy))
            or not 0.0 < float(energy) <= 1.0):
        raise ValueError(f"energy must be a real number in (0, 1] (a fraction of variance), got {energy!r} "
                         f"({type(energy).__name__}); e.g. energy=0.95.")
    share = eigenvalues.double().cumsum(-1) / eigenvalues.double().sum(-1, keepdim=True).clamp_min(1e-300)
    ranks = (share < float(energy) - 1e-12).sum(-1) + 1
    return ranks.clamp(1, dim)
