"""Low-rank latent form of per-head vectors (`LatentBasis`) and how latents are stored (`Codec`).

A layer's keys (or values) `x` `[batch, kv_heads, seq, head_dim]` become coefficients
`c = (x - mean) @ basis`, `[batch, kv_heads, seq, max_rank]`, zero past each head's rank (heads may keep
different numbers of components). A codec turns coefficients into what the cache stores, `[batch, 1,
seq, width]`: `PackedCodec` packs the kept floats with no padding (`width = total_rank`); the DP-quantized
codec of `patchkv.methods.quantized` stores fixed-rate integer codes (uint8, `width` bytes).

These objects are deliberately not `nn.Module`s: patching leaves the model's module tree, `state_dict` and
accelerate's hooks untouched, and their tensors follow each layer's execution device (`to`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import ops as kernels
from .kernels.reference import ComponentTable


class LatentBasis:
    """Truncated PCA basis for keys or values of one layer.

    mean `[kv_heads, head_dim]`; eigenvectors `[kv_heads, head_dim, head_dim]` (columns by decreasing
    variance); ranks: components kept per head. `query_groups` query heads share each KV head (GQA).
    """

    def __init__(self, mean: torch.Tensor, eigenvectors: torch.Tensor, ranks: list[int], query_groups: int,
                 dtype: torch.dtype):
        heads, dim = mean.shape
        self.ranks = [int(r) for r in ranks]
        self.max_rank, self.total_rank = max(self.ranks), sum(self.ranks)
        self.heads, self.head_dim, self.query_groups = heads, dim, query_groups
        keep = torch.arange(self.max_rank).unsqueeze(0) < torch.tensor(self.ranks).unsqueeze(1)  # [heads, max_rank]
        self.keep = keep
        self.mean = mean.to(dtype)
        self.basis = (eigenvectors[:, :, : self.max_rank] * keep.unsqueeze(1)).to(dtype)
        self.float_mean, self.float_basis = self.mean.float(), self.basis.float()  # encoding is done in float32
        # the same basis and mean per query head (GQA), built once rather than on every forward
        self.query_basis = self.basis.repeat_interleave(query_groups, dim=0)
        self.query_mean = self.mean.repeat_interleave(query_groups, dim=0)

    def to(self, device: torch.device) -> LatentBasis:
        """Move every tensor to `device` in place; returns self."""
        for name in ("mean", "basis", "query_basis", "query_mean", "float_mean", "float_basis"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @property
    def device(self) -> torch.device:
        return self.basis.device

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """x `[batch, kv_heads, seq, head_dim]` -> float32 `[batch, kv_heads, seq, max_rank]`, zero past each rank
        (computed in float32 whatever x's dtype: small half-precision products are slower on CPU, and rounder)."""
        return (x.float() - self.float_mean.unsqueeze(1)) @ self.float_basis

    def reconstruct(self, coeffs: torch.Tensor) -> torch.Tensor:
        """`[batch, kv_heads, seq, max_rank]` -> vectors `[batch, kv_heads, seq, head_dim]`."""
        if coeffs.device.type == "cpu" and coeffs.dtype != torch.float32:
            # CPUs without half-precision matrix units run this GEMM over the whole cache many times slower
            out = coeffs.float() @ self.basis.float().transpose(1, 2) + self.mean.float().unsqueeze(1)
            return out.to(coeffs.dtype)
        return coeffs @ self.basis.transpose(1, 2) + self.mean.unsqueeze(1)


class LayerBasis(LatentBasis):
    """One basis for a layer's keys (or values), shared by its KV heads: PCA over the heads concatenated,
    `[kv_heads * head_dim]` per token (artifact format version 5). A token's coefficients `c` `[rank]` are one latent
    for the whole layer; head h reads its own rows of the basis: `x_h = U_h c + mean_h`, U_h `[head_dim, rank]`.

    mean `[kv_heads * head_dim]`; eigenvectors `[kv_heads * head_dim, D]` (columns by decreasing variance); the
    first `rank` are kept. As a `LatentBasis` it has `heads` = kv_heads, each of rank `rank` with basis U_h, and
    `coefficients` gives every head the same latent (codecs store it once)."""

    def __init__(self, mean: torch.Tensor, eigenvectors: torch.Tensor, rank: int, heads: int, query_groups: int,
                 dtype: torch.dtype):
        width = mean.shape[0]
        if width % heads:
            raise ValueError(f"a layer basis of width {width} cannot be split into {heads} heads.")
        dim = width // heads
        super().__init__(mean.view(heads, dim), eigenvectors[:, :rank].reshape(heads, dim, rank), [rank] * heads,
                         query_groups, dtype)
        self.float_layer_basis = eigenvectors[:, :rank].float()   # [D, rank]
        self.float_layer_mean = mean.float()                      # [D]

    def to(self, device: torch.device) -> LayerBasis:
        super().to(device)
        self.float_layer_basis = self.float_layer_basis.to(device)
        self.float_layer_mean = self.float_layer_mean.to(device)
        return self

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """x `[batch, kv_heads, seq, head_dim]` -> float32 `[batch, kv_heads, seq, rank]`: the layer's latent of each
        token (its heads concatenated, projected once), the same for every head."""
        batch, heads, seq, dim = x.shape
        flat = x.float().transpose(1, 2).reshape(batch, seq, heads * dim)
        latent = (flat - self.float_layer_mean) @ self.float_layer_basis   # [batch, seq, rank]
        return latent.unsqueeze(1).expand(batch, heads, seq, latent.shape[-1])


class Codec:
    """How a layer's coefficients are stored. Subclasses set `width` and `stored_dtype`, implement `encode`,
    and describe their stored form to the kernels with `set_table` (`patchkv.kernels`: attention reads the
    middle from what is stored, never from a decoded copy); `basis` is the `LatentBasis` the coefficients
    live on.

    After `set_table`: `table` (a `ComponentTable`), `rows` float32 `[C, head_dim]` (the basis vector of each
    stored component, table order), `kernel_mean` float32 `[kv_heads, head_dim]`, `padded_rows` float32
    `[kv_heads, widest, head_dim]` (each head's rows, zero past its last)."""

    basis: LatentBasis
    width: int
    stored_dtype: torch.dtype
    table: ComponentTable
    #: how many layers share the codes this codec reads (a basis across layers, artifact format 7), those layers in
    #: order and this codec's place among them: 1, () and 0 for a layer's own codes
    span: int = 1
    span_layers: tuple[int, ...] = ()
    position: int = 0

    def set_table(self, table: ComponentTable, components: torch.Tensor) -> None:
        basis = self.basis
        self.table, self.components = table, components.long()
        self._leading: dict[int, tuple[ComponentTable, torch.Tensor]] = {}  # rank -> its sub-table, built on demand
        head = torch.div(self.components, basis.max_rank, rounding_mode="floor")
        self.rows = basis.basis.float()[head, :, self.components % basis.max_rank].contiguous()
        self.kernel_mean = basis.mean.float().contiguous()
        padded = self.rows.new_zeros(basis.heads * table.widest, basis.head_dim)
        padded[(table.head * table.widest + table.slot).long()] = self.rows
        self.padded_rows = padded.view(basis.heads, table.widest, basis.head_dim)

    def leading_scores(self, stored: torch.Tensor, rank: int, q_latent: torch.Tensor, q_bias: torch.Tensor,
                       chunk: int) -> torch.Tensor:
        """Top-k's candidate scores from the first `rank` coefficients of every stored token `[batch, 1, seq,
        width]`, only those components read: one query per chunk of `chunk` tokens, q_latent `[batch, heads,
        chunks, rank]` and q_bias `[batch, heads, chunks]` -> float32 `[batch, heads, seq]` (`kernels.leading_scores`:
        straight from the codes, no float copy of the middle)."""
        cached = self._leading
        if rank not in cached or cached[rank][0].byte.device != stored.device:
            keep = (self.components % self.basis.max_rank) < rank
            t = self.table
            rows = [x[keep] for x in (t.byte, t.shift, t.mask, t.step, t.offset, t.wide)]
            components = torch.div(self.components[keep], self.basis.max_rank, rounding_mode="floor") * rank + \
                self.components[keep] % self.basis.max_rank
            table = ComponentTable.build(self.basis.heads, rank, components.cpu(), rows[0].cpu(), dict(zip(
                ("shift", "mask", "step", "offset", "wide"), (x.cpu() for x in rows[1:])))).to(stored.device)
            cached[rank] = (table, components.to(stored.device))
        table, components = cached[rank]
        return kernels.leading_scores(stored.squeeze(1), table, components, rank, q_latent, q_bias,
                                      self.basis.query_groups, chunk)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Vectors `[batch, kv_heads, seq, head_dim]` -> stored form `[batch, 1, seq, width]`."""
        raise NotImplementedError

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        """No tokens as stored, `[batch, 1, 0, width]`, for vectors like `like` `[batch, kv_heads, n, head_dim]`."""
        return like.new_empty(like.shape[0], 1, 0, self.width, dtype=self.stored_dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored `[batch, 1, seq, width]` -> coefficients `[batch, kv_heads, seq, max_rank]` (basis dtype)."""
        raise NotImplementedError

    def to(self, device: torch.device) -> Codec:
        self.basis.to(device)
        for name in ("rows", "kernel_mean", "padded_rows", "components"):
            setattr(self, name, getattr(self, name).to(device))
        self.table = self.table.to(device)
        return self

    def bytes_per_token(self) -> int:
        return self.width * torch.empty(0, dtype=self.stored_dtype).element_size()

    def describe(self) -> str:
        return f"{type(self).__name__}(ranks={self.basis.ranks})"


class PackedCodec(Codec):
    """The kept coefficients as floats, packed: head h in columns `offsets[h] : offsets[h] + ranks[h]`."""

    def __init__(self, basis: LatentBasis):
        self.basis = basis
        self.width, self.stored_dtype = basis.total_rank, basis.basis.dtype
        self.uniform = len(set(basis.ranks)) == 1
        # slot h * max_rank + j of the padded layout holds packed column pack_index[...]; padding reads column R (zero)
        self.pack_index = basis.keep.flatten().nonzero().squeeze(1)
        self.unpack_index = torch.full((basis.heads * basis.max_rank,), self.width, dtype=torch.long)
        self.unpack_index[self.pack_index] = torch.arange(self.width)
        self.set_table(ComponentTable.build(basis.heads, basis.max_rank, self.pack_index, torch.arange(self.width)),
                       self.pack_index)

    def to(self, device: torch.device) -> PackedCodec:
        super().to(device)
        self.pack_index, self.unpack_index = self.pack_index.to(device), self.unpack_index.to(device)
        return self

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.pack(self.basis.coefficients(x))

    def pack(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Coefficients `[batch, kv_heads, seq, max_rank]` -> stored `[batch, 1, seq, width]` (each head's kept ones)."""
        coeffs = coeffs.to(self.stored_dtype)
        b, h, s, r = coeffs.shape
        flat = coeffs.transpose(1, 2).reshape(b, s, h * r)
        if not self.uniform:
            flat = flat.index_select(-1, self.pack_index)
        return flat.unsqueeze(1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = stored.shape
        flat = stored.squeeze(1)
        if not self.uniform:
            flat = F.pad(flat, (0, 1)).index_select(-1, self.unpack_index)
        return flat.reshape(b, s, self.basis.heads, self.basis.max_rank).transpose(1, 2)
