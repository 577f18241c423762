"""The two ways keys enter the latent cache, one small class each, behind one interface.

- `PreRoPE`: keys are projected before the rotary embedding, where they are most compressible. At attention
  time cached keys are reconstructed and rotated by their true positions (recorded by the cache).
- `PostRoPE`: rotated keys are projected. Queries are projected onto the same basis, so scores against
  latent tokens are computed in the latent space and keys are never reconstructed.

Values are the same in both modes (see `patchkv.attention`). Exact tokens (sinks, window) and latent tokens
are scored together by augmenting features, `[exact dims | latent dims | 1]`, so any attention function
(eager, sdpa) sees one key tensor whose dot products are the true scores, mean term included.

At a decode step (`patchkv.attention.grouped_decode`) the mode scores each region directly instead
(`decode_scores`), with no augmented copy: post-RoPE latent tokens in the latent space, pre-RoPE middle keys
rebuilt with each rotated pair of dims adjacent (`kernels.reference.pair_order`, one complex product per pair)
and dotted with the query in that same order.

Attention operands are built in `compute_dtype`: float32 on CPU for half-precision models (CPU attention
kernels run several times faster in float32 than in bfloat16, and the patched operands are small), the
model's dtype elsewhere.

Top-k selection scores candidates approximately (`approximate_scores`); attention over the chosen tokens is
exact. Pre-RoPE, each chunk of `SCORE_CHUNK` consecutive middle tokens is scored in the latent space
against the query turned back by the rotation of the chunk's centre position, `U^T R(p_ref)^T q`, so no
key is reconstructed; the error is the rotation between a token and its chunk's centre.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .context import LayerPatch
from .kernels import ops as kernels
from .latent import augmented

#: consecutive middle tokens sharing one reference rotation in pre-RoPE top-k scoring
SCORE_CHUNK = 16


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention operands are built in: float32 for half-precision tensors on CPU, else x's dtype."""
    return torch.float32 if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16) else x.dtype


