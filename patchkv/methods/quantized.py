"""`Quantized`: transform coding. A fixed budget of bits per KV head and token is allocated over the PCA
components by dynamic programming on the calibrated eigenvalues (`patchkv.quantize.allocate_bits`); each
component is quantized by a uniform quantizer matched to a Gaussian of its variance; codes are packed at
a fixed rate (no per-token scales), so the cache holds exactly `bits` bits per head and token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..latent import Codec, LatentBasis
from ..quantize import MAX_BITS, CoefficientQuantizer
from .base import CodecMethod, check_int


class QuantizedCodec(Codec):
    """Fixed-rate codes `uint8 [batch, 1, seq, bytes]` of the coefficients on `basis`."""

    def __init__(self, basis: LatentBasis, bits: torch.Tensor, eigenvalues: torch.Tensor):
        """bits `[kv_heads, head_dim]` per component; eigenvalues `[kv_heads, head_dim]` set the step sizes."""
        self.basis = basis
        std = eigenvalues[:, : basis.max_rank].double().clamp_min(0).sqrt()
        self.quantizer = CoefficientQuantizer(bits[:, : basis.max_rank] * basis.keep, std)
        self.width, self.stored_dtype = self.quantizer.bytes_per_token, torch.uint8

    def to(self, device: torch.device) -> QuantizedCodec:
        super().to(device)
        self.quantizer.to(device)
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantizer.encode(self.basis.coefficients(x))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return self.quantizer.decode(stored, self.basis.basis.dtype)

    def describe(self) -> str:
        return f"QuantizedCodec({self.quantizer.total_bits} bits/token)"


@dataclass(frozen=True)
class Quantized(CodecMethod):
    """`bits` per KV head and token, for keys and for values (e.g. 64 bits = 16x smaller than fp16 at head_dim 64)."""

    name = "quantized"
    bits: int = 64

    def __post_init__(self):
        object.__setattr__(self, "bits", check_int("quantized", "bits", self.bits, 1))

    def codecs(self, artifact, query_groups: list[int], dtype: torch.dtype) -> list[tuple[Codec, Codec]]:
        if self.bits > artifact.head_dim * MAX_BITS:
            raise ValueError(f"quantized: bits must be <= {artifact.head_dim * MAX_BITS} (head_dim "
                             f"{artifact.head_dim} x {MAX_BITS} bits), got {self.bits}.")
        out = []
        for i, (groups, key_bits, value_bits) in enumerate(zip(query_groups, *artifact.bit_allocation(self.bits))):
            pair = []
            for c, bits in ((artifact.keys, key_bits), (artifact.values, value_bits)):
                ranks = [int((row > 0).nonzero().max()) + 1 if row.any() else 1 for row in bits]
                basis = LatentBasis(c.mean[i], c.eigenvectors[i], ranks, groups, dtype)
                pair.append(QuantizedCodec(basis, bits, c.eigenvalues[i]))
            out.append(tuple(pair))
        return out
