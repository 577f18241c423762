"""`apply`, `remove` and `patched`: install latent attention on a model and take it off again.

`apply` installs three things, each recorded so that `remove` restores exactly what was there:

- on every attention module, `forward` (a `LatentForward`) and `patchkv` (its `LayerPatch`);
- on the decoder stack, a forward pre-hook (`CacheGuard`) that gives a forward with `use_cache` and no cache
  a `LatentCache`, and refuses any other cache with a `PatchKVError`;
- on the model, `_prepare_cache_for_generation` (a `LatentCachePreparer`) so that `generate()` builds a
  `LatentCache` by itself, and `patchkv` (the model-wide `Patch`).

Every check runs before anything changes; if installing fails or is interrupted, what was installed is
taken off again, so the model is either fully patched or exactly as it was. `remove` refuses, changing
nothing, while another library's wrapper sits on what `apply` installed (e.g. an accelerate hook added after
`apply`): that wrapper would keep calling the patched forward after its state is gone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from os import PathLike
from typing import Any

from torch import nn
from transformers.cache_utils import DynamicCache, QuantizedCache, StaticCache
from transformers.utils import logging

from .adapters import adapter_for, attention_modules
from .artifact import Artifact
from .attention import LatentForward
from .cache import LatentCache, check_cache
from .compat import (accelerate_hook, attn_implementation, installed_cache_preparer, is_user_defined, prepare_cache,
                     remove_pre_hook, set_cache_preparer)
from .errors import AlreadyPatchedError, PatchKVError
from .key_space import MODES
from .methods import CachePlan, Method, build_plan, from_options
from .patch import LayerPatch, Patch
from .rope import RopeTable, length_dependent

logger = logging.get_logger(__name__)


def is_patched(model: nn.Module) -> bool:
    return any(hasattr(m, "patchkv") for m in model.modules())


def apply(model: nn.Module, artifact: Artifact | str | PathLike, methods: Sequence[Method] = (), *, sink_tokens: int | None = None,
          window: int | None = None, bits: int | None = None, top_k: int | None = None,
          top_k_rank: int | None = None) -> nn.Module:
    """Patch `model` in place so its KV cache holds `artifact`'s latents; returns `model`. `artifact` may be an
    `Artifact`, a local path or a Hub repo id (`Artifact.from_pretrained`).

    methods: compression methods (`patchkv.methods`), at most one per role; the default codec is `LowRank()`
        (the artifact's ranks). The keyword arguments are shorthands for the common ones:
    sink_tokens, window: `SinksWindow(sink_tokens, window)`: the first and the last tokens stay exact.
    bits: `Quantized(bits)`: DP-allocated fixed-rate codes, `bits` per KV head and token.
    top_k, top_k_rank: `TopK(top_k, top_k_rank)`: decode over the best `top_k` latent tokens per KV head.
    """
    adapter = adapter_for(model)
    if is_patched(model):
        raise AlreadyPatchedError("The model is already patched; call patchkv.remove(model) before applying again.")
    if isinstance(artifact, (str, PathLike)):  # a local path or a Hub repo id
        artifact = Artifact.from_pretrained(artifact)
    if not isinstance(artifact, Artifact):
        raise TypeError(f"apply(model, artifact): expected a patchkv.Artifact, a path or a Hub repo id, got "
                        f"{type(artifact).__name__}.")
    artifact.check_compatible(model)
    plan = build_plan([*methods, *from_options(sink_tokens, window, bits, top_k, top_k_rank)])
    implementation = attn_implementation(model.config)
    if implementation not in ("eager", "sdpa"):
        raise PatchKVError(f"patchkv is built and tested with the 'sdpa' and 'eager' attention implementations, not "
                           f"attn_implementation={implementation!r}; load the model with attn_implementation='sdpa' "
                           "or 'eager'.")
    modules = attention_modules(model, adapter)
    groups, dtype = [adapter.query_groups(m) for m in modules], adapter.dtype(modules[0])
    rotary = adapter.rotary_embedding(model)
    if artifact.mode == "pre_rope" and (kind := length_dependent(rotary)):
        raise PatchKVError(f"pre-RoPE mode cannot rotate cached keys exactly under rope_type={kind!r}: its frequencies "
                           "change with the sequence length, and the model keeps each key rotated as it was when "
                           "written. Calibrate a post-RoPE artifact for this model (patchkv calibrate --mode "
                           "post_rope), which is exact under it.")
    tables: dict[Any, RopeTable] = {}
    for attn in modules:
        tables.setdefault(adapter.rope_key(attn), RopeTable(adapter, rotary, attn))
    digest = hashlib.sha256(f"{artifact.metadata()['checksum']}|{artifact.mode}|{plan.describe()}".encode()).hexdigest()
    patch = Patch(adapter, MODES[artifact.mode], plan, artifact, f"sha256:{digest}",
                  [adapter.sliding_window(m) for m in modules], dtype=dtype, query_groups=groups)
    codecs, near = patch.codecs(dtype)
    if codecs[0][0].span > 1:
        check_span(plan, codecs[0][0].span)
    layer_patches = [LayerPatch(patch, attn.layer_idx, keys, values, tables[adapter.rope_key(attn)], *near_pair)
                     for attn, (keys, values), near_pair in zip(modules, codecs, near)]
    patch.layers = layer_patches
    try:
        _install(model, patch, modules, layer_patches)
    except BaseException:
        _uninstall(model, patch, modules)
        raise
    return model


def check_span(plan: CachePlan, span: int) -> None:
    """What a cache on bases across `span` layers does not do yet (each span's codes are made and held by its last
    layer, `patchkv.cache`): methods that rank, copy or recode a layer's coded tokens."""
    others = [m.spec() for m in (plan.selector, plan.salience, plan.near, plan.evict) if m is not None]
    if others:
        raise PatchKVError(f"this artifact's layer bases span {span} layers, and the cache codes each span's tokens "
                           f"once for all its layers; {', '.join(others)} ranks, copies or recodes each layer's "
                           "own coded tokens, which it cannot do on them yet: drop it, or use an artifact calibrated "
                           "with layers_per_basis=1.")


def _install(model: nn.Module, patch: Patch, modules: list[nn.Module], layer_patches: list[LayerPatch]) -> None:
    model.patchkv = patch
    patch.restore["prepare"] = installed_cache_preparer(model)
    set_cache_preparer(model, LatentCachePreparer(model))
    decoder = patch.adapter.decoder(model)
    patch.decoder_hook_id = decoder.register_forward_pre_hook(CacheGuard(model), with_kwargs=True).id
    for attn, lp in zip(modules, layer_patches):
        patch.restore[f"forward.{lp.layer_idx}"] = vars(attn).get("forward")
        attn.forward = LatentForward(attn)
        attn.patchkv = lp


def _uninstall(model: nn.Module, patch: Patch, modules: list[nn.Module]) -> None:
    """Take off whatever `_install` put on, restoring what was there before (also after a partial install)."""
    for attn in modules:
        if vars(attn).get("patchkv") is not None and vars(attn)["patchkv"].patch is not patch:
            continue
        previous = patch.restore.pop(f"forward.{attn.layer_idx}", None)
        if isinstance(vars(attn).get("forward"), LatentForward):
            del attn.forward
        if previous is not None:
            attn.forward = previous
        vars(attn).pop("patchkv", None)
    if patch.decoder_hook_id is not None:
        decoder = patch.adapter.decoder(model)
        remove_pre_hook(decoder, patch.decoder_hook_id)
        patch.decoder_hook_id = None
    if isinstance(installed_cache_preparer(model), LatentCachePreparer):
        set_cache_preparer(model, None)
    previous = patch.restore.pop("prepare", None)
    if previous is not None:
        set_cache_preparer(model, previous)
    vars(model).pop("patchkv", None)


def remove(model: nn.Module) -> nn.Module:
    """Restore the model exactly as it was before `apply` (forwards, hooks, attributes); returns `model`.
    A model that is not patched is returned unchanged.

    Raises `PatchKVError`, changing nothing, when another library wrapped what `apply` installed (an attention
    module's `forward`, or `model._prepare_cache_for_generation`, replaced after `apply`, e.g. by
    `accelerate.hooks.add_hook_to_module`): the wrapper would go on calling patchkv's code after its state is
    gone. Remove the other library's wrappers first, then call `remove` again."""
    patch = vars(model).get("patchkv")
    if patch is not None:
        modules = attention_modules(model, patch.adapter)
        _check_unwrapped(model, patch, modules)
        _uninstall(model, patch, modules)
    return model


def _check_unwrapped(model: nn.Module, patch: Patch, modules: list[nn.Module]) -> None:
    """Refuse (before anything changes) to remove a patch whose installed callables were replaced since `apply`."""
    names = {id(m): name for name, m in model.named_modules()}
    wrapped, accelerate = [], False
    for attn in modules:
        layer_patch = vars(attn).get("patchkv")
        if layer_patch is None or layer_patch.patch is not patch or "forward" not in vars(attn):
            continue
        forward = vars(attn)["forward"]
        if not (isinstance(forward, LatentForward) and forward.module is attn):
            wrapped.append(f"{names.get(id(attn)) or type(attn).__name__}.forward")
            accelerate = accelerate or accelerate_hook(attn) is not None
    preparer = installed_cache_preparer(model)
    if preparer is not None and not isinstance(preparer, LatentCachePreparer):
        wrapped.append("model._prepare_cache_for_generation")
    if not wrapped:
        return
    shown = ", ".join(wrapped[:3]) + (f" and {len(wrapped) - 3} more" if len(wrapped) > 3 else "")
    how = ("accelerate.hooks.remove_hook_from_module(module) on each of those modules" if accelerate
           else "with that library's own remove or unwrap call")
    raise PatchKVError(
        f"Cannot remove patchkv: {shown} {'was' if len(wrapped) == 1 else 'were'} replaced after patchkv.apply by "
        "another library's wrapper, which may call patchkv's code and would fail once its state is gone. Nothing "
        f"was changed; the model is still patched. Remove the other library's wrappers first ({how}), then call "
        "patchkv.remove(model) again.")


@contextmanager
def patched(model: nn.Module, artifact: Artifact, methods: Sequence[Method] = (), **options: Any) -> Iterator[nn.Module]:
    """`with patchkv.patched(model, artifact, ...): ...` applies on entry and removes on exit."""
    apply(model, artifact, methods, **options)
    try:
        yield model
    finally:
        remove(model)


class CacheGuard:
    """Forward pre-hook of the decoder stack: a `LatentCache` where a cache is wanted and none was given,
    the patch's own `LatentCache` passed on, anything else refused with a `PatchKVError` (`check_cache`)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        name = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(name)
        if cache is None:
            use_cache = kwargs.get("use_cache")
            if use_cache is None:
                use_cache = getattr(self.model.config, "use_cache", False)
            if use_cache:
                kwargs["cache"] = LatentCache(self.model)
                kwargs.pop("past_key_values", None)
                return args, kwargs
            return None
        check_cache(cache, self.model.patchkv.fingerprint)
        return None


class LatentCachePreparer:
    """Stands in for `model._prepare_cache_for_generation`: the cache `generate()` would make becomes a
    `LatentCache` (a static cache too: the latent cache grows with the sequence and gives the same results)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, generation_config, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        result = prepare_cache(self.model, generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache")
        if cache is None or is_user_defined(cache) or isinstance(cache, LatentCache):
            return result
        if isinstance(cache, QuantizedCache):
            raise PatchKVError("cache_implementation='quantized' would quantize full keys and values, but a patched "
                               "model stores latents: quantize the latents instead with patchkv.apply(..., bits=N).")
        if type(cache) not in (DynamicCache, StaticCache):
            raise PatchKVError(f"generate() prepared a {type(cache).__name__}, which a patched model cannot use; "
                               "leave cache_implementation unset (patchkv builds a LatentCache).")
        if isinstance(cache, StaticCache):
            logger.warning_once("patchkv: cache_implementation='static' is served by a LatentCache, which grows with "
                                "the sequence; results are the same, but shapes are not static (no torch.compile gain).")
        latent = LatentCache(self.model, offloading=bool(getattr(cache, "offloading", False)))
        if getattr(generation_config, "is_assistant", False):
            latent.activate_past_recording()
        model_kwargs["cache"] = latent
        return result
