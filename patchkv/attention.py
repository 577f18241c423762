"""The patched attention forward, one code path for every family, mode and method.

It mirrors `LlamaAttention.forward` in `transformers` with everything architecture-specific asked of the
adapter, and these changes:

1. q, k, v come out of the adapter un-rotated; the mode puts them in cache space (`patchkv.modes`);
2. the layer of the `LatentCache` appends the new tokens exact (sinks, then the recent region) and records
   their true positions; after attention it encodes what has left the window with the plan's codec;
3. if the plan has a selector and this is a decode step, each KV head keeps its best-scoring latent tokens;
4. the model's own attention function runs on what the mode prepares: keys whose dot products with the
   queries are the true scores, and values augmented as `[exact v | latent c | 1]`, in the mode's
   `compute_dtype` (float32 on CPU for half-precision models);
5. outputs are decoded once per query: `sum_j p_j v_j + basis @ (sum_j p_j c_j) + (sum_j p_j) mean`.

A decode step (one query per sequence, no dropout, softcap or returned weights) skips the augmented copies
(`grouped_decode`): the mode scores each region directly (latent tokens in the latent space), one softmax
runs over all of them, and the same sum is taken region by region, each KV head's query heads in one product.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .cache import LatentCache, LatentLayer
from .context import LayerPatch
from .errors import PatchKVError
from .latent import augmented
from .modes import Visible, compute_dtype


class LatentForward:
    """The `forward` installed on a patched attention module: a plain object (no closure), so a patched
    model pickles and loads patched."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                 attention_mask: torch.Tensor | None = None, cache: Cache | None = None, **kwargs: Any
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        return latent_attention_forward(self.module, hidden_states, position_embeddings, attention_mask, cache,
                                        **kwargs)


def latent_attention_forward(attn: nn.Module, hidden_states: torch.Tensor,
                             position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None,
                             cache: Cache | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden_states `[batch, seq, hidden]` -> (`[batch, seq, hidden]`, attention weights or None)."""
    lp: LayerPatch = attn.patchkv.on(hidden_states.device)
    adapter, mode = lp.patch.adapter, lp.patch.mode
    q, k, v = adapter.project_qkv(attn, hidden_states)
    batch, _, seq, _ = q.shape
    cos, sin = position_embeddings
    layer = _layer(cache, lp)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=q.device).unsqueeze(0) + layer.get_seq_length()
    q, k = mode.to_cache_space(lp, q, k, cos, sin)
    layer.append(k, v, positions.expand(batch, seq), lp)
    out, weights = _attend(attn, lp, layer, q, cos, sin, attention_mask, kwargs)
    layer.after_attention()
    if isinstance(cache, LatentCache):
        cache.done(lp.layer_idx)
    return adapter.output(attn, out.reshape(batch, seq, -1).contiguous()), weights


def _layer(cache: Cache | None, lp: LayerPatch) -> LatentLayer:
    if cache is None:  # use_cache=False: a throwaway layer for this forward
        plan = lp.patch.plan
        return LatentLayer(plan.sink_tokens, plan.window, lp.sliding_window)
    if not isinstance(cache, LatentCache):
        raise PatchKVError(f"A patched model got a {type(cache).__name__}; it stores latents in a patchkv.LatentCache. "
                           "Pass cache=patchkv.LatentCache(model), or no cache (generate() makes one).")
    if cache.fingerprint != lp.patch.fingerprint:
        raise PatchKVError(f"This LatentCache was written under another patch ({cache.plan_description}); continuing it "
                           "with different bases or methods would mix incompatible latents. Start from a new cache.")
    return cache.layer(lp.layer_idx)


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean (True = attend) or additive mask as an additive float32 mask."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=torch.float32, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask.float()


def _attend(attn: nn.Module, lp: LayerPatch, layer: LatentLayer, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            mask: torch.Tensor | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q `[batch, heads, s, d]` in cache space -> (`[batch, s, heads, d]`, weights or None)."""
    patch = lp.patch
    regions, positions = layer.regions(q.shape[2])
    ns, nm, nr = (regions[f"{r}_keys"].shape[2] for r in ("sink", "latent", "recent"))
    sink_pos, middle_pos, recent_pos = positions.split([ns, nm, nr], dim=1)
    key_coeffs, value_coeffs = lp.keys.decode(regions["latent_keys"]), lp.values.decode(regions["latent_values"])
    selector = patch.plan.selector
    if selector is not None and not layer.is_sliding and selector.applies(q.shape[2], nm):
        rank = min(selector.rank or lp.keys.basis.max_rank, lp.keys.basis.max_rank)
        scores = patch.mode.approximate_scores(lp, q, cos, sin, key_coeffs[..., :rank], middle_pos)
        if mask is not None:
            scores = scores + _additive(mask)[:, :, -1, ns:ns + nm]
        chosen = selector.select(scores, lp.keys.basis.query_groups)  # [batch, kv_heads, k]
        key_coeffs, value_coeffs = (c.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, c.shape[-1]))
                                    for c in (key_coeffs, value_coeffs))
        middle_pos = middle_pos.unsqueeze(1).expand(-1, chosen.shape[1], -1).gather(2, chosen)
        if mask is not None:
            mask = _select_columns(mask, chosen, ns, nm, nr, lp.keys.basis.query_groups)
    seen = Visible(regions["sink_keys"], regions["sink_values"], regions["recent_keys"], regions["recent_values"],
                   key_coeffs, value_coeffs, sink_pos, middle_pos, recent_pos)
    if grouped_decode_applies(attn, lp, q, kwargs):
        return grouped_decode(lp, q, cos, sin, seen, mask, patch.adapter.scaling(attn)), None
    work = compute_dtype(q)
    queries, keys = patch.mode.score_operands(lp, q, cos, sin, seen)
    values, has_exact, has_latent = augmented(seen.sink_values.to(work), value_coeffs.to(work),
                                              seen.recent_values.to(work))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(work)
    out, weights = patch.adapter.attention_function(attn)(
        attn, queries, keys, values, mask, dropout=attn.attention_dropout if attn.training else 0.0,
        scaling=patch.adapter.scaling(attn), **{**kwargs, **patch.adapter.attention_kwargs(attn)})
    return _decode_values(lp, out.to(q.dtype), has_exact, has_latent, q.shape[-1]), weights


