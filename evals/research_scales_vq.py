"""Research: per-token scales and vector quantization of the 16x codes, at equal bytes, simulated through the cache.

    .venv/bin/python -m evals scales-vq --out evals/results --ratios 16   # about 30 minutes on one core

SmolLM2-135M-Instruct in bfloat16, the shipped pre-RoPE artifact, global pool, 4 sinks and a 32-token window exact
(the suite's 16x), held-out perplexity of the first document of each perplexity task (prose, Shakespeare, Milton;
4,096 tokens fed 64 per forward), as `evals.research_quantizer` scores them. Variants, each within the bytes of the
suite's codes:

- **codes**: the suite's real codes (`Quantized(bits, pool="global")`);
- **uniform (simulated)**: the suite's quantizer (midrise, Gaussian-matched steps widened by the fitted step
  scales), simulated; it checks the simulation against the real codes;
- **token scale per head**: each token's coefficients of a head's keys (or values) divided by their RMS over the
  coded components in units of the calibrated standard deviations, that factor stored as a 5-bit power of two
  (2^(k/8), k in [-16, 15]) per token, head and kind; the codes get the bytes left (3 x 5 bits per layer and kind:
  2 bytes of each layer's key and value codes, 120 of the 1,237 bytes of codes per token);
- **token scale per layer**: one 8-bit factor (2^(k/16), k in [-128, 127]) per token, layer and kind over all the
  layer's heads (1 byte per layer and kind, 60 bytes per token);
- **VQ d=1, 2, 4**: the components a head gives the same b bits, in order, grouped d at a time (d x b <= 8; the
  rest stay scalar), each group coded by the nearest of 2^(d x b) centroids of a codebook fitted by k-means on
  calibration coefficients (per (d, b), in units of each component's standard deviation: the SmolLM2 calibration
  mix, 4,096 tokens, never the test documents). Same bits as the scalar codes: d=1 is a non-uniform scalar
  quantizer fitted to the data (Lloyd-Max), d=2 and 4 add vector (space-filling and shape) gain;
- **VQ d=2, 4 widened**: the same codebooks stretched by the step scales the artifact fitted for the scalar codes
  of this budget (as those widen the scalar quantizer's range: k-means minimises squared error, the model's loss
  wants the tails).

Simulated: each variant quantizes and reconstructs the coefficients as the middle enters the cache and the cache
holds the reconstruction as bf16 latents (`SimulatedCodec`), so attention reads exactly what the variant's codes
would decode to, through the real cache and attention; its bytes per token are counted from the bits it would
store (the real 16x run's bytes with the codes replaced by the variant's, scales included).

Results: `scales_vq.csv` (+ provenance sidecar), one row per variant and document: NLL sum, tokens, perplexity,
change against unpatched on the same document, KV bytes per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import patchkv
from patchkv.allocation import allocate_to_bytes, bit_allocation, cost_variances, step_scales_for
from patchkv.budgets import bits_for_ratio
from patchkv.latent import LatentBasis, PackedCodec
from patchkv.methods import SinksWindow
from patchkv.methods.base import CodecMethod
from patchkv.perplexity import token_nll
from patchkv.quantize import GAUSSIAN_STEP

from .calibrate_smollm2 import general_mix
from .suite import load_artifacts, load_smollm2, write_csv
from .tasks import TASKS
from .verbs import parse, parser

TASK_NAMES = ("ppl_prose", "ppl_shakespeare", "ppl_milton")
VARIANTS = ("codes", "uniform", "token scale per head", "token scale per layer", "VQ d=1", "VQ d=2", "VQ d=4",
            "VQ d=2 widened", "VQ d=4 widened")
SCALE_BITS = {"head": 5, "layer": 8}  # per token, head (or layer) and kind
SCALE_RESOLUTION = {"head": 8, "layer": 16}  # levels per octave
KMEANS_SAMPLES = 200_000


def midrise(c: torch.Tensor, bits: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The suite's scalar quantizer, reconstructed: c `[batch, heads, seq, rank]`, bits and step `[heads, rank]`;
    level i of 2^b reconstructs to `(i + 0.5 - 2^b / 2) * step`, 0 where b = 0."""
    levels = (2.0 ** bits).unsqueeze(1)
    s = step.unsqueeze(1).clamp_min(1e-30)
    q = torch.minimum(torch.floor(c / s + levels / 2).clamp_min(0), levels - 1)
    return torch.where(bits.unsqueeze(1) > 0, (q + 0.5 - levels / 2) * s, 0.0)


