"""`Quantized`: transform coding. Bits are allocated over the PCA components, each component is quantized by
a uniform quantizer matched to a Gaussian of its variance, and codes are packed at a fixed rate (no per-token
scales), so the cache holds a fixed number of bytes per token. An artifact with step scales
(`patchkv.step_scales.fit_step_scales`) widens or narrows each head's quantizer range by the factor fitted for this
budget, or the nearest of the same pool (`patchkv.allocation.step_scales_for`: typed fields of the artifact
only).

Two allocations (`pool`):
- "head": every KV head's keys and values get exactly `bits` bits per token, by dynamic programming on the
  head's eigenvalues (`patchkv.quantize.allocate_bits`): the squared error of each head is minimal;
- "global": one pool of `bits x layers x kv_heads x 2` bits per token, shared by every layer, head, key and
  value and allocated on eigenvalue x effect weight (the calibrated Fisher weight of each component,
  `patchkv.fisher`), so the expected increase of the loss is minimal. Heads and layers the model is
  sensitive to get more bits, others fewer or none. Needs an artifact calibrated with effect weights.

Two bases (`basis`):
- "head": each KV head's keys and values on its own PCA basis;
- "layer": one basis per layer over its KV heads concatenated (`patchkv.latent.LayerBasis`, artifact format
  version 5, `calibrate(..., layer_bases=True)`): each token's code for a layer's keys is one latent that every head
  reads through its rows of the basis, so what the heads share is coded once (on SmolLM2: lower perplexity at the
  same bytes, but more needles cut short on RULER at 16x; docs/results.md). A decode step reads each head's keys and
  values from the whole layer latent (`kv_heads` times the components per head). The global pool weighs layer
  components by the layer's whole Fisher matrix (artifact `layer_weights`). Step scales are read for the budget as
  for "head", averaged over each layer's heads (they were fitted on the per-head bases).
  On an artifact whose layer bases span S layers (format version 7, `calibrate(..., layers_per_basis=S)`) one
  latent per token codes S layers (consecutive layers of one attention kind): each layer reads it through its rows
  of the span's basis (`SpanQuantizedCodec`), and the cache codes and holds it at the span's last layer
  (`patchkv.cache`). The budget is spent per span (`bits x kv_heads x S` per span at pool "head"); step scales are
  averaged over the span's heads. Methods that rank, copy or recode one layer's coded tokens are refused on them
  (`patchkv.patching.check_span`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..allocation import BASES, POOLS, bit_allocation, layer_bit_allocation, step_scales_for
from ..artifact_format import MAX_BITS
from ..errors import PatchKVError
from ..kernels import ops as kernels
from ..kernels.reference import ComponentTable
from ..latent import Codec, LatentBasis, LayerBasis
from ..quantize import CoefficientQuantizer
from .base import CodecMethod


class QuantizedCodec(Codec):
    """Fixed-rate codes `uint8 [batch, 1, seq, bytes]` of the coefficients on `basis`."""

    def __init__(self, basis: LatentBasis, bits: torch.Tensor, eigenvalues: torch.Tensor,
                 step_scales: torch.Tensor | None = None):
        """bits `[kv_heads, head_dim]` per component; eigenvalues `[kv_heads, head_dim]` set the step sizes, each
        head's multiplied by `step_scales` `[kv_heads]` where given (the artifact's, `patchkv.step_scales`)."""
        self.basis = basis
        std = eigenvalues[:, : basis.max_rank].double().clamp_min(0).sqrt()
        if step_scales is not None:
            std = std * step_scales.double().unsqueeze(1)
        self.quantizer = CoefficientQuantizer(bits[:, : basis.max_rank] * basis.keep, std)
        self.width, self.stored_dtype = self.quantizer.bytes_per_token, torch.uint8
        self.set_table(self.quantizer.table, self.quantizer.components)

    def to(self, device: torch.device) -> QuantizedCodec:
        super().to(device)
        self.quantizer.to(device)
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantizer.encode(self.basis.coefficients(x))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return self.quantizer.decode(stored).to(self.basis.basis.dtype)

    def describe(self) -> str:
        return f"QuantizedCodec({self.quantizer.total_bits} bits/token)"


class LayerQuantizedCodec(QuantizedCodec):
    """Fixed-rate codes `uint8 [batch, 1, seq, bytes]` of one latent per token on a `LayerBasis`: component j is
    stored once, and the table the kernels read lists it for every head (same bits, that head's basis rows), so
    attention reads each head from the one code."""

    def __init__(self, basis: LayerBasis, bits: torch.Tensor, eigenvalues: torch.Tensor, step_scale: float = 1.0):
        """bits, eigenvalues `[kv_heads * head_dim]` per layer component; steps Gaussian-matched times
        `step_scale`."""
        self.basis = basis
        rank, heads = basis.max_rank, basis.heads
        std = eigenvalues[:rank].double().clamp_min(0).sqrt() * step_scale
        self.quantizer = CoefficientQuantizer(bits[:rank].unsqueeze(0), std.unsqueeze(0))  # one "head": the layer
        self.width, self.stored_dtype = self.quantizer.bytes_per_token, torch.uint8
        one, coded = self.quantizer.table, self.quantizer.components
        layout = {name: getattr(one, name).repeat(heads) for name in ("shift", "mask", "step", "offset", "wide")}
        every = torch.cat([coded + h * rank for h in range(heads)])  # head h's copy of component j: h * rank + j
        self.set_table(ComponentTable.build(heads, rank, every, one.byte.repeat(heads), layout), every)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        latent = self.basis.coefficients(x)[:, :1].contiguous()  # the heads' copies are equal: code one
        return kernels.encode(latent, self.quantizer.table, self.quantizer.components,
                              self.quantizer.bytes_per_token).unsqueeze(1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return self.table.spread(kernels.unpack(stored.squeeze(1), self.table), self.components,
                                 self.basis.max_rank).to(self.basis.basis.dtype)


class SpanQuantizedCodec(LayerQuantizedCodec):
    """Layer `position` of a layer basis spanning `span` layers (artifact format version 7): it reads the
    span's codes `uint8 [batch, 1, seq, bytes]`, one latent per token for all the span's layers, through its own rows
    of the span's basis (a `LayerBasis` on them: attention and the kernels read it as a layer basis). Those rows are
    not a basis of their own, so this codec never codes: the span's last layer (the owner, `owns`) codes every layer
    of the span at once (`encode_span`), and `patchkv.cache` keeps the span's codes there."""

    def __init__(self, mean: torch.Tensor, eigenvectors: torch.Tensor, rank: int, heads: int, query_groups: int,
                 dtype: torch.dtype, bits: torch.Tensor, eigenvalues: torch.Tensor, step_scale: float, position: int,
                 layers: list[int]):
        """mean `[span * kv_heads * head_dim]`, eigenvectors `[span * kv_heads * head_dim, D]` (the span's basis,
        its `layers` in order, each layer's heads concatenated); bits, eigenvalues `[span * kv_heads * head_dim]` per
        span component; this codec's layer is `layers[position]`."""
        span = len(layers)
        width = mean.shape[0] // span
        rows = slice(position * width, (position + 1) * width)
        basis = LayerBasis(mean[rows], eigenvectors[rows], rank, heads, query_groups, dtype)
        super().__init__(basis, bits, eigenvalues, step_scale)
        self.position, self.span, self.span_layers = position, span, tuple(layers)
        self.owns = position == span - 1
        if self.owns:  # what coding needs: the whole span's mean and basis (the quantizer is the readers' own)
            self.span_mean, self.span_basis = mean.float(), eigenvectors[:, :rank].float()  # [S * D], [S * D, rank]

    def to(self, device: torch.device) -> SpanQuantizedCodec:
        super().to(device)
        if self.owns:
            self.span_mean, self.span_basis = self.span_mean.to(device), self.span_basis.to(device)
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise PatchKVError(f"layer {self.position} of a {self.span}-layer basis reads the span's codes and cannot code "
                           "its own vectors: the span's last layer codes them all (encode_span).")

    def encode_span(self, x: torch.Tensor) -> torch.Tensor:
        """The span's layers' vectors `[batch, span * kv_heads, seq, head_dim]` (layers in order) -> the span's codes
        `uint8 [batch, 1, seq, bytes]`. Only the owner codes."""
        if not self.owns:
            raise PatchKVError(f"layer {self.position} of a {self.span}-layer basis does not code the span: its last "
                               "layer does.")
        batch, heads, seq, dim = x.shape
        flat = x.float().transpose(1, 2).reshape(batch, seq, heads * dim)
        latent = ((flat - self.span_mean) @ self.span_basis).unsqueeze(1).contiguous()   # [batch, 1, seq, rank]
        return kernels.encode(latent, self.quantizer.table, self.quantizer.components,
                              self.quantizer.bytes_per_token).unsqueeze(1)


@dataclass(frozen=True)
class Quantized(CodecMethod):
    """`bits` per KV head and token on average, for keys and for values (e.g. 64 bits = 16x smaller than bf16 at
    head_dim 64); `pool` "head" (the same budget for each head) or "global" (one pool by effect weight); `basis`
    "head" (each KV head's PCA) or "layer" (one PCA per layer, shared by its KV heads; module docstring);
    `context` (global pool only) the context the pool is priced at, for a model with sliding-window layers: a bit
    costs what its layer holds there (`patchkv.allocation.layer_prices`), `bits` is the average over the tokens
    the cache holds, and a sliding layer gets more bits per token; None (what budgets use) prices every layer
    alike. Priced lost to alike on Gemma 3 at 2k tokens and equal bytes (`evals/research_sliding.py`)."""

    name = "quantized"
    bits: int = 64
    pool: str = "head"
    basis: str = "head"
    context: int | None = None

    def __post_init__(self):
        self.integers(1, "bits", "context")
        if self.pool not in POOLS:
            raise ValueError(f"quantized: pool must be one of {POOLS}, got {self.pool!r}.")
        if self.basis not in BASES:
            raise ValueError(f"quantized: basis must be one of {BASES}, got {self.basis!r}.")

    def spec(self) -> str:
        return (f"quantized:bits={self.bits}" + ("" if self.pool == "head" else f",pool={self.pool}")
                + ("" if self.basis == "head" else f",basis={self.basis}")
                + ("" if self.context is None else f",context={self.context}"))

    def finer(self, artifact, factor: int) -> Quantized:
        """`factor` times the bits (at most every component at the most bits), the same pool, basis and pricing."""
        return replace(self, bits=min(self.bits * factor, artifact.head_dim * MAX_BITS))

    def codecs(self, artifact, query_groups: list[int], dtype: torch.dtype) -> list[tuple[Codec, Codec]]:
        if self.basis == "layer":
            return self._layer_codecs(artifact, query_groups, dtype)
        allocation = bit_allocation(artifact, self.bits, self.pool, self.context)  # refuses a budget out of range
        scales = step_scales_for(artifact, self.bits, self.pool)
        out = []
        for i, (groups, key_bits, value_bits) in enumerate(zip(query_groups, *allocation)):
            pair = []
            for kind, c, bits in ((0, artifact.keys, key_bits), (1, artifact.values, value_bits)):
                ranks = [int((row > 0).nonzero().max()) + 1 if row.any() else 1 for row in bits]
                basis = LatentBasis(c.mean[i], c.eigenvectors[i], ranks, groups, dtype)
                pair.append(QuantizedCodec(basis, bits, c.eigenvalues[i], None if scales is None else scales[kind][i]))
            out.append(tuple(pair))
        return out

    def _layer_codecs(self, artifact, query_groups: list[int], dtype: torch.dtype) -> list[tuple[Codec, Codec]]:
        allocation = layer_bit_allocation(artifact, self.bits, self.pool, self.context)  # refuses one without them
        scales = step_scales_for(artifact, self.bits, self.pool)
        heads, span = artifact.num_kv_heads, artifact.layers_per_basis
        place = {layer: (unit, position, layers) for unit, layers in enumerate(artifact.layer_groups)
                 for position, layer in enumerate(layers)}
        out = []
        for i, groups in enumerate(query_groups):
            unit, position, layers = place[i]  # the basis, this layer's place in it and the layers it spans
            pair = []
            for kind, c, bits in ((0, artifact.keys, allocation[0][unit]), (1, artifact.values, allocation[1][unit])):
                rank = int(bits.nonzero().max()) + 1 if bits.any() else 1
                scale = 1.0 if scales is None else float(scales[kind][layers].double().mean())  # over the span's heads
                if span == 1:
                    basis = LayerBasis(c.layer_mean[unit], c.layer_eigenvectors[unit], rank, heads, groups, dtype)
                    pair.append(LayerQuantizedCodec(basis, bits, c.layer_eigenvalues[unit], scale))
                else:
                    pair.append(SpanQuantizedCodec(c.layer_mean[unit], c.layer_eigenvectors[unit], rank, heads, groups,
                                                   dtype, bits, c.layer_eigenvalues[unit], scale, position, layers))
            out.append(tuple(pair))
        return out
