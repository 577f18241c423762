"""Budgets: "8x" (compression against the 16-bit cache, every byte counted) or a number of bits per KV head and
token, turned into the methods that meet them (`Quantized` codes behind `SinksWindow`).

    budget = parse_budget("8x")
    methods = budget.methods(artifact, context=4096)   # [SinksWindow(4, 32), Quantized(119, pool="global")]

A ratio is met at a context: the exact sinks and window cost the same at any length, the codes and the int32 true
position per token grow with it, so `bits_for_ratio` picks the most bits per head (average) whose whole cache at
`context` tokens holds at most `16-bit bytes / ratio` per token. The global pool (one bit pool over every layer,
head, key and value, by effect weight) needs an artifact with effect weights; without them the per-head pool is
used.

Bytes are those the caches hold: a sliding-window layer holds only its last `window - 1` tokens, in the unpatched
cache as in patchkv's, so for a model with such layers (Gemma 3, Mistral or Qwen2 configs with a window) the 16-bit
reference at `context` counts what each layer holds (`sixteen_bit_bytes(artifact, context)`), and so do the codes.
The pool itself prices every layer alike: pricing a layer's bits by the tokens it holds
(`Quantized(..., context=context)`) lost on Gemma 3 (`evals/research_sliding.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from numbers import Integral

from .allocation import code_bytes, default_pool, full_kv_bytes_per_token, held_tokens
from .methods import Evict, Method, NearCodes, Quantized, Salience, SinksWindow, parse_method
from .methods.base import token_kv_bytes

#: the sinks and recent window every budget keeps exact (and counts)
EXACT = (4, 32)
#: bytes of the int32 true position a LatentCache keeps per token
POSITION_BYTES = 4
#: bytes a salient token's coded index (int32) and score (float32) take per KV head, beside its exact key and value
SALIENT_INDEX_BYTES = 8
#: the budgets calibration fits step scales for when none are asked for
DEFAULT_BUDGETS = ("4x", "8x", "16x")


def sixteen_bit_bytes(artifact, context: int | None = None) -> float:
    """Bytes per token of the uncompressed cache in a 16-bit dtype (bf16 / fp16), what ratios are quoted against:
    every layer holding every token, or with `context` what the unpatched cache holds after that many tokens (a
    sliding-window layer its last `window - 1`), per token of the context."""
    full = full_kv_bytes_per_token(artifact, element_size=2)
    if context is None:
        return full
    return full * sum(held_tokens(artifact, context)) / (artifact.num_layers * context)


def check_context(context: int) -> None:
    """Refuse a context that is not a positive number of tokens (the length a ratio is met at)."""
    if not isinstance(context, Integral) or isinstance(context, bool):
        raise TypeError(f"context must be an integer number of tokens, e.g. 4096, got {context!r}.")
    if context < 1:
        raise ValueError(f"context must be at least 1 token (the length the budget is met at), got {context}.")


def salient_bytes(artifact, salience: Salience | None, coded: int) -> int:
    """Bytes a `salience` method's kept tokens take over `coded` coded tokens (middle and near): per KV head of every
    full-attention layer (a sliding-window layer keeps none), `capacity(coded)` key and value copies (16-bit, or int8
    or int4 with their scales: `Salience.copy_bytes`) with their index and score."""
    if salience is None:
        return 0
    per_head = salience.copy_bytes(artifact.head_dim) + SALIENT_INDEX_BYTES
    full_layers = sum(window is None for window in artifact.sliding_windows)
    return salience.capacity(coded) * per_head * full_layers * artifact.num_kv_heads


def exact_tokens(held: int, context: int, sink_tokens: int, window: int) -> int:
    """Of the `held` tokens a layer holds after `context`, those kept exact: the sinks and the window, or, for a
    sliding-window layer past its window (it no longer holds the sinks), the window alone."""
    return min(context, sink_tokens + window) if held == context else min(held, window)


def exact_bytes(artifact, held: list[int], context: int, sink_tokens: int, window: int, window_bits: int = 16) -> int:
    """Bytes the exact regions take over every layer after `context` tokens, each layer holding `held` of them: the
    sinks in 16 bits, the window in `window_bits` (16, or int8 / int4 with a float32 scale per token, head and kind)."""
    per_token = {bits: artifact.num_kv_heads * token_kv_bytes(artifact.head_dim, bits) for bits in (16, window_bits)}
    total = 0
    for h in held:
        exact = exact_tokens(h, context, sink_tokens, window)
        sinks = min(context, sink_tokens) if h == context else 0
        total += sinks * per_token[16] + (exact - sinks) * per_token[window_bits]
    return total


def bits_for_ratio(artifact, ratio: float, *, pool: str, context: int, sink_tokens: int = EXACT[0],
                   window: int = EXACT[1], basis: str = "head", salience: Salience | None = None,
                   priced: bool = False, near: NearCodes | None = None, window_bits: int = 16,
                   evict: Evict | None = None) -> int:
    """The most bits per head (average) for `Quantized(bits, pool)` behind `SinksWindow(sink_tokens, window)` (and
    `salience`'s exact tokens, or `near`'s tokens at its rate, or with `evict`'s dropped tokens gone) whose whole cache
    at `context` tokens (exact sinks and window in 16 bits, codes, the near codes, the salient tokens, the kept-token
    bitmap, positions) holds at most the 16-bit cache's bytes / `ratio` per token (the window in `window_bits`: 16,
    or int8 / int4 with its scales). `evict` is priced for a context prefilled in one forward (its tokens leave the
    window in one block). Raises ValueError if even 1 bit per head does not fit, and a context that is not a positive
    integer (`check_context`). `priced`: for `Quantized(bits, pool, context=context)`, the pool priced by the tokens
    each layer holds."""
    check_context(context)
    full = sixteen_bit_bytes(artifact, context)
    held = held_tokens(artifact, context)
    exact = [exact_tokens(h, context, sink_tokens, window) for h in held]
    exact_total = exact_bytes(artifact, held, context, sink_tokens, window, window_bits)
    # each layer's coded tokens (a full-attention layer's less those `evict` drops, beside its bitmap): the newest
    # `near.tokens` of them at the near rate, the others at the middle's
    coded = [h - e if evict is None or w is not None else evict.kept(h - e)
             for h, e, w in zip(held, exact, artifact.sliding_windows)]
    bitmaps = 0 if evict is None else sum(-(-(h - e) // 8) for h, e, w in zip(held, exact, artifact.sliding_windows)
                                          if w is None)
    full_coded = context - min(sink_tokens + window, context)
    salient = salient_bytes(artifact, salience, full_coded if evict is None else evict.kept(full_coded))
    nearby = [0 if near is None else min(near.tokens, c) for c in coded]
    price = context if priced else None

    def total(bits: int) -> float:
        codes = sum((c - n) * b for c, n, b in zip(coded, nearby, code_bytes(artifact, bits, pool, basis, price)))
        if near is not None:
            finer = Quantized(bits, pool=pool, basis=basis).finer(artifact, near.factor).bits
            codes += sum(n * b for n, b in zip(nearby, code_bytes(artifact, finer, pool, basis, price)))
        return (exact_total + codes + salient + bitmaps) / context + POSITION_BYTES

    if total(1) > full / ratio:
        kept = f"{sink_tokens} sinks and a {window}-token{f' int{window_bits}' if window_bits != 16 else ''} window" + (
            f" and {salience.spec()}" if salience else "")
        raise ValueError(f"a {ratio:g}x budget cannot be met at {context} tokens with {kept} kept exact: they alone "
                         f"take {total(1):.0f} bytes per token of the {full / ratio:.0f} allowed; use a longer "
                         "context, a smaller ratio or a smaller salient fraction.")
    return most_bits(lambda bits: total(bits) <= full / ratio, artifact.head_dim * 8)


def most_bits(fits: Callable[[int], bool], high: int) -> int:
    """The most bits per KV head in [1, `high`] that `fits` (a budget test that holds for 1 bit and, once it fails,
    fails for every larger number), by bisection."""
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


@dataclass(frozen=True)
class Budget:
    """A compression target: `ratio` against the 16-bit cache, or `bits` per KV head and token; `pool` None picks
    the global pool when the artifact has effect weights; `basis` "head" or "layer" (`Quantized`'s); `salience` a
    `Salience` method whose exact tokens the ratio pays for too (the codes get what is left); `regions` the
    `SinksWindow` kept exact (None: `SinksWindow(*EXACT)`; an int8 / int4 or longer window is paid for from the same
    bytes); `evict` an `Evict` whose dropped tokens free bytes for the codes (its bitmap paid for)."""

    ratio: float | None = None
    bits: int | None = None
    pool: str | None = None
    basis: str = "head"
    salience: Salience | None = None
    near: NearCodes | None = None
    regions: SinksWindow | None = None
    evict: Evict | None = None

    def __str__(self) -> str:
        size = f"{self.ratio:g}x" if self.ratio is not None else f"{self.bits} bits"
        return size + "".join(f"+{m.spec()}" for m in (self.regions, self.near, self.evict, self.salience)
                              if m is not None) + (" on layer bases" if self.basis == "layer" else "")

    @property
    def exact(self) -> SinksWindow:
        """The sinks and window this budget keeps exact (or the window int8 / int4)."""
        return self.regions or SinksWindow(*EXACT)

    def quantized(self, artifact, context: int) -> Quantized:
        """The codes meeting this budget at `context` tokens (a positive integer, for bit budgets too)."""
        check_context(context)
        pool = self.pool or default_pool(artifact)
        exact = self.exact
        bits = self.bits if self.bits is not None else bits_for_ratio(
            artifact, self.ratio, pool=pool, context=context, sink_tokens=exact.sink_tokens, window=exact.window,
            basis=self.basis, salience=self.salience, near=self.near, window_bits=exact.bits, evict=self.evict)
        return Quantized(bits, pool=pool, basis=self.basis)

    def methods(self, artifact, context: int) -> list[Method]:
        """[SinksWindow(*EXACT) or `regions`, Quantized(bits, pool)] (and the near codes, the eviction, the salience
        method) meeting this budget at `context` tokens."""
        return [self.exact, self.quantized(artifact, context),
                *(m for m in (self.near, self.evict, self.salience) if m is not None)]


def parse_budget(text: str) -> Budget:
    """"8x" or "8" followed by x (a ratio > 1 against the 16-bit cache), or "119" (bits per KV head and token);
    "+near" after either keeps the newest coded tokens at a higher rate out of the same budget ("16x+near",
    "16x+near:tokens=480", `NearCodes`), "+" and a salience method keeps its tokens exact ("16x+novelty",
    "16x+novelty:fraction=0.01"; `patchkv.methods.parse_method`); both, near first: "16x+near+novelty"; "+sinks:..."
    first sets the exact regions ("16x+sinks:window=64,bits=8": an int8 window of 64, `SinksWindow`); "+evict" drops
    the tokens a score ranks lowest and codes the rest from the same bytes ("16x+evict", "16x+evict:fraction=0.2",
    `Evict`)."""
    text, plus, extra = text.strip().lower().rpartition("+")
    if plus:
        method, budget = parse_method(extra.strip()), parse_budget(text)
        role = "near" if isinstance(method, NearCodes) else "salience" if isinstance(method, Salience) else \
            "regions" if isinstance(method, SinksWindow) else "evict" if isinstance(method, Evict) else None
        if role is None:
            raise ValueError(f"budget {text + plus + extra!r}: after '+' comes sinks, near, evict or a salience method "
                             f"(novelty, code_error, key_norm, attention_mass), not {method.name!r}.")
        if getattr(budget, role) is not None:
            raise ValueError(f"budget {text + plus + extra!r} names two {role} methods; keep one.")
        return replace(budget, **{role: method})
    text = extra
    if re.fullmatch(r"\d+(\.\d+)?x", text):
        ratio = float(text[:-1])
        if ratio <= 1:
            raise ValueError(f"budget {text!r}: a ratio must be above 1x, e.g. 8x.")
        return Budget(ratio=ratio)
    if re.fullmatch(r"\d+", text) and int(text) > 0:
        return Budget(bits=int(text))
    raise ValueError(f"budget {text!r}: expected a ratio such as 8x, or bits per KV head and token such as 119.")