def token_factor(c: torch.Tensor, bits: torch.Tensor, std: torch.Tensor, per: str) -> torch.Tensor:
    """Each token's RMS of its coded coefficients in standard deviations, per head `[batch, heads, seq, 1]` or per
    layer `[batch, 1, seq, 1]`, rounded to the stored power of two."""
    coded = (bits > 0).unsqueeze(1)
    z = torch.where(coded, c / std.unsqueeze(1).clamp_min(1e-30), 0.0).square()
    dims = (-1,) if per == "head" else (1, -1)
    n = coded.expand_as(z).sum(dims, keepdim=True).clamp_min(1)
    rms = (z.sum(dims, keepdim=True) / n).sqrt().clamp_min(1e-30)
    res, half = SCALE_RESOLUTION[per], 2 ** (SCALE_BITS[per] - 1)
    return 2.0 ** ((rms.log2() * res).round().clamp(-half, half - 1) / res)


def kmeans(x: torch.Tensor, k: int, iters: int = 30, seed: int = 0) -> torch.Tensor:
    """Centroids `[k, d]` of points `[n, d]` (Lloyd's algorithm from k random points; empty ones re-seeded)."""
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(len(x), generator=gen)[:k]].clone()
    for _ in range(iters):
        nearest = torch.cdist(x, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, nearest, x)
        counts = torch.bincount(nearest, minlength=k).unsqueeze(1)
        empty = counts.squeeze(1) == 0
        centroids = torch.where(counts > 0, sums / counts.clamp_min(1), centroids)
        if empty.any():
            centroids[empty] = x[torch.randint(len(x), (int(empty.sum()),), generator=gen)]
    return centroids


