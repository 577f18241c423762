"""Step scales: the quantizer range of `Quantized` codes, fitted to the model's loss on calibration text.

`Quantized` codes each PCA coefficient with the uniform quantizer matched to a Gaussian of its variance
(`patchkv.quantize`), which minimises the coefficient's own mean squared error. At 1-3 bits that quantizer
clips hard, and real keys and values are heavier-tailed than a Gaussian. Attention reads the tails: the
tokens a query attends to most are those with large coefficients along it. Widening the range (every step
times s > 1) costs resolution near zero and buys the tails back.

`fit_step_scales` picks one s for keys and one for values by the loss of the patched model itself: token
log-likelihood of calibration text fed `chunk` tokens per forward through a `LatentCache` (so every token reads
earlier ones as the cache holds them), with `SinksWindow(sink_tokens, window)` and `Quantized(bits, pool)`, by
coordinate descent over `grid` (keys, then values, then keys again). The artifact stores a scale per layer
and head, so finer fits can be written in the same format; a per-head fit of attention output error alone was
tried on SmolLM2 and lost to one scale per kind on held-out perplexity.

Scales are fitted per budget: the artifact keeps one set per `(bits, pool)` (`Artifact.step_budgets`, format
version 4), and `Quantized(bits, pool)` reads the set fitted for its budget, or for the nearest of its pool
(`patchkv.allocation.step_scales_for`). Each fit's trials are recorded, for information, in
`calibration["step_scale_fits"]`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .artifact import KINDS, Artifact
from .errors import PatchKVError
from .methods import Quantized, SinksWindow
from .patching import is_patched, patched
from .perplexity import token_nll

#: step multipliers tried, for keys and for values
GRID = (1.0, 1.25, 1.5, 1.75)


@torch.no_grad()
def fit_step_scales(model: nn.Module, artifact: Artifact, input_ids: torch.Tensor, *, bits: int, pool: str = "head",
                    context: int | None = None, sink_tokens: int = 4, window: int = 32, chunk: int | None = None,
                    grid: tuple[float, ...] = GRID, passes: int = 3) -> Artifact:
    """A copy of `artifact` with step scales (format version 4) fitted for `Quantized(bits, pool, context=context)`
    (a budget's codes, `Budget.quantized`: `context` prices the pool of a model with sliding-window layers) behind
    `SinksWindow(sink_tokens, window)` on `input_ids` `[batch, seq]` (unpadded calibration text, held out from
    what you evaluate on), fed `chunk` tokens per forward (default: half the window, at least 1). `model` is
    the unpatched model the artifact was calibrated for. The search is coordinate-wise over `grid`: the keys'
    scale, then the values', then the keys' again (`passes` 3; 2 stops after the values, 7 losses instead of
    10)."""
    if is_patched(model):
        raise PatchKVError("fit_step_scales() needs the original model, but this model is patched by patchkv. "
                           "Call patchkv.remove(model) first.")
    artifact.check_compatible(model)
    if input_ids.dim() != 2 or input_ids.shape[1] <= sink_tokens + window + 1:
        raise ValueError(f"input_ids must be [batch, seq] with seq > sink_tokens + window + 1 = "
                         f"{sink_tokens + window + 1}, got shape {tuple(input_ids.shape)}.")
    if not grid or min(grid) <= 0:
        raise ValueError(f"grid must hold step multipliers > 0, got {grid}.")
    if passes not in (1, 2, 3):
        raise ValueError(f"passes must be 1, 2 or 3, got {passes}.")
    chunk = chunk or max(1, window // 2)
    methods = [SinksWindow(sink_tokens, window), Quantized(bits, pool=pool, context=context)]
    tried: dict[tuple[float, float], float] = {}

    def loss(scales: tuple[float, float]) -> float:
        if scales not in tried:
            with patched(model, with_step_scales(artifact, *scales, bits=bits, pool=pool), methods):
                tried[scales] = token_loss(model, input_ids, chunk)
        return tried[scales]

    best = (1.0, 1.0)
    for kind in (0, 1, 0)[:passes]:  # keys, values, keys again
        candidates = [tuple(s if i == kind else best[i] for i in range(2)) for s in grid]
        best = min(candidates, key=lambda c: (loss(c), c))
    out = with_step_scales(artifact, *best, bits=bits, pool=pool)
    fits = [f for f in artifact.calibration.get("step_scale_fits", []) if isinstance(f, dict)
            and (f.get("bits"), f.get("pool")) != (bits, pool)]
    out.calibration["step_scale_fits"] = fits + [{
        "bits": bits, "pool": pool, "sink_tokens": sink_tokens, "window": window, "chunk": chunk,
        "tokens": int(input_ids.numel()), "keys": best[0], "values": best[1],
        "tried": [[k, v, round(nll, 6)] for (k, v), nll in sorted(tried.items())]}]
    return out


def with_step_scales(artifact: Artifact, keys: float, values: float, *, bits: int, pool: str) -> Artifact:
    """A copy (tensors shared) with step scale `keys` on every head's keys and `values` on every head's values for
    the budget `Quantized(bits, pool)`, replacing the artifact's set for that budget or added to its sets."""
    budgets = list(artifact.step_budgets or [])
    index = budgets.index((bits, pool)) if (bits, pool) in budgets else len(budgets)
    budgets[index:index + 1] = [(bits, pool)]
    parts = {}
    for kind, scale in zip(KINDS, (keys, values)):
        c = getattr(artifact, kind)
        new = torch.full((1, *c.ranks.shape), float(scale))
        old = c.step_scales.float() if c.step_scales is not None else new[:0]
        stacked = torch.cat([old[:index], new, old[index + 1:]])
        parts[kind] = dataclasses.replace(c, step_scales=stacked)
    return Artifact(mode=artifact.mode, model=artifact.model, calibration=dict(artifact.calibration),
                    step_budgets=budgets, **parts)


def token_loss(model: nn.Module, input_ids: torch.Tensor, chunk: int) -> float:
    """Mean next-token negative log-likelihood (nats) of `input_ids` `[batch, seq]` fed `chunk` tokens per forward
    through the model's own cache (`patchkv.perplexity.token_nll`)."""
    scored = token_nll(model, input_ids, chunk)
    return scored.nll / scored.count if scored.count else math.nan
