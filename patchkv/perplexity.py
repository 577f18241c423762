"""Token perplexity through the KV cache: the one scoring function the library, the CLI and the benchmarks share.

Text is fed `chunk` tokens per forward, so every token reads the earlier ones as the cache holds them (its own
chunk, and for a patched model the window before it, exact), as generation would. One forward per sequence would
score a patched model as the unpatched one: a forward reads its own tokens exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Scored:
    """What `token_nll` measured: the sum of next-token negative log-likelihoods (nats) over `count` tokens, the
    cache holding the text, and the logits after its last token `[batch, vocab]` (to continue from)."""

    nll: float
    count: int
    cache: Any
    last_logits: torch.Tensor

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count) if self.count else math.nan


@torch.no_grad()
def token_nll(model: nn.Module, input_ids: torch.Tensor, chunk: int, cache: Any = None,
              targets: torch.Tensor | None = None) -> Scored:
    """Score `input_ids` `[batch, seq]` fed `chunk` tokens per forward through `cache` (None: the model's own, a
    `LatentCache` when patched); the cache is left holding the text. `targets` `[batch, seq]`: where each token's
    logit is read (default `input_ids`; for a model whose head scores a restricted vocabulary, the tokens' indices
    in it)."""
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    targets_at = ids if targets is None else targets.to(device)
    total, count, logits = 0.0, 0, None
    for start in range(0, ids.shape[1], chunk):
        step = ids[:, start:start + chunk]
        out = model(input_ids=step, cache=cache, use_cache=True)
        cache = out.cache if cache is None else cache
        targets = targets_at[:, start + 1:start + 1 + step.shape[1]]
        logits = out.logits[:, -1].float()
        if targets.shape[1]:
            logprobs = out.logits[:, : targets.shape[1]].float().log_softmax(-1)
            total -= logprobs.gather(-1, targets.unsqueeze(-1)).sum().item()
            count += targets.numel()
    return Scored(total, count, cache, logits)


def token_perplexity(model: nn.Module, input_ids: torch.Tensor, chunk: int, cache: Any = None) -> float:
    """exp(mean next-token NLL) of `input_ids` through the cache (`token_nll`)."""
    return token_nll(model, input_ids, chunk, cache).perplexity
