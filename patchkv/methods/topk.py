"""`TopK`: at each decode step, attend to the `k` latent tokens per KV head that score best.

Candidates are scored cheaply from their first `rank` key components (post-RoPE: the projected query
against latents, Triton kernel `latent_scores`; pre-RoPE: a rank-`rank` reconstruction rotated to each
token's position, kernel `reconstruct_rope`; see `patchkv.modes`). A KV head keeps the tokens that score
best for any of its query heads; attention then runs exactly over sinks, those tokens and the window.
Prefill (more than one query) is dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector, check_int


@dataclass(frozen=True)
class TopK(Selector):
    name = "topk"
    k: int = 64
    rank: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "k", check_int("topk", "k", self.k, 1))
        if self.rank is not None:
            object.__setattr__(self, "rank", check_int("topk", "rank", self.rank, 1))

    def applies(self, query_len: int, middle_len: int) -> bool:
        return query_len == 1 and middle_len >= self.k

    def select(self, scores: torch.Tensor, groups: int) -> torch.Tensor:
        batch, heads, n = scores.shape
        per_kv_head = scores.view(batch, heads // groups, groups, n).amax(2)
        return per_kv_head.topk(self.k, dim=-1).indices.sort(dim=-1).values
