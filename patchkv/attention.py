"""The patched attention forward, one code path for every family, mode and method.

It mirrors `LlamaAttention.forward` in `transformers` with everything architecture-specific asked of the
adapter, and these changes:

1. q, k, v come out of the adapter un-rotated; the mode puts them in cache space (`patchkv.key_space`);
2. the layer of the `LatentCache` takes the new tokens exact at their true positions (`update_latent`);
3. a forward of several queries reads the visible tokens dense, the middle rebuilt from what the cache stores
   (keys rotated by their true positions in pre-RoPE mode), and runs the model's own attention function
   (sdpa or eager, with the family's masks, scaling, softcap and sliding window) on ordinary tensors;
4. a decode step (one query per sequence, no dropout, softcap or returned weights) reads the middle straight
   from the stored codes in one pass (`decode_attention`, `Mode.middle_attend`: scores, a running softmax, values
   summed in the latent space), merged with the exact tokens: `sum_j p_j v_j + U (sum_j p_j c_j) + (sum_j p_j)
   mean`;
5. if the layer has dropped tokens (`patchkv.methods.Evict`), the mask is cut to the columns of those it holds
   (`held_columns`);
   if the plan has a selector (`TopK`) a decode step asks it which latent tokens each KV head reads (`select`)
   and attends exactly over sinks, those and the window;
   if it has a salience method (`patchkv.methods.Salience`), the coded tokens (middle and near) each KV head keeps
   exact are read in place of their codes: written over the dense ones, or merged with the exact tokens of a decode
   step;
6. after attention the layer encodes what has left the window (`LatentLayer.after_attention`).

Effect-weight calibration (`patchkv.fisher`) runs this same path (`attention_forward`) over a layer of its own that
serves every token exact and perturbed, with a mask choosing per query and key, in float32.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from . import heap
from .cache import LatentCache, LatentLayer, check_cache
from .errors import PatchKVError
from .kernels import ops as kernels
from .key_space import grouped_scores
from .methods import Observation
from .operands import dense
from .patch import LayerPatch
from .visible import AttentionLayer, Visible


class LatentForward:
    """The `forward` installed on a patched attention module: a plain object (no closure), so a patched
    model pickles and loads patched. `torch.compile` never traces it (`torch.compiler.disable`): the rest of the
    model compiles, and patched attention runs as it does uncompiled (its data-dependent shapes, Python-side cache
    and C++ kernels are not graphs)."""

    def __init__(self, module: nn.Module):
        self.module = module

    @torch.compiler.disable
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
    """hidden_states `[batch, seq, hidden]` -> (`[batch, seq, hidden]`, attention weights or None): the patched
    module's forward, over its layer of the `LatentCache` (`attention_forward`). A long CPU forward hands the heap's
    freed pages back to the system before and after the layer (`patchkv.heap`)."""
    lp: LayerPatch = attn.patchkv
    lp.patch.compute_in(lp.patch.adapter.dtype(attn))  # the model may have moved to another dtype since apply
    lp = lp.on(hidden_states.device)
    tokens = hidden_states.shape[0] * hidden_states.shape[1] if hidden_states.device.type == "cpu" else 0
    heap.release(tokens)  # the layer below's temporaries, freed
    out = attention_forward(attn, lp, _layer(cache, lp), hidden_states, position_embeddings, attention_mask, **kwargs)
    if isinstance(cache, LatentCache):
        cache.done(lp.layer_idx)
    heap.release(tokens)  # this layer's
    return out


def attention_forward(attn: nn.Module, lp: LayerPatch, layer: AttentionLayer, hidden_states: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None, *,
                      compute_dtype: torch.dtype | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one attention path: hidden_states `[batch, seq, hidden]` -> (`[batch, seq, hidden]`, attention weights or
    None). q, k, v by the adapter, put in cache space by the mode; `layer` takes the new keys and values and gives
    what this step reads (`update_latent` -> `Visible`), attention runs over it (`decode_attention`, or the model's
    own attention function over dense operands), then `layer.after_attention()`.

    layer: an `AttentionLayer`: the `LatentLayer` of the cache, or effect-weight calibration's own
        (`patchkv.fisher.FisherProbe`: every token exact and perturbed, the mask choosing per query and key).
    compute_dtype: q, k, v and cos/sin cast to this dtype before attention, the output cast back to the model's
        (effect-weight calibration takes its gradients in float32); None: attention in the model's dtype."""
    adapter, mode = lp.patch.adapter, lp.patch.mode
    q, k, v = adapter.project_qkv(attn, hidden_states)
    cos, sin = position_embeddings
    model_dtype = q.dtype
    if compute_dtype is not None:
        q, k, v, cos, sin = (x.to(compute_dtype) for x in (q, k, v, cos, sin))
    batch, _, seq, _ = q.shape
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=q.device).unsqueeze(0) + layer.get_seq_length()
    positions = positions.expand(batch, seq)
    q, k = mode.to_cache_space(lp, q, k, cos, sin)
    seen = layer.update_latent(k, v, positions)
    if seen.columns is not None:  # tokens were dropped (`Evict`): the mask's columns of those held
        attention_mask = held_columns(attention_mask, seen.columns, seq, layer.get_seq_length(), q.dtype)
    queries = mode.queries(lp, q, cos, sin)
    dtype, decode = q.dtype, decode_applies(attn, lp, q, kwargs)
    del q, k, v  # the layer holds its own copies: a long forward's encoding (`after_attention`) runs without these
    scaling = adapter.scaling(attn)
    weights, chosen = None, None
    selector = lp.patch.plan.selector
    if selector is not None and lp.sliding_window is None and selector.applies(seq, seen.middle_len):
        with torch.profiler.record_function("patchkv::select"):
            chosen, attention_mask = select(lp, queries, seen, attention_mask)
    if decode:
        with torch.profiler.record_function("patchkv::decode_attention"):
            out = decode_attention(lp, queries, seen, attention_mask, scaling, chosen)
    else:
        with torch.profiler.record_function("patchkv::dense_operands"):
            keys, values = dense(lp, seen, dtype, chosen)
        with torch.profiler.record_function("patchkv::attention_function"):
            out, weights = adapter.attention_function(attn)(
                attn, queries, keys, values, attention_mask, dropout=attn.attention_dropout if attn.training else 0.0,
                scaling=scaling, **{**kwargs, **adapter.attention_kwargs(attn)})
        del keys, values
    plan = lp.patch.plan
    observes = any(m is not None and m.observes for m in (plan.salience, plan.evict))
    observed = Observation(queries, positions, scaling, partial(mode.exact_keys, lp)) if observes else None
    del queries
    layer.after_attention(observed)
    out = out.reshape(batch, seq, -1).to(model_dtype).contiguous()
    return adapter.output(attn, out), weights


