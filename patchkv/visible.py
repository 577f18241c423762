"""What the attention path reads a layer through: the `AttentionLayer` protocol, and `Visible`, what a layer hands
attention for one step (`update_latent`), the middle as stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .methods import Observation


@dataclass
class Visible:
    """What one attention step reads, in position order (sinks, middle, near, window).

    sink_*/window_*: exact `[batch, kv_heads, n, head_dim]` in cache space; middle_keys/middle_values: the middle
    as stored, `[batch, m, width]` (fixed-rate codes or packed floats, read through `patchkv.kernels`);
    near_keys/near_values: the newest coded tokens at the near rate (`patchkv.methods.NearCodes`), `[batch, n,
    near width]` as stored, None where the plan keeps none; *_positions: true positions `[batch, n]`. salient_*: the
    coded tokens each KV head also holds exact (`patchkv.methods.Salience`), `[batch, kv_heads, s, head_dim]` in
    cache space, at coded indices `salient_index` int64 `[batch, kv_heads, s]` (over the middle, then the near
    tokens) and true positions
    `salient_positions` `[batch, kv_heads, s]`; None where the plan keeps none. Attention reads them in place of
    their codes. columns: where `patchkv.methods.Evict` has dropped tokens, each visible token's index in the
    sequence (its column in the model's attention mask), int64 `[batch, n]`; None where the visible tokens are the
    sequence's own, in order.
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    window_keys: torch.Tensor
    window_values: torch.Tensor
    middle_keys: torch.Tensor
    middle_values: torch.Tensor
    sink_positions: torch.Tensor
    middle_positions: torch.Tensor
    window_positions: torch.Tensor
    salient_keys: torch.Tensor | None = None
    salient_values: torch.Tensor | None = None
    salient_index: torch.Tensor | None = None
    salient_positions: torch.Tensor | None = None
    near_keys: torch.Tensor | None = None
    near_values: torch.Tensor | None = None
    near_positions: torch.Tensor | None = None
    columns: torch.Tensor | None = None

    @property
    def middle_len(self) -> int:
        return self.middle_keys.shape[1]

    @property
    def near_len(self) -> int:
        return 0 if self.near_keys is None else self.near_keys.shape[1]

    def near(self) -> Visible:
        """The near tokens as a step with them for its middle and no exact tokens: what the mode's middle readers
        (`middle_keys`, `middle_attend`) read them through, with the layer's near codecs (`LayerPatch.near`)."""
        none = self.sink_keys[:, :, :0]
        at = self.sink_positions[:, :0]
        return Visible(none, self.sink_values[:, :, :0], none, self.sink_values[:, :, :0], self.near_keys,
                       self.near_values, at, self.near_positions, at)

    @property
    def salient_len(self) -> int:
        return 0 if self.salient_keys is None else self.salient_keys.shape[2]


class AttentionLayer(Protocol):
    """A layer as the attention path (`patchkv.attention.attention_forward`) reads it, implemented by
    `patchkv.cache.LatentLayer` (a layer of the cache) and `patchkv.fisher.FisherProbe` (effect-weight calibration's
    own: every token exact and perturbed, no middle)."""

    def get_seq_length(self) -> int:
        """Tokens the layer has taken before this forward (where the new ones start when the model passes no
        `position_ids`)."""

    def update_latent(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, /) -> Visible:
        """Take this forward's keys and values `[batch, kv_heads, n, head_dim]` in cache space at their true positions
        `[batch, n]`; return what its attention reads."""

    def after_attention(self, observed: Observation | None = None, /) -> None:
        """The forward's attention is done; `observed`: its queries, for a salience method that observes them."""
