"""Hot-path kernels: the C++ CPU kernels on CPU tensors (`cpu.py`), Triton on CUDA tensors (or under
TRITON_INTERPRET=1), the PyTorch reference otherwise (and whenever the C++ kernels are not built)."""

from __future__ import annotations

import functools
import os

import torch

from . import cpu, reference
from .reference import ComponentTable


def _triton_for(x: torch.Tensor):
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    try:
        from . import triton_kernels
    except ImportError:  # triton is an optional extra: patchkv[triton]
        return None
    return triton_kernels


def chunked_latent_scores(q_latent: torch.Tensor, bias: torch.Tensor, latents: torch.Tensor, groups: int,
                          chunk: int) -> torch.Tensor:
    """`[batch, heads, chunks, rank]`, `[batch, heads, chunks]` x `[batch, kv_heads, seq, rank]` -> `[batch, heads,
    seq]`, one query per chunk of tokens; see `reference`."""
    impl = _triton_for(latents) or reference
    return impl.chunked_latent_scores(q_latent, bias, latents, groups, chunk)


# ----- attention over stored latents: C++ on CPU, the reference elsewhere -----------------------------------------


def _labelled(fn):
    """Run under a `torch.profiler` label `patchkv::<name>` (C++ extension calls are invisible to the profiler
    otherwise; `evals/profile_paths.py` reads these)."""
    label = f"patchkv::{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapper


#: what the C++ kernels read and write; other dtypes (float64) take the PyTorch references
CPU_DTYPES = (torch.uint8, torch.float32, torch.bfloat16, torch.float16)


def _cpu_for(x: torch.Tensor, *others: torch.Tensor | torch.dtype):
    """The C++ extension when `x` is on the CPU and it and `others` (tensors or dtypes) are of dtypes it handles."""
    dtypes = [x.dtype, *(o if isinstance(o, torch.dtype) else o.dtype for o in others)]
    if x.device.type != "cpu" or any(d not in CPU_DTYPES for d in dtypes):
        return None
    return cpu.extension()


def _coeffs(latents: torch.Tensor, table: ComponentTable) -> torch.Tensor | None:
    """Codes unpacked by the Triton kernel (CUDA), for the reference to continue from; None elsewhere."""
    impl = _triton_for(latents) if latents.dtype == torch.uint8 else None
    return impl.unpack(latents, table) if impl is not None else None


def _rope_args(rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None, like: torch.Tensor):
    if rope is None:
        empty = like.new_empty(0, dtype=torch.float32)
        return empty, empty, like.new_empty(0, dtype=torch.int32), 0
    cos, sin, positions, rot = rope
    return cos, sin, positions.to(torch.int32).contiguous(), rot


@_labelled
def unpack(latents: torch.Tensor, table: ComponentTable) -> torch.Tensor:
    """Stored latents `[batch, tokens, width]` -> float32 coefficients `[batch, heads, tokens, widest]`, table order;
    see `reference.unpack`."""
    ext = _cpu_for(latents)
    if ext is None:
        coeffs = _coeffs(latents, table)
        return reference.unpack(latents, table) if coeffs is None else coeffs
    return ext.unpack(latents.contiguous(), *table.kernel_args())


@_labelled
def reconstruct(latents: torch.Tensor, table: ComponentTable, rows: torch.Tensor, mean: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None, dtype: torch.dtype,
                half: bool = False) -> torch.Tensor:
    """Stored latents -> vectors `[batch, heads, tokens, head_dim]` in `dtype`, rotated when `rope` = (cos table,
    sin table, positions `[batch, tokens]`, rotary dims) is given; see `reference.reconstruct`. `half`: the C++
    kernel may multiply in bfloat16 (accumulating in float32), for models that compute in half precision."""
    ext = _cpu_for(latents, rows, mean, dtype)
    cos, sin, positions, rot = _rope_args(rope, latents)
    if ext is None:
        return reference.reconstruct(latents, table, rows, mean, cos if rope else None, sin if rope else None,
                                     positions if rope else None, rot, dtype, _coeffs(latents, table))
    return ext.reconstruct(latents.contiguous(), *table.kernel_args(), rows, mean, cos, sin, positions, rot, dtype,
                           half)


