"""Effect-weighted transform coding: one global bit pool over every coded component.

The error that matters for a cached key or value is not its squared error but its effect on what the model
computes. With a positive semi-definite weight `W` per vector space (for example the Fisher matrix
E[g g^T] of the loss gradient with respect to the cached vector, the query covariance for keys, or
W_o^T W_o for values), the expected cost of an error e is e^T W e. Writing W = L L^T, the coordinates
z = L^T (x - mean) turn that cost into a plain squared error, so the optimal orthogonal transform is the PCA
of z (eigenvectors of L^T C L), and its eigenvalues are the variances *in cost units*: they can be compared
across layers, heads, keys and values, and bits can be allocated from one pool.

Each component with cost-variance `lam` coded at b bits by the uniform quantizer matched to a Gaussian
(patchkv.quantize.GAUSSIAN_STEP) costs lam * GAUSSIAN_MSE[b] (b = 0 drops it). These distortion steps are
strictly decreasing and convex in b, so taking the `budget` largest marginal gains
lam_c * (GAUSSIAN_MSE[b] - GAUSSIAN_MSE[b + 1]) over all (component, b) is an exact optimum of the integer
allocation (the gains of each component are already sorted, so a greedy choice is always feasible).

Over an artifact (`bit_allocation`), the bits of `Quantized(bits, pool)` come from one of two pools (`POOLS`):
"head" (each head's own budget) or "global" (one pool by effect weight), on one of two bases (`BASES`): "head" (the
per-head PCA) or "layer" (one PCA per layer over its KV heads concatenated, `layer_bit_allocation`). This module
also counts the bytes per
token a budget holds (`kv_bytes_per_token`, `compression_ratio`) and picks the step scales a budget codes with
(`step_scales_for`, from the artifact's typed `step_budgets`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .artifact_format import MAX_BITS, POOLS
from .quantize import GAUSSIAN_MSE, allocate_bits

if TYPE_CHECKING:  # this module sits below patchkv.artifact, which shows a compression ratio
    from .artifact import Artifact, Components

#: what `Quantized` codes on: each KV head's own basis, or one basis per layer shared by its KV heads
BASES = ("head", "layer")
#: a budget's step scales serve a `Quantized` budget of the same pool within this factor of its bits
STEP_BUDGET_REACH = 1.5


def marginal_gains(eigenvalues: torch.Tensor, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Distortion saved by each extra bit: `[n]` -> `[n, max_bits]`, entry (c, b) = lam_c * (D[b] - D[b+1])."""
    mse = torch.tensor(GAUSSIAN_MSE[: max_bits + 1], dtype=torch.float64)
    return eigenvalues.double().clamp_min(0)[:, None] * (mse[:-1] - mse[1:])[None, :]


