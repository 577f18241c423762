"""`apply`, `remove` and `patched`: install the latent attention forward on a model and take it off."""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from .adapters import adapter_for, attention_modules
from .artifact import Artifact
from .attention import LatentAttentionState, latent_attention_forward
from .errors import AlreadyPatchedError, PatchKVError
from .hybrid import CacheOptions
from .latent import LatentBasis
from .modes import MODES
from .rope import RopeTable, find_rotary_embedding


def is_patched(model: nn.Module) -> bool:
    return any(hasattr(m, "patchkv") for m in model.modules())


def apply(model: nn.Module, artifact: Artifact, *, sink_tokens: int | None = None, window: int = 0,
          bits: int | None = None, top_k: int | None = None, top_k_rank: int | None = None) -> nn.Module:
    """Patch `model` in place so its KV cache holds `artifact`'s latent coefficients; returns `model`.

    sink_tokens: keep the first tokens as full K/V (default: the artifact's calibration `sink_tokens`).
    window: keep the last `window` tokens as full K/V; older ones move into latent form.
    bits: quantize latents to this many bits per KV head and token, allocated over components by DP
        on the calibrated eigenvalues (replaces the artifact's ranks; see `patchkv.quantize`).
    top_k: at each decode step attend to the `top_k` middle tokens (per query head) that score best
        from their first `top_k_rank` key components, plus sinks and window.
    Every check runs before anything is changed: on error the model is left unpatched.
    """
    adapter = adapter_for(model)
    if is_patched(model):
        raise AlreadyPatchedError("The model is already patched; call patchkv.remove(model) before applying again.")
    artifact.check_compatible(model)
    options = CacheOptions(artifact.calibration.get("sink_tokens", 0) if sink_tokens is None else sink_tokens,
                           window, bits, top_k, top_k_rank)
    modules = attention_modules(model, adapter)
    _check_options(options, [adapter.sliding_window(m) for m in modules])
    allocation = artifact.bit_allocation(bits) if bits else (None, None)
    rope = RopeTable(find_rotary_embedding(model))
    mode = MODES[artifact.mode]
    states = []
    for attn in modules:
        i = attn.layer_idx
        device, dtype = attn.k_proj.weight.device, attn.k_proj.weight.dtype
        bases = [
            LatentBasis(c.mean[i], c.eigenvectors[i], c.ranks[i], attn.num_key_value_groups, dtype,
                        bits=None if alloc is None else alloc[i], eigenvalues=c.eigenvalues[i]).to(device)
            for c, alloc in zip((artifact.keys, artifact.values), allocation)
        ]
        states.append(LatentAttentionState(adapter, mode, *bases, rope=rope, options=options))
    for attn, state in zip(modules, states):
        attn.patchkv = state
        attn.forward = types.MethodType(latent_attention_forward, attn)
    model.patchkv_artifact = artifact
    return model


def _check_options(options: CacheOptions, windows: list[int | None]) -> None:
    for name in ("sink_tokens", "window"):
        if getattr(options, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(options, name)}.")
    for name in ("top_k", "top_k_rank"):
        if getattr(options, name) is not None and getattr(options, name) < 1:
            raise ValueError(f"{name} must be a positive int or None, got {getattr(options, name)}.")
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if options.hybrid and sliding:
        raise PatchKVError(
            f"sink_tokens/window/top_k need full-attention layers, but layers {sliding[:8]} use a sliding window "
            f"({options}). Apply with sink_tokens=0, window=0, top_k=None: the plain latent cache supports "
            "sliding windows."
        )


def remove(model: nn.Module) -> nn.Module:
    """Restore every attention module's original forward and drop the bases; returns `model`."""
    for module in model.modules():
        if hasattr(module, "patchkv"):
            del module.patchkv
            del module.forward  # the instance attribute; the class's own forward shows through again
    if hasattr(model, "patchkv_artifact"):
        del model.patchkv_artifact
    return model


@contextmanager
def patched(model: nn.Module, artifact: Artifact, **options: Any) -> Iterator[nn.Module]:
    """`with patchkv.patched(model, artifact, **options): ...` applies on entry and removes on exit."""
    apply(model, artifact, **options)
    try:
        yield model
    finally:
        remove(model)
