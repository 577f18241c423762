"""Research: where Gemma 3 270M's perplexity goes at 8x, measured part by part.

    .venv/bin/python -m evals gemma-loss --out evals/results/gemma3 --threads 2   # about 12 minutes on 2 quiet cores

The shipped Gemma 3 artifact (`patchkv calibrate`'s defaults) without its step scales, so the bit allocation alone
differs between rows; the model in bfloat16; token perplexity through the `LatentCache`, 64 tokens per forward, of
2,048 tokens of the report's held-out prose (`patchkv.report.default_text`) unless a row says otherwise; the 8x
budget is `parse_budget("8x")` at that context (4 sinks and a 32-token window exact, the global pool). Parts, one
CSV row each (`loss_sources.csv`, + provenance sidecar):

- `spectrum`: how compressible each model's keys and values are, from the artifacts alone (SmolLM2 beside Gemma):
  the relative squared error of the Gaussian-matched codes at 2 bits per element, each head's bits by dynamic
  programming on its eigenvalues (`allocate_bits`), mean over layers and heads;
- `exact`: every component at 8 bits, the quantizer's range as calibrated and 1.5x wider (how much clipping costs);
- `window`: exact window against code bits at about the same bytes (window 32/64/128/256 at the 8x bits, twice
  the bits at window 32);
- `group`: one layer's keys or values coded at the 8x allocation, every other part at 8 bits with a 1.5x range
  (as good as exact), on 2,048 tokens of the calibration mix (`patchkv.texts.default_texts`): the measured loss
  against the effect weights' prediction (`sum_j weight_j x eigenvalue_j x GAUSSIAN_MSE[bits_j]`, nats);
- `allocation`: the 8x pool reallocated with each group's effect weights scaled by its measured / predicted loss
  (from `group`, so measured on calibration text), scored on the held-out prose beside the shipped allocation;
- `tier`: a simulation of a high-rate class for the newest middle tokens (those that just left the window): the
  last `tier` tokens of each layer's middle read from their exact keys and values coded at twice the bits (a probe
  that overrides the dense operands of `patchkv.attention`, so only the multi-token path; nothing of it ships),
  their extra bytes counted per layer by the tokens the layer holds.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch

import patchkv
import patchkv.attention as attention
import patchkv.methods.quantized as quantized
from patchkv.allocation import allocate_to_bytes, bit_allocation, cost_variances
from patchkv.artifact import KINDS, Artifact
from patchkv.allocation import code_bytes
from patchkv.budgets import exact_tokens, parse_budget
from patchkv.cache import LatentLayer
from patchkv.methods import Quantized, SinksWindow
from patchkv.perplexity import token_nll
from patchkv.quantize import GAUSSIAN_MSE, GAUSSIAN_STEP, allocate_bits
from patchkv.report import default_text
from patchkv.texts import default_texts

from .suite import BASES, GEMMA3_BASES, RESULTS, load_gemma3, perplexity_fields, text_ids, write_csv
from .verbs import parse, parser

ARTIFACT = GEMMA3_BASES / "pre_rope.safetensors"
CHUNK = 64
FINE = 8  # bits per component that stand in for exact (with a range 1.5x the calibrated one)
MSE = torch.tensor(GAUSSIAN_MSE, dtype=torch.float64)


def without_step_scales(a: Artifact) -> Artifact:
    parts = {k: dataclasses.replace(getattr(a, k), step_scales=None) for k in KINDS}
    return Artifact(mode=a.mode, model=a.model, calibration=a.calibration, step_budgets=None,
                    **parts).with_sliding_windows(a.sliding_windows)


@contextmanager
def coded_with(bits: tuple[torch.Tensor, torch.Tensor] | None, scales: tuple[float, float] | torch.Tensor | None):
    """`Quantized` codes with these bits per component `[L, H, d]` (keys, values) and step scales (one per kind, or
    `[2, L, H]`) instead of the artifact's allocation (None: the artifact's)."""
    with ExitStack() as stack:
        if bits is not None:
            stack.enter_context(mock.patch.object(quantized, "bit_allocation", lambda *a, **k: bits))
        if scales is not None:
            table = scales if torch.is_tensor(scales) else torch.tensor(scales).view(2, 1, 1)
            stack.enter_context(mock.patch.object(quantized, "step_scales_for", lambda art, *a: tuple(
                table.expand(2, art.num_layers, art.num_kv_heads))))
        yield


def fake_code(x: torch.Tensor, components, layer: int, bits: torch.Tensor) -> torch.Tensor:
    """x `[batch, kv_heads, n, d]` through the Gaussian-matched codes of `bits` `[kv_heads, d]` on the layer's basis
    (what `QuantizedCodec` stores, computed densely in float64), back in x's dtype."""
    out = x.double().clone()
    step_of = torch.tensor((0.0, *GAUSSIAN_STEP[1:]), dtype=torch.float64)
    for h in range(x.shape[1]):
        vectors, mean = components.eigenvectors[layer, h].double(), components.mean[layer, h].double()
        b = bits[h]
        levels, step = 2.0 ** b.double(), step_of[b] * components.eigenvalues[layer, h].double().clamp_min(0).sqrt()
        c = (out[:, h] - mean) @ vectors
        level = torch.floor(c / step.clamp_min(1e-30) + levels / 2).clamp(torch.zeros_like(levels), levels - 1)
        out[:, h] = torch.where(b > 0, (level + 0.5 - levels / 2) * step, torch.zeros_like(c)) @ vectors.T + mean
    return out.to(x.dtype)


