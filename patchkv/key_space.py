"""The key space the cache codes keys in: pre-RoPE or post-RoPE (a model's `mode`), one small class each, behind one
interface.

- `PreRoPE`: keys are projected before the rotary embedding, where they are most compressible. At attention
  time cached keys are rebuilt and rotated by their true positions (recorded by the cache).
- `PostRoPE`: rotated keys are projected. Decode steps score latent tokens in the latent space (the query
  projected on the basis), so keys are never rebuilt there.

Values are the same in both modes. Attention reads the middle from what the cache stores (codes or packed
floats) through `patchkv.kernels`, never from a decoded copy kept between forwards:

- a forward of several queries (prefill, chunked scoring) gets dense keys and values for the middle,
  rebuilt (and rotated) once per forward by `kernels.reconstruct`, and runs the model's own attention
  function on ordinary tensors (`middle_keys`);
- a decode step reads the middle straight from the stored codes in one pass (`middle_attend`, `kernels.attend`:
  each key rebuilt and rotated in registers, or post-RoPE scored in the latent space; a running softmax; value
  coefficients summed in the latent space), merged with the exact tokens by `patchkv.attention.decode_attention`.

Dense operands are in the model's dtype, as the unpatched model computes attention; a decode step scores and
sums in float32 (the kernels accumulate in float32 whatever the stored dtype).

A selector (`patchkv.methods.TopK`) chooses the middle tokens a decode step reads from the mode's approximate
scores (`approximate_scores`, the one mode-specific part of selection); attention over the chosen tokens is
exact. Pre-RoPE, each chunk of `SCORE_CHUNK` consecutive middle tokens is scored in the latent space
against the query turned back by the rotation of the chunk's centre position, `U^T R(p_ref)^T q`, so no
key is rebuilt; the error is the rotation between a token and its chunk's centre.
"""

from __future__ import annotations

import torch

from .kernels import ops as kernels
from .latent import Codec
from .patch import LayerPatch
from .rope import rotate_at
from .visible import Visible

#: consecutive middle tokens sharing one reference rotation in pre-RoPE top-k scoring
SCORE_CHUNK = 16


def grouped_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Queries grouped by KV head `[batch, kv_heads, groups, D]` against `[batch, kv_heads, n, D]` -> `[batch,
    kv_heads, groups, n]`: each KV head's query heads in one product, no repeated keys."""
    return q @ keys.transpose(-1, -2)


def _half(codec: Codec) -> bool:
    """Whether the model computes in half precision: then the kernels may multiply in bfloat16 (float32 sums)."""
    return codec.basis.basis.dtype in (torch.float16, torch.bfloat16)


