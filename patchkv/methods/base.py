"""The method interface: every compression method is a small frozen dataclass that edits a `CachePlan`.

A plan says what the cache stores and how attention reads it:

- `codec`: how the middle is stored (one per plan): `LowRank` floats or `Quantized` DP codes;
- `sink_tokens` / `window`: the first and the last tokens kept as exact K/V, the window optionally int8
  (`SinksWindow`);
- `selector`: decode-time token selection over the middle (`TopK`);
- `salience`: which middle tokens each KV head also keeps exact, by a question-agnostic score (`Salience`:
  `Novelty`, `CodeError`, `KeyNorm`, `AttentionMass`);
- `near`: the newest coded tokens kept at a higher rate than the rest of the middle (`NearCodes`);
- `evict`: the coded tokens a score ranks lowest dropped as they leave the window (`Evict`).

A new method is one file in this folder: a dataclass subclassing `Method` with a `name`, validated fields
and `configure`, registered in `patchkv/methods/__init__.py`. The CLI and the evals read that registry.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..artifact import Artifact
    from ..latent import Codec
    from ..patch import LayerPatch


#: how a `Salience` method's kept tokens are chosen: the same for a layer's KV heads, or each head its own
SCOPES = ("layer", "head")
#: how a `Salience` method's copies and a `SinksWindow`'s window are held: exact (16-bit, the model's dtype), or int8
#: or int4 (two to a byte) with a scale
COPY_BITS = (16, 8, 4)


def check_bits(owner: str, bits: object, what: str) -> int:
    """`bits` as one of `COPY_BITS` (`what` says what each means to `owner`)."""
    if isinstance(bits, bool) or bits not in COPY_BITS:
        raise ValueError(f"{owner}: bits must be one of {COPY_BITS} ({what}), got {bits!r}.")
    return int(bits)


def spec_of(method: Method, always: tuple[str, ...] = ()) -> str:
    """`name` and the fields that differ from their defaults, or are named in `always` ("near", "near:tokens=480")."""
    shown = [f"{f.name}={getattr(method, f.name)}" for f in fields(method)
             if f.name in always or getattr(method, f.name) != f.default]
    return f"{method.name}:{','.join(shown)}" if shown else method.name


def copy_layout(bits: int, dtype: torch.dtype, head_dim: int) -> tuple[torch.dtype, int, int]:
    """How keys or values of `head_dim` held at `bits` (`COPY_BITS`) are stored in a `patchkv.cache` layer: (dtype,
    width, scale width): the model's `dtype` at 16 bits, no scale; int8 at 8; int4 two to a byte (uint8, `head_dim /
    2`) at 4; a float32 scale per token, head and kind, for each of keys and values (2) at 8 and 4."""
    if bits == 16:
        return dtype, head_dim, 0
    return (torch.int8, head_dim, 2) if bits == 8 else (torch.uint8, head_dim // 2, 2)


def token_kv_bytes(head_dim: int, bits: int) -> int:
    """Bytes one token's key and value take in one KV head of `head_dim` held at `bits` (`COPY_BITS`), as
    `copy_layout` stores them: 16-bit, or int8 / int4 (two to a byte) and a float32 scale each."""
    held, width, scales = copy_layout(bits, torch.bfloat16, head_dim)
    return 2 * width * held.itemsize + 4 * scales


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

    def fraction_of_tokens(self) -> None:
        """The `fraction` field checked to be a number in (0, 1) and kept as a plain float (for `__post_init__` of a
        frozen dataclass)."""
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0.0 < float(fraction) < 1.0:
            raise ValueError(f"{self.name}: fraction must be a number in (0, 1), got {fraction!r}.")
        object.__setattr__(self, "fraction", float(fraction))

    def integers(self, minimum: int, *fields: str) -> None:
        """Each of `fields` that is not None checked to be an integer >= `minimum` (`check_int`) and kept as a plain
        int (for `__post_init__` of a frozen dataclass)."""
        for field_name in fields:
            if getattr(self, field_name) is not None:
                object.__setattr__(self, field_name, check_int(self.name, field_name, getattr(self, field_name),
                                                               minimum))


class CodecMethod(Method):
    """A method that decides how latents are stored: builds every layer's key and value codecs."""

    role = "codec"

    def codecs(self, artifact: Artifact, query_groups: list[int], dtype: torch.dtype) -> list[tuple[Codec, Codec]]:
        """One (key codec, value codec) per layer, for a model computing in `dtype`."""
        raise NotImplementedError

    def finer(self, artifact: Artifact, factor: int) -> CodecMethod:
        """This codec at `factor` times its rate (what `NearCodes` stores its tokens with); a codec without a rate
        refuses."""
        raise ValueError(f"{self.spec()} has no rate to raise: near codes (NearCodes) need a Quantized codec.")

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

    def choose(self, codec: Codec, score: Callable[[int], torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
        """The middle tokens each KV head reads at this decode step. codec: the layer's key codec; score: the mode's
        scores of this step's query against the middle's keys from their first r components, read from the stored
        codes: r -> float32 `[batch, heads, m]`; bias: the mask's middle columns for this query, additive float32
        `[batch, 1 or heads, m]`, or None -> sorted indices `[batch, kv_heads, k]` into the middle."""
        raise NotImplementedError

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, selector=self)


@dataclass
class Observation:
    """What a forward's attention saw, for a `Salience` method that `observes`: its queries as attention dots them
    with keys `[batch, heads, s, head_dim]` (rotated), their true positions `[batch, s]`, the softmax `scaling` and
    how attention reads cached keys (`read_keys`: keys `[batch, kv_heads, n, head_dim]` in cache space and their true
    positions `[batch, n]` -> keys as the queries dot them, the mode's); the layer adds the tokens leaving its window,
    keys as attention reads them `[batch, kv_heads, n, head_dim]` (by `read_keys`) and their true positions `[batch,
    n]`."""

    queries: torch.Tensor
    query_positions: torch.Tensor
    scaling: float
    read_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    keys: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass(frozen=True)
class Salience(Method):
    """A method that keeps a `fraction` of each KV head's coded tokens (middle and near) exact beside their codes:
    the tokens its `score` ranks highest among those the head has coded. Tokens are scored once, as they leave the
    window (the whole prefill at once, one token per decode step); each full-attention layer keeps, per KV head, the
    `capacity(coded)` best seen so far (a newcomer that scores above the lowest displaces it, which is then read
    from its codes again; of equal scores the earlier token is kept). Attention reads a kept token's exact key and value in place of its codes; the cache
    counts their bytes, their coded index (int32) and their score (float32). Sliding-window layers keep none.

    scope "layer": a layer's KV heads keep the same tokens, ranked by their scores averaged over the heads (a needle
    kept in every head of a layer, not in the heads where it stands out most); "head": each KV head its own.

    bits 16: the copies are exact, in the model's dtype; 8: each key and value copy is held as int8 with a float32
    scale (symmetric, its largest magnitude at 127: a relative error under 0.4%, MiKV's "kept sharper, not exact"),
    so the same bytes keep 1.8 times as many tokens (`copy_bytes`); 4: int4, two to a byte, with a float32 scale (its
    largest magnitude at 7), 1.8 times int8's tokens again for the same bytes at head_dim 64."""

    role = "salience"
    #: whether `score` reads this forward's queries (`Observation`): the attention path then passes them
    observes: ClassVar[bool] = False
    #: whether `score` reads the tokens' middle codes (`stored`): with near codes the layer then makes them for it
    reads_codes: ClassVar[bool] = False
    fraction: float = 1 / 128
    scope: str = "layer"
    bits: int = field(default=16, kw_only=True)  # keyword only: a subclass's own fields follow `scope` positionally

    def __post_init__(self):
        self.fraction_of_tokens()
        if self.scope not in SCOPES:
            raise ValueError(f"{self.name}: scope must be one of {SCOPES}, got {self.scope!r}.")
        object.__setattr__(self, "bits", check_bits(self.name, self.bits, "exact copies, or int8 or int4 with a scale"))

    def spec(self) -> str:
        """`name` and the fields that differ from their defaults ("novelty", "novelty:fraction=0.01")."""
        return spec_of(self)

    def copy_bytes(self, head_dim: int) -> int:
        """Bytes one kept token's key and value copies take in one KV head of `head_dim`: 16-bit, or int8 / int4 and a
        float32 scale each (its coded index and score are counted apart: `patchkv.budgets.SALIENT_INDEX_BYTES`)."""
        return token_kv_bytes(head_dim, self.bits)

    def capacity(self, coded: int) -> int:
        """Exact tokens each KV head keeps over `coded` coded tokens."""
        return int(self.fraction * coded)

    def rank(self, lp: LayerPatch, keys: torch.Tensor, values: torch.Tensor,
             stored: tuple[torch.Tensor, torch.Tensor] | None, observed: Observation | None = None) -> torch.Tensor:
        """`score` within the `scope`: float32 `[batch, kv_heads, n]`, equal over a layer's heads for "layer"."""
        scores = self.score(lp, keys, values, stored, observed)
        return scores.mean(1, keepdim=True).expand_as(scores).contiguous() if self.scope == "layer" else scores

    def score(self, lp: LayerPatch, keys: torch.Tensor, values: torch.Tensor,
              stored: tuple[torch.Tensor, torch.Tensor] | None, observed: Observation | None = None) -> torch.Tensor:
        """Tokens leaving the window: keys and values `[batch, kv_heads, n, head_dim]` exact in cache space, and
        their codes at the middle's rate (`[batch, 1, n, width]` keys and values: as the middle stores them, or will
        once they leave the near region; given to a method that `reads_codes`, else possibly None); `observed`: this
        forward's queries, for a
        method that `observes` (None where the layer has none, e.g. effect-weight calibration) -> float32 `[batch,
        kv_heads, n]`, higher kept first."""
        raise NotImplementedError

    @staticmethod
    def variances(lp: LayerPatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each KV head's total variance of keys and of values in `lp`'s layer (the sum of the artifact's
        eigenvalues), float32 `[kv_heads]` each on the codecs' device: what scorers divide squared distances by, so
        that keys and values weigh alike."""
        artifact, device = lp.patch.artifact, lp.keys.rows.device
        return tuple(c.eigenvalues[lp.layer_idx].float().sum(-1).clamp_min(1e-12).to(device)
                     for c in (artifact.keys, artifact.values))

    def configure(self, plan: CachePlan) -> CachePlan:
        return replace(plan, salience=self)


@dataclass(frozen=True)
class CachePlan:
    """What `patchkv.apply` assembled from its methods; read by `LatentCache` and the patched attention."""

    codec: CodecMethod
    sink_tokens: int = 0
    window: int = 0
    window_bits: int = 16  # 8 / 4: the window held as int8 / int4 between forwards (`SinksWindow(bits=8)`)
    selector: Selector | None = None
    salience: Salience | None = None
    near: Method | None = None  # a `NearCodes`
    evict: Method | None = None  # an `Evict`
    methods: tuple[Method, ...] = field(default=())

    @property
    def near_tokens(self) -> int:
        """How many of the newest coded tokens each layer holds at the near rate (0: none)."""
        return 0 if self.near is None else self.near.tokens

    def describe(self) -> str:
        return " + ".join(m.spec() for m in self.methods)


def check_int(owner: str, name: str, value: object, minimum: int) -> int:
    """`value` as an int >= minimum (numpy integers accepted, bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)