@contextmanager
def recency_tier(artifact: Artifact, tier: int, bits: tuple[torch.Tensor, torch.Tensor]):
    """The probe of the `tier` part: each layer's exact keys and values recorded as they arrive, and the last `tier`
    middle tokens of every multi-token forward's dense operands replaced by those coded at `bits`."""
    history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    append, dense = LatentLayer.append, attention.dense

    def recording_append(layer, keys, values, positions):
        history.setdefault(layer.patch.layer_idx, []).append((keys, values))
        return append(layer, keys, values, positions)

    def tiered_dense(lp, seen, dtype, chosen=None):
        keys, values = dense(lp, seen, dtype, chosen)
        if seen.middle_len and chosen is None:
            i, ns, nm = lp.layer_idx, seen.sink_keys.shape[2], seen.middle_len
            positions = seen.middle_positions[:, -tier:]
            n = positions.shape[1]
            k_all, v_all = (torch.cat(parts, dim=2) for parts in zip(*history[i]))
            k = fake_code(k_all[:, :, positions[0]], artifact.keys, i, bits[0][i])
            v = fake_code(v_all[:, :, positions[0]], artifact.values, i, bits[1][i])
            keys[:, :, ns + nm - n:ns + nm] = lp.patch.mode.exact_keys(lp, k, positions).to(keys.dtype)
            values[:, :, ns + nm - n:ns + nm] = v.to(values.dtype)
        return keys, values

    with mock.patch.object(LatentLayer, "append", recording_append), mock.patch.object(attention, "dense", tiered_dense):
        yield


