"""`Novelty`: keep exact the tokens least like the others, what a reconstruction scorer keeps without a second pass.

KVzip ranks a token by the attention it receives while the model re-reads its context: a token the rest of the
context predicts (a repeated phrase, boilerplate) is never needed to reproduce it, and one nothing predicts (a number,
a name: a needle) is. This ranks the same tokens from the keys and values the forward already made: a token's score
is its squared distance to the nearest other token among `references` spread evenly over the tokens leaving the window
with it (neighbours within 8 positions excluded: the digits of one number are not each other's twins), keys and
values each relative to the head's total variance:

    score = min_j |k - k_j|^2 / tr(S_k) + min_j |v - v_j|^2 / tr(S_v)

The cost is one `[n, references]` product per KV head and layer (a prefill of 4k tokens: under a tenth of its
time on SmolLM2). A decode step's single token has nothing to compare with and scores 0: it never displaces a kept
token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Salience

#: a token's own neighbours (within this many positions) are not compared with it
NEIGHBOURS = 8


@dataclass(frozen=True)
class Novelty(Salience):
    """`fraction` of each KV head's coded tokens kept exact: the tokens farthest from every other (module docstring)."""

    name = "novelty"
    references: int = 256

    def __post_init__(self):
        super().__post_init__()
        self.integers(1, "references")

    def score(self, lp, keys, values, stored, observed=None):
        batch, heads, n, _ = keys.shape
        total = torch.zeros(batch, heads, n, dtype=torch.float32, device=keys.device)
        if n <= 2 * NEIGHBOURS + 1:
            return total
        picked = torch.linspace(0, n - 1, min(self.references, n), device=keys.device).round().long().unique()
        near = (torch.arange(n, device=keys.device)[:, None] - picked[None, :]).abs() <= NEIGHBOURS
        for x, variance in zip((keys, values), self.variances(lp)):
            x = x.float()
            ref = x[:, :, picked]
            distance = (x.square().sum(-1, keepdim=True) + ref.square().sum(-1).unsqueeze(2)
                        - 2 * x @ ref.transpose(-1, -2))  # [batch, kv_heads, n, references]
            total += distance.masked_fill(near, float("inf")).amin(-1).clamp_min(0) / variance[:, None]
        return total
