"""`CodeError`: keep exact the tokens the codes represent worst.

A token's score is the squared error of its decoded codes, keys and values each relative to the head's total
variance (the sum of the artifact's eigenvalues, so the two are comparable):

    score = |k - decode(code(k))|^2 / tr(S_k) + |v - decode(code(v))|^2 / tr(S_v)

Tokens far from what calibration saw (digits, names, rare words: what a needle is made of) are the ones a fixed-rate
code cuts short, and the ones this ranks first. The cost is one decode of the tokens leaving the window, next to the
encode they already pay; it needs no query and no second pass over the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import ops as kernels
from .base import Salience


@dataclass(frozen=True)
class CodeError(Salience):
    """`fraction` of each KV head's coded tokens kept exact: the tokens whose codes miss them most (module docstring)."""

    name = "code_error"
    reads_codes = True

    def score(self, lp, keys, values, stored, observed=None):
        total = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
        for codec, exact, codes, variance in zip((lp.keys, lp.values), (keys, values), stored, self.variances(lp)):
            decoded = kernels.reconstruct(codes.squeeze(1), codec.table, codec.rows, codec.kernel_mean, None,
                                          torch.float32)
            total += (exact.float() - decoded).square().sum(-1) / variance[:, None]
        return total
