"""`TopK`: at each decode step, attend to the `k` latent tokens per KV head that score best.

Candidates are scored in the latent space from their first `rank` key components, read straight from the
stored codes without reconstructing keys (kernel `leading_scores`; post-RoPE: the projected query against latents,
exact at full rank; pre-RoPE: per chunk of `patchkv.key_space.SCORE_CHUNK` tokens, the query turned back by the
rotation of the chunk's centre position and projected onto the basis, approximate by the rotation between a token
and its chunk's centre; the mode's `approximate_scores`). A KV head keeps the tokens that score
best for any of its query heads (`select`); attention reconstructs (and rotates) only those and runs exactly over
sinks, those tokens and the window. Prefill (more than one query) is dense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import Selector

if TYPE_CHECKING:
    from ..latent import Codec


@dataclass(frozen=True)
class TopK(Selector):
    """`k` latent tokens per KV head, scored from the first `rank` key components (None: all the codec keeps)."""

    name = "topk"
    k: int = 64
    rank: int | None = None

    def __post_init__(self):
        self.integers(1, "k", "rank")

    def applies(self, query_len: int, middle_len: int) -> bool:
        return query_len == 1 and middle_len >= self.k

    def choose(self, codec: Codec, score: Callable[[int], torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
        """Scores every middle token from its first `rank` key components (masked columns by `bias`) and keeps each
        KV head's `k` best (`select`): sorted indices `[batch, kv_heads, k]` into the middle."""
        rank = min(self.rank or codec.basis.max_rank, codec.basis.max_rank)
        scores = score(rank)  # [batch, heads, m]
        if bias is not None:
            scores = scores + bias
        return self.select(scores, codec.basis.query_groups)

    def select(self, scores: torch.Tensor, groups: int) -> torch.Tensor:
        """Scores `[batch, heads, n]` -> each KV head's `k` best tokens for any of its `groups` query heads, sorted
        indices `[batch, kv_heads, k]` into the n tokens."""
        batch, heads, n = scores.shape
        per_kv_head = scores.view(batch, heads // groups, groups, n).amax(2)
        return per_kv_head.topk(self.k, dim=-1).indices.sort(dim=-1).values
