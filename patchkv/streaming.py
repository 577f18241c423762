"""An lm-eval model that scores through the KV cache, a few tokens per forward, as generation would.

lm-eval's `HFLM` scores a whole sequence in one forward pass. A forward reads its own tokens exact in a
patched model, as in transformers' `QuantizedCache` (which attends in full precision during prefill), and
top-k acts only when a token is decoded: scored in one forward, every method would look lossless.
`StreamingLM` prefills the context in one forward (read exact by itself, as a prompt is) and then feeds the
continuation through the cache `chunk` tokens per forward, so every scored token reads the earlier ones as
the cache really holds them. It also measures the bytes the cache holds per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lm_eval.api.model import LM
from torch import nn
from tqdm.auto import tqdm

from .nbytes import cache_nbytes
from .perplexity import token_nll

#: tokens per forward for an unpatched model (its own DynamicCache is exact at any chunk)
UNPATCHED_CHUNK = 512


def default_chunk(model: nn.Module) -> int:
    """Tokens per forward for scoring `model` through its own cache: half its patch's exact window, at least 1.

    A forward reads its own tokens and the `window` tokens before it exact (`patchkv.cache`), so with a chunk c
    each query reads between window + 1 tokens exact, as a decode step does, and window + c; half the window
    keeps that within 1.5 times a decode step's. Without a window that is 1: each token reads itself exact and
    the rest from the latents, as in decoding; a chunk of 32 there would let each query read up to 31 tokens
    exact that decoding reads compressed (reference model, post-RoPE rank 16: +0.2% token perplexity instead
    of +23%). An unpatched model gets `UNPATCHED_CHUNK`."""
    patch = getattr(model, "patchkv", None)
    if patch is None:
        return UNPATCHED_CHUNK
    return max(1, patch.plan.window // 2)


class StreamingLM(LM):
    """lm-eval `LM` over a (patched or not) model, batch size 1, scoring through the cache.

    cache_factory: makes the empty cache for each request (default: none, so the model makes its own: a
        `LatentCache` when patched, a `DynamicCache` otherwise).
    chunk: tokens fed per forward while scoring (1: every scored token is a decode step). A larger chunk is
        chunked prefill: each token reads its own chunk and the window before it exact, the earlier tokens as
        the cache holds them; many times faster on long contexts. None: `default_chunk(model)` at scoring time (which assumes the
        model's own cache, not a `cache_factory`'s).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, cache_factory: Callable[[], Any] | None = None,
                 max_length: int | None = None, chunk: int | None = 1):
        super().__init__()
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be a positive integer or None, got {chunk!r}.")
        self.chunk = chunk
        self.model, self.tokenizer = model.eval(), tokenizer
        self.cache_factory = cache_factory or (lambda: None)
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", 1024)
        self.prefix_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.bytes_held = self.tokens_held = 0

    @property
    def kv_bytes_per_token(self) -> float:
        """Mean over every request of the cache bytes at its end, per token held."""
        return self.bytes_held / max(self.tokens_held, 1)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def score(self, prefix: list[int], targets: list[int]) -> tuple[float, bool]:
        """Prefill `prefix` in one forward (its tokens read exact, as a prompt's are), then feed `targets` but the last
        `chunk` tokens at a time through the cache (`patchkv.perplexity.token_nll`). Returns (sum of log-probs of the
        targets, whether each was the greedy choice)."""
        chunk = self.chunk or default_chunk(self.model)
        scored = token_nll(self.model, torch.tensor([prefix + targets[:-1]]), chunk, self.cache_factory(),
                           prompt=len(prefix))
        last = scored.last_logits[0].log_softmax(-1)  # the prediction of the last target
        self.bytes_held += cache_nbytes(scored.cache)
        self.tokens_held += scored.cache.get_seq_length()
        return -scored.nll + last[targets[-1]].item(), scored.greedy and int(last.argmax()) == targets[-1]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="streaming loglikelihood"):
            context, continuation = req.args
            ctx = self._encode(context) if context else [self.prefix_id]
            whole = self._encode(context + continuation) if context else [self.prefix_id] + self._encode(continuation)
            targets = whole[len(ctx):] if whole[: len(ctx)] == ctx else self._encode(continuation)
            keep = self.max_length - len(targets)
            out.append(self.score(ctx[-keep:], targets))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="streaming rolling loglikelihood"):
            tokens = self._encode(req.args[0])
            total, span = 0.0, self.max_length - 1
            for start in range(0, len(tokens), span):  # disjoint windows, each after the prefix token
                total += self.score([self.prefix_id], tokens[start:start + span])[0]
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("StreamingLM scores; use lm-eval's HFLM to generate.")
