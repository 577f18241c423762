"""The method interface: every compression method is a small frozen dataclass that edits a `CachePlan`.

A plan says what the cache stores and how attention reads it:

- `codec`: how the latent middle is stored (one per plan): `LowRank` floats or `Quantized` DP codes;
- `sink_tokens` / `window`: the first and the last tokens kept as exact K/V (`SinksWindow`);
- `selector`: decode-time token selection over the latent middle (`TopK`).

A new method is one file in this folder: a dataclass subclassing `Method` with a `name`, validated fields
and `configure`, registered in `patchkv/methods/__init__.py`. The CLI and the evals read that registry.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..artifact import Artifact
    from ..latent import Codec


class Method:
    """Base class. Subclasses are frozen dataclasses; `configure` returns the edited plan."""

    name: ClassVar[str]
    #: "codec", "regions" or "selection": a plan holds at most one method of each role.
    role: ClassVar[str]

    def configure(self, plan: CachePlan) -> CachePlan:
        raise NotImplementedError

    def spec(self) -> str:
        """`name:field=value,...`, the form `patchkv.methods.parse_method` and the CLI's `--method` read."""
        fields = ",".join(f"{k}={v}" for k, v in vars(self).items() if v is not None)
        return f"{self.name}:{fields}" if fields else self.name


class CodecMethod(Method):
    """A method that decides how latents are stored: builds every layer's key and value codecs."""

    role = "codec"

    def codecs(self, artifact: Artifact, query_groups: list[int], dtype: torch.dtype) -> list[tuple[Codec, Codec]]:
        """One (key codec, value codec) per layer, for a model computing in `dtype`."""
        raise NotImplementedError

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, codec=self)


class Selector(Method):
    """A method that picks, at a decode step, which latent tokens each KV head attends to. Attention asks it which
    middle tokens to read (`choose`) and reads only those, exactly (`patchkv.attention.select`); the mode gives it the
    one mode-specific primitive it needs, scores of this step's query against leading key coefficients."""

    role = "selection"

    def applies(self, query_len: int, middle_len: int) -> bool:
        """Whether a forward of `query_len` queries over a middle of `middle_len` latent tokens selects."""
        raise NotImplementedError

    def choose(self, codec: Codec, middle: torch.Tensor, score: Callable[[torch.Tensor], torch.Tensor],
               bias: torch.Tensor | None) -> torch.Tensor:
        """The middle tokens each KV head reads at this decode step. codec: the layer's key codec; middle: the
        middle's keys as stored, `[batch, m, width]`; score: the mode's scores of this step's query against leading
        key coefficients `[batch, kv_heads, m, r]` -> float32 `[batch, heads, m]`; bias: the mask's middle columns
        for this query, additive float32 `[batch, 1 or heads, m]`, or None -> sorted indices `[batch, kv_heads, k]`
        into the middle."""
        raise NotImplementedError

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, selector=self)


@dataclass(frozen=True)
class CachePlan:
    """What `patchkv.apply` assembled from its methods; read by `LatentCache` and the patched attention."""

    codec: CodecMethod
    sink_tokens: int = 0
    window: int = 0
    selector: Selector | None = None
    methods: tuple[Method, ...] = field(default=())

    @property
    def exact_regions(self) -> bool:
        return bool(self.sink_tokens or self.window)

    def describe(self) -> str:
        return " + ".join(m.spec() for m in self.methods)


def check_int(owner: str, name: str, value: object, minimum: int) -> int:
    """`value` as an int >= minimum (numpy integers accepted, bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)
