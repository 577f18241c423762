"""Research: would a basis shared across heads, or across layers and heads (KVTC's), beat per-head bases at equal bits?

    .venv/bin/python -m evals shared-basis --out evals/results    # about 6 minutes on one core

SmolLM2-135M-Instruct in float32. The vectors the cache holds in pre-RoPE mode (k_proj outputs: un-rotated keys;
v_proj outputs: values) are collected on `--fit-rows` + `--test-rows` sequences of 512 tokens of the general
calibration mix (the first 4 positions of each left out, as calibration leaves the sinks out). For each grouping
of the `[layers, kv_heads, head_dim]` vectors, a plain PCA is fitted per group on the first rows; the bits of a
budget (`bits x layers x kv_heads` per token for keys, the same for values, as `Quantized(bits, pool="global")`
spends them) are allocated over every group's components at once (`patchkv.allocation.allocate_bits_global`, on
the fitted variances); the distortion is measured on the held-out rows as each component's held-out variance
times the Gaussian quantizer's error at its bits (`GAUSSIAN_MSE`), relative to the held-out total variance.

Groupings: `head` (what patchkv ships: one basis per layer and KV head, 64 dims), `layer` (one per layer, its
heads concatenated: 192 dims), `layers2` / `layers5` (one per 2 or 5 consecutive layers), `layers30` (one basis
over every layer and head: 5,760 dims, KVTC). What this does not measure: the effect on the model's loss
(distortion here is plain squared error, not effect-weighted), nor the cost of decoding a shared latent (a
layer reads a latent as wide as its group's). Results: `shared_basis.csv` (+ provenance sidecar).

End to end, by simulation (`--docs N`, `shared_basis_ppl.csv`): token perplexity of the first N held-out 4k
documents of each perplexity task (prose, Shakespeare, Milton; `--ppl-tokens` tokens each) when every cached key and
value past the 4 sinks is replaced by its quantized reconstruction on each grouping's bases, at each budget's bits,
in one forward (the keys and values to code come from a clean forward of the document; no exact window; bits
allocated by plain variance, not by effect weight). It compares groupings with each other under the same
simplifications; it is not what `patchkv`'s cache measures (that keeps a 32-token window exact and allocates by
effect weight, and its figures are in smollm2_accuracy.csv).

Needles in real text, by simulation (`--needles N`, `shared_basis_needles.csv`): `needle_text` samples 0 to N-1 at
4k, in the models' dtype (`models_dtype()`), run as the suite runs them (the context in one forward, which reads
itself exact as patchkv's cache does, then the question and a greedy answer reading the cache), with the keys and
values the context left in the cache past the 4 sinks and before its last 32 tokens replaced by their
reconstructions from codes at each of `--needle-budgets`' bits per head (the suite's 4k budgets). The bits are
allocated over every group's components, keys and values together, by effect (variance x effect weight, as the
global pool allocates them); a group component's effect weight is u^T F u, F block-diagonal over the group's heads,
each head's F = E diag(w) E^T from the shipped pre-RoPE artifact's eigenvectors E and effect weights w (no cross-head
or cross-layer terms: those are not measured); steps are the Gaussian-matched ones times the artifact's step scale
for the budget (one per kind). Grouping `shipped` is the artifact's own bases, weights and scales: the codes
`Quantized` builds, which the simulation must reproduce (the suite's records of the same samples: `16x`, `32x`).
Bases of the other groupings are fitted on `--fit-rows` rows of 512 tokens of the calibration mix, in the same dtype.
A budget with `Evict` ("16x+evict") first reads each context through patchkv's own cache under that budget to learn
which tokens its `Evict` drops in each layer (`dropped`); the simulation then codes at that budget's bits and masks
those tokens out of each layer's attention (`Masked`), so `shipped` reproduces the suite's `16x-evict`.

Perplexity read as the suite reads it, by simulation (`--chunked-docs N`, `shared_basis_chunked_ppl.csv`): the first
N 4k documents of each perplexity task fed 64 tokens a forward through the model's own cache, in which, after each
forward, every token past the 4 sinks that has left the last 32 is replaced by its reconstruction from codes (the
keys and values that forward computed, coded as for the needles): what patchkv's cache holds, on each grouping's
bases. `shipped` must reproduce the suite's `16x` / `32x` records of the same documents.

Grouping `spanned` (with `--spanned ARTIFACT`) codes on the layer bases of an artifact calibrated with
`layers_per_basis=S` (`python -m evals calibrate --layer-bases-only --layers-per-basis S`): PCA on the calibration's
65k tokens and effect weights from the span's whole Fisher matrix, cross-layer terms measured, where `layersS`
fits its bases on `--fit-rows` rows and builds its weights from the heads' Fisher matrices alone.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

import patchkv
from patchkv.adapters import adapter_for
from patchkv.allocation import allocate_bits_global, step_scales_for
from patchkv.artifact_format import file_sha256
from patchkv.budgets import parse_budget
from patchkv.methods import Quantized
from patchkv.perplexity import token_nll
from patchkv.quantize import GAUSSIAN_MSE, GAUSSIAN_STEP

from .calibrate_smollm2 import general_mix
from .suite import SMOLLM2, load_artifacts, load_smollm2, models_dtype, text_ids, write_csv
from .tasks import TASKS, greedy_answer, ruler_score
from .verbs import parse, parser

#: the exact regions of the coded simulations: the suite's 4 sinks and 32-token window
SINKS, WINDOW = 4, 32
BUDGETS = (("4x", 249), ("8x", 119), ("16x", 55), ("32x", 23))  # bits per head at 4k, as evals/suite.py runs them
GROUPINGS = ("head", "layer", "layers2", "layers5", "layers30")


@torch.no_grad()
def cached_vectors(model, rows: torch.Tensor, sinks: int = 4) -> dict[str, torch.Tensor]:
    """{"keys", "values"}: float64 `[tokens, layers, kv_heads * head_dim]` of `rows` `[n, seq]`, sinks left out."""
    out: dict[str, list] = {"keys": [], "values": []}
    with Capture(model) as capture:
        for start in range(0, rows.shape[0], 4):
            model(rows[start:start + 4])
            for kind, x in capture.take().items():                     # [batch, seq, layers, width]
                out[kind].append(x[:, sinks:].reshape(-1, *x.shape[2:]))
    return {kind: torch.cat(v) for kind, v in out.items()}


def grouped(x: torch.Tensor, grouping: str, head_dim: int) -> list[torch.Tensor]:
    """`[tokens, layers, width]` -> one `[tokens, dims]` per group of `grouping`."""
    layers, width = x.shape[1], x.shape[2]
    if grouping == "head":
        return [x[:, layer, h * head_dim:(h + 1) * head_dim] for layer in range(layers) for h in range(width // head_dim)]
    size = 1 if grouping == "layer" else int(grouping.removeprefix("layers"))
    return [x[:, start:start + size].reshape(x.shape[0], -1) for start in range(0, layers, size)]


def bases(fit: torch.Tensor, grouping: str, head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(mean `[dims]`, variances `[dims]` descending, components `[dims, dims]`) of each group."""
    out = []
    for x in grouped(fit, grouping, head_dim):
        mean = x.mean(0)
        lam, vec = torch.linalg.eigh((x - mean).T @ (x - mean) / x.shape[0])
        out.append((mean, lam.flip(0).clamp_min(0), vec.flip(1)))
    return out


