"""Freed heap pages handed back to the system around each patched attention layer of a long CPU forward.

CPU tensors live in the C allocator's memory. glibc raises its mmap threshold to the size of each large block freed
(up to 32 MiB), so after a model's first large frees every tensor of a 4k-token forward comes from the heap, and the
heap keeps freed memory resident: a layer's temporaries leave holes that the next layer's allocations, carved in
another order, only partly reuse, and the heap grows layer after layer. The unpatched model fills its holes with the
cache it keeps (3 MiB a layer at 4k for SmolLM2); a patched layer at 8x keeps an eighth of that, so the same growth is all
holes, and a one-shot prefill peaked above the unpatched one although its tensors never did (docs/results.md).

`release(tokens)` asks glibc (`malloc_trim`) to return every free page to the system when a forward of `tokens`
tokens is long enough for its temporaries to matter; the patched attention calls it before and after each layer
(before: the model's MLP of the layer below has just freed its temporaries). A few milliseconds a call: a forward of
fewer than `TOKENS` tokens (a decode step, chunked scoring) never calls it. Elsewhere than glibc (musl, macOS,
Windows) it does nothing.
"""

from __future__ import annotations

import ctypes

#: the fewest tokens in one forward (batch included) for which the patched attention releases freed heap pages
TOKENS = 1024


def _malloc_trim():
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:  # no C library to load symbols from (Windows)
        return None


_TRIM = _malloc_trim()


def release(tokens: int) -> None:
    """Return the C heap's free pages to the system if a forward of `tokens` tokens (batch times sequence) reaches
    `TOKENS` and the C library is glibc; otherwise nothing."""
    if _TRIM is not None and tokens >= TOKENS:
        _TRIM(0)
