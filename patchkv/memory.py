"""Bytes a cache really holds, whatever its layers store (full K/V, latents, codes, quanto tensors)."""

from __future__ import annotations

import torch


def tensor_nbytes(t: torch.Tensor | None) -> int:
    """Storage bytes of a tensor, looking inside tensor subclasses (e.g. quanto's packed tensors)."""
    if t is None:
        return 0
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(t, name)) for name in names)
    return t.nbytes


def cache_nbytes(cache) -> int:
    """Total bytes held by a `transformers` cache: every tensor of every layer."""
    if hasattr(cache, "nbytes"):  # patchkv's LatentCache counts its own regions and position track
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, name, None) for name in ("keys", "values", "_quantized_keys", "_quantized_values")]
        total += sum(tensor_nbytes(t) for t in tensors if isinstance(t, torch.Tensor))
    return total