def spectra(fitted: list, test: torch.Tensor, grouping: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fitted variances, held-out variances) along every group's principal components, concatenated."""
    held = [(((y - mean) @ vec) ** 2).mean(0) for (mean, _, vec), y in zip(fitted, grouped(test, grouping, head_dim))]
    return torch.cat([lam for _, lam, _ in fitted]), torch.cat(held)


def quantized(x: torch.Tensor, fitted: list, bits: torch.Tensor, grouping: str, head_dim: int,
              scale: float = 1.0) -> torch.Tensor:
    """`x` `[tokens, layers, width]` with every group's coefficients coded at `bits` (concatenated over groups, as
    `allocate_bits_global` returns them) by the Gaussian-matched midrise quantizer, its steps times `scale`,
    reconstructed."""
    out, start = [], 0
    for (mean, lam, vec), part in zip(fitted, grouped(x, grouping, head_dim)):
        b = bits[start:start + lam.numel()]
        start += lam.numel()
        levels = (2.0 ** b).double()
        step = torch.tensor([GAUSSIAN_STEP[int(v)] if v else 0.0 for v in b], dtype=torch.float64) * lam.sqrt() * scale
        c = (part - mean) @ vec
        index = torch.floor(c / step.clamp_min(1e-30) + levels / 2).clamp(torch.zeros_like(levels), levels - 1)
        c = torch.where(b > 0, (index + 0.5 - levels / 2) * step, torch.zeros_like(c))
        out.append(mean + c @ vec.T)
    tokens, layers, width = x.shape
    if grouping == "head":
        return torch.stack(out, 1).view(tokens, layers, width)
    return torch.cat([o.view(tokens, -1, width) for o in out], 1)


