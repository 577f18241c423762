"""Bytes a cache really holds, whatever its layers store (full K/V, latents, codes, quanto and HQQ tensors), and what
a patched model keeps beside its caches.

A `LatentCache` counts its tokens (`nbytes`, what compression ratios are measured on) and its storage
(`allocated_nbytes`: every buffer it keeps, whole). The RoPE tables pre-RoPE mode rotates cached keys with are the
patch's, not a cache's: one per rotary table of the model, shared by all its caches, grown to the highest position
any forward reached; `rope_nbytes(model)` counts them (`LatentCache.describe` shows them too).
"""

from __future__ import annotations

import torch

from .compat import quantized_storage


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
    return sum(held_nbytes(x) for layer in cache.layers
               for x in (getattr(layer, "keys", None), getattr(layer, "values", None), *quantized_storage(layer)))


def storage_nbytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (an iterable of tensors): each storage whole and once, however
    many views of it there are and however few of its bytes they show."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def rope_nbytes(model) -> int:
    """Bytes of the RoPE tables of `model`'s patch (0 for an unpatched model): kept once for every cache of the
    model, so counted here and not in a cache's `allocated_nbytes`."""
    patch = getattr(model, "patchkv", None)
    tables = {id(lp.rope): lp.rope for lp in patch.layers} if patch is not None else {}
    return sum(table.nbytes() for table in tables.values())
