"""Token perplexity through the KV cache: the one scoring function the library, the CLI and the benchmarks share.

Text is fed `chunk` tokens per forward, so every token reads the earlier ones as the cache holds them (its own
chunk, and for a patched model the window before it, exact), as generation would. One forward per sequence would
score a patched model as the unpatched one: a forward reads its own tokens exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Scored:
    """What `token_nll` measured: the sum of next-token negative log-likelihoods (nats) over `count` tokens, whether
    each of them was the greedy choice, the cache holding the text, and the logits after its last token
    `[batch, vocab]` (to continue from)."""

    nll: float
    count: int
    greedy: bool
    cache: Any
    last_logits: torch.Tensor

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count) if self.count else math.nan


@torch.no_grad()
def token_nll(model: nn.Module, input_ids: torch.Tensor, chunk: int, cache: Any = None, prompt: int = 0,
              targets: torch.Tensor | None = None, after: Callable[[Any, int, int], None] | None = None) -> Scored:
    """Score `input_ids` `[batch, seq]` fed through `cache` (None: the model's own, a `LatentCache` when patched),
    the cache left holding them: the first `prompt` tokens in one forward and only the tokens after them scored (a
    prompt reads itself exact, as in generation), then `chunk` tokens per forward; `prompt` 0: every token from the
    second on scored, the first forward `chunk` tokens too. `targets` `[batch, seq]`: where each token's logit is
    read (default `input_ids`; for a model whose head scores a restricted vocabulary, the tokens' indices in it).
    `after(cache, start, n)`: called after each forward, which fed the `n` tokens from `start` (a simulation that
    rewrites the cache between forwards)."""
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    targets_at = ids if targets is None else targets.to(device)
    total, count, greedy, logits, start = 0.0, 0, True, None, 0
    while start < ids.shape[1]:
        step = ids[:, start:start + (prompt or chunk if start == 0 else chunk)]
        out = model(input_ids=step, cache=cache, use_cache=True)
        cache = out.cache if cache is None else cache
        skip = max(0, prompt - 1 - start)  # predictions of prompt tokens
        targets = targets_at[:, start + 1 + skip:start + 1 + step.shape[1]]
        logits = out.logits[:, -1].float()
        if targets.shape[1]:
            logprobs = out.logits[:, skip:skip + targets.shape[1]].float().log_softmax(-1)
            total -= logprobs.gather(-1, targets.unsqueeze(-1)).sum().item()
            greedy = greedy and bool((logprobs.argmax(-1) == targets).all())
            count += targets.numel()
        if after is not None:
            after(cache, start, step.shape[1])
        start += step.shape[1]
    return Scored(total, count, greedy, cache, logits)