class Quantizer:
    """One layer's keys (or values) coded one of the ways above: `__call__` takes coefficients `[batch, heads, seq,
    rank]` and returns what the codes decode to. `record` (a dict) collects the calibration groups for k-means."""

    def __init__(self, variant: str, bits: torch.Tensor, std: torch.Tensor, step_scale: torch.Tensor | None,
                 codebooks: dict | None = None, record: dict | None = None):
        self.variant, self.bits, self.std, self.codebooks, self.record = variant, bits, std.float(), codebooks, record
        widen = torch.ones_like(std, dtype=torch.float64) if step_scale is None else \
            step_scale.double().unsqueeze(1).expand_as(std)
        self.step = (torch.tensor(GAUSSIAN_STEP, dtype=torch.float64)[bits] * std.double() * widen).float()
        self.widen = widen.float()
        self.groups = {d: self._groups(d) for d in (1, 2, 4)}

    def _groups(self, d: int) -> dict[int, torch.Tensor]:
        """For each bit count b with d x b <= 8: flat indices `[groups, d]` of the components grouped d at a time."""
        heads, rank = self.bits.shape
        out: dict[int, list] = {}
        for h in range(heads):
            for b in range(1, 8 // d + 1):
                same = (self.bits[h] == b).nonzero().squeeze(1) + h * rank
                usable = len(same) // d * d
                if usable:
                    out.setdefault(b, []).append(same[:usable].view(-1, d))
        return {b: torch.cat(g) for b, g in out.items()}

    def __call__(self, c: torch.Tensor) -> torch.Tensor:
        if self.variant.startswith("token scale"):
            factor = token_factor(c, self.bits, self.std, self.variant.split()[-1])
            return midrise(c / factor, self.bits, self.step) * factor
        out = midrise(c, self.bits, self.step)
        if self.record is not None:
            self._record(c)
        if not self.variant.startswith("VQ"):
            return out
        d = int(self.variant.split("=")[1].split()[0])
        batch, heads, seq, rank = c.shape
        flat = c.transpose(1, 2).reshape(batch, seq, heads * rank)
        std = (self.std * self.widen if self.variant.endswith("widened") else self.std).flatten()
        rebuilt = out.transpose(1, 2).reshape(batch, seq, heads * rank).clone()
        for b, idx in self.groups[d].items():
            x = (flat[..., idx] / std[idx]).reshape(-1, d)
            book = self.codebooks[(d, b)]
            rebuilt[..., idx] = book[torch.cdist(x, book).argmin(1)].view(batch, seq, *idx.shape) * std[idx]
        return rebuilt.view(batch, seq, heads, rank).transpose(1, 2)

    def _record(self, c: torch.Tensor) -> None:
        flat = c.transpose(1, 2).reshape(-1, c.shape[1] * c.shape[3])
        std = self.std.flatten()
        for d, by_bits in self.groups.items():
            for b, idx in by_bits.items():
                self.record.setdefault((d, b), []).append((flat[:, idx] / std[idx]).reshape(-1, d))


class SimulatedCodec(PackedCodec):
    """The coefficients as `quantize` reconstructs them, held as floats at the components that get bits."""

    def __init__(self, basis: LatentBasis, quantize: Quantizer):
        super().__init__(basis)
        self.quantize = quantize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.pack(self.quantize(self.basis.coefficients(x)))


def global_bits(artifact, byte_budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`bit_allocation(artifact, bits, "global")` with the pool given in bytes: keys and values `[L, H, d]`."""
    layers, heads, dim = artifact.num_layers, artifact.num_kv_heads, artifact.head_dim
    per_kind = [cost_variances(c) for c in (artifact.keys, artifact.values)]
    groups = allocate_to_bytes([c[layer].flatten() for layer in range(layers) for c in per_kind], byte_budget)
    return tuple(torch.stack([groups[2 * layer + kind] for layer in range(layers)]).view(layers, heads, dim)
                 for kind in (0, 1))


def code_bytes(allocation: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes of codes per token: each layer's key and value codes packed to whole bytes."""
    return sum(-(-int(b[layer].sum()) // 8) for b in allocation for layer in range(b.shape[0]))


@dataclass(frozen=True)
class Simulated(CodecMethod):
    """A research variant of the global-pool codes at `bits` per head (module docstring), simulated."""

    name = "simulated"
    bits: int = 55
    variant: str = "uniform"
    codebooks: dict | None = field(default=None, compare=False, repr=False)
    record: dict | None = field(default=None, compare=False, repr=False)

    def spec(self) -> str:
        return f"simulated:bits={self.bits},pool=global,variant={self.variant}"

    def allocation(self, artifact) -> tuple[torch.Tensor, torch.Tensor]:
        """Bits per component (keys, values) `[L, H, d]`: the suite's, or for a token scale those of the pool less
        the scales' bytes."""
        base = bit_allocation(artifact, self.bits, "global")
        scales = self.scale_bytes(artifact)
        return global_bits(artifact, code_bytes(base) - scales) if scales else base

    def scale_bytes(self, artifact) -> int:
        """Bytes of per-token scales per token: whole bytes per layer and kind."""
        if not self.variant.startswith("token scale"):
            return 0
        per = self.variant.split()[-1]
        return 2 * artifact.num_layers * -(-SCALE_BITS[per] * (artifact.num_kv_heads if per == "head" else 1) // 8)

    def codecs(self, artifact, query_groups, dtype):
        scales = step_scales_for(artifact, self.bits, "global")
        out = []
        for i, (groups, *bits) in enumerate(zip(query_groups, *self.allocation(artifact))):
            pair = []
            for kind, c in enumerate((artifact.keys, artifact.values)):
                b = bits[kind]
                ranks = [int((row > 0).nonzero().max()) + 1 if row.any() else 1 for row in b]
                basis = LatentBasis(c.mean[i], c.eigenvectors[i], ranks, groups, dtype)
                rank = basis.max_rank
                quantize = Quantizer(self.variant, b[:, :rank], c.eigenvalues[i][:, :rank].double().clamp_min(0).sqrt(),
                                     None if scales is None else scales[kind][i], self.codebooks, self.record)
                pair.append(SimulatedCodec(basis, quantize))
            out.append(tuple(pair))
        return out


def fit_codebooks(model, tokenizer, artifact, bits: int, tokens: int) -> dict[tuple[int, int], torch.Tensor]:
    """k-means codebooks per (d, b) on the coefficients of the calibration mix's first `tokens` tokens."""
    record: dict = {}
    ids = tokenizer("".join(general_mix()[:4]), return_tensors="pt").input_ids[:, :tokens]
    with patchkv.patched(model, artifact, [SinksWindow(4, 32), Simulated(bits, "uniform", record=record)]):
        token_nll(model, ids, 64)
    gen = torch.Generator().manual_seed(0)
    books = {}
    for (d, b), parts in sorted(record.items()):
        x = torch.cat(parts)
        x = x[torch.randperm(len(x), generator=gen)[:KMEANS_SAMPLES]]
        books[(d, b)] = kmeans(x, 2 ** (d * b))
        print(f"codebook d={d} b={b}: {len(x)} points, {2 ** (d * b)} centroids", flush=True)
    return books


def main(argv: list[str] | None = None) -> None:
    p = parser("scales-vq", __doc__)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--ratios", default="16", help="compression ratios to try the variants at")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifact = load_artifacts()["pre_rope"]
    rows, base = [], {}
    for task in TASK_NAMES:
        scored = TASKS[task].run(model, tokenizer, 0, args.context, None)
        base[task] = math.exp(scored.score / scored.count)
    for ratio in (float(r) for r in args.ratios.split(",")):
        bits = bits_for_ratio(artifact, ratio, pool="global", context=args.context)
        codebooks = fit_codebooks(model, tokenizer, artifact, bits, args.context)
        real_codes = code_bytes(bit_allocation(artifact, bits, "global"))
        real_bytes = {}
        for variant in args.variants.split(","):
            if variant == "codes":
                methods = [SinksWindow(4, 32), patchkv.methods.Quantized(bits, pool="global")]
            else:
                sim = Simulated(bits, variant, codebooks)
                methods = [SinksWindow(4, 32), sim]
            for task in TASK_NAMES:
                with patchkv.patched(model, artifact, methods):
                    scored = TASKS[task].run(model, tokenizer, 0, args.context, None)
                if variant == "codes":
                    real_bytes[task] = scored.kv_bytes_per_token
                    held = scored.kv_bytes_per_token
                else:
                    held = (real_bytes[task] - real_codes + code_bytes(sim.allocation(artifact))
                            + sim.scale_bytes(artifact))
                ppl = math.exp(scored.score / scored.count)
                rows.append({"ratio": f"{ratio:g}x", "variant": variant,
                             "methods": " + ".join(m.spec() for m in methods), "task": task, "document": 0,
                             "nll": round(scored.score, 3), "tokens": scored.count,
                             "ppl": round(ppl, 4), "vs_unpatched_pct": round(100 * (ppl / base[task] - 1), 2),
                             "kv_bytes_per_token": round(held, 1)})
                print(rows[-1], flush=True)
    write_csv(rows, args.out / "scales_vq.csv")


if __name__ == "__main__":
    main()
