"""`AttentionMass`: keep exact the tokens the forward's last queries attend to most (SnapKV's observation window,
H2O / TOVA's accumulated attention), read from the queries the forward already computed.

A token leaving the window scores the attention it receives from the last `observe` queries of the forward that
moves it out (a prefill: the end of the context; a decode step: that step's query), averaged over those queries and
the KV head's query heads, softmax taken over the tokens leaving together (so the cost is `[observe, n]` per query
head: a few hundredths of a prefill). It sees what the end of the context asks of it, not what a later question
will: kvpress's attention-based presses keep few RULER needles past 8x (docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Salience


@dataclass(frozen=True)
class AttentionMass(Salience):
    """`fraction` of each KV head's coded tokens kept exact: the tokens the last `observe` queries attend to most."""

    name = "attention_mass"
    observes = True
    observe: int = 32

    def __post_init__(self):
        super().__post_init__()
        self.integers(1, "observe")

    def score(self, lp, keys, values, stored, observed=None):
        batch, heads, n, dim = keys.shape
        if observed is None:
            return torch.zeros(batch, heads, n, dtype=torch.float32, device=keys.device)
        q = observed.queries[:, :, -self.observe:].float()
        w = q.shape[2]
        q = q.view(batch, heads, -1, w, dim)  # each KV head's query heads together
        logits = q @ observed.keys.float().unsqueeze(2).transpose(-1, -2) * observed.scaling  # [b, h, g, w, n]
        after = observed.query_positions[:, -w:, None] >= observed.positions[:, None, :]  # causal: [batch, w, n]
        logits = logits.masked_fill(~after[:, None, None], float("-inf"))
        return torch.softmax(logits, dim=-1).nan_to_num(0.0).mean((2, 3))
