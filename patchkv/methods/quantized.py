"""`Quantized`: transform coding. Bits are allocated over the PCA components, each component is quantized by
a uniform quantizer matched to a Gaussian of its variance, and codes are packed at a fixed rate (no per-token
scales), so the cache holds a fixed number of bytes per token. An artifact with step scales
(`patchkv.steps.fit_step_scales`) widens or narrows each head's quantizer range by the factor fitted for this
budget, or the nearest of the same pool (`patchkv.allocation.step_scales_for`: typed fields of the artifact
only).

Two allocations (`pool`):
- "head": every KV head's keys and values get exactly `bits` bits per token, by dynamic programming on the
  head's eigenvalues (`patchkv.quantize.allocate_bits`): the squared error of each head is minimal;
- "global": one pool of `bits x layers x kv_heads x 2` bits per token, shared by every layer, head, key and
  value and allocated on eigenvalue x effect weight (the calibrated Fisher weight of each component,
  `patchkv.fisher`), so the expected increase of the loss is minimal. Heads and layers the model is
  sensitive to get more bits, others fewer or none. Needs an artifact calibrated with effect weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocation import POOLS, bit_allocation, step_scales_for
from ..latent import Codec, LatentBasis
from ..quantize import CoefficientQuantizer
from .base import CodecMethod, check_int


class QuantizedCodec(Codec):
    """Fixed-rate codes `uint8 [batch, 1, seq, bytes]` of the coefficients on `basis`."""

    def __init__(self, basis: LatentBasis, bits: torch.Tensor, eigenvalues: torch.Tensor,
                 step_scales: torch.Tensor | None = None):
        """bits `[kv_heads, head_dim]` per component; eigenvalues `[kv_heads, head_dim]` set the step sizes, each
        head's multiplied by `step_scales` `[kv_heads]` where given (the artifact's, `patchkv.steps`)."""
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


@dataclass(frozen=True)
class Quantized(CodecMethod):
    """`bits` per KV head and token on average, for keys and for values (e.g. 64 bits = 16x smaller than bf16 at
    head_dim 64); `pool` "head" (the same budget for each head) or "global" (one pool by effect weight)."""

    name = "quantized"
    bits: int = 64
    pool: str = "head"

    def __post_init__(self):
        object.__setattr__(self, "bits", check_int("quantized", "bits", self.bits, 1))
        if self.pool not in POOLS:
            raise ValueError(f"quantized: pool must be one of {POOLS}, got {self.pool!r}.")

    def spec(self) -> str:
        return f"quantized:bits={self.bits}" + ("" if self.pool == "head" else f",pool={self.pool}")

    def codecs(self, artifact, query_groups: list[int], dtype: torch.dtype) -> list[tuple[Codec, Codec]]:
        allocation = bit_allocation(artifact, self.bits, self.pool)  # refuses a budget out of range
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
