"""Low-rank latent form of per-head vectors, and its packed storage in the cache.

Heads may keep different numbers of components (an energy budget picks them per head), so latents
are stored packed: `[batch, 1, seq, total_rank]`, head h in columns `offsets[h] : offsets[h] + ranks[h]`.
The cache therefore holds exactly `total_rank` numbers per token and layer, with no padding. For
compute, `unpack` spreads them to `[batch, kv_heads, seq, max_rank]`, zero-padded.

With a bit allocation (`patchkv.quantize`), the stored form is instead fixed-rate integer codes,
uint8 `[batch, 1, seq, bytes_per_token]`, and `unpack` dequantizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .quantize import CoefficientQuantizer


class LatentBasis(nn.Module):
    """Truncated PCA basis for keys or values of one layer.

    mean: `[kv_heads, head_dim]`; eigenvectors: `[kv_heads, head_dim, head_dim]` (columns by decreasing
    variance); ranks: `[kv_heads]`. `query_groups` query heads share each KV head (GQA).
    Buffers are not persistent: patching leaves the model's `state_dict` unchanged.
    """

    def __init__(self, mean: torch.Tensor, eigenvectors: torch.Tensor, ranks: torch.Tensor, query_groups: int,
                 dtype: torch.dtype, bits: torch.Tensor | None = None, eigenvalues: torch.Tensor | None = None):
        """bits: optional `[kv_heads, head_dim]` bits per component (then `ranks` is ignored: a head keeps
        the components up to its last one with bits); eigenvalues `[kv_heads, head_dim]` set the scales."""
        super().__init__()
        heads, dim = mean.shape
        if bits is not None:
            ranks = torch.stack([(row > 0).nonzero().max() + 1 if row.any() else torch.tensor(1) for row in bits])
        ranks = [int(r) for r in ranks]
        self.ranks, self.max_rank, self.total_rank = ranks, max(ranks), sum(ranks)
        self.uniform = len(set(ranks)) == 1
        keep = torch.arange(self.max_rank).unsqueeze(0) < torch.tensor(ranks).unsqueeze(1)  # [heads, max_rank]
        basis = eigenvectors[:, :, : self.max_rank] * keep.unsqueeze(1)
        # slot h * max_rank + j of the padded layout holds packed column pack_index[...]; padding reads column R (zero)
        pack_index = keep.flatten().nonzero().squeeze(1)
        unpack_index = torch.full((heads * self.max_rank,), self.total_rank, dtype=torch.long)
        unpack_index[pack_index] = torch.arange(self.total_rank)
        self.register_buffer("mean", mean.to(dtype), persistent=False)
        self.register_buffer("basis", basis.to(dtype), persistent=False)
        self.register_buffer("pack_index", pack_index, persistent=False)
        self.register_buffer("unpack_index", unpack_index, persistent=False)
        # the same basis and mean per query head (GQA), built once rather than on every forward
        self.register_buffer("query_basis", self.basis.repeat_interleave(query_groups, dim=0), persistent=False)
        self.register_buffer("query_mean", self.mean.repeat_interleave(query_groups, dim=0), persistent=False)
        self.quantizer = None
        if bits is not None:
            std = eigenvalues[:, : self.max_rank].double().clamp_min(0).sqrt()
            self.quantizer = CoefficientQuantizer(bits[:, : self.max_rank] * keep, std)

    def bytes_per_token(self, element_size: int) -> int:
        """What the cache stores per token for this layer: packed floats, or the quantized codes."""
        return self.quantizer.bytes_per_token if self.quantizer else self.total_rank * element_size

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """x `[batch, kv_heads, seq, head_dim]` -> `[batch, kv_heads, seq, max_rank]`, zero past each head's rank."""
        return (x - self.mean.unsqueeze(1)) @ self.basis

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x `[batch, kv_heads, seq, head_dim]` -> packed latents `[batch, 1, seq, total_rank]` (or codes)."""
        coeffs = self.coefficients(x)
        if self.quantizer:
            return self.quantizer.encode(coeffs)
        b, h, s, r = coeffs.shape
        flat = coeffs.transpose(1, 2).reshape(b, s, h * r)
        if not self.uniform:
            flat = flat.index_select(-1, self.pack_index)
        return flat.unsqueeze(1)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed `[batch, 1, seq, total_rank]` -> `[batch, kv_heads, seq, max_rank]`, zero-padded past each rank."""
        if self.quantizer:
            return self.quantizer.decode(latents, self.basis.dtype)
        b, _, s, _ = latents.shape
        flat = latents.squeeze(1)
        if not self.uniform:
            flat = F.pad(flat, (0, 1)).index_select(-1, self.unpack_index)
        return flat.view(b, s, len(self.ranks), self.max_rank).transpose(1, 2)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """`[batch, kv_heads, seq, max_rank]` -> reconstructed vectors `[batch, kv_heads, seq, head_dim]`."""
        if coeffs.device.type == "cpu" and coeffs.dtype != torch.float32:
            # CPUs without half-precision matrix units run this GEMM over the whole cache many times slower
            decoded = coeffs.float() @ self.basis.float().transpose(1, 2) + self.mean.float().unsqueeze(1)
            return decoded.to(coeffs.dtype)
        return coeffs @ self.basis.transpose(1, 2) + self.mean.unsqueeze(1)

    def project_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries `[batch, heads, seq, head_dim]` onto their KV head's basis -> `[batch, heads, seq, max_rank]`.

        Scores against latent keys then equal scores against reconstructed keys up to a per-query
        constant (q . mean), which softmax ignores.
        """
        return q @ self.query_basis

    def decode_query_heads(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Latents per query head `[batch, heads, n, max_rank]` -> `[batch, heads, n, head_dim]`, each head
        decoded with its KV head's basis. Used for attention outputs computed on value latents: exact because
        attention weights sum to one, sum_j p_j (mean + U c_j) = mean + U sum_j p_j c_j.
        """
        return coeffs @ self.query_basis.transpose(1, 2) + self.query_mean.unsqueeze(1)
