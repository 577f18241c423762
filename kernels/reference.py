"""PyTorch reference implementations of the hot paths: the oracle for the C++ and Triton kernels, and the path
wherever those do not run."""

from __future__ import annotations

from typing import NamedTuple

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[..., 2m]` -> `[-x[m:], x[:m]]`: the rotate-half RoPE convention of the transformers families."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def chunked_latent_scores(q_latent: torch.Tensor, bias: torch.Tensor, latents: torch.Tensor, groups: int,
                          chunk: int) -> torch.Tensor:
    """Scores in the latent space with one query per chunk of `chunk` consecutive tokens.

    q_latent: `[batch, heads, chunks, rank]`; bias: `[batch, heads, chunks]`; latents: `[batch, kv_heads, seq,
    rank]` with chunks = ceil(seq / chunk), heads = kv_heads * groups. Returns `[batch, heads, seq]`:
    q_latent[b, h, t // chunk] . latents[b, h // groups, t] + bias[b, h, t // chunk].
    """
    batch, heads, chunks, rank = q_latent.shape
    kv_heads, seq = latents.shape[1], latents.shape[2]
    padded = torch.nn.functional.pad(latents, (0, 0, 0, chunks * chunk - seq)).view(batch, kv_heads, chunks, chunk, rank)
    queries = q_latent.view(batch, kv_heads, groups, chunks, rank).transpose(2, 3)  # [b, kv, chunks, groups, r]
    scores = queries @ padded.transpose(-1, -2) + bias.view(batch, kv_heads, groups, chunks, 1).transpose(2, 3)
    return scores.permute(0, 1, 3, 2, 4).reshape(batch, heads, chunks * chunk)[..., :seq]


def pair_order(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices `0, half, 1, half + 1, ...`: head dims ordered so that each pair RoPE rotates together is adjacent."""
    return torch.arange(head_dim, device=device).view(2, head_dim // 2).t().flatten()


# ----- attention over stored latents (codes or packed floats) -----------------------------------------------------


class ComponentTable(NamedTuple):
    """Where each coefficient of one layer's stored latents `[batch, tokens, width]` is, and how to read it.

    The components of head h are `head_start[h] : head_start[h + 1]` (int32 `[heads + 1]`), the same for every
    token, in the order the kernels return them ("table order"; `widest` is the most of any head). For component
    c (`[C]` each): `byte` the byte its bits start in (codes) or its column (packed floats); codes only:
    `value = (bits >> shift) & mask`, `wide` 1 when the bits run into the next byte, coefficient
    `value * step + offset` (mask 0 marks float latents). `head` and `slot` (its place among its head's
    components) serve the references.
    """

    head_start: torch.Tensor
    byte: torch.Tensor
    shift: torch.Tensor
    mask: torch.Tensor
    step: torch.Tensor
    offset: torch.Tensor
    wide: torch.Tensor
    head: torch.Tensor
    slot: torch.Tensor
    widest: int

    @classmethod
    def build(cls, heads: int, max_rank: int, components: torch.Tensor, byte: torch.Tensor,
              codes: dict[str, torch.Tensor] | None = None) -> ComponentTable:
        """The table of stored components `[C]`, given as flat indices `head * max_rank + j` in stored order
        (sorted), each starting at `byte` `[C]` (its column, for floats); codes: their `shift`, `mask`, `step`,
        `offset`, `wide` `[C]`."""
        head = torch.div(components, max_rank, rounding_mode="floor")
        counts = torch.bincount(head, minlength=heads)
        head_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        slot = torch.arange(components.numel()) - head_start[head]
        zeros = torch.zeros(components.numel(), dtype=torch.int32)
        codes = codes or {"shift": zeros, "mask": zeros, "step": zeros.float() + 1, "offset": zeros.float(),
                          "wide": zeros}
        return cls(head_start.int(), byte.int(), codes["shift"].int(), codes["mask"].int(), codes["step"].float(),
                   codes["offset"].float(), codes["wide"].int(), head.int(), slot.int(),
                   max(1, int(counts.max()) if counts.numel() else 1))

    @property
    def heads(self) -> int:
        return self.head_start.numel() - 1

    def spread(self, coeffs: torch.Tensor, components: torch.Tensor, max_rank: int) -> torch.Tensor:
        """Coefficients in table order `[batch, heads, n, widest]` -> by component, `[batch, heads, n, max_rank]`
        (zero where nothing is stored); components as given to `build`."""
        batch, _, n, _ = coeffs.shape
        flat = coeffs.transpose(1, 2).reshape(batch, n, -1)[..., (self.head * self.widest + self.slot).long()]
        out = flat.new_zeros(batch, n, self.heads * max_rank)
        out[..., components.long()] = flat
        return out.view(batch, n, self.heads, max_rank).transpose(1, 2)

    def to(self, device: torch.device) -> ComponentTable:
        return ComponentTable(*(t.to(device) for t in self[:-1]), self.widest)

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """The tensors the C++ kernels take, in their order."""
        return self[:7]


def unpack(latents: torch.Tensor, table: ComponentTable) -> torch.Tensor:
    """Stored latents `[batch, tokens, width]` (uint8 codes or floats) -> float32 coefficients `[batch, heads,
    tokens, widest]`, each head's in table order, zero past its last."""
    batch, tokens, width = latents.shape
    byte = table.byte.long()
    if latents.dtype == torch.uint8:
        padded = torch.nn.functional.pad(latents, (0, 1)).int()
        values = ((padded[..., byte] | padded[..., byte + 1] * table.wide << 8) >> table.shift) & table.mask
        coeffs = values.float() * table.step + table.offset
    else:
        coeffs = latents[..., byte].float()
    out = coeffs.new_zeros(batch, tokens, table.heads * table.widest)
    out[..., (table.head * table.widest + table.slot).long()] = coeffs
    return out.view(batch, tokens, table.heads, table.widest).transpose(1, 2)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, rot: int) -> torch.Tensor:
    """Rotate-half RoPE over the first `rot` dims of x `[batch, heads, n, d]` at `positions` `[batch, n]`, from
    tables cos, sin `[positions, rot]` (or `[positions, rot / 2]`: both halves the same rotation)."""
    c, s = cos[positions.long()].unsqueeze(1), sin[positions.long()].unsqueeze(1)
    if c.shape[-1] != rot:
        c, s = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
    turned = x[..., :rot] * c + rotate_half(x[..., :rot]) * s
    return torch.cat([turned, x[..., rot:]], dim=-1) if rot < x.shape[-1] else turned


def _padded_rows(rows: torch.Tensor, table: ComponentTable) -> torch.Tensor:
    """Basis rows in table order `[C, d]` -> `[heads, widest, d]`, zero past each head's last component."""
    out = rows.new_zeros(table.heads * table.widest, rows.shape[-1])
    out[(table.head * table.widest + table.slot).long()] = rows
    return out.view(table.heads, table.widest, -1)


def reconstruct(latents: torch.Tensor, table: ComponentTable, rows: torch.Tensor, mean: torch.Tensor,
                cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor | None, rot: int,
                dtype: torch.dtype, coeffs: torch.Tensor | None = None) -> torch.Tensor:
    """Stored latents `[batch, tokens, width]` -> vectors `[batch, heads, tokens, head_dim]` in `dtype`:
    `mean + sum_c coefficient_c rows[c]`, rotated (rotate-half over the first `rot` dims) by `positions`
    `[batch, tokens]` when given. rows: float32 basis vectors of the components in table order `[C, head_dim]`;
    mean `[heads, head_dim]`. coeffs: the latents already unpacked (`unpack`'s result), if at hand."""
    coeffs = unpack(latents, table) if coeffs is None else coeffs
    out = coeffs @ _padded_rows(rows, table) + mean.unsqueeze(1)
    if positions is not None:
        out = _rope(out, cos, sin, positions, rot)
    return out.to(dtype)


def scores(latents: torch.Tensor, table: ComponentTable, rows: torch.Tensor, mean: torch.Tensor,
           cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor | None, rot: int,
           q: torch.Tensor, coeffs: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of queries q float32 `[batch, heads, groups, head_dim]` against every stored token, each key rebuilt
    and rotated as `reconstruct` does -> float32 `[batch, heads, groups, tokens]`."""
    keys = reconstruct(latents, table, rows, mean, cos, sin, positions, rot, torch.float32, coeffs)
    return q @ keys.transpose(-1, -2)


def attend(latents: torch.Tensor, table: ComponentTable, rows: torch.Tensor, mean: torch.Tensor,
           cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor | None, rot: int,
           q: torch.Tensor, q_bias: torch.Tensor | None, bias: torch.Tensor | None, scaling: float,
           value_latents: torch.Tensor, value_table: ComponentTable, latent_space: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step's attention over the stored middle (`tokens` >= 1): scores of q float32 `[batch, heads,
    groups, head_dim]` against every token (keys rebuilt and rotated as `scores` does; `latent_space`: q `[batch,
    heads, groups, widest]` in table order against the coefficients, plus q_bias `[batch, heads, groups]`), times
    `scaling`, plus `bias` `[batch, tokens]` or per head `[batch, heads, tokens]` (the mask's columns, or None) -> (m, l, sums): the max score m `[batch,
    heads, groups]`, l = sum_t exp(s_t - m), and sums = sum_t exp(s_t - m) c_t of the value coefficients `[batch,
    heads, groups, value widest]` in table order. The caller merges them with other regions."""
    if latent_space:
        s = q @ unpack(latents, table).transpose(-1, -2) + q_bias.unsqueeze(-1)
    else:
        s = scores(latents, table, rows, mean, cos, sin, positions, rot, q)
    s = s * scaling + (0 if bias is None else bias[:, None, None, :] if bias.dim() == 2 else bias[:, :, None, :])
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1))
    return m, p.sum(-1), p @ unpack(value_latents, value_table)


def encode(coeffs: torch.Tensor, table: ComponentTable, components: torch.Tensor, width: int) -> torch.Tensor:
    """Fixed-rate codes of coefficients float32 `[batch, heads, tokens, max_rank]` -> uint8 `[batch, tokens, width]`:
    component c (flat index `components[c]` = head * max_rank + j) is quantized to `idx = clamp(floor(x / step +
    levels / 2), 0, levels - 1)` (a step of 0 reads as 1), levels = mask + 1, and its bits written from bit `shift`
    of byte `byte` on, least significant first (`unpack` reads them back as `idx * step + offset`)."""
    batch, heads, tokens, rank = coeffs.shape
    x = coeffs.transpose(1, 2).reshape(batch, tokens, heads * rank)[..., components.long()]
    levels = (table.mask + 1).float()
    size = torch.where(table.step > 0, table.step, torch.ones_like(table.step))
    idx = torch.floor(x / size + levels / 2).clamp(torch.zeros_like(levels), levels - 1).long()
    bits = idx << table.shift.long()
    out = torch.zeros(batch, tokens, width + 1, dtype=torch.long, device=coeffs.device)
    byte = table.byte.long()
    # components never share a bit, so adding their bytes is or-ing them
    out.index_add_(2, byte, bits & 0xFF)
    out.index_add_(2, byte + 1, (bits >> 8) * table.wide)
    return out[..., :width].to(torch.uint8)