def rebuild(codec: Codec, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored middle `[batch, m, width]` -> vectors `[batch, kv_heads, m, head_dim]` in `dtype`, not rotated."""
    return kernels.reconstruct(stored, codec.table, codec.rows, codec.kernel_mean, None, dtype, _half(codec))


class Mode:
    """Which keys the basis describes, and how attention reads cached keys."""

    name: str

    def to_cache_space(self, lp: LayerPatch, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Un-rotated q `[batch, heads, s, d]`, k `[batch, kv_heads, s, d]` and this step's cos/sin -> (q, k) in
        the space the key basis was calibrated in."""
        raise NotImplementedError

    def queries(self, lp: LayerPatch, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q in cache space -> q as attention dots it with keys (rotated), `[batch, heads, s, d]`."""
        raise NotImplementedError

    def exact_keys(self, lp: LayerPatch, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Exact cached keys `[batch, kv_heads, n, d]` at `positions` `[batch, n]` -> as attention reads them."""
        raise NotImplementedError

    def middle_keys(self, lp: LayerPatch, seen: Visible, dtype: torch.dtype) -> torch.Tensor:
        """The middle's keys as attention reads them, `[batch, kv_heads, m, d]` in `dtype`."""
        raise NotImplementedError

    def middle_attend(self, lp: LayerPatch, seen: Visible, q: torch.Tensor, bias: torch.Tensor | None,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step over the middle in one pass over its codes (`kernels.attend`): q float32 `[batch, kv_heads,
        groups, d]` (as `queries` returns it, grouped), bias `[batch, m]` or `[batch, kv_heads, m]` (the mask's
        columns) -> (max score,
        sum of exp, value coefficient sums), float32 `[batch, kv_heads, groups]` twice and `[batch, kv_heads, groups,
        widest]`."""
        raise NotImplementedError

    def approximate_scores(self, lp: LayerPatch, q: torch.Tensor, middle: torch.Tensor, rank: int,
                           positions: torch.Tensor) -> torch.Tensor:
        """Scores of a single query `[batch, heads, 1, d]` (as `queries` returns it) against the middle's keys as
        stored `[batch, m, width]` (at `positions` `[batch, m]`) from their first `rank` components, read straight
        from the codes (`Codec.leading_scores`), the mean term included (a KV head selects by the best of its query
        heads, so no per-query-head offset may be dropped) -> float32 `[batch, heads, m]`."""
        raise NotImplementedError

    def cached_keys_as_rotated(self, lp: LayerPatch, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cached keys `[batch, kv_heads, n, d]` at `positions` -> as the unpatched model would cache them."""
        return self.exact_keys(lp, keys, positions)


class PreRoPE(Mode):
    name = "pre_rope"

    def to_cache_space(self, lp, q, k, cos, sin):
        return q, k

    def queries(self, lp, q, cos, sin):
        return lp.patch.adapter.rotate(q, cos, sin)

    def exact_keys(self, lp, keys, positions):
        return rotate_at(lp.rope, keys, positions) if keys.shape[2] else keys

    def _rope(self, lp: LayerPatch, positions: torch.Tensor):
        """The kernels' rotation of the middle, or None where the adapter's RoPE is not rotate-half."""
        if lp.patch.adapter.rope_convention != "rotate_half" or not positions.numel():
            return None
        cos, sin, rot = lp.rope.kernel_tables(positions)
        return cos, sin, positions, rot

    def middle_keys(self, lp, seen, dtype):
        rope = self._rope(lp, seen.middle_positions)
        codec = lp.keys
        if rope is None and seen.middle_len:
            return rotate_at(lp.rope, rebuild(codec, seen.middle_keys, torch.float32), seen.middle_positions).to(dtype)
        return kernels.reconstruct(seen.middle_keys, codec.table, codec.rows, codec.kernel_mean, rope, dtype,
                                   _half(codec))

    def middle_attend(self, lp, seen, q, bias, scaling):
        rope = self._rope(lp, seen.middle_positions)
        keys, values = lp.keys, lp.values
        if rope is None:  # a RoPE the kernels do not implement: rebuild and rotate, then attend to the dense keys
            s = grouped_scores(q, self.middle_keys(lp, seen, torch.float32)) * scaling
            s = s + (0 if bias is None else bias[:, None, None, :] if bias.dim() == 2 else bias[:, :, None, :])
            top = s.amax(-1)
            p = torch.exp(s - top.unsqueeze(-1))
            return top, p.sum(-1), p @ kernels.unpack(seen.middle_values, values.table)
        return kernels.attend(seen.middle_keys, keys.table, keys.rows, keys.kernel_mean, rope, q, None, bias, scaling,
                              seen.middle_values, values.table, half=_half(keys))

    def approximate_scores(self, lp, q, middle, rank, positions):
        basis, rotate = lp.keys.basis, lp.patch.adapter.rotate
        m, r = middle.shape[1], rank
        chunks = -(-m // SCORE_CHUNK)
        centres = (torch.arange(chunks, device=positions.device) * SCORE_CHUNK + SCORE_CHUNK // 2).clamp_max(m - 1)
        q = q.float()
        # q . R(p) k = (R(p)^T q) . k, and R(p)^T is the rotation with sin negated (any scaling of the table kept)
        lp.rope.grow(int(positions.max()) + 1, q.device)
        turn = lp.rope.turn() if lp.patch.adapter.rope_convention == "rotate_half" and \
            lp.rope.cos.shape[-1] == basis.head_dim else None
        query_basis, query_mean = basis.query_basis[..., :r].float(), basis.query_mean.float()
        if turn is not None:  # in pair order each chunk's turn back is one complex product (conjugate rotation)
            order = kernels.reference.pair_order(basis.head_dim, q.device)
            back = turn[positions[:, centres].long()].conj().unsqueeze(1)  # [batch, 1, chunks, d / 2]
            paired = torch.view_as_complex(q[..., order].reshape(*q.shape[:3], -1, 2).contiguous())
            q_ref = torch.view_as_real(paired * back).flatten(-2)  # [batch, heads, chunks, d], pair order
            query_basis, query_mean = query_basis[:, order], query_mean[:, order]
        else:
            ref_cos, ref_sin = lp.rope.at(positions[:, centres], like=q)  # [batch, chunks, rotary_dim]
            q_ref = rotate(q.expand(-1, -1, chunks, -1), ref_cos, -ref_sin)  # [batch, heads, chunks, d]
        q_latent = q_ref @ query_basis
        bias = (q_ref * query_mean.unsqueeze(1)).sum(-1)
        return lp.keys.leading_scores(middle.unsqueeze(1), r, q_latent, bias, SCORE_CHUNK)


class PostRoPE(Mode):
    name = "post_rope"

    def to_cache_space(self, lp, q, k, cos, sin):
        rotate = lp.patch.adapter.rotate
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def queries(self, lp, q, cos, sin):
        return q

    def exact_keys(self, lp, keys, positions):
        return keys

    def middle_keys(self, lp, seen, dtype):
        return rebuild(lp.keys, seen.middle_keys, dtype)

    def middle_attend(self, lp, seen, q, bias, scaling):
        # q . (mean + sum_c coefficient_c row_c) = (q . rows) . c + q . mean: scored in the latent space
        keys, values = lp.keys, lp.values
        q_latent = (q @ keys.padded_rows.transpose(1, 2)).contiguous()  # [batch, kv_heads, groups, widest]
        q_bias = (q * keys.kernel_mean.unsqueeze(1)).sum(-1)
        return kernels.attend(seen.middle_keys, keys.table, keys.rows, keys.kernel_mean, None, q_latent, q_bias, bias,
                              scaling, seen.middle_values, values.table, latent_space=True)

    def approximate_scores(self, lp, q, middle, rank, positions):
        basis = lp.keys.basis
        q = q.float()
        q_latent = (q @ basis.query_basis.float())[..., :rank]  # [batch, heads, 1, rank]: one chunk, every token
        # q . mean differs between the query heads of one KV head, which keeps the best for any of them: kept
        mean = (q * basis.query_mean.float().unsqueeze(1)).sum(-1)  # [batch, heads, 1]
        return lp.keys.leading_scores(middle.unsqueeze(1), rank, q_latent, mean, max(1, middle.shape[1]))


MODES: dict[str, Mode] = {mode.name: mode for mode in (PreRoPE(), PostRoPE())}