@torch.no_grad()
def simulated_nll(model, ids: torch.Tensor, coded: dict[str, torch.Tensor], sinks: int = 4) -> tuple[float, int]:
    """(NLL sum, tokens) of `ids` `[1, seq]` with each layer's k_proj / v_proj outputs past `sinks` replaced by
    `coded[kind]` `[seq - sinks, layers, width]`."""
    def replace(layer, kind):
        def hook(module, inputs, output):
            new = output.clone()
            new[0, sinks:] = coded[kind][:, layer].to(output.dtype)
            return new
        return hook
    hooks = [getattr(block.self_attn, proj).register_forward_hook(replace(i, kind))
             for i, block in enumerate(model.model.layers) for proj, kind in (("k_proj", "keys"), ("v_proj", "values"))]
    try:
        logits = model(ids).logits[0, :-1].float()
    finally:
        for h in hooks:
            h.remove()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
    return float(nll), ids.shape[1] - 1


def main(argv: list[str] | None = None) -> None:
    p = parser("shared-basis", __doc__)
    p.add_argument("--fit-rows", type=int, default=32)
    p.add_argument("--test-rows", type=int, default=16)
    p.add_argument("--docs", type=int, default=0, help="held-out documents per domain for the simulated perplexity")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--needles", type=int, default=0, help="needle_text samples for the simulated needles (only)")
    p.add_argument("--needle-indices", default="", help="of the --needles samples, only these (comma-separated)")
    p.add_argument("--chunked-docs", type=int, default=0,
                   help="documents per domain for the simulated perplexity read 64 tokens a forward (only)")
    p.add_argument("--needle-budgets", default="16x,32x", help="the budgets of --needles and --chunked-docs")
    p.add_argument("--needle-groupings", default=",".join(("shipped", *GROUPINGS)),
                   help="the groupings of --needles and --chunked-docs (and 'spanned': the bases of --spanned)")
    p.add_argument("--spanned", default="",
                   help="an artifact whose layer bases span several layers (format version 7), for grouping 'spanned'")
    args = parse(p, argv)
    if args.needles or args.chunked_docs:
        if args.needles:
            needles(args)
        if args.chunked_docs:
            chunked_perplexity(args)
        return
    model, tokenizer = load_smollm2(torch.float32)
    rows = calibration_rows(tokenizer, args.fit_rows + args.test_rows)
    fit, test = cached_vectors(model, rows[:args.fit_rows]), cached_vectors(model, rows[args.fit_rows:])
    head_dim, heads = model.config.head_dim, model.config.num_key_value_heads
    mse = torch.tensor(GAUSSIAN_MSE, dtype=torch.float64)
    out = []
    fitted_bases = {(kind, g): bases(fit[kind], g, head_dim) for kind in ("keys", "values") for g in GROUPINGS}
    for kind in ("keys", "values"):
        for grouping in GROUPINGS:
            fitted, held = spectra(fitted_bases[kind, grouping], test[kind], grouping, head_dim)
            for budget, bits in BUDGETS:
                allocated = allocate_bits_global(fitted, bits * model.config.num_hidden_layers * heads)
                out.append({"kind": kind, "grouping": grouping, "dims_per_group": fitted.numel() // len(
                    grouped(fit[kind][:1], grouping, head_dim)), "budget": budget, "bits_per_head": bits,
                    "relative_distortion": round(float((held * mse[allocated]).sum() / held.sum()), 5),
                    "fit_tokens": fit[kind].shape[0], "test_tokens": test[kind].shape[0]})
                print(out[-1], flush=True)
    write_csv(out, args.out / "shared_basis.csv")
    if args.docs:
        simulate(model, tokenizer, fitted_bases, args, args.out / "shared_basis_ppl.csv")