def grouped_decode_applies(attn: nn.Module, lp: LayerPatch, q: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """A decode step (one query per sequence) attends by `grouped_decode` unless the model's attention function
    would add something to softmax(q.k * scaling + mask) v: dropout, a logit softcap, returned weights."""
    return (q.shape[2] == 1 and not attn.training and not kwargs.get("output_attentions")
            and set(lp.patch.adapter.attention_kwargs(attn)) <= {"sliding_window"})


def grouped_decode(lp: LayerPatch, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seen: Visible,
                   mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """One decode step's attention without augmented features: true scores region by region (the mode's
    `decode_scores`, latent tokens in the latent space), one softmax (`decode_weights`), then the weighted sum
    of exact values and, for latent ones, `U (sum_j p_j c_j) + (sum_j p_j) mean` (`weighted_values`), each KV
    head's query heads in one product. q `[batch, heads, 1, d]` in cache space -> `[batch, 1, heads, d]`, as the
    attention function returns it."""
    scores = lp.patch.mode.decode_scores(lp, q, cos, sin, seen)
    return weighted_values(lp, decode_weights(scores, mask, scaling), seen, q.dtype)


def decode_weights(scores: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Scores `[batch, kv_heads, groups, n]` -> attention weights (same shape and dtype): softmax, in float32, of
    scores * scaling + mask; mask `[batch, 1 or heads, 1, >= n]`, its first n columns, as the attention
    functions take them."""
    scores = scores * scaling
    batch, kv_heads, groups, n = scores.shape
    if mask is not None:
        m = _additive(mask[..., :n])
        scores = scores + (m.view(m.shape[0], kv_heads, groups, n) if m.shape[1] > 1 else m)
    return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)


def weighted_values(lp: LayerPatch, p: torch.Tensor, seen: Visible, dtype: torch.dtype) -> torch.Tensor:
    """Weights `[batch, kv_heads, groups, n]` over sinks, middle and window -> `[batch, 1, heads, d]` in `dtype`:
    exact values weighted as they are, latent ones in the latent space, decoded once."""
    batch, kv_heads, groups, n = p.shape
    work = p.dtype
    ns, nm = seen.sink_values.shape[2], seen.value_coeffs.shape[2]
    p_sink, p_middle, p_recent = p.split([ns, nm, n - ns - nm], dim=-1)
    out = None
    for weights, values in ((p_sink, seen.sink_values), (p_recent, seen.recent_values)):
        if weights.shape[-1]:
            part = weights @ values.to(work)  # [batch, kv_heads, groups, d]
            out = part if out is None else out + part
    if nm:
        basis = lp.values.basis
        coeffs = (p_middle @ seen.value_coeffs.to(work)).reshape(batch, kv_heads * groups, 1, -1)
        latent = coeffs @ basis.query_basis.to(work).transpose(1, 2) + p_middle.sum(-1).reshape(
            batch, -1, 1, 1) * basis.query_mean.to(work).unsqueeze(1)
        latent = latent.view(batch, kv_heads, groups, -1)
        out = latent if out is None else out + latent
    return out.reshape(batch, 1, kv_heads * groups, -1).to(dtype)


def _select_columns(mask: torch.Tensor, chosen: torch.Tensor, ns: int, nm: int, nr: int, groups: int) -> torch.Tensor:
    """Mask `[batch, 1 or heads, 1, ns + nm + nr]` -> the columns of sinks, the chosen middle tokens (per KV head,
    repeated over its query heads) and the window: `[batch, heads, 1, ns + k + nr]`."""
    batch, kv_heads, _ = chosen.shape
    device = chosen.device
    columns = torch.cat([torch.arange(ns, device=device).expand(batch, kv_heads, ns), ns + chosen,
                         torch.arange(ns + nm, ns + nm + nr, device=device).expand(batch, kv_heads, nr)], dim=2)
    columns = columns.repeat_interleave(groups, dim=1).unsqueeze(2)  # [batch, heads, 1, n]
    mask = mask[..., -(ns + nm + nr):].expand(batch, kv_heads * groups, 1, -1)
    return mask.gather(3, columns)


def _decode_values(lp: LayerPatch, out: torch.Tensor, has_exact: bool, has_latent: bool, dim: int) -> torch.Tensor:
    """Attention output over augmented values `[batch, s, heads, D]` -> `[batch, s, heads, head_dim]`."""
    if not has_latent:
        return out
    basis = lp.values.basis
    latent = out[..., dim:] if has_exact else out
    coeffs, weight = latent[..., : basis.max_rank], latent[..., basis.max_rank:]
    decoded = basis.decode_query_heads(coeffs.transpose(1, 2)).transpose(1, 2) + weight * basis.query_mean
    return out[..., :dim] + decoded if has_exact else decoded
