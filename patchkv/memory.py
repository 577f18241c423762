"""Bytes a cache really holds, whatever its layers store (full K/V, latents, codes, quanto and HQQ tensors)."""

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


def held_nbytes(x) -> int:
    """Bytes of every tensor in `x`: a tensor, or a tuple, list or dict of them (HQQ keeps `(codes, {"scale",
    "zero", ...})`); anything else holds none."""
    if isinstance(x, torch.Tensor):
        return tensor_nbytes(x)
    if isinstance(x, (tuple, list)):
        return sum(held_nbytes(item) for item in x)
    if isinstance(x, dict):
        return sum(held_nbytes(item) for item in x.values())
    return 0


def cache_nbytes(cache) -> int:
    """Total bytes held by a `transformers` cache: every tensor of every layer (quanto's packed tensors, HQQ's
    codes with their scales and zeros)."""
    if hasattr(cache, "nbytes"):  # patchkv's LatentCache counts its own regions and position track
        return cache.nbytes()
    names = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(held_nbytes(getattr(layer, name, None)) for layer in cache.layers for name in names)