def calibration_rows(tokenizer, n: int, seq: int = 512) -> torch.Tensor:
    """`[n, seq]` token ids of the general calibration mix, its documents joined by blank lines."""
    mix, docs = general_mix(), 40
    while len(ids := tokenizer("\n\n".join(mix[:docs]), add_special_tokens=False)["input_ids"]) < n * seq:
        if docs >= len(mix):
            raise SystemExit(f"shared-basis: the calibration mix holds {len(ids)} tokens, fewer than {n} rows of {seq}")
        docs *= 2
    return torch.tensor(ids[:n * seq]).view(n, seq)


def group_weights(fitted: list, grouping: str, fisher: torch.Tensor) -> list[torch.Tensor]:
    """Each group's components' effect weights u^T F u `[dims]`, F block-diagonal over the group's (layer, head)
    blocks of `fisher` `[layers, kv_heads, head_dim, head_dim]` (each head's Fisher)."""
    layers, heads = fisher.shape[:2]
    blocks = fisher.reshape(layers * heads, *fisher.shape[2:])
    size = 1 if grouping == "head" else heads * (1 if grouping == "layer" else int(grouping.removeprefix("layers")))
    return [((vec.T @ torch.block_diag(*blocks[g * size:(g + 1) * size])) * vec.T).sum(-1)
            for g, (_, _, vec) in enumerate(fitted)]


class Capture:
    """The k_proj and v_proj outputs (pre-RoPE keys, values) of every layer while active; `take()` returns those of
    the forwards since the last take (of one batch size), float64 `[batch, tokens, layers, width]` each."""

    def __init__(self, model):
        self.model, self.got = model, {"keys": [], "values": []}

    def __enter__(self) -> Capture:
        self.hooks = [getattr(layer.self_attn, proj).register_forward_hook(
            lambda m, i, o, kind=kind: self.got[kind].append(o.detach().double()))
            for layer in self.model.model.layers for proj, kind in (("k_proj", "keys"), ("v_proj", "values"))]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()

    def take(self) -> dict[str, torch.Tensor]:
        layers = len(self.model.model.layers)
        out = {kind: torch.cat([torch.stack(got[f:f + layers], 2) for f in range(0, len(got), layers)], 1)
               for kind, got in self.got.items()}
        self.got = {"keys": [], "values": []}
        return out


def grouped_bases(model, tokenizer, artifact, groupings: list[str], fit_rows: int, spanned=None) -> dict:
    """(kind, grouping) -> (fitted bases as `bases` returns them, each group's effect weights, the form `quantized`
    groups by): `shipped` the artifact's own, `spanned` the layer bases and layer weights of the artifact `spanned`
    (`calibrate(..., layers_per_basis=S)`: PCA and Fisher matrices over S layers, cross-layer terms measured), the
    others fitted on `fit_rows` rows of the calibration mix (module doc)."""
    layers, heads, head_dim = artifact.keys.eigenvalues.shape
    fit = cached_vectors(model, calibration_rows(tokenizer, fit_rows)) \
        if set(groupings) - {"shipped", "spanned"} else None
    out = {}
    for kind in ("keys", "values"):
        c = getattr(artifact, kind)
        mean, lam, vec, w = (t.double() for t in (c.mean, c.eigenvalues, c.eigenvectors, c.weights))
        fisher = vec @ torch.diag_embed(w) @ vec.transpose(-1, -2)
        for grouping in groupings:
            if grouping == "shipped":
                out[kind, grouping] = ([(mean[l, h], lam[l, h], vec[l, h]) for l in range(layers)
                                        for h in range(heads)], list(w.reshape(layers * heads, head_dim)), "head")
            elif grouping == "spanned":
                s = getattr(spanned, kind)
                span = [t.double() for t in (s.layer_mean, s.layer_eigenvalues, s.layer_eigenvectors)]
                out[kind, grouping] = (list(zip(*span)), list(s.layer_weights.double()),
                                       f"layers{spanned.layers_per_basis}")
            else:
                fitted = bases(fit[kind], grouping, head_dim)
                out[kind, grouping] = (fitted, group_weights(fitted, grouping, fisher), grouping)
    return out