def allocate_bits_global(eigenvalues: torch.Tensor, budget: int, max_bits: int = MAX_BITS,
                         prices: torch.Tensor | None = None) -> torch.Tensor:
    """Bits per component minimising sum_c eigenvalues[c] * GAUSSIAN_MSE[b_c] subject to sum_c b_c <= budget
    (with `prices`: sum_c prices[c] * b_c <= budget).

    eigenvalues: `[n]` cost-variances of every component in the pool (all layers, heads, keys and values
    concatenated; they must share one unit, e.g. nats from effect weights, `cost_variances`). budget: total
    bits (0 <= budget; at most n * max_bits are used). prices: `[n]` > 0, what a bit of each component costs
    (a component of a layer that holds fewer tokens costs less, `layer_prices`); None: 1 each. Returns int64
    `[n]`. The bits of the largest marginal gains per price (ties broken towards the lower index, then fewer
    bits), taken in that order while the budget lasts: exact without prices, because each component's gains
    decrease with b; with prices the greedy optimum of the knapsack, short of the exact one by at most the last
    bit's gain.
    """
    if eigenvalues.dim() != 1:
        raise ValueError(f"eigenvalues must be 1-d [n], got shape {tuple(eigenvalues.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    n = eigenvalues.shape[0]
    gains = marginal_gains(eigenvalues, max_bits)                    # [n, max_bits]
    if prices is not None:
        gains = gains / prices.double()[:, None]
    # stable descending sort: equal gains keep (component, bit) order, so a component's bits stay a prefix
    order = torch.sort(gains.flatten(), descending=True, stable=True).indices   # index c * max_bits + b
    if prices is None:
        order = order[:min(int(budget), n * max_bits)]
    else:
        order = order[prices.double()[order // max_bits].cumsum(0) <= budget]
    return torch.bincount(order // max_bits, minlength=n).to(torch.int64)


def allocate_bits_grouped(eigenvalues: list[torch.Tensor], budget: int, max_bits: int = MAX_BITS,
                          prices: list[float] | None = None) -> list[torch.Tensor]:
    """`allocate_bits_global` over a list of groups (e.g. one per layer, head and K/V): `[n_g]` each -> bits `[n_g]`;
    `prices` one per group (what a bit of its components costs), None for 1 each."""
    sizes = [int(e.numel()) for e in eigenvalues]
    each = None if prices is None else torch.cat([torch.full((size,), float(p)) for size, p in zip(sizes, prices)])
    bits = allocate_bits_global(torch.cat([e.flatten() for e in eigenvalues]), budget, max_bits, each)
    return list(torch.split(bits, sizes))


def allocate_to_bytes(costs: list[torch.Tensor], byte_budget: int, max_bits: int = MAX_BITS,
                      prices: list[float] | None = None) -> list[torch.Tensor]:
    """Bits per component for groups that are each packed to whole bytes (one group = one layer's key or value
    codes), with at most `byte_budget` bytes in all: sum_g ceil(sum(bits_g) / 8) <= byte_budget (with `prices`,
    one per group: sum_g prices[g] * ceil(sum(bits_g) / 8) <= byte_budget).

    costs: one `[n_g]` tensor of cost-variances per group (one shared unit). The pool is the largest number of
    bits whose global allocation fits once each group is rounded up to whole bytes (found by bisection: the
    greedy allocation only grows with the pool); then each group's padding bits (up to 7) go to its own best
    next bits, so no byte holds bits it could use. Returns int64 `[n_g]` per group.
    """
    if byte_budget < 0:
        raise ValueError(f"byte_budget must be >= 0, got {byte_budget}")
    weights = [1.0] * len(costs) if prices is None else prices

    def used_bytes(budget: int) -> float:
        return sum(w * -(-int(b.sum()) // 8) for w, b in zip(weights, allocate_bits_grouped(costs, budget, max_bits,
                                                                                              prices)))

    low, high = 0, byte_budget * 8  # used_bytes(0) == 0 fits; find the largest pool that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if used_bytes(mid) <= byte_budget + 1e-9 else (low, mid - 1)
    bits = allocate_bits_grouped(costs, low, max_bits, prices)
    for cost, b in zip(costs, bits):
        gains = marginal_gains(cost.flatten(), max_bits)
        rows = torch.arange(len(b))
        for _ in range(-int(b.sum()) % 8):
            room = b < max_bits
            if not room.any():
                break
            nxt = torch.where(room, gains[rows, b.clamp(max=max_bits - 1)], -1.0)
            b[int(nxt.argmax())] += 1
    return bits


# ----- budgets over an artifact: bits per component, bytes per token, step scales ---------------------------------
def default_pool(artifact: Artifact) -> str:
    """"global" when the artifact has effect weights (the pool by expected loss), else "head"."""
    return "global" if artifact.has_effect_weights else "head"


def held_tokens(artifact: Artifact, context: int) -> list[int]:
    """Tokens each layer's cache holds after `context` tokens: all of them, or a sliding-window layer's last
    `window - 1` (`Artifact.sliding_windows`)."""
    return [context if window is None else min(context, window - 1) for window in artifact.sliding_windows]


def layer_prices(artifact: Artifact, context: int | None) -> list[float] | None:
    """What a bit of one token's code costs in each layer at `context` tokens, relative to the mean over layers:
    the tokens the layer holds (`held_tokens`) over the mean held, so a sliding-window layer's bits are cheaper
    when the context is longer than its window. None when every layer holds the same (or `context` is None)."""
    if context is None:
        return None
    held = held_tokens(artifact, context)
    if len(set(held)) == 1:
        return None
    mean = sum(held) / len(held)
    return [h / mean for h in held]


def cost_variances(components: Components) -> torch.Tensor:
    """What dropping each component costs, in nats per token (eigenvalue x effect weight): `[L, H, d]` float64.
    Needs effect weights."""
    return components.eigenvalues.double().clamp_min(0) * components.weights.double()


def bit_allocation(artifact: Artifact, bits: int, pool: str = "head", context: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bits per component `[layers, kv_heads, head_dim]` int64 for keys and for values, `bits` per head and token
    on average: what `Quantized(bits, pool, context=context)` codes with.

    pool="head": exactly `bits` for every head's keys and every head's values, by dynamic programming on that
    head's eigenvalues (`patchkv.quantize.allocate_bits`). pool="global": one pool of
    `bits x layers x kv_heads x 2` bits shared by every layer, head, key and value, allocated on the
    cost-variances (`cost_variances`) so the expected loss increase is minimal, with each layer's key and value
    codes packed to whole bytes within the pool (`allocate_to_bytes`); needs an artifact with effect weights.
    With `context`, a bit of the global pool costs what the layer holds at that context (`layer_prices`): the
    average is over the tokens the cache holds, and a sliding-window layer gets more bits per token.
    """
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}.")
    dim = artifact.head_dim
    if not 1 <= bits <= dim * MAX_BITS:
        raise ValueError(f"bits per head must be in [1, {dim * MAX_BITS}] for head_dim={dim}, got {bits}.")
    if pool == "head":
        return allocate_bits(artifact.keys.eigenvalues, bits), allocate_bits(artifact.values.eigenvalues, bits)
    if not artifact.has_effect_weights:
        raise ValueError("pool='global' allocates bits by effect weights, and this artifact has none (format "
                         "version 1). Recalibrate with effect weights: patchkv.calibrate(..., fisher_tokens=8192) "
                         "or `patchkv calibrate --fisher-tokens 8192`; or use pool='head'.")
    layers, heads = artifact.num_layers, artifact.num_kv_heads
    per_kind = [cost_variances(c) for c in (artifact.keys, artifact.values)]
    prices = layer_prices(artifact, context)
    groups = allocate_to_bytes([c[layer].flatten() for layer in range(layers) for c in per_kind],
                               bits * layers * heads * 2 // 8, prices=None if prices is None else
                               [p for p in prices for _ in per_kind])
    keys = torch.stack([groups[2 * layer] for layer in range(layers)]).view(layers, heads, dim)
    values = torch.stack([groups[2 * layer + 1] for layer in range(layers)]).view(layers, heads, dim)
    return keys, values


def layer_bit_allocation(artifact: Artifact, bits: int, pool: str = "head", context: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bits per layer component `[layers / S, S * kv_heads * head_dim]` int64 for keys and for values, on the
    artifact's layer bases, each spanning S layers (format version 5: S = 1; version 7: S > 1): what
    `Quantized(bits, pool, basis="layer")` codes with, `bits` per head and token on average as `bit_allocation`
    spends them. pool="head": `bits x kv_heads x S` for each basis' keys and for its values, by dynamic programming on
    its eigenvalues; pool="global": one pool over every basis, key and value on eigenvalue x the components' effect
    weights (`layer_weights`: the span's whole Fisher matrix, cross-head and cross-layer terms included), each
    basis' key and value codes packed to whole bytes, priced by `context` as `bit_allocation` does (S = 1 only)."""
    if not artifact.has_layer_bases:
        raise ValueError("basis='layer' codes on the artifact's layer bases, and this artifact has none (format "
                         f"version {artifact.format_version}). Recalibrate with patchkv.calibrate(..., "
                         "layer_bases=True), or use basis='head'.")
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}.")
    layers, heads, dim = artifact.num_layers, artifact.num_kv_heads, artifact.head_dim
    if not 1 <= bits <= dim * MAX_BITS:
        raise ValueError(f"bits per head must be in [1, {dim * MAX_BITS}] for head_dim={dim}, got {bits}.")
    parts, span = (artifact.keys, artifact.values), artifact.layers_per_basis
    if pool == "head":
        return tuple(allocate_bits(c.layer_eigenvalues, bits * heads * span) for c in parts)
    if not artifact.has_effect_weights:
        raise ValueError("pool='global' allocates bits by effect weights, and this artifact has none; recalibrate "
                         "with fisher_tokens=8192, or use pool='head'.")
    costs = [c.layer_eigenvalues.double().clamp_min(0) * c.layer_weights.double() for c in parts]
    prices = layer_prices(artifact, context)
    if prices is not None and span > 1:
        raise ValueError(f"a pool priced by the tokens each layer holds needs one basis per layer; this artifact's "
                         f"layer bases span {span} layers: pass context=None (every layer priced alike).")
    groups = allocate_to_bytes([c[unit] for unit in range(layers // span) for c in costs],
                               bits * layers * heads * 2 // 8,
                               prices=None if prices is None else [p for p in prices for _ in costs])
    return torch.stack(groups[0::2]), torch.stack(groups[1::2])


def full_kv_bytes_per_token(artifact: Artifact, element_size: int | None = None) -> int:
    """Bytes per token of the uncompressed cache: 2 (K and V) x layers x KV heads x head_dim x `element_size`
    (default: that of the artifact's model dtype)."""
    size = artifact.element_size if element_size is None else element_size
    return 2 * artifact.num_layers * artifact.num_kv_heads * artifact.head_dim * size


def code_bytes(artifact: Artifact, bits: int, pool: str = "head", basis: str = "head", context: int | None = None
               ) -> list[int]:
    """Bytes of one token's codes in each layer, keys and values (each rounded up to whole bytes), for
    `Quantized(bits, pool, basis, context)`: on layer bases across layers, a span's at its last layer (which holds
    them, `patchkv.cache`) and none at its others."""
    allocate = layer_bit_allocation if basis == "layer" else bit_allocation
    keys, values = allocate(artifact, bits, pool, context)
    held = [-(-int(k.sum()) // 8) - (-int(v.sum()) // 8) for k, v in zip(keys, values)]
    if basis != "layer" or artifact.layers_per_basis == 1:
        return held
    out = [0] * artifact.num_layers
    for layers, n in zip(artifact.layer_groups, held):
        out[layers[-1]] = n
    return out


def kv_bytes_per_token(artifact: Artifact, bits: int | None = None, pool: str = "head", basis: str = "head") -> int:
    """Bytes per token of the latent cache, over every layer: the kept components of K and V (`ranks`) in the
    model dtype, summed over layers and heads; with `bits`, the codes of `Quantized(bits, pool, basis)`
    (`code_bytes`)."""
    if bits is None:
        return int(artifact.keys.ranks.sum() + artifact.values.ranks.sum()) * artifact.element_size
    return sum(code_bytes(artifact, bits, pool, basis))


def compression_ratio(artifact: Artifact, bits: int | None = None, pool: str = "head") -> float:
    """`full_kv_bytes_per_token` / `kv_bytes_per_token(bits, pool)`."""
    return full_kv_bytes_per_token(artifact) / kv_bytes_per_token(artifact, bits, pool)


def step_scales_for(artifact: Artifact, bits: int, pool: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step scales (keys, values) `[L, H]` that `Quantized(bits, pool)` codes with, from the artifact's typed
    `step_budgets`: those fitted for that budget, else for the nearest budget of the same pool within a factor
    `STEP_BUDGET_REACH` of its bits; None if there is none (the Gaussian-matched range). A budget of the other pool
    never serves: the pools give the same components different bits (on SmolLM2, global-pool scales cost the
    per-head pool +21% perplexity)."""
    if not artifact.has_step_scales:
        return None
    near = [(abs(math.log(b / bits)), i) for i, (b, p) in enumerate(artifact.step_budgets)
            if p == pool and max(b / bits, bits / b) <= STEP_BUDGET_REACH]
    if not near:
        return None
    index = min(near)[1]
    return artifact.keys.step_scales[index], artifact.values.step_scales[index]
