"""What attention reads, assembled in one place from what a layer of the cache hands out (`patchkv.visible.Visible`,
the middle as stored):

- `dense`: the visible tokens as attention reads them, keys and values `[batch, kv_heads, n, head_dim]`: the
  mode's keys (rotated pre-RoPE), the middle and the near tokens rebuilt from what is stored, each KV head's salient tokens written in
  place of their codes (`overlay`), or top-k's chosen tokens in place of the middle. The operands of a forward of
  several queries (`patchkv.attention`), and what `LatentLayer.update` returns (the `transformers` layer contract);
- `unpatched`: a layer's keys or values as the unpatched model would hold them (`LatentLayer.keys` / `.values`).

The layer stores and hands out what it holds; the mode (`patchkv.key_space`) is read here, never by the storage.
"""

from __future__ import annotations

import torch

from .key_space import rebuild
from .patch import LayerPatch
from .visible import Visible


def dense(lp: LayerPatch, seen: Visible, dtype: torch.dtype,
          chosen: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The visible tokens as attention reads them: keys (rotated as the mode wants, the middle rebuilt from what is
    stored) and values, `[batch, kv_heads, n, head_dim]` in `dtype`, sinks, middle, near tokens and window in position
    order.
    chosen: the middle's keys and values replaced by each KV head's selected tokens (top-k)."""
    mode = lp.patch.mode
    coded_keys, coded_values = [], []  # the middle (or top-k's chosen tokens), then the near tokens
    if chosen is not None:
        coded_keys.append(chosen[0].to(dtype))
        coded_values.append(chosen[1].to(dtype))
    elif seen.middle_len:
        coded_keys.append(mode.middle_keys(lp, seen, dtype))
        coded_values.append(rebuild(lp.values, seen.middle_values, dtype))
    if seen.near_len:  # the near tokens, a middle of their own read with the near codecs
        near_lp, near = lp.near(), seen.near()
        coded_keys.append(mode.middle_keys(near_lp, near, dtype))
        coded_values.append(rebuild(near_lp.values, near.middle_values, dtype))
    coded_keys, coded_values = _joined(coded_keys), _joined(coded_values)
    if chosen is None and seen.salient_len:  # each KV head's exact tokens in place of their codes
        salient_keys = mode.exact_keys(lp, seen.salient_keys.to(dtype), seen.salient_positions)
        coded_keys = overlay(coded_keys, salient_keys, seen.salient_index)
        coded_values = overlay(coded_values, seen.salient_values.to(dtype), seen.salient_index)
    keys = [mode.exact_keys(lp, seen.sink_keys.to(dtype), seen.sink_positions), coded_keys,
            mode.exact_keys(lp, seen.window_keys.to(dtype), seen.window_positions)]
    values = [seen.sink_values.to(dtype), coded_values, seen.window_values.to(dtype)]
    return _joined(keys), _joined(values)


def unpatched(lp: LayerPatch, held: Visible, kind: str) -> torch.Tensor:
    """The tokens `held` (a layer's, as `LatentLayer` holds them) as the unpatched model would cache them: keys
    (`kind` "keys", rotated) or values ("values") `[batch, kv_heads, n, head_dim]` in the exact regions' dtype, the
    middle reconstructed from what is stored and each KV head's salient tokens written in place of their codes."""
    sinks, middle, window = (getattr(held, f"{region}_{kind}") for region in ("sink", "middle", "window"))
    coded, positions = [rebuild(getattr(lp, kind), middle, sinks.dtype)], [held.sink_positions, held.middle_positions]
    if held.near_len:
        coded.append(rebuild(getattr(lp, f"near_{kind}"), getattr(held, f"near_{kind}"), sinks.dtype))
        positions.append(held.near_positions)
    coded = _joined(coded)
    if held.salient_len:
        coded = overlay(coded, getattr(held, f"salient_{kind}"), held.salient_index)
    full = torch.cat([sinks, coded, window], dim=2)
    if kind == "keys":
        positions = torch.cat([*positions, held.window_positions], dim=1)
        full = lp.patch.mode.cached_keys_as_rotated(lp, full, positions)
    return full


def overlay(coded: torch.Tensor, exact: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The coded tokens rebuilt (middle, then near tokens) `[batch, kv_heads, m, head_dim]` with each KV head's tokens
    at `index` `[batch, kv_heads, s]` replaced by `exact` `[batch, kv_heads, s, head_dim]` (a new tensor)."""
    return coded.scatter(2, index.unsqueeze(-1).expand(-1, -1, -1, coded.shape[-1]), exact.to(coded.dtype))


def _joined(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Concatenate along the token axis, skipping empty parts (no copy when one part holds every token); None when
    there are none."""
    kept = [p for p in parts if p is not None and p.shape[2]]
    if not kept:
        return next((p for p in parts if p is not None), None)
    return kept[0] if len(kept) == 1 else torch.cat(kept, dim=2)