def _layer(cache: Cache | None, lp: LayerPatch) -> LatentLayer:
    if cache is None:  # use_cache=False: a throwaway layer for this forward
        plan = lp.patch.plan
        return LatentLayer(lp, plan.sink_tokens, plan.window, lp.sliding_window, salience=plan.salience,
                           near_tokens=plan.near_tokens, evict=plan.evict)
    return check_cache(cache, lp.patch.fingerprint).layer(lp.layer_idx)


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean (True = attend) or additive mask as an additive float32 mask."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=torch.float32, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask.float()


def held_columns(mask: torch.Tensor | None, columns: torch.Tensor, seq: int, seen: int, dtype: torch.dtype
                 ) -> torch.Tensor | None:
    """The attention mask of a forward of `seq` queries, the last of the `seen` tokens of the sequence, cut to the
    tokens a layer holds, at `columns` `[batch, n]` (their indices in the sequence, `Visible.columns`): `[batch, 1 or
    heads, seq, n]`. The model's mask, `[batch or 1, 1 or heads, seq, >= seen]`, gathered; with none, causal by the
    columns, additive in `dtype` (the queries'; a query reads the held tokens up to its own; one decode query reads
    every one: None)."""
    batch = columns.shape[0]
    if mask is None:
        if seq == 1:
            return None
        queries = torch.arange(seen - seq, seen, device=columns.device)
        later = columns[:, None, None, :] > queries[None, None, :, None]  # [batch, 1, seq, n]
        return torch.zeros(later.shape, dtype=dtype, device=columns.device).masked_fill(later, torch.finfo(dtype).min)
    if mask.shape[-1] < seen:
        raise PatchKVError(f"the attention mask has {mask.shape[-1]} key columns, this layer has seen {seen} tokens; "
                           "pass a mask over every token of the sequence (as generate() builds it).")
    mask = mask.expand(batch, *mask.shape[1:])
    return mask.gather(3, columns[:, None, None, :].expand(-1, mask.shape[1], mask.shape[2], -1))


