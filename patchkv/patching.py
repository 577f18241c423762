"""`apply`, `remove` and `patched`: install the latent attention forward on a model and take it off."""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from .adapters import adapter_for, attention_modules
from .artifact import Artifact
from .attention import LatentAttentionState, latent_attention_forward
from .errors import AlreadyPatchedError
from .latent import LatentBasis
from .modes import MODES
from .rope import RopeTable, find_rotary_embedding


def is_patched(model: nn.Module) -> bool:
    return any(hasattr(m, "patchkv") for m in model.modules())


def apply(model: nn.Module, artifact: Artifact) -> nn.Module:
    """Patch `model` in place so its KV cache holds `artifact`'s latent coefficients; returns `model`.

    Every check runs before anything is changed: on error the model is left unpatched.
    """
    adapter = adapter_for(model)
    if is_patched(model):
        raise AlreadyPatchedError("The model is already patched; call patchkv.remove(model) before applying again.")
    artifact.check_compatible(model)
    modules = attention_modules(model, adapter)
    rope = RopeTable(find_rotary_embedding(model))
    mode = MODES[artifact.mode]
    states = []
    for attn in modules:
        i = attn.layer_idx
        device, dtype = attn.k_proj.weight.device, attn.k_proj.weight.dtype
        bases = [
            LatentBasis(c.mean[i], c.eigenvectors[i], c.ranks[i], attn.num_key_value_groups, dtype).to(device)
            for c in (artifact.keys, artifact.values)
        ]
        states.append(LatentAttentionState(adapter, mode, *bases, rope=rope))
    for attn, state in zip(modules, states):
        attn.patchkv = state
        attn.forward = types.MethodType(latent_attention_forward, attn)
    model.patchkv_artifact = artifact
    return model


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
def patched(model: nn.Module, artifact: Artifact) -> Iterator[nn.Module]:
    """`with patchkv.patched(model, artifact): ...` applies on entry and removes on exit."""
    apply(model, artifact)
    try:
        yield model
    finally:
        remove(model)
