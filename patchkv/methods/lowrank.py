"""`LowRank`: keep each head's leading PCA components as floats (the default codec)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..latent import Codec, LatentBasis, PackedCodec
from .base import CodecMethod


@dataclass(frozen=True)
class LowRank(CodecMethod):
    """Latents at the artifact's ranks, or re-truncated to `rank` components per head / the fewest that
    explain `energy` of the variance (keys and values each from their own spectrum)."""

    name = "lowrank"
    rank: int | None = None
    energy: float | None = None

    def __post_init__(self):
        if self.rank is not None and self.energy is not None:
            raise ValueError("lowrank: pass rank= or energy=, not both.")
        self.integers(1, "rank")
        if self.energy is not None and not 0.0 < float(self.energy) <= 1.0:
            raise ValueError(f"lowrank: energy must be in (0, 1], got {self.energy!r}.")

    def codecs(self, artifact, query_groups: list[int], dtype: torch.dtype) -> list[tuple[Codec, Codec]]:
        if self.rank is not None or self.energy is not None:
            artifact = artifact.with_ranks(rank=self.rank, energy=self.energy)
        return [tuple(PackedCodec(LatentBasis(c.mean[i], c.eigenvectors[i], c.ranks[i].tolist(), groups, dtype))
                      for c in (artifact.keys, artifact.values))
                for i, groups in enumerate(query_groups)]