@_labelled
def attend(latents: torch.Tensor, table: ComponentTable, rows: torch.Tensor, mean: torch.Tensor,
           rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None, q: torch.Tensor,
           q_bias: torch.Tensor | None, bias: torch.Tensor | None, scaling: float, value_latents: torch.Tensor,
           value_table: ComponentTable, latent_space: bool = False, half: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step over the stored middle in one pass: (max score, sum of exp, value coefficient sums); see
    `reference.attend`."""
    ext = _cpu_for(latents, rows, mean, value_latents)
    cos, sin, positions, rot = _rope_args(rope, latents)
    q = q.float().contiguous()
    if ext is None:
        return reference.attend(latents, table, rows, mean, cos if rope else None, sin if rope else None,
                                positions if rope else None, rot, q, q_bias, bias, scaling, value_latents,
                                value_table, latent_space)
    empty = q.new_empty(0)
    return tuple(ext.attend(
        latents.contiguous(), *table.kernel_args(), rows, mean, cos, sin, positions, rot, q,
        empty if q_bias is None else q_bias.float().contiguous(), empty if bias is None else bias.float().contiguous(),
        float(scaling), value_latents.contiguous(), *value_table.kernel_args(), latent_space, half))


@_labelled
def leading_scores(latents: torch.Tensor, table: ComponentTable, components: torch.Tensor, max_rank: int,
                   q_latent: torch.Tensor, q_bias: torch.Tensor, groups: int, chunk: int) -> torch.Tensor:
    """Stored latents `[batch, tokens, width]` scored by one query per chunk of `chunk` tokens against the table's
    coefficients: q_latent `[batch, heads, chunks, max_rank]`, q_bias `[batch, heads, chunks]` -> float32 `[batch,
    heads, tokens]`: `chunked_latent_scores` of the coefficients by component (`components`: flat indices `head *
    max_rank + j`, as given to `ComponentTable.build`). On CPU one pass over the codes (the query put in table
    order); elsewhere, and as the tests' oracle, the coefficients unpacked and spread, then scored."""
    ext = _cpu_for(latents)
    q_latent, q_bias = q_latent.float(), q_bias.float()
    if ext is None:
        coeffs = table.spread(unpack(latents, table), components, max_rank)
        return chunked_latent_scores(q_latent, q_bias, coeffs, groups, chunk)
    batch, heads, chunks, _ = q_latent.shape
    kv_heads = table.heads
    # each head's query in its components' order: slot s of head h reads rank index components[...] - h * max_rank
    order = torch.full((kv_heads * table.widest,), max_rank, dtype=torch.long, device=latents.device)
    order[(table.head * table.widest + table.slot).long()] = components.long() - table.head.long() * max_rank
    padded = torch.nn.functional.pad(q_latent, (0, 1)).view(batch, kv_heads, groups, chunks, max_rank + 1)
    q = padded.gather(4, order.view(1, kv_heads, 1, 1, table.widest).expand(batch, -1, groups, chunks, -1))
    return ext.leading_scores(latents.contiguous(), *table.kernel_args(), q.contiguous(), q_bias.contiguous(), chunk)


@_labelled
def encode(coeffs: torch.Tensor, table: ComponentTable, components: torch.Tensor, width: int) -> torch.Tensor:
    """float32 coefficients `[batch, heads, tokens, max_rank]` -> fixed-rate codes uint8 `[batch, tokens, width]`;
    see `reference.encode`."""
    coeffs = coeffs.float().contiguous()
    ext = _cpu_for(coeffs)
    if ext is None:
        return reference.encode(coeffs, table, components, width)
    return ext.encode(coeffs, *table.kernel_args(), components.to(torch.int32).contiguous(), width)


__all__ = ["ComponentTable", "attend", "chunked_latent_scores", "encode", "leading_scores", "reconstruct", "reference",
           "unpack"]
