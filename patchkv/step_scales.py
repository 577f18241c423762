"""Step scales: the quantizer range of `Quantized` codes, fitted to the model's loss on calibration text.

`Quantized` codes each PCA coefficient with the uniform quantizer matched to a Gaussian of its variance
(`patchkv.quantize`), which minimises the coefficient's own mean squared error. At 1-3 bits that quantizer
clips hard, and real keys and values are heavier-tailed than a Gaussian. Attention reads the tails: the
tokens a query attends to most are those with large coefficients along it. Widening the range (every step
times s > 1) costs resolution near zero and buys the tails back.

`fit_step_scales` picks one s for keys and one for values by the loss of the patched model itself: token
log-likelihood of calibration text fed `chunk` tokens per forward through a `LatentCache` (so every token reads
earlier ones as the cache holds them), with `SinksWindow(sink_tokens, window)` and `Quantized(bits, pool)`, by
coordinate descent over `grid` (keys, then values, then keys again). The loss is read over a restricted vocabulary:
the text's own tokens and, at every position, the unpatched model's `top` (64) likeliest next tokens (found in one
unpatched pass; `loss_vocabulary`), with the model's output head cut to those rows while fitting (`restricted_head`).
A 262k-token head is otherwise most of each trial's time (Gemma 3 270M: 57%), and the candidates differ in the
probability they give tokens the model considers, not in the tail: on SmolLM2 the restricted loss orders the
trials as the full one does (`python -m evals.research_step_loss`; each fit records its vocabulary). `patchkv
calibrate` restricts it by default only for vocabularies above 65,536 tokens (`--step-top`). The artifact stores a scale per layer
and head, so finer fits can be written in the same format; a per-head fit of attention output error alone was
tried on SmolLM2 and lost to one scale per kind on held-out perplexity.

Scales are fitted per budget: the artifact keeps one set per `(bits, pool)` (`Artifact.step_budgets`, format
version 4), and `Quantized(bits, pool)` reads the set fitted for its budget, or for the nearest of its pool
(`patchkv.allocation.step_scales_for`). Each fit's trials are recorded, for information, in
`calibration["step_scale_fits"]`, with its grid and the scales that sit at an end of it (`grid_edges`: the loss may
fall further past that end; `patchkv calibrate` then says so and offers a wider `--step-grid`). With `extend` N
(`--step-extend`) a scale that wins at an end is searched on past it, a multiplier at a time at the grid's spacing
there, while the loss falls, N at most. Not the default: the calibration loss moves little out there and ranked the
scales unlike held-out text did (Gemma 3 270M on 3-layer spans, 8x +6.7% -> +9.6% at 4k; SmolLM2's main job mixed,
8x worse, 16x better; docs/results.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from .artifact import KINDS, Artifact
from .errors import PatchKVError
from .methods import Quantized, SinksWindow
from .patching import is_patched, patched
from .perplexity import token_nll

#: step multipliers tried, for keys and for values
GRID = (1.0, 1.25, 1.5, 1.75)
#: the loss reads the unpatched model's this many likeliest next tokens at each position (and the targets)
TOP = 64


@torch.no_grad()
def fit_step_scales(model: nn.Module, artifact: Artifact, input_ids: torch.Tensor, *, bits: int, pool: str = "head",
                    basis: str = "head", context: int | None = None, sink_tokens: int = 4, window: int = 32,
                    chunk: int | None = None, grid: tuple[float, ...] = GRID, passes: int = 3, top: int | None = TOP,
                    extend: int = 0) -> Artifact:
    """A copy of `artifact` with step scales (format version 4) fitted for `Quantized(bits, pool, basis, context)`
    (a budget's codes, `Budget.quantized`: `basis` "layer" codes on the artifact's layer bases, its set stored
    under (bits, pool) as every set is, so it replaces a per-head fit of the same bits; `context` prices the pool
    of a model with sliding-window layers) behind
    `SinksWindow(sink_tokens, window)` on `input_ids` `[batch, seq]` (unpadded calibration text, held out from
    what you evaluate on), fed `chunk` tokens per forward (default: half the window, at least 1). `model` is
    the unpatched model the artifact was calibrated for. The search is coordinate-wise over `grid`: the keys'
    scale, then the values', then the keys' again (`passes` 3; 2 stops after the values, 7 losses instead of
    10). Where a kind's best multiplier is an end of those tried, the next one past it (the grid's spacing at that
    end, as a ratio: 1.0, 1.25, ... goes on to 0.8, 0.64) is tried, up to `extend` times while the loss falls; the
    fit records those (`beyond`) and the ends it still sits at (`edges`)."""
    if is_patched(model):
        raise PatchKVError("fit_step_scales() needs the original model, but this model is patched by patchkv. "
                           "Call patchkv.remove(model) first.")
    artifact.check_compatible(model)
    if input_ids.dim() != 2 or input_ids.shape[1] <= sink_tokens + window + 1:
        raise ValueError(f"input_ids must be [batch, seq] with seq > sink_tokens + window + 1 = "
                         f"{sink_tokens + window + 1}, got shape {tuple(input_ids.shape)}.")
    if not grid or min(grid) <= 0:
        raise ValueError(f"grid must hold step multipliers > 0, got {grid}.")
    if isinstance(extend, bool) or not isinstance(extend, int) or extend < 0:
        raise ValueError(f"extend must be a non-negative integer (0: the grid only), got {extend!r}.")
    if passes not in (1, 2, 3):
        raise ValueError(f"passes must be 1, 2 or 3, got {passes}.")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"top must be a positive integer (or None: the whole vocabulary), got {top!r}.")
    chunk = chunk or max(1, window // 2)
    methods = [SinksWindow(sink_tokens, window), Quantized(bits, pool=pool, basis=basis, context=context)]
    tried: dict[tuple[float, float], float] = {}
    vocabulary = loss_vocabulary(model, input_ids, top) if top is not None else None
    targets = torch.searchsorted(vocabulary, input_ids.to(vocabulary.device)) if vocabulary is not None else None

    def loss(scales: tuple[float, float]) -> float:
        if scales not in tried:
            with patched(model, with_step_scales(artifact, *scales, bits=bits, pool=pool), methods):
                tried[scales] = token_loss(model, input_ids, chunk, targets)
        return tried[scales]

    searched = [sorted(set(grid)), sorted(set(grid))]  # per kind: the grid and the multipliers tried past it
    best = (1.0, 1.0)

    def at(kind: int, scale: float) -> tuple[float, float]:
        return (scale, best[1]) if kind == 0 else (best[0], scale)

    with restricted_head(model, vocabulary):
        for kind in (0, 1, 0)[:passes]:  # keys, values, keys again
            best = min((at(kind, s) for s in searched[kind]), key=lambda c: (loss(c), c))
            for _ in range(extend):  # past an end of what was searched while the loss still falls there
                ends = searched[kind]
                if len(ends) < 2 or best[kind] not in (ends[0], ends[-1]):
                    break
                beyond = ends[0] * ends[0] / ends[1] if best[kind] == ends[0] else ends[-1] * ends[-1] / ends[-2]
                beyond = round(beyond, 4)
                searched[kind] = sorted({*ends, beyond})  # a beyond that loses is no longer best: the loop stops
                best = min((best, at(kind, beyond)), key=lambda c: (loss(c), c))
    out = with_step_scales(artifact, *best, bits=bits, pool=pool)
    fits = [f for f in artifact.calibration.get("step_scale_fits", []) if isinstance(f, dict)
            and (f.get("bits"), f.get("pool")) != (bits, pool)]
    out.calibration["step_scale_fits"] = fits + [{
        "bits": bits, "pool": pool, "basis": basis, "sink_tokens": sink_tokens, "window": window, "chunk": chunk,
        "tokens": int(input_ids.numel()), "keys": best[0], "values": best[1],
        "grid": list(grid), "extend": extend,
        "beyond": {kind: past for kind, tried_kind in zip(KINDS, searched)
                   if (past := [s for s in tried_kind if s not in grid])},
        "edges": {kind: edge for kind, tried_kind in zip(KINDS, searched)
                  if (edge := grid_edges(best, tuple(tried_kind)).get(kind))},
        "loss_vocabulary": {"top": top, "tokens": int(vocabulary.numel()) if vocabulary is not None else None},
        "tried": [[k, v, round(nll, 6)] for (k, v), nll in sorted(tried.items())]}]
    return out


def grid_edges(best: tuple[float, float], grid: tuple[float, ...]) -> dict[str, str]:
    """{kind: "lowest" or "highest"} for each of the fitted (keys, values) scales `best` that is the lowest or the
    highest multiplier of `grid`: there the loss may fall further past the grid, which a wider one would find (Gemma 3
    270M's 16x values fit 1.0 on the default grid and 0.625 on one reaching 0.5, plain 16x at 4k +65.6% -> +52.7%)."""
    return {kind: "lowest" if scale == min(grid) else "highest" for kind, scale in zip(KINDS, best)
            if len(set(grid)) > 1 and scale in (min(grid), max(grid))}


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


def token_loss(model: nn.Module, input_ids: torch.Tensor, chunk: int, targets: torch.Tensor | None = None) -> float:
    """Mean next-token negative log-likelihood (nats) of `input_ids` `[batch, seq]` fed `chunk` tokens per forward
    through the model's own cache (`patchkv.perplexity.token_nll`; `targets`: the tokens' indices in a restricted
    head's vocabulary)."""
    scored = token_nll(model, input_ids, chunk, targets=targets)
    return scored.nll / scored.count if scored.count else math.nan


@torch.no_grad()
def loss_vocabulary(model: nn.Module, input_ids: torch.Tensor, top: int = TOP, chunk: int = 256) -> torch.Tensor | None:
    """The vocabulary the step-scale loss reads, sorted token ids `[v]` (int64): every token of `input_ids` `[batch,
    seq]` and, at every position, the unpatched `model`'s `top` likeliest next tokens (one pass, `chunk` tokens per
    forward). None when that is the whole vocabulary, or the model's head is not a plain `[vocab, hidden]` matrix
    (`restricted_head` cannot cut it)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or top >= weight.shape[0]:
        return None
    ids = input_ids.to(weight.device)
    found, cache = [ids.flatten()], None
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True)
        cache = out.cache
        found.append(out.logits.topk(top, dim=-1).indices.flatten().to(weight.device))
    vocabulary = torch.unique(torch.cat(found))
    return vocabulary if vocabulary.numel() < weight.shape[0] else None


class _Rows(nn.Module):
    """An output head's rows of `vocabulary`: logits `[..., v]` over those tokens only."""

    def __init__(self, head: nn.Module, vocabulary: torch.Tensor):
        super().__init__()
        bias = getattr(head, "bias", None)
        self.register_buffer("weight", head.weight.detach()[vocabulary], persistent=False)
        self.register_buffer("bias", bias.detach()[vocabulary] if bias is not None else None, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.device), self.weight, self.bias)


@contextlib.contextmanager
def restricted_head(model: nn.Module, vocabulary: torch.Tensor | None) -> Iterator[None]:
    """Within the block the model's output head scores only `vocabulary` (`[v]` token ids: logits `[batch, seq, v]`
    in its order); the model's own head is put back on exit. None: the whole vocabulary, nothing changed."""
    if vocabulary is None:
        yield
        return
    head = model.get_output_embeddings()
    model.set_output_embeddings(_Rows(head, vocabulary))
    try:
        yield
    finally:
        model.set_output_embeddings(head)
