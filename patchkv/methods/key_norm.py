"""`KeyNorm`: keep exact the tokens with the smallest keys, the cheap baseline (kvpress's `KnormPress` keeps the same
ones: a low key norm goes with high attention, Devoto et al. 2024). Free to compute; it sees neither the codes
nor any query.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Salience


@dataclass(frozen=True)
class KeyNorm(Salience):
    """`fraction` of each KV head's coded tokens kept exact: the tokens with the lowest key norm."""

    name = "key_norm"

    def score(self, lp, keys, values, stored, observed=None):
        return -keys.float().norm(dim=-1)
