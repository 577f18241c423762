"""`Evict`: drop the coded tokens a question-agnostic score ranks lowest, and spend their bytes on the rest.

    position:  0 .. sinks-1 | ...                                      | the last `window`
    stored as: exact K/V    | codes, the lowest `fraction` dropped     | exact K/V

Codes keep every token at one rate and eviction keeps a few tokens exact; this does both: the tokens a score ranks
lowest go, and the budget's bytes code the others at a higher rate. Which tokens go depends on the score, and on what
the cache is for (SmolLM2 at 4k, bf16, `evals/results/smollm2_accuracy.csv`):
- `scorer="novelty"` (the default) keeps what nothing else in the context predicts: `"16x+evict"` (78 bits per head
  where 16x alone gets 55) found 72 of 100 needles in real prose where 16x codes on every token found 23 and KVzip at
  16x 10 of 50 (unpatched 85), and with 70% dropped at 32x RULER's needle 99 times in 100. The tokens a continuation
  reads go with the rest: perplexity after such a context rose more than at 16x (+12.6% against +6.4% on prose).
- `scorer="attention_mass"` keeps what the context's last queries attend to (SnapKV's observation window): after the
  context, perplexity +3.1% on prose at 16x and +8.9% at 32x with 70% dropped (KVzip +9.5% and +24.4%), but a needle
  nothing at the end of the context points to goes.

Tokens are ranked as they leave the window, before they are coded: those leaving together, at least `block` of them
(a prefill, a chunk of a chunked prefill), by `scorer` (a `Salience` method's score, averaged over the layer's KV
heads: the same tokens go from every head, so the codes stay one row per token), and the lowest `fraction` of them
(rounded down; of equal scores the earlier) is dropped. Fewer leaving together (a decode step's one token, chunks
under `block`) are coded as they leave, and once `block` of them have gathered they are ranked together from their
codes (keys and values rebuilt; with near codes, those still in the near region) and the lowest `fraction` go, so a
long generation holds the budget's rate (up to `block - 1` tokens at a time wait to be ranked; a scorer that reads
how a token is coded, `code_error`, cannot rank them from their codes and keeps them). Sliding-window layers drop
none. Each full-attention layer keeps a bitmap of the tokens it kept, one bit per token that left its window
(`patchkv.cache`), from which attention reads the kept tokens' true positions and mask columns. A budget pays for the
kept tokens' codes and the bitmap ("16x+evict": the codes get the bytes the dropped tokens free, `patchkv.budgets`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .attention_mass import AttentionMass
from .base import CachePlan, Method, Observation, Salience, spec_of
from .code_error import CodeError
from .key_norm import KeyNorm
from .novelty import Novelty

if TYPE_CHECKING:
    from ..patch import LayerPatch

#: the scores a token can be dropped by, by name (each a `Salience` method's `score`)
SCORERS: dict[str, type[Salience]] = {cls.name: cls for cls in (Novelty, CodeError, KeyNorm, AttentionMass)}


@dataclass(frozen=True)
class Evict(Method):
    """The lowest `fraction` of each full-attention layer's tokens leaving the window together (at least `block` of
    them) by `scorer`, dropped before they are coded (module docstring)."""

    name = "evict"
    role = "eviction"
    fraction: float = 0.3
    scorer: str = "novelty"
    block: int = 64

    def __post_init__(self):
        self.fraction_of_tokens()
        if self.scorer not in SCORERS:
            raise ValueError(f"{self.name}: scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}.")
        self.integers(1, "block")

    @property
    def score_method(self) -> Salience:
        """The salience method whose `score` ranks the tokens (its fraction unused)."""
        return SCORERS[self.scorer]()

    @property
    def observes(self) -> bool:
        """Whether the score reads this forward's queries (`Observation`)."""
        return SCORERS[self.scorer].observes

    @property
    def reads_codes(self) -> bool:
        """Whether the score reads the tokens' middle codes."""
        return SCORERS[self.scorer].reads_codes

    def dropped(self, leaving: int) -> int:
        """Tokens dropped of `leaving` that leave the window together."""
        return int(self.fraction * leaving) if leaving >= self.block else 0

    def kept(self, coded: int) -> int:
        """Tokens kept of `coded` that leave the window in one block (a one-forward prefill: what budgets price)."""
        return coded - self.dropped(coded)

    def rank(self, lp: LayerPatch, keys: torch.Tensor, values: torch.Tensor,
             stored: tuple[torch.Tensor, torch.Tensor] | None, observed: Observation | None = None) -> torch.Tensor:
        """Tokens leaving the window, as a `Salience` method's `score` takes them (keys and values `[batch, kv_heads,
        n, head_dim]` exact in cache space, their middle codes where the scorer reads them, this forward's queries
        where it observes them) -> float32 `[batch, n]`, the layer's KV heads averaged, lowest dropped first."""
        return self.score_method.score(lp, keys, values, stored, observed).float().mean(1)

    def spec(self) -> str:
        """`evict` and the fields that differ from their defaults ("evict", "evict:fraction=0.2")."""
        return spec_of(self)

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, evict=self)
