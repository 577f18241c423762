"""The patched attention forward, shared by every architecture family.

It mirrors `LlamaAttention.forward` in `transformers`, with three changes: keys and values are
encoded to latents before they reach the cache, the attention kernel runs on what the mode prepares
(see `patchkv.modes`), and attention outputs are decoded from value latents before `o_proj`.
The cache is whatever `transformers` passes in (a `DynamicCache` under `generate`): it stores the
packed latents `[batch, 1, seq, total_rank]` in place of `[batch, kv_heads, seq, head_dim]` tensors.
With sinks, a recent window or top-k decoding, layers hand over to `patchkv.hybrid` instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .adapters import AttentionAdapter
from .hybrid import CacheOptions, hybrid_attention
from .latent import LatentBasis
from .modes import Mode
from .rope import RopeTable


class LatentAttentionState(nn.Module):
    """What a patched attention module carries: its layer's key and value bases and the shared helpers."""

    def __init__(self, adapter: AttentionAdapter, mode: Mode, keys: LatentBasis, values: LatentBasis,
                 rope: RopeTable, options: CacheOptions):
        super().__init__()
        self.keys, self.values = keys, values
        self.adapter, self.mode, self.rope, self.options = adapter, mode, rope, options

    def extra_repr(self) -> str:
        return f"mode={self.mode.name}, key_ranks={self.keys.ranks}, value_ranks={self.values.ranks}, {self.options}"


def latent_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Cache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden_states `[batch, seq, hidden]` -> (`[batch, seq, hidden]`, attention weights or None)."""
    state: LatentAttentionState = self.patchkv
    input_shape = hidden_states.shape[:-1]

    q, k, v = state.adapter.project_qkv(self, hidden_states)
    q, k = state.mode.keys_for_cache(state, q, k, position_embeddings)
    if state.options.hybrid:
        return hybrid_attention(self, state, q, k, v, attention_mask, cache, **kwargs)
    key_latents, value_latents = state.keys.encode(k), state.values.encode(v)

    if cache is not None:
        key_latents, value_latents = cache.update(key_latents, value_latents, self.layer_idx, kwargs=kwargs)

    queries, keys = state.mode.score_inputs(state, q, key_latents)
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    latent_output, attn_weights = attention_interface(
        self,
        queries,
        keys,
        state.values.unpack(value_latents),
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=state.adapter.sliding_window(self),
        **kwargs,
    )

    # [batch, seq, heads, max_rank] -> [batch, seq, heads, head_dim]
    attn_output = state.values.decode_query_heads(latent_output.transpose(1, 2)).transpose(1, 2)
    attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
    return attn_output, attn_weights
