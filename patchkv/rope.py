"""cos/sin of the model's own rotary embedding at any integer positions, shared by the layers that use it."""

from __future__ import annotations

import torch
from torch import nn

from .adapters import AttentionAdapter
from .nbytes import storage_nbytes


def length_dependent(rotary: nn.Module) -> str | None:
    """The model's RoPE type if its frequencies change with the sequence length ("dynamic" NTK scaling: rescaled
    past `max_position_embeddings`; "longrope": long factors past `original_max_position_embeddings`), else None.
    Under these the unpatched model keeps each key rotated by the frequencies in force when it was written, which
    one table of cos/sin per position cannot reproduce: pre-RoPE mode refuses them (`patchkv.apply`)."""
    kinds = getattr(rotary, "rope_type", "default")
    for kind in kinds.values() if isinstance(kinds, dict) else [kinds]:
        if "dynamic" in str(kind) or kind == "longrope":
            return str(kind)
    return None


class RopeTable:
    """cos/sin `[n, rotary_dim]` for positions `0 .. n-1` of one rotary table, computed in float32 by the model's
    rotary module through the adapter (the families compute them in float32 and cast to the activations' dtype,
    as `at` does), grown on demand, gathered at true positions (pre-RoPE mode rotates cached keys by them)."""

    def __init__(self, adapter: AttentionAdapter, rotary: nn.Module, attn: nn.Module):
        self.adapter, self.rotary, self.attn = adapter, rotary, attn
        self.reset()

    def reset(self) -> None:
        """Forget the table, so the next use computes it again from the rotary module as it is now (after
        `model.to(torch.bfloat16)` its inverse frequencies are rounded, and the model's cos/sin with them)."""
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self._turn: torch.Tensor | bool | None = None  # built on demand; False: the halves differ
        self._kernel: tuple[torch.Tensor, torch.Tensor] | None = None

    def grow(self, need: int, device: torch.device) -> None:
        """Make the table cover positions `0 .. need - 1` on `device`."""
        cached = self.cos
        if cached is None or cached.shape[0] < need or cached.device != device:
            size = need if cached is None else max(need, 2 * cached.shape[0])
            grid = torch.arange(size, device=device).unsqueeze(0)
            like = torch.empty(0, device=device, dtype=torch.float32)
            cos, sin = self.adapter.cos_sin(self.rotary, self.attn, like, grid)
            self.cos, self.sin, self._turn, self._kernel = cos[0].float(), sin[0].float(), None, None

    def nbytes(self) -> int:
        """Bytes of storage the table keeps: cos and sin, and the kernels' and `turn`'s forms of them once built."""
        derived = [*(self._kernel or ()), *([self._turn] if isinstance(self._turn, torch.Tensor) else [])]
        return storage_nbytes([t for t in (self.cos, self.sin, *derived) if t is not None])

    def at(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: integer tensor of any shape `[...]` -> cos, sin `[..., rotary_dim]` in `like`'s dtype/device."""
        self.grow(int(positions.max()) + 1 if positions.numel() else 1, like.device)
        index = positions.to(self.cos.device).long()
        return self.cos[index].to(like.dtype), self.sin[index].to(like.dtype)

    def kernel_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(cos, sin, rotary_dim) float32 tables covering `positions`, for the kernels (`patchkv.kernels`): `[n,
        rotary_dim / 2]` when both halves are the same rotation (every rotate-half RoPE of transformers: half the
        bytes read per token), `[n, rotary_dim]` otherwise."""
        self.grow(int(positions.max()) + 1 if positions.numel() else 1, positions.device)
        if self._kernel is None:
            half = self.cos.shape[-1] // 2
            same = torch.equal(self.cos[:, :half], self.cos[:, half:]) and torch.equal(self.sin[:, :half], self.sin[:, half:])
            self._kernel = (self.cos[:, :half].contiguous(), self.sin[:, :half].contiguous()) if same else \
                (self.cos, self.sin)
        return *self._kernel, self.cos.shape[-1]

    def turn(self) -> torch.Tensor | None:
        """`cos + i sin` of the table's first half, `[n, rotary_dim / 2]` complex, when both halves are the same
        rotation (rotate-half RoPE); None otherwise. Kept until the table is rebuilt."""
        if self._turn is None:
            half = self.cos.shape[-1] // 2
            cos, sin = self.cos, self.sin
            same = torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
            self._turn = torch.complex(cos[:, :half], sin[:, :half]) if same else False
        return self._turn if self._turn is not False else None


def rope_rows(table: RopeTable, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[..., rotary_dim]` of `table` at `positions` `[batch, n]` or `[batch, heads, n]`, in like's dtype.
    Positions on CPU that run `p, p + 1, ...` alike in every row (the middle of an unpadded batch) are a slice of the
    table, not a gather."""
    n = positions.shape[-1]
    if positions.device.type == "cpu" and positions.dim() == 2 and n > 1:
        first = positions[0, 0]
        if bool((positions == first + torch.arange(n, dtype=positions.dtype)).all()):
            table.grow(int(positions[0, -1]) + 1, like.device)
            start = int(first)
            rows = (table.cos[start: start + n], table.sin[start: start + n])
            return tuple(r.to(like.dtype).expand(positions.shape[0], -1, -1) for r in rows)
    return table.at(positions, like=like)


def rotate_at(table: RopeTable, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE of `table` (by its adapter's `rotate`) on x `[batch, heads, n, head_dim]` at positions `[batch, n]` or per
    head `[batch, heads, n]`."""
    cos, sin = rope_rows(table, positions, x)
    rotate = table.adapter.rotate
    if positions.dim() == 2:
        return rotate(x, cos, sin)
    b, h, n, d = x.shape
    flat = rotate(x.reshape(b * h, 1, n, d), cos.reshape(b * h, n, -1), sin.reshape(b * h, n, -1))
    return flat.reshape(b, h, n, d)
