"""Per-head PCA: streaming moments in float64, eigen-decomposition, rank selection."""

from __future__ import annotations

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
        """x: `[heads, n, dim]`."""
        x = x.detach().to("cpu", torch.float64)
        self.total += x.sum(dim=1)
        self.outer += x.transpose(1, 2) @ x
        self.count += x.shape[1]

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
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= dim:
            raise ValueError(
                f"rank must be an int in [1, head_dim={dim}], got {rank!r}; "
                f"a rank above head_dim would store more than the uncompressed cache."
            )
        return torch.full(eigenvalues.shape[:-1], rank, dtype=torch.int64)
    if not 0.0 < float(energy) <= 1.0:
        raise ValueError(f"energy must be a fraction of variance in (0, 1], got {energy!r}, e.g. energy=0.95.")
    share = eigenvalues.double().cumsum(-1) / eigenvalues.double().sum(-1, keepdim=True).clamp_min(1e-300)
    ranks = (share < float(energy) - 1e-12).sum(-1) + 1
    return ranks.clamp(1, dim)
