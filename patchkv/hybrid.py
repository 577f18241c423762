"""The hybrid cache: full-precision sinks and recent window around a latent middle, with optional
top-k sparse decoding over the latent middle.

    position:  0 .. sink_tokens-1 | sink_tokens .. T-window-1 | T-window .. T-1
    stored as: full K/V           | latents (or codes)        | full K/V

New tokens enter the recent window; as they leave it they are encoded into the latent middle.
With `top_k`, a decode step scores every middle token cheaply from its first `top_k_rank` components,
reconstructs only the `top_k` best per query head, and runs exact softmax attention over sinks,
those tokens and the window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .kernels import ops as kernels
from .errors import PatchKVError

if TYPE_CHECKING:
    from .attention import LatentAttentionState


@dataclass(frozen=True)
class CacheOptions:
    """What `patchkv.apply` was asked for beyond the plain low-rank cache."""

    sink_tokens: int = 0
    window: int = 0
    bits: int | None = None
    top_k: int | None = None
    top_k_rank: int | None = None

    @property
    def hybrid(self) -> bool:
        """Whether the cache needs full-precision regions or sparse decoding (quantization alone does not)."""
        return bool(self.sink_tokens or self.window or self.top_k)


class HybridLayer(CacheLayerMixin):
    """One layer's hybrid cache. Full parts are `[batch, kv_heads, n, head_dim]`; the middle is the packed
    latents or codes of `LatentBasis.encode`, `[batch, 1, n, width]`."""

    is_sliding = False
    is_croppable = False

    def __init__(self, sink_tokens: int, window: int):
        super().__init__()
        self.sink_tokens, self.window = sink_tokens, window
        self.length = 0
        self.parts: dict[str, torch.Tensor] = {}

    def append(self, k: torch.Tensor, v: torch.Tensor, state: LatentAttentionState) -> None:
        """Add new full keys and values `[batch, kv_heads, seq, head_dim]`, encoding what leaves the window."""
        if not self.is_initialized:
            empty_full = k[:, :, :0]
            self.parts = {"sink_k": empty_full, "sink_v": v[:, :, :0], "recent_k": empty_full,
                          "recent_v": v[:, :, :0], "middle_k": state.keys.encode(k[:, :, :0]),
                          "middle_v": state.values.encode(v[:, :, :0])}
            self.device, self.is_initialized = k.device, True
        p = self.parts
        room = max(0, self.sink_tokens - p["sink_k"].shape[2])
        p["sink_k"] = torch.cat([p["sink_k"], k[:, :, :room]], dim=2)
        p["sink_v"] = torch.cat([p["sink_v"], v[:, :, :room]], dim=2)
        p["recent_k"] = torch.cat([p["recent_k"], k[:, :, room:]], dim=2)
        p["recent_v"] = torch.cat([p["recent_v"], v[:, :, room:]], dim=2)
        leaving = p["recent_k"].shape[2] - self.window
        if leaving > 0:
            p["middle_k"] = torch.cat([p["middle_k"], state.keys.encode(p["recent_k"][:, :, :leaving])], dim=2)
            p["middle_v"] = torch.cat([p["middle_v"], state.values.encode(p["recent_v"][:, :, :leaving])], dim=2)
            p["recent_k"], p["recent_v"] = p["recent_k"][:, :, leaving:], p["recent_v"][:, :, leaving:]
        self.length += k.shape[2]

    @property
    def sink_len(self) -> int:
        return self.parts["sink_k"].shape[2]

    @property
    def middle_len(self) -> int:
        return self.parts["middle_k"].shape[2]

    def full(self, state: LatentAttentionState) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values in position order `[batch, kv_heads, length, head_dim]`, the middle reconstructed."""
        p = self.parts
        keys = state.keys.decode(state.keys.unpack(p["middle_k"]))
        values = state.values.decode(state.values.unpack(p["middle_v"]))
        return (torch.cat([p["sink_k"], keys, p["recent_k"]], dim=2),
                torch.cat([p["sink_v"], values, p["recent_v"]], dim=2))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts.values())

    # ----- the CacheLayerMixin interface ------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError("HybridLayer is filled by the patched attention through append().")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("HybridLayer is filled by the patched attention through append().")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.parts, self.length, self.is_initialized = {}, 0, False

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.parts = {name: fn(t) for name, t in self.parts.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise PatchKVError("A patchkv hybrid cache cannot be cropped (assisted decoding); use the plain latent "
                           "cache (no sink_tokens/window/top_k) for that.")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


def hybrid_layer(cache: Cache | None, layer_idx: int, options: CacheOptions) -> HybridLayer:
    """The layer's HybridLayer, swapped into `cache` in place of the empty layer `transformers` made."""
    if cache is None:  # no cache (use_cache=False): a throwaway one for this forward
        return HybridLayer(options.sink_tokens, options.window)
    while len(cache.layers) <= layer_idx:
        cache.layers.append(DynamicLayer())
    layer = cache.layers[layer_idx]
    if not isinstance(layer, HybridLayer):
        if layer.get_seq_length() > 0:
            raise PatchKVError(f"Cache layer {layer_idx} already holds {layer.get_seq_length()} tokens written "
                               "without patchkv's hybrid cache; start generation from an empty cache.")
        layer = cache.layers[layer_idx] = HybridLayer(options.sink_tokens, options.window)
    return layer


def hybrid_attention(attn: nn.Module, state: LatentAttentionState, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q `[batch, heads, seq, head_dim]`, k, v `[batch, kv_heads, seq, head_dim]` as `Mode.keys_for_cache`
    returns them -> (`[batch, seq, hidden]`, attention weights or None)."""
    options = state.options
    layer = hybrid_layer(cache, attn.layer_idx, options)
    layer.append(k, v, state)
    batch, _, seq, _ = q.shape
    if options.top_k and seq == 1 and layer.middle_len >= options.top_k:
        out, weights = _sparse_decode(attn, state, layer, q, attention_mask)
    else:
        keys, values = layer.full(state)
        q, keys = state.mode.rotate_for_attention(state, q, keys)
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                                    eager_attention_forward)
        out, weights = interface(attn, q, keys, values, attention_mask, scaling=attn.scaling,
                                 dropout=0.0 if not attn.training else attn.attention_dropout, **kwargs)
    return attn.o_proj(out.reshape(batch, seq, -1).contiguous()), weights


def _additive(mask: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A `[batch, 1, 1, kv]` boolean or additive mask (or None) as an additive float mask."""
    if mask is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def _sparse_decode(attn: nn.Module, state: LatentAttentionState, layer: HybridLayer, q: torch.Tensor,
                   attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step over sinks + the top-k latent-scored middle tokens + the window.

    q: `[batch, heads, 1, head_dim]`. Returns (`[batch, 1, heads, head_dim]`, weights `[batch, heads, 1, n]`).
    """
    opts, p, groups = state.options, layer.parts, attn.num_key_value_groups
    batch, heads, _, dim = q.shape
    start, middle, total = layer.sink_len, layer.middle_len, layer.length
    mask = _additive(attention_mask, (batch, 1, 1, total), q.dtype, q.device)[..., -total:].squeeze(2)  # [b,1,T]
    basis, mean = state.keys.basis, state.keys.mean  # [kv_heads, head_dim, max_rank], [kv_heads, head_dim]
    coeffs = state.keys.unpack(p["middle_k"])  # [batch, kv_heads, middle, max_rank]
    r = min(opts.top_k_rank or state.keys.max_rank, state.keys.max_rank)
    kv_of_head = torch.arange(heads, device=q.device) // groups
    positions = torch.arange(start, start + middle, device=q.device)
    if state.mode.rotated_in_cache:  # post-RoPE: scores in the latent space, from the first r components
        q_lat = state.keys.project_queries(q)[:, :, 0, :r]
        scores = kernels.latent_scores(q_lat, coeffs[..., :r].contiguous(), groups)
        q_rot = q
    else:  # pre-RoPE: rank-r reconstruction, rotated to its positions, dotted with the rotated query
        cos, sin = state.rope(total, like=q)
        q_rot = state.adapter.rotate(q, cos[:, total - 1:], sin[:, total - 1:])
        approx = kernels.reconstruct_rope(coeffs[..., :r].contiguous(), basis[..., :r].contiguous(), mean,
                                          cos[:, positions].unsqueeze(1), sin[:, positions].unsqueeze(1))
        scores = torch.einsum("bhd,bhtd->bht", q_rot[:, :, 0], approx.repeat_interleave(groups, dim=1))
    scores = scores + mask[..., start:start + middle]
    chosen = scores.topk(opts.top_k, dim=-1).indices  # [batch, heads, top_k], indices into the middle

    def gather(x: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, middle, C] -> [batch, heads, top_k, C]
        per_head = x[:, kv_of_head]
        return per_head.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

    picked = gather(coeffs)
    if state.mode.rotated_in_cache:
        sel_k = state.keys.decode_query_heads(picked)
    else:
        cos_sel, sin_sel = cos[0, positions[chosen]], sin[0, positions[chosen]]  # [batch, heads, top_k, dim]
        sel_k = kernels.reconstruct_rope(picked.contiguous(), state.keys.query_basis, state.keys.query_mean,
                                         cos_sel, sin_sel)
    sel_v = state.values.decode_query_heads(gather(state.values.unpack(p["middle_v"])))

    full_k = torch.cat([p["sink_k"], p["recent_k"]], dim=2)  # [batch, kv_heads, sinks + window, dim]
    full_v = torch.cat([p["sink_v"], p["recent_v"]], dim=2)
    full_pos = torch.cat([torch.arange(start, device=q.device), torch.arange(start + middle, total, device=q.device)])
    if not state.mode.rotated_in_cache:
        full_k = state.adapter.rotate(full_k, cos[:, full_pos], sin[:, full_pos])
    keys = torch.cat([full_k[:, kv_of_head], sel_k.to(q.dtype)], dim=2)
    values = torch.cat([full_v[:, kv_of_head], sel_v], dim=2)
    bias = torch.cat([mask[..., full_pos].expand(batch, heads, -1),
                      (mask[..., start:start + middle].expand(batch, heads, -1)).gather(2, chosen)], dim=2)
    logits = torch.einsum("bhd,bhnd->bhn", q_rot[:, :, 0], keys) * attn.scaling + bias
    weights = logits.float().softmax(-1).to(q.dtype)
    out = torch.einsum("bhn,bhnd->bhd", weights, values)
    return out.unsqueeze(1), weights.unsqueeze(2)