def coder(artifact, grouped: dict, grouping: str, budget: str):
    """(bits per head, read, code): `code(keys, values)` `[tokens, layers, width]` -> their reconstructions from codes
    on `grouping`'s bases at `budget`'s bits (allocated by effect over keys and values together, the artifact's step
    scale for the budget, 1 without one); `read` the coded coefficients one query head reads per token and layer,
    keys and values together (its KV head's on per-head bases, its group's on shared ones), averaged over layers:
    the work of a decode step that scores and sums in the latent space."""
    layers, heads, head_dim = artifact.keys.eigenvalues.shape
    bits = next(m.bits for m in parse_budget(budget).methods(artifact, 4096) if isinstance(m, Quantized))
    scales = [float(s.mean()) for s in step_scales_for(artifact, bits, "global") or (torch.ones(1), torch.ones(1))]
    (kb, kw, form), (vb, vw, _) = grouped["keys", grouping], grouped["values", grouping]
    cost = torch.cat([lam * w.clamp_min(0) for (_, lam, _), w in zip(kb + vb, kw + vw)])
    allocated = allocate_bits_global(cost, bits * layers * heads * 2)
    split = sum(lam.numel() for _, lam, _ in kb)
    coded = [int((b > 0).sum()) for b in allocated.split([lam.numel() for _, lam, _ in kb + vb])]
    read = sum(coded) / len(kb)   # every layer of a group (a head: one) reads the group's keys and values

    def code(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (quantized(keys, kb, allocated[:split], form, head_dim, scales[0]),
                quantized(values, vb, allocated[split:], form, head_dim, scales[1]))
    return bits, read, code


def write_codes(model, cache, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Positions `start` onwards of every layer of `model`'s own `cache` replaced by `keys` (pre-RoPE, rotated here
    by the model's rotary embedding, as its adapter rotates) and `values`, `[tokens, layers, heads * head_dim]`."""
    heads, head_dim = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    span = slice(start, start + keys.shape[0])
    cos, sin = (t.double() for t in model.model.rotary_emb(cache.layers[0].keys,
                                                            torch.arange(span.start, span.stop)[None]))
    rotate = adapter_for(model).rotate
    for l, layer in enumerate(cache.layers):
        layer.keys[0, :, span] = rotate(keys[:, l].view(1, -1, heads, head_dim).transpose(1, 2), cos, sin
                                        )[0].to(layer.keys.dtype)
        layer.values[0, :, span] = values[:, l].view(-1, heads, head_dim).transpose(0, 1).to(layer.values.dtype)


def coded_runs(args) -> tuple:
    """(model, tokenizer, the artifact, {(budget, grouping): (bits, read, code)}, the `--spanned` artifact or None)
    for the simulations."""
    model, tokenizer = load_smollm2(models_dtype())
    artifact = load_artifacts()["pre_rope"]
    groupings = args.needle_groupings.split(",")
    if "spanned" in groupings and not args.spanned:
        raise SystemExit("grouping 'spanned' codes on the layer bases of --spanned ARTIFACT; pass one (calibrated with "
                         "`python -m evals calibrate --layer-bases-only --layers-per-basis 5 ...`).")
    spanned = patchkv.Artifact.load(args.spanned) if args.spanned else None
    grouped = grouped_bases(model, tokenizer, artifact, groupings, args.fit_rows, spanned)
    return model, tokenizer, artifact, {(budget, grouping): coder(artifact, grouped, grouping, budget)
                                        for budget in args.needle_budgets.split(",") for grouping in groupings}, spanned


def inputs(args, spanned) -> dict:
    """What a simulation's results were made from, beyond the command: the rows the fitted bases were fitted on and
    the `--spanned` artifact's file hash and span (`spanned`, the artifact as loaded, or None)."""
    out = {"fit_rows": args.fit_rows}
    if spanned is not None:
        out["spanned"] = {"file_sha256": file_sha256(args.spanned), "layers_per_basis": spanned.layers_per_basis}
    return out


def dropped(model, artifact, budget: str, context: torch.Tensor) -> list[torch.Tensor] | None:
    """Per layer, bool `[n]`: the tokens of `context` `[1, n]` that patchkv's cache under `budget` dropped after
    reading it in one forward (its `Evict`'s choice, as the suite's `16x-evict` makes it); None without `Evict`."""
    methods = parse_budget(budget).methods(artifact, 4096)
    if not any(isinstance(m, patchkv.Evict) for m in methods):
        return None
    with patchkv.patched(model, artifact, methods):
        cache = model(input_ids=context, use_cache=True, logits_to_keep=1).cache
    out = []
    for layer in cache.layers:
        held = layer.columns()   # the sequence index of every token the layer holds; None: all of them
        gone = torch.zeros(context.shape[1], dtype=torch.bool)
        if held is not None:
            gone[:] = True
            gone[held[0]] = False
        out.append(gone)
    return out


class Masked:
    """While active, each layer's attention reads no column its entry of `gone` (bool `[n]`, the first n positions)
    marks: the tokens an `Evict` dropped, left in the model's own cache but out of every query's reach."""

    def __init__(self, model, gone: list[torch.Tensor]):
        self.model, self.gone = model, gone

    def __enter__(self) -> Masked:
        def hook(module, args, kwargs, gone):
            query = kwargs["hidden_states"].shape[1]
            past = kwargs["cache"].get_seq_length(module.layer_idx)
            allowed = torch.arange(past + query)[None] <= torch.arange(past, past + query)[:, None]
            allowed[:, :gone.shape[0]] &= ~gone
            return args, {**kwargs, "attention_mask": allowed[None, None]}
        self.hooks = [layer.self_attn.register_forward_pre_hook(
            lambda m, a, k, gone=gone: hook(m, a, k, gone), with_kwargs=True)
            for layer, gone in zip(self.model.model.layers, self.gone)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def needles(args) -> None:
    """`shared_basis_needles.csv`: needle_text scores per grouping and budget, by simulation (module doc)."""
    model, tokenizer, artifact, coders, spanned = coded_runs(args)
    rows = []
    samples = TASKS["needle_text"].samples(4096, args.needles, SMOLLM2)
    chosen = [int(i) for i in args.needle_indices.split(",")] if args.needle_indices else range(len(samples))
    for sample in (samples[i] for i in chosen):
        context = torch.tensor([sample["context_ids"]])
        gone = {budget: dropped(model, artifact, budget, context) for budget in args.needle_budgets.split(",")}
        with Capture(model) as capture:
            cache = model(input_ids=context, use_cache=True, logits_to_keep=1).cache
        n = len(sample["context_ids"])
        clean = {kind: x[0, SINKS:n - WINDOW] for kind, x in capture.take().items()}
        exact = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        for (budget, grouping), (bits, _, code) in coders.items():
            for layer, (k, v) in zip(cache.layers, exact):
                layer.keys, layer.values = k.clone(), v.clone()
            write_codes(model, cache, *code(clean["keys"], clean["values"]), SINKS)
            with Masked(model, gone[budget]) if gone[budget] else contextlib.nullcontext():
                logits = model(input_ids=torch.tensor([sample["question_ids"]]), cache=cache, use_cache=True
                               ).logits[:, -1]
                answer = greedy_answer(model, tokenizer, logits, cache, sample["max_new_tokens"], sample["outputs"])
            rows.append({"grouping": grouping, "budget": budget, "bits_per_head": bits, "index": sample["index"],
                         "score": ruler_score(sample, answer), "prediction": answer[:40]})
            print(rows[-1], flush=True)
    write_csv(rows, args.out / "shared_basis_needles.csv", extra=inputs(args, spanned))


def coded_nll(model, ids: torch.Tensor, code, chunk: int = 64) -> tuple[float, int]:
    """(NLL sum, tokens scored) of `ids` `[1, seq]` read `chunk` tokens a forward as `Perplexity` reads them
    (`token_nll`), the model's own cache holding, after each forward, every token past the sinks that has left the
    last `WINDOW` as `code` reconstructs it (None: exact)."""
    clean, coded = {}, SINKS

    def recode(cache, start: int, n: int) -> None:
        nonlocal coded
        for kind, x in capture.take().items():
            clean[kind] = x[0] if kind not in clean else torch.cat([clean[kind], x[0]])
        end = start + n - WINDOW
        if code is not None and end > coded:
            write_codes(model, cache, *code(clean["keys"][coded:end], clean["values"][coded:end]), coded)
            coded = end

    with Capture(model) as capture:
        scored = token_nll(model, ids, chunk, after=recode)
    return scored.nll, scored.count


def chunked_perplexity(args) -> None:
    """`shared_basis_chunked_ppl.csv`: perplexity per grouping and budget, read 64 tokens a forward, by simulation."""
    model, tokenizer, artifact, coders, spanned = coded_runs(args)
    rows = []
    for domain in ("prose", "shakespeare", "milton"):
        task = TASKS[f"ppl_{domain}"]
        for index in range(args.chunked_docs):
            ids = text_ids(tokenizer, task.documents()[index], 4096)
            base, count = coded_nll(model, ids, None)
            for (budget, grouping), (bits, read, code) in {("-", "unpatched"): (16, None, None), **coders}.items():
                nll = base if code is None else coded_nll(model, ids, code)[0]
                rows.append({"document": f"{domain}#{index}", "tokens": count, "grouping": grouping,
                             "budget": budget, "bits_per_head": bits, "read_per_query_head": read,
                             "ppl": round(math.exp(nll / count), 4),
                             "vs_unpatched": round(math.exp((nll - base) / count) - 1, 5)})
                print(rows[-1], flush=True)
    write_csv(rows, args.out / "shared_basis_chunked_ppl.csv", extra=inputs(args, spanned))


def simulate(model, tokenizer, fitted_bases: dict, args, path: Path) -> None:
    """`shared_basis_ppl.csv`: perplexity per grouping and budget, by simulation (module doc), beside unpatched."""
    head_dim, units = model.config.head_dim, model.config.num_hidden_layers * model.config.num_key_value_heads
    documents = [(domain, i, tokenizer(TASKS[f"ppl_{domain}"].documents()[i], add_special_tokens=False)["input_ids"])
                 for domain in ("prose", "shakespeare", "milton") for i in range(args.docs)]
    rows = []
    for domain, index, ids in documents:
        ids = torch.tensor([[tokenizer.bos_token_id, *ids][:args.ppl_tokens]])
        clean = cached_vectors(model, ids)
        base_nll, count = simulated_nll(model, ids, clean)
        trials = [("unpatched", "-", 0)] + [(g, budget, bits) for budget, bits in BUDGETS[1:] for g in GROUPINGS]
        for grouping, budget, bits in trials:
            if grouping == "unpatched":
                nll = base_nll
            else:
                coded = {kind: quantized(clean[kind], fitted_bases[kind, grouping], allocate_bits_global(
                    torch.cat([lam for _, lam, _ in fitted_bases[kind, grouping]]), bits * units), grouping, head_dim)
                    for kind in ("keys", "values")}
                nll = simulated_nll(model, ids, coded)[0]
            rows.append({"document": f"{domain}#{index}", "tokens": count, "grouping": grouping, "budget": budget,
                         "bits_per_head": bits, "ppl": round(math.exp(nll / count), 4),
                         "vs_unpatched": round(math.exp((nll - base_nll) / count) - 1, 5)})
            print(rows[-1], flush=True)
    write_csv(rows, path)


if __name__ == "__main__":
    main()
