"""What a patched model carries: `Patch` on the model, `LayerPatch` on each attention module.

Neither is an `nn.Module`: the model's module tree and `state_dict` stay as they were, accelerate's hooks
never see the bases, and both pickle with the model (`torch.save(model)` of a patched model loads patched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .adapters import AttentionAdapter
from .latent import Codec
from .methods import CachePlan
from .rope import RopeTable


@dataclass
class Patch:
    """Model-wide: the adapter, mode, plan, artifact, and what `remove` must restore."""

    adapter: AttentionAdapter
    mode: Any  # patchkv.key_space.Mode
    plan: CachePlan
    artifact: Any  # patchkv.Artifact
    fingerprint: str
    sliding_windows: list[int | None]
    #: one per attention layer, in order (`LatentCache` builds each of its layers with one)
    layers: list[LayerPatch] = field(default_factory=list)
    decoder_hook_id: int | None = None
    #: instance attributes `apply` replaced (None where there was none), put back by `remove`
    restore: dict[str, Any] = field(default_factory=dict)
    #: the dtype the codecs compute in (the model's), and each layer's query heads per KV head
    dtype: torch.dtype | None = None
    query_groups: list[int] = field(default_factory=list)

    def compute_in(self, dtype: torch.dtype) -> None:
        """Follow the model into `dtype` (`model.to(torch.bfloat16)` after `apply`): every layer's codecs are rebuilt
        from the artifact for it, once, and the RoPE tables from the moved rotary module. A cache written before keeps
        its old dtype and is refused by its layers."""
        if dtype == self.dtype:
            return
        codecs, near = self.codecs(dtype)
        for lp, (keys, values), (near_keys, near_values) in zip(self.layers, codecs, near):
            lp.keys, lp.values, lp.near_keys, lp.near_values, lp.device = keys, values, near_keys, near_values, None
            lp.rope.reset()
        self.dtype = dtype

    def codecs(self, dtype: torch.dtype) -> tuple[list[tuple[Codec, Codec]], list[tuple[Codec, Codec]]]:
        """Every layer's (key, value) codecs for a model computing in `dtype`, for the middle and for the near tokens
        (the middle's own where the plan keeps no near tokens)."""
        codecs = self.plan.codec.codecs(self.artifact, self.query_groups, dtype)
        if self.plan.near is None:
            return codecs, codecs
        finer = self.plan.codec.finer(self.artifact, self.plan.near.factor)
        return codecs, finer.codecs(self.artifact, self.query_groups, dtype)


@dataclass
class LayerPatch:
    """One attention module's codecs and rotary table, moved lazily to the device the layer computes on: `keys`,
    `values` code the middle, `near_keys`, `near_values` the near tokens (`NearCodes`; the same codecs without)."""

    patch: Patch
    layer_idx: int
    keys: Codec
    values: Codec
    rope: RopeTable
    near_keys: Codec | None = None
    near_values: Codec | None = None
    device: torch.device | None = None

    def __post_init__(self):
        self.near_keys = self.keys if self.near_keys is None else self.near_keys
        self.near_values = self.values if self.near_values is None else self.near_values

    def on(self, device: torch.device) -> LayerPatch:
        if self.device != device:
            for codec in {id(c): c for c in (self.keys, self.values, self.near_keys, self.near_values) if c}.values():
                codec.to(device)
            self.device = device
        return self

    def near(self) -> LayerPatch:
        """This layer with the near tokens' codecs in place of the middle's: what reads the near tokens as a middle
        of their own (`Visible.near`) codes and scores them with."""
        if self.near_keys is self.keys:
            return self
        return LayerPatch(self.patch, self.layer_idx, self.near_keys, self.near_values, self.rope, device=self.device)

    @property
    def sliding_window(self) -> int | None:
        return self.patch.sliding_windows[self.layer_idx]