def main(argv: list[str] | None = None) -> None:
    p = parser("gemma-loss", __doc__, out=RESULTS / "gemma3")
    p.add_argument("--context", type=int, default=2048)
    args = parse(p, argv)
    model, tokenizer = load_gemma3()
    artifact = without_step_scales(Artifact.load(ARTIFACT))
    name, text = default_text()
    held_out = text_ids(tokenizer, text, args.context)
    calibration = text_ids(tokenizer, "\n\n".join(default_texts()), args.context)
    context = held_out.shape[1]
    eight = parse_budget("8x").methods(artifact, context)
    bits8 = eight[1].bits
    allocation = bit_allocation(artifact, bits8, "global")
    fine = tuple(torch.full_like(b, FINE) for b in allocation)
    rows: list[dict] = []
    base = {key: token_nll(model, ids, CHUNK).perplexity for key, ids in (("prose", held_out),
                                                                          ("calibration", calibration))}

    def record(part: str, configuration: str, methods, ids_key: str = "prose", bits=None, scales=None,
               extra_bytes: float = 0.0, **fields) -> float:
        with coded_with(bits, scales), patchkv.patched(model, artifact, methods):
            scored = token_nll(model, held_out if ids_key == "prose" else calibration, CHUNK)
        rows.append({"part": part, "configuration": configuration, "text": name if ids_key == "prose" else
                     "calibration mix", "context": context,
                     **perplexity_fields(scored, base[ids_key], context, extra_bytes),
                     "predicted_nats": fields.get("predicted", ""), "measured_nats": fields.get("measured", "")})
        print(rows[-1], flush=True)
        write_csv(rows, args.out / "loss_sources.csv")
        return scored.perplexity

    for label, path in (("SmolLM2-135M-Instruct", BASES / "pre_rope.safetensors"), ("gemma-3-270m", ARTIFACT)):
        a = Artifact.load(path)
        for kind, c in (("keys", a.keys), ("values", a.values)):
            lam = c.eigenvalues.double().clamp_min(0)
            error = (lam * MSE[allocate_bits(lam, 2 * a.head_dim)]).sum(-1) / lam.sum(-1)
            rows.append({"part": "spectrum", "configuration": f"{label} {kind}: relative error at 2 bits/element",
                         "text": "", "context": "", "kv_bytes_per_token": "", "perplexity": "",
                         "change_pct": round(100 * float(error.mean()), 2), "predicted_nats": "", "measured_nats": ""})
    sinks_window = SinksWindow(4, 32)
    record("exact", f"every component {FINE} bits, range as calibrated", eight, bits=fine)
    record("exact", f"every component {FINE} bits, range 1.5x", eight, bits=fine, scales=(1.5, 1.5))
    record("window", f"8x: window 32, {bits8} bits", eight)
    for window in (64, 128, 256):
        record("window", f"window {window}, {bits8} bits", [SinksWindow(4, window), eight[1]])
    record("window", f"window 32, {2 * bits8} bits", [sinks_window, Quantized(2 * bits8, pool="global")])

    # one group at a time on calibration text; the others fine with a wide range
    predicted, measured = {}, {}
    weights = [cost_variances(c) for c in (artifact.keys, artifact.values)]
    fine_ppl = record("group", "every part fine (reference)", eight, "calibration", bits=fine, scales=(1.5, 1.5))
    for layer in range(artifact.num_layers):
        for k, kind in enumerate(KINDS):
            bits = [f.clone() for f in fine]
            bits[k][layer] = allocation[k][layer]
            scales = torch.full((2, artifact.num_layers, artifact.num_kv_heads), 1.5)
            scales[k, layer] = 1.0
            predicted[layer, k] = float((weights[k][layer] * MSE[allocation[k][layer]]).sum())
            ppl = record("group", f"layer {layer} {kind} at 8x ({int(allocation[k][layer].sum())} bits)", eight,
                         "calibration", bits=tuple(bits), scales=scales, predicted=round(predicted[layer, k], 5))
            measured[layer, k] = math.log(ppl / fine_ppl)
            rows[-1]["measured_nats"] = round(measured[layer, k], 5)
    write_csv(rows, args.out / "loss_sources.csv")

    floor = 1e-3  # nats: a group measured at or below zero keeps a small weight
    costs = [weights[k][layer].flatten() * max(measured[layer, k], floor) / predicted[layer, k]
             for layer in range(artifact.num_layers) for k in range(2)]
    groups = allocate_to_bytes(costs, bits8 * artifact.num_layers * artifact.num_kv_heads * 2 // 8)
    shape = allocation[0].shape
    refit = tuple(torch.stack(groups[k::2]).view(shape) for k in range(2))
    record("allocation", "8x, effect weights (shipped)", eight)
    record("allocation", "8x, effect weights scaled by measured / predicted group loss", eight, bits=refit)

    # the tier's extra bytes: its tokens' codes at the high rate instead of the base one, per layer held tokens
    held = [context if w is None else min(context, w - 1) for w in artifact.sliding_windows]
    coded = [h - exact_tokens(h, context, 4, 32) for h in held]
    high = code_bytes(artifact, 2 * bits8, "global")

    def extra(tier: int, base_bits: int) -> float:
        low = code_bytes(artifact, base_bits, "global")
        return sum(min(tier, n) * (hi - lo) for n, hi, lo in zip(coded, high, low)) / context

    def codes(base_bits: int) -> float:
        return sum(n * b for n, b in zip(coded, code_bytes(artifact, base_bits, "global"))) / context

    double = bit_allocation(artifact, 2 * bits8, "global")
    for tier in (96, 224):
        for base_bits in (bits8, max(b for b in range(1, bits8 + 1) if codes(b) + extra(tier, b) <= codes(bits8))):
            with recency_tier(artifact, tier, double):
                record("tier", f"newest {tier} middle tokens at {2 * bits8} bits, the rest at {base_bits}",
                       [sinks_window, Quantized(base_bits, pool="global")], extra_bytes=extra(tier, base_bits))

if __name__ == "__main__":
    main()