@dataclass
class Visible:
    """What one attention step reads, in position order (sinks, middle, window).

    sink_*/recent_*: exact `[batch, kv_heads, n, head_dim]` in cache space; key_coeffs/value_coeffs: the
    middle's coefficients `[batch, kv_heads, m, max_rank]`; *_positions: true positions `[batch, n]`
    (`[batch, kv_heads, m]` for a middle selected per KV head).
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    key_coeffs: torch.Tensor
    value_coeffs: torch.Tensor
    sink_positions: torch.Tensor
    middle_positions: torch.Tensor
    recent_positions: torch.Tensor


def grouped_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One query per head `[batch, heads, 1, D]` against `[batch, kv_heads, n, D]` -> `[batch, kv_heads, groups, n]`:
    each KV head's query heads in one product, no repeated keys."""
    batch, heads, _, dim = q.shape
    return q.reshape(batch, keys.shape[1], heads // keys.shape[1], dim) @ keys.transpose(-1, -2)


def rope_rows(lp: LayerPatch, positions: torch.Tensor, like: torch.Tensor, turn: bool = False):
    """cos, sin `[..., rotary_dim]` at `positions` `[batch, n]` or `[batch, heads, n]` (with `turn`: the rows of
    `RopeTable.turn()` instead, `[..., rotary_dim / 2]` complex). Positions on CPU that run `p, p + 1, ...` alike
    in every row (the middle of an unpadded batch) are a slice of the table, not a gather."""
    n = positions.shape[-1]
    if positions.device.type == "cpu" and positions.dim() == 2 and n > 1:
        first = positions[0, 0]
        if bool((positions == first + torch.arange(n, dtype=positions.dtype)).all()):
            lp.rope.at(positions[:1, -1:], like=like)  # grows the table to the last position
            start = int(first)
            if turn:
                return lp.rope.turn()[start: start + n].expand(positions.shape[0], -1, -1)
            return lp.rope.cos[start: start + n].expand(positions.shape[0], -1, -1), \
                lp.rope.sin[start: start + n].expand(positions.shape[0], -1, -1)
    cos, sin = lp.rope.at(positions, like=like)
    return lp.rope.turn()[positions.to(cos.device).long()] if turn else (cos, sin)


def rotate_at(lp: LayerPatch, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE on x `[batch, heads, n, head_dim]` at positions `[batch, n]` or per head `[batch, heads, n]`."""
    cos, sin = rope_rows(lp, positions, x)
    rotate = lp.patch.adapter.rotate
    if positions.dim() == 2:
        return rotate(x, cos, sin)
    b, h, n, d = x.shape
    flat = rotate(x.reshape(b * h, 1, n, d), cos.reshape(b * h, n, -1), sin.reshape(b * h, n, -1))
    return flat.reshape(b, h, n, d)


class Mode:
    """Which keys the basis describes, and what the attention function dots queries with."""

    name: str

    def to_cache_space(self, lp: LayerPatch, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Un-rotated q `[batch, heads, s, d]`, k `[batch, kv_heads, s, d]` and this step's cos/sin -> (q, k) in
        the space the key basis was calibrated in."""
        raise NotImplementedError

    def score_operands(self, lp: LayerPatch, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       seen: Visible) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries `[batch, heads, s, D]`, keys `[batch, kv_heads, n, D]`), in `compute_dtype(q)`, whose dot
        products are the true attention scores of q (in cache space) against every visible token."""
        raise NotImplementedError

    def decode_scores(self, lp: LayerPatch, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      seen: Visible) -> torch.Tensor:
        """The true scores of a single query `[batch, heads, 1, d]` (in cache space) against every visible token,
        region by region with no augmented copy -> `[batch, kv_heads, groups, n]` in `compute_dtype(q)`."""
        raise NotImplementedError

    def approximate_scores(self, lp: LayerPatch, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           coeffs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Scores of a single query `[batch, heads, 1, d]` against middle tokens from their first r components
        `coeffs` `[batch, kv_heads, m, r]`, the mean term included (a KV head selects by the best of its query
        heads, so no per-query-head offset may be dropped) -> float32 `[batch, heads, m]`."""
        raise NotImplementedError

    def cached_keys_as_rotated(self, lp: LayerPatch, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cached keys `[batch, kv_heads, n, d]` at `positions` -> as the unpatched model would cache them."""
        raise NotImplementedError


class PreRoPE(Mode):
    name = "pre_rope"

    def to_cache_space(self, lp, q, k, cos, sin):
        return q, k

    def score_operands(self, lp, q, cos, sin, seen):
        work = compute_dtype(q)
        regions = [(rotate_at, seen.sink_keys, seen.sink_positions),
                   (self._rotated_middle, seen.key_coeffs, seen.middle_positions),
                   (rotate_at, seen.recent_keys, seen.recent_positions)]
        rotated = [rotate(lp, x.to(work), at) for rotate, x, at in regions if x.shape[2]]  # the token itself is one
        keys = rotated[0] if len(rotated) == 1 else torch.cat(rotated, dim=2)  # no copy of a lone region
        return lp.patch.adapter.rotate(q, cos, sin).to(work), keys

    def decode_scores(self, lp, q, cos, sin, seen):
        work = compute_dtype(q)
        q_rot = lp.patch.adapter.rotate(q, cos, sin).to(work)
        scores = []
        if seen.sink_keys.shape[2]:
            scores.append(grouped_scores(q_rot, rotate_at(lp, seen.sink_keys.to(work), seen.sink_positions)))
        if seen.key_coeffs.shape[2]:  # keys in pair order, the query too: the pairs are never put back
            keys = self._rotated_middle(lp, seen.key_coeffs.to(work), seen.middle_positions, paired=True)
            scores.append(grouped_scores(q_rot[..., kernels.reference.pair_order(q.shape[-1], q.device)], keys))
        if seen.recent_keys.shape[2]:
            scores.append(grouped_scores(q_rot, rotate_at(lp, seen.recent_keys.to(work), seen.recent_positions)))
        return scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)

    @staticmethod
    def _rotated_middle(lp: LayerPatch, coeffs: torch.Tensor, positions: torch.Tensor,
                        paired: bool = False) -> torch.Tensor:
        """Coefficients `[batch, kv_heads, m, max_rank]` at `positions` (`[batch, m]` or `[batch, kv_heads, m]`)
        -> rotated keys `[batch, kv_heads, m, head_dim]` in coeffs' dtype (fused when the whole head rotates),
        head dims in `pair_order` if `paired`."""
        basis = lp.keys.basis
        cos, sin = rope_rows(lp, positions, coeffs)
        if lp.patch.adapter.rope_convention == "rotate_half" and cos.shape[-1] == basis.head_dim:
            turn = rope_rows(lp, positions, coeffs, turn=True) if paired and lp.rope.turn() is not None else None
            if positions.dim() == 2:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                turn = None if turn is None else turn.unsqueeze(1)
            return kernels.reconstruct_rope(coeffs, basis.basis.to(coeffs.dtype), basis.mean.to(coeffs.dtype), cos, sin,
                                            paired, turn)
        keys = rotate_at(lp, basis.reconstruct(coeffs), positions)
        return keys[..., kernels.reference.pair_order(keys.shape[-1], keys.device)] if paired else keys

    def approximate_scores(self, lp, q, cos, sin, coeffs, positions):
        basis, rotate = lp.keys.basis, lp.patch.adapter.rotate
        m, r = coeffs.shape[2], coeffs.shape[3]
        chunks = -(-m // SCORE_CHUNK)
        centres = (torch.arange(chunks, device=positions.device) * SCORE_CHUNK + SCORE_CHUNK // 2).clamp_max(m - 1)
        q_rot = rotate(q, cos, sin).to(compute_dtype(q))  # [batch, heads, 1, d]
        # q . R(p) k = (R(p)^T q) . k, and R(p)^T is the rotation with sin negated (any scaling of the table kept)
        lp.rope.at(positions[:, -1:], like=q_rot)  # the table covers every position
        turn = lp.rope.turn() if lp.patch.adapter.rope_convention == "rotate_half" and \
            lp.rope.cos.shape[-1] == basis.head_dim else None
        query_basis, query_mean = basis.query_basis[..., :r], basis.query_mean
        if turn is not None:  # in pair order each chunk's turn back is one complex product (conjugate rotation)
            order = kernels.reference.pair_order(basis.head_dim, q.device)
            back = turn[positions[:, centres].long()].conj().unsqueeze(1)  # [batch, 1, chunks, d / 2]
            paired = torch.view_as_complex(q_rot[..., order].float().reshape(*q_rot.shape[:3], -1, 2).contiguous())
            q_ref = torch.view_as_real(paired * back).flatten(-2)  # [batch, heads, chunks, d], pair order
            query_basis, query_mean = query_basis[:, order], query_mean[:, order]
        else:
            ref_cos, ref_sin = lp.rope.at(positions[:, centres], like=q_rot)  # [batch, chunks, rotary_dim]
            q_ref = rotate(q_rot.expand(-1, -1, chunks, -1), ref_cos, -ref_sin).float()  # [batch, heads, chunks, d]
        q_latent = q_ref @ query_basis.float()
        bias = (q_ref * query_mean.float().unsqueeze(1)).sum(-1)
        return kernels.chunked_latent_scores(q_latent, bias, coeffs.float(), basis.query_groups, SCORE_CHUNK)

    def cached_keys_as_rotated(self, lp, keys, positions):
        return rotate_at(lp, keys, positions)


class PostRoPE(Mode):
    name = "post_rope"

    def to_cache_space(self, lp, q, k, cos, sin):
        rotate = lp.patch.adapter.rotate
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def score_operands(self, lp, q, cos, sin, seen):
        work = compute_dtype(q)
        keys, has_exact, has_latent = augmented(seen.sink_keys.to(work), seen.key_coeffs.to(work),
                                                seen.recent_keys.to(work))
        basis = lp.keys.basis
        parts = ([q] if has_exact else []) + ([basis.project_queries(q), basis.mean_scores(q)] if has_latent else [])
        return torch.cat(parts, dim=-1).to(work), keys

    def decode_scores(self, lp, q, cos, sin, seen):
        work = compute_dtype(q)
        basis, qw = lp.keys.basis, q.to(work)
        scores = []
        if seen.sink_keys.shape[2]:
            scores.append(grouped_scores(qw, seen.sink_keys.to(work)))
        if seen.key_coeffs.shape[2]:  # q . (mean + U c) = (q U) . c + q . mean, in the latent space
            q_latent = qw @ basis.query_basis.to(work)
            mean = (qw * basis.query_mean.to(work).unsqueeze(1)).sum(-1)  # [batch, heads, 1]
            groups = basis.query_groups
            scores.append(grouped_scores(q_latent, seen.key_coeffs.to(work)) + mean.view(
                mean.shape[0], -1, groups, 1))
        if seen.recent_keys.shape[2]:
            scores.append(grouped_scores(qw, seen.recent_keys.to(work)))
        return scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)

    def approximate_scores(self, lp, q, cos, sin, coeffs, positions):
        basis = lp.keys.basis
        q_latent = basis.project_queries(q)[:, :, 0, : coeffs.shape[-1]]
        # q . mean differs between the query heads of one KV head, which keeps the best for any of them: kept
        return kernels.latent_scores(q_latent.float(), coeffs.float(), basis.query_groups) + \
            basis.mean_scores(q)[:, :, 0].float()

    def cached_keys_as_rotated(self, lp, keys, positions):
        return keys


MODES: dict[str, Mode] = {mode.name: mode for mode in (PreRoPE(), PostRoPE())}