def decode_applies(attn: nn.Module, lp: LayerPatch, q: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """A decode step (one query per sequence) attends by `decode_attention` unless the model's attention function
    would add something to softmax(q.k * scaling + mask) v: dropout, a logit softcap, returned weights."""
    return (q.shape[2] == 1 and not attn.training and not kwargs.get("output_attentions")
            and set(lp.patch.adapter.attention_kwargs(attn)) <= {"sliding_window"})


def decode_attention(lp: LayerPatch, q: torch.Tensor, seen: Visible, mask: torch.Tensor | None, scaling: float,
                     chosen: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step's attention, the middle read from what the cache stores. q `[batch, heads, 1, d]` as the
    mode's `queries` returns it; mask `[batch, 1 or heads, 1, >= n]` as the attention functions take it ->
    `[batch, 1, heads, d]` in q's dtype, as the attention function returns it.

    The exact tokens (sinks, window) are scored and weighted as they are; the middle is read in one pass over its
    codes by the mode (`Mode.middle_attend`: keys rebuilt and rotated in registers, or scored in the latent space;
    a running softmax; value coefficients summed in the latent space), the near tokens (`NearCodes`) in one pass of
    their own with their codecs, and all are merged (log-sum-exp), each coded region's values decoded once per query
    head: `U (sum_j p_j c_j) + (sum_j p_j) mean`. `chosen`: the middle cut
    to each KV head's selected tokens by top-k (`select`; the mask is cut alike), attended exactly. Salient tokens
    (`Visible.salient_*`) join the exact ones with their own mask columns, and their codes are masked out of the
    coded passes."""
    batch, heads = q.shape[:2]
    kv_heads = lp.keys.basis.heads
    mode = lp.patch.mode
    qg = q.float().reshape(batch, kv_heads, heads // kv_heads, -1)  # each KV head's query heads together
    ns, nm, nn = seen.sink_keys.shape[2], seen.middle_len, seen.near_len
    middle = chosen is None and nm > 0
    coded = (nm if middle else 0) + nn  # the mask's columns read from codes: the middle's, then the near tokens'
    salient = chosen is None and seen.salient_len > 0  # each KV head's exact copies of coded tokens, read instead
    if salient:
        chosen = (mode.exact_keys(lp, seen.salient_keys.float(), seen.salient_positions), seen.salient_values)
    # the exact tokens (sinks, top-k's chosen or the salient ones, window), as attention reads them
    keys = [mode.exact_keys(lp, seen.sink_keys.float(), seen.sink_positions),
            chosen[0] if chosen is not None else None,
            mode.exact_keys(lp, seen.window_keys.float(), seen.window_positions)]
    values = [seen.sink_values.float(), chosen[1].float() if chosen is not None else None, seen.window_values.float()]
    keys, values = (torch.cat([x for x in xs if x is not None], dim=2) for xs in (keys, values))
    scores = grouped_scores(qg, keys).float() * scaling  # [batch, kv_heads, groups, exact]
    bias = None  # the coded columns' additive mask: [batch, coded], or [batch, kv_heads, coded] per KV head
    if mask is not None:
        columns_read = keys.shape[2] - (seen.salient_len if salient else 0)  # sinks, top-k's chosen, window
        m = _additive(mask[..., : columns_read + coded])  # the mask's columns for these tokens
        per_head = m.shape[1] > 1
        m = m.view(m.shape[0], kv_heads, -1, m.shape[-1]) if per_head else m  # [batch, kv_heads or 1, groups or 1, n]
        if coded:
            columns, bias = _coded_bias(m, ns, coded, per_head)
            exact = [m[..., :ns], m[..., ns + coded:]]
            if salient:  # the salient tokens' own columns of the coded ones, per KV head
                shape = (m.shape[0], kv_heads, m.shape[2])
                exact = [exact[0].expand(*shape, -1), columns.expand(*shape, -1).gather(
                    3, seen.salient_index.unsqueeze(2).expand(*shape, -1)), exact[1].expand(*shape, -1)]
            m = torch.cat(exact, dim=-1)
        scores = scores + m
    if salient:  # the salient tokens' codes are not read: their exact copies stand in
        hidden = torch.zeros(batch, kv_heads, coded, device=q.device) if bias is None else \
            (bias if bias.dim() == 3 else bias.unsqueeze(1)).expand(batch, kv_heads, coded).clone()
        bias = hidden.scatter_(2, seen.salient_index, torch.finfo(torch.float32).min)
    middle_bias, near_bias = (None, None) if bias is None else \
        (bias[..., :coded - nn].contiguous(), bias[..., coded - nn:].contiguous())
    # one pass over each coded region as stored (the middle, the near tokens with their own codecs): its running
    # max, sum of exp and value coefficient sums
    regions = ([(lp, seen, middle_bias)] if middle else []) + ([(lp.near(), seen.near(), near_bias)] if nn else [])
    passes = [(region_lp.values, *mode.middle_attend(region_lp, region, qg, region_bias, scaling))
              for region_lp, region, region_bias in regions]
    top = scores.amax(-1)
    for _, m_region, _, _ in passes:
        top = torch.maximum(top, m_region)
    p = torch.exp(scores - top.unsqueeze(-1))
    total = p.sum(-1)
    out = p @ values
    for codec, m_region, l_region, sums in passes:
        weight = torch.exp(m_region - top).nan_to_num(0.0)  # m_region = -inf: every token of the region masked
        total = total + weight * l_region
        out = out + weight.unsqueeze(-1) * (sums @ codec.padded_rows + l_region.unsqueeze(-1) *
                                             codec.kernel_mean.unsqueeze(1))
    out = out / total.unsqueeze(-1)
    return out.reshape(batch, 1, heads, -1).to(q.dtype)


def _coded_bias(m: torch.Tensor, start: int, n: int, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive mask `m` `[batch, kv_heads or 1, groups or 1, columns]`'s columns `start:start + n` (a coded
    region's) and the one row of them a pass over the region reads, `[batch, n]` or per KV head `[batch, kv_heads,
    n]`: each KV head's query heads must agree."""
    columns = m[..., start:start + n]
    if per_head and not bool((columns == columns[:, :, :1]).all()):
        raise PatchKVError("a decode step over the middle takes one mask per KV head; this mask differs between "
                           "query heads that share a KV head.")
    return columns, (columns[:, 0, 0] if not per_head else columns[:, :, 0]).contiguous()


def select(lp: LayerPatch, q: torch.Tensor, seen: Visible, mask: torch.Tensor | None
           ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """A decode step under the plan's selector (`Selector.choose`, e.g. `TopK`): asks it which middle tokens each KV
    head reads, scored by the mode's `approximate_scores` of q `[batch, heads, 1, d]` (as the mode's `queries` returns
    it), and reads them -> (their keys as attention reads them, their values), float32 `[batch, kv_heads, k, d]` each,
    and the mask cut to sinks, chosen tokens and window."""
    mode = lp.patch.mode
    codecs = lp.keys, lp.values
    ns, nm, nr = seen.sink_keys.shape[2], seen.middle_len, seen.window_keys.shape[2]
    bias = None if mask is None else _additive(mask)[:, :, -1, ns:ns + nm]
    chosen = lp.patch.plan.selector.choose(
        codecs[0], lambda rank: mode.approximate_scores(lp, q, seen.middle_keys, rank, seen.middle_positions),
        bias)  # [batch, kv_heads, k]
    batch, kv_heads, k = chosen.shape
    positions = seen.middle_positions.unsqueeze(1).expand(-1, kv_heads, -1).gather(2, chosen)
    picked = []
    for codec, stored in zip(codecs, (seen.middle_keys, seen.middle_values)):
        # the chosen rows of every head, decoded, then each head's own: [batch, kv_heads, k, width] -> vectors
        rows = stored.gather(1, chosen.reshape(batch, -1, 1).expand(-1, -1, stored.shape[-1]))
        vectors = kernels.reconstruct(rows, codec.table, codec.rows, codec.kernel_mean, None, torch.float32)
        picked.append(vectors.view(batch, kv_heads, kv_heads, k, -1).diagonal(dim1=1, dim2=2).permute(0, 3, 1, 2))
    keys = mode.exact_keys(lp, picked[0], positions)
    if mask is not None:
        mask = _select_columns(mask, chosen, ns, nm, nr, codecs[0].basis.query_groups)
    return (keys, picked[1]), mask


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
