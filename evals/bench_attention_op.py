"""One decode step of one attention layer: unpatched SDPA vs every patchkv method, total and per stage.

    nice -n 10 .venv/bin/python evals/bench_attention_op.py --threads 1 --out evals/results \
        --conditions "1 thread on 2 CPU cores shared with other jobs (load ~5), nice 10"

Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bfloat16, batch 1) at contexts
8k-128k, with random orthonormal bases (QR) in an in-memory artifact: an operator benchmark, no model.
Every stage calls the library's own code, in the order `patchkv.attention._attend` runs it: the cache is a
real `LatentLayer` filled through the method's codec, and the stages are

    unpack       codec decode: packed floats -> coefficients (a view), or DP codes -> coefficients
    score        top-k only: approximate scores of every latent token (`Mode.approximate_scores`)
    select       top-k only: `TopK.select`, then gathering the chosen tokens' coefficients and positions
    reconstruct  pre-RoPE only: keys rebuilt from coefficients and rotated (`PreRoPE.score_operands`)
    augment      latent rows as `[c | 1]` (`patchkv.latent.augmented`; post-RoPE keys and the query
                 projection through `PostRoPE.score_operands`)
    attention    the model's attention function (transformers' sdpa): score p = q.K, softmax and
                 weighted sum y = p.V FUSED in one call, timed as one stage
    decode       y's latent part through the value basis (`patchkv.attention._decode_values`)

Those are the stages of the attention function's path. A decode step (which this is) takes the grouped path
(`patchkv.attention.grouped_decode`), with no augmented features:

    qk           the true scores region by region (`Mode.decode_scores`: post-RoPE q.U against latents;
                 pre-RoPE keys rebuilt and rotated, then q.K)
    softmax      `decode_weights`
    pv           exact values and latent coefficients weighted, the latent part decoded (`weighted_values`)

Unpatched is that same attention function over a bf16 K/V cache. The `total` row of each method is the
sum of its stages' medians. `bytes_read` is what the step must read from the cache (bases and the
query are negligible), `bandwidth_bound_ms` = bytes_read / the machine's copy bandwidth (a large
tensor clone, bytes read + written / time): the time a step limited only by memory would take.
Timings are ratios measured side by side in one run; on a shared CPU they carry its load.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from patchkv.adapters.llama import LlamaAdapter
from patchkv.artifact import Artifact, Components
from patchkv.attention import _decode_values, decode_weights, grouped_decode_applies, weighted_values
from patchkv.cache import LatentLayer
from patchkv.context import LayerPatch, Patch
from patchkv.latent import augmented
from patchkv.methods import LowRank, Method, Quantized, TopK, build_plan
from patchkv.modes import MODES, Visible, compute_dtype
from patchkv.rope import RopeTable

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("unpack", "score", "select", "reconstruct", "augment", "attention", "decode", "qk", "softmax", "pv")
FIELDS = ("context", "method", "stage", "ms", "bytes_read", "bandwidth_bound_ms", "ratio_vs_sdpa", "vs_bound",
          "bandwidth_gbps", "device", "threads", "conditions")


@dataclass(frozen=True)
class Shape:
    """One attention layer: `heads` query heads sharing `kv_heads` KV heads of `head_dim` (GQA), batch 1."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Spec:
    """A patchkv method as benchmarked: the artifact's mode and the methods `patchkv.apply` would get."""

    mode: str
    methods: tuple[Method, ...]


def method_specs(rank: int, top_k: int, top_k_rank: int, bits: int) -> dict[str, Spec | None]:
    """Method name -> spec (None: unpatched SDPA over a bf16 cache)."""
    low, select = LowRank(rank=rank), TopK(top_k, top_k_rank)
    return {
        "sdpa": None,
        f"post-r{rank}": Spec("post_rope", (low,)),
        f"pre-r{rank}": Spec("pre_rope", (low,)),
        f"pre-r{rank}-top{top_k}": Spec("pre_rope", (low, select)),
        f"post-r{rank}-top{top_k}": Spec("post_rope", (low, select)),
        f"dp-pre-{bits}bits": Spec("pre_rope", (Quantized(bits),)),
    }


class Clock:
    """Per-stage wall time of one step. CPU ops are synchronous: `perf_counter` between stages. On CUDA, events
    recorded between stages (no sync inside the step), read after one synchronize at the end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object, object]] = []

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = self._now()
        yield
        self.marks.append((stage, start, self._now()))

    def stages_ms(self) -> dict[str, float]:
        """Milliseconds per stage of the step just run (stages entered twice are summed)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for stage, start, end in self.marks:
            ms = start.elapsed_time(end) if self.cuda else 1000 * (end - start)
            out[stage] = out.get(stage, 0.0) + ms
        self.marks.clear()
        return out


def random_artifact(shape: Shape, mode: str, seed: int = 0) -> Artifact:
    """One layer of PCA bases: orthonormal eigenvectors (QR of a Gaussian), eigenvalues decaying like a
    calibrated spectrum (lambda_j = exp(-j / 16)), small means, full ranks (methods re-truncate)."""
    g = torch.Generator().manual_seed(seed)
    h, d = shape.kv_heads, shape.head_dim

    def components() -> Components:
        vectors = torch.linalg.qr(torch.randn(1, h, d, d, generator=g, dtype=torch.float64))[0].float()
        eigenvalues = torch.exp(-torch.arange(d, dtype=torch.float32) / 16).expand(1, h, d).contiguous()
        return Components(mean=0.1 * torch.randn(1, h, d, generator=g), eigenvalues=eigenvalues,
                          eigenvectors=vectors, ranks=torch.full((1, h), d, dtype=torch.int32))

    model = {"model_type": "llama", "architecture": "LlamaForCausalLM", "name_or_path": "random Llama-3-8B layer",
             "num_hidden_layers": 1, "num_attention_heads": shape.heads, "num_key_value_heads": h,
             "head_dim": d, "hidden_size": shape.heads * d, "dtype": str(shape.dtype).removeprefix("torch.")}
    return Artifact(mode=mode, model=model, keys=components(), values=components())


class Layer:
    """One attention layer at `shape`: the model-side objects the patched forward uses (adapter, rotary
    table, the attention module on the meta device: only its config and scaling are read) and the query."""

    def __init__(self, shape: Shape, device: torch.device, seed: int = 0):
        config = LlamaConfig(hidden_size=shape.heads * shape.head_dim, num_attention_heads=shape.heads,
                             num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, num_hidden_layers=1,
                             rope_theta=500000.0, attn_implementation="sdpa")
        with torch.device("meta"):
            self.attn = LlamaAttention(config, layer_idx=0).eval()
        self.adapter = LlamaAdapter()
        self.rope = RopeTable(self.adapter, LlamaRotaryEmbedding(config).to(device), self.attn)
        self.shape, self.device = shape, device
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(1, shape.heads, 1, shape.head_dim, generator=g).to(device, shape.dtype)

    def attention(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The model's attention function, as `_attend` calls it: q `[1, heads, 1, D]`, k `[1, kv_heads, n, D]`,
        v `[1, kv_heads, n, Dv]` -> `[1, 1, heads, Dv]`."""
        fn = self.adapter.attention_function(self.attn)
        out, _ = fn(self.attn, queries, keys, values, None, dropout=0.0, scaling=self.adapter.scaling(self.attn),
                    **self.adapter.attention_kwargs(self.attn))
        return out

    def patch(self, spec: Spec) -> tuple[LayerPatch, Artifact]:
        """The `LayerPatch` `patchkv.apply` would install for `spec` on this layer, and its artifact."""
        artifact = random_artifact(self.shape, spec.mode)
        plan = build_plan(spec.methods)
        keys, values = plan.codec.codecs(artifact, [self.shape.groups], self.shape.dtype)[0]
        patch = Patch(self.adapter, MODES[spec.mode], plan, artifact, "bench", [None])
        return LayerPatch(patch, 0, keys, values, self.rope).on(self.device), artifact

    def kv_cache(self, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The unpatched cache: random keys and values `[1, kv_heads, context, head_dim]`."""
        g = torch.Generator().manual_seed(1)
        s = self.shape
        size = (1, s.kv_heads, context, s.head_dim)
        return tuple(torch.randn(size, generator=g).to(self.device, s.dtype) for _ in range(2))

    def latent_cache(self, lp: LayerPatch, artifact: Artifact, context: int, chunk: int = 8192) -> LatentLayer:
        """A `LatentLayer` (no sinks, no window: every token latent) holding `context` tokens, appended in
        chunks through `lp`'s codecs as prefill does. Vectors are drawn on the artifact's spectrum,
        x = mean + U (sqrt(lambda) * z), so DP codes see the distribution they were allocated for."""
        g = torch.Generator().manual_seed(2)
        s = self.shape
        layer = LatentLayer()
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            kv = []
            for c in (artifact.keys, artifact.values):
                z = torch.randn(1, s.kv_heads, n, s.head_dim, generator=g) * c.eigenvalues[0].sqrt().unsqueeze(1)
                kv.append((c.mean[0].unsqueeze(1) + z @ c.eigenvectors[0].transpose(1, 2)).to(self.device, s.dtype))
            positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)
            layer.append(*kv, positions, lp)
            layer.after_attention()  # as the forward does: the chunk's tokens are served from the latents from now on
        return layer


def sdpa_step(layer: Layer, keys: torch.Tensor, values: torch.Tensor, clock: Clock) -> torch.Tensor:
    """The unpatched decode step: the attention function over the bf16 cache -> `[1, 1, heads, head_dim]`."""
    with clock("attention"):
        return layer.attention(layer.q, keys, values)


def patchkv_step(layer: Layer, lp: LayerPatch, cache: LatentLayer, cos: torch.Tensor, sin: torch.Tensor,
                 clock: Clock) -> torch.Tensor:
    """One patched decode step, `patchkv.attention._attend` split into timed stages (batch 1: no mask).

    q: the query `[1, heads, 1, head_dim]` in cache space; cos, sin `[1, 1, head_dim]` its rotation.
    Returns `[1, 1, heads, head_dim]`, equal to what `_attend` returns (tests/test_bench_op.py).
    """
    q, mode, selector, basis = layer.q, lp.patch.mode, lp.patch.plan.selector, lp.keys.basis
    regions, positions = cache.regions(1)
    ns, nm, nr = (regions[f"{r}_keys"].shape[2] for r in ("sink", "latent", "recent"))
    sink_pos, middle_pos, recent_pos = positions.split([ns, nm, nr], dim=1)
    with clock("unpack"):
        key_coeffs, value_coeffs = lp.keys.decode(regions["latent_keys"]), lp.values.decode(regions["latent_values"])
    if selector is not None and selector.applies(1, nm):
        rank = min(selector.rank or basis.max_rank, basis.max_rank)
        with clock("score"):
            scores = mode.approximate_scores(lp, q, cos, sin, key_coeffs[..., :rank], middle_pos)
        with clock("select"):
            chosen = selector.select(scores, basis.query_groups)  # [1, kv_heads, k]
            key_coeffs, value_coeffs = (c.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, c.shape[-1]))
                                        for c in (key_coeffs, value_coeffs))
            middle_pos = middle_pos.unsqueeze(1).expand(-1, chosen.shape[1], -1).gather(2, chosen)
    seen = Visible(regions["sink_keys"], regions["sink_values"], regions["recent_keys"], regions["recent_values"],
                   key_coeffs, value_coeffs, sink_pos, middle_pos, recent_pos)
    if grouped_decode_applies(layer.attn, lp, q, {}):  # what `_attend` runs at a decode step: `grouped_decode`
        with clock("qk"):
            scores = mode.decode_scores(lp, q, cos, sin, seen)
        with clock("softmax"):
            p = decode_weights(scores, None, layer.adapter.scaling(layer.attn))
        with clock("pv"):
            return weighted_values(lp, p, seen, q.dtype)
    work = compute_dtype(q)
    with clock("reconstruct" if mode.name == "pre_rope" else "augment"):
        queries, keys = mode.score_operands(lp, q, cos, sin, seen)
    with clock("augment"):
        values, has_exact, has_latent = augmented(seen.sink_values.to(work), value_coeffs.to(work),
                                                  seen.recent_values.to(work))
    with clock("attention"):
        out = layer.attention(queries, keys, values)
    with clock("decode"):
        return _decode_values(lp, out.to(q.dtype), has_exact, has_latent, q.shape[-1])


def bytes_read(lp: LayerPatch | None, cache: LatentLayer | None, context: int, shape: Shape) -> int:
    """Cache bytes one step must read: the whole cache for dense methods; for top-k, the scoring rank's
    share of the key latents plus the chosen tokens' keys and values."""
    if lp is None:
        return 2 * context * shape.kv_heads * shape.head_dim * torch.empty(0, dtype=shape.dtype).element_size()
    selector = lp.patch.plan.selector
    if selector is None:
        return cache.nbytes()
    basis = lp.keys.basis
    rank = min(selector.rank or basis.max_rank, basis.max_rank)
    per_token = lp.keys.bytes_per_token() + lp.values.bytes_per_token()
    return context * lp.keys.bytes_per_token() * rank // basis.max_rank + selector.k * per_token


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 29, repeats: int = 7) -> float:
    """Bytes read + written per second by `clone()` of an `nbytes` tensor, median of `repeats`."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t0 = time.perf_counter()
        y = x.clone()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        del y
    return 2 * nbytes / statistics.median(times[1:])


def time_stages(step: Callable[[Clock], torch.Tensor], device: torch.device, warmup: int,
                repeats: int) -> dict[str, float]:
    """Median milliseconds per stage of `step` over `repeats` runs after `warmup` runs."""
    clock = Clock(device)
    runs = []
    for i in range(warmup + repeats):
        step(clock)
        stages = clock.stages_ms()
        if i >= warmup:
            runs.append(stages)
    return {stage: statistics.median(r[stage] for r in runs) for stage in STAGES if stage in runs[0]}


def run(contexts: list[int], specs: dict[str, Spec | None], shape: Shape, device: torch.device, warmup: int,
        repeats: int, conditions: str) -> list[dict]:
    """Every method at every context -> CSV rows (one per stage, then the `total`)."""
    layer = Layer(shape, device)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)", flush=True)
    patches = {name: layer.patch(spec) for name, spec in specs.items() if spec is not None}
    rows = []
    with torch.no_grad():
        for context in contexts:
            cos, sin = layer.rope.at(torch.tensor([[context]], device=device), like=layer.q)
            sdpa_ms = None
            for name, spec in specs.items():
                if spec is None:
                    keys, values = layer.kv_cache(context)
                    lp, cache = None, None
                    stages = time_stages(lambda clock: sdpa_step(layer, keys, values, clock), device, warmup, repeats)
                    del keys, values
                else:
                    lp, artifact = patches[name]
                    cache = layer.latent_cache(lp, artifact, context)
                    stages = time_stages(lambda clock: patchkv_step(layer, lp, cache, cos, sin, clock), device,
                                         warmup, repeats)
                total = sum(stages.values())
                sdpa_ms = sdpa_ms or total
                need = bytes_read(lp, cache, context, shape)
                bound = 1000 * need / bandwidth
                common = {"context": context, "method": name, "bandwidth_gbps": round(bandwidth / 1e9, 2),
                          "device": device.type, "threads": torch.get_num_threads(), "conditions": conditions}
                for stage, ms in stages.items():
                    rows.append({**common, "stage": stage, "ms": round(ms, 4), "ratio_vs_sdpa": round(ms / sdpa_ms, 4)})
                rows.append({**common, "stage": "total", "ms": round(total, 4), "bytes_read": need,
                             "bandwidth_bound_ms": round(bound, 4), "ratio_vs_sdpa": round(total / sdpa_ms, 4),
                             "vs_bound": round(total / bound, 2)})
                print(f"{context:>7} {name:<20} {total:9.3f} ms  x{total / sdpa_ms:.2f} vs sdpa  bound "
                      f"{bound:.3f} ms  " + " ".join(f"{s}={ms:.2f}" for s, ms in stages.items()), flush=True)
                del cache
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Stacked bars: one group per context, one bar per method, stages stacked, in units of that
    context's SDPA step; a black tick marks each method's bandwidth bound on the same scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = list(dict.fromkeys(r["context"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    totals = {(r["context"], r["method"]): r for r in rows if r["stage"] == "total"}
    colors = dict(zip(STAGES, plt.get_cmap("tab10").colors))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.9 * len(contexts) + 2), 4.8))
    for i, context in enumerate(contexts):
        sdpa_ms = totals[(context, methods[0])]["ms"]
        for j, method in enumerate(methods):
            x, bottom = i + (j - (len(methods) - 1) / 2) * width, 0.0
            for r in rows:
                if r["context"] == context and r["method"] == method and r["stage"] != "total":
                    ax.bar(x, r["ms"] / sdpa_ms, width, bottom=bottom, color=colors[r["stage"]])
                    bottom += r["ms"] / sdpa_ms
            ax.plot([x - width / 2, x + width / 2], [totals[(context, method)]["bandwidth_bound_ms"] / sdpa_ms] * 2,
                    color="black", lw=1.5)
            ax.text(x, bottom, method, rotation=90, ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(contexts)),
                  [f"{c // 1024}k\n(sdpa {totals[(c, methods[0])]['ms']:.2f} ms)" for c in contexts])
    ax.set(ylabel="time / unpatched SDPA step", title=title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in STAGES]
    handles.append(plt.Line2D([], [], color="black"))
    ax.legend(handles, [*STAGES, "bandwidth bound"], fontsize=7, ncol=2)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    p.add_argument("--rank", type=int, default=32, help="latent rank per KV head (32 of 128: 4x)")
    p.add_argument("--top-k", type=int, default=2048, help="latent tokens kept per KV head by top-k")
    p.add_argument("--top-k-rank", type=int, default=16, help="key components top-k scores from")
    p.add_argument("--bits", type=int, default=128, help="DP code bits per KV head and token (128: 16x vs bf16)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--conditions", default="", help="how the machine was shared, recorded in the CSV")
    p.add_argument("--out", default=str(ROOT / "evals" / "results"))
    p.add_argument("--name", default="attention_op")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = run(contexts, method_specs(args.rank, args.top_k, args.top_k_rank, args.bits), Shape(), device,
               args.warmup, args.repeats, args.conditions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / f"{args.name}.csv")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    plot(rows, out / f"{args.name}.png", f"One decode step, one Llama-3-8B attention layer, bf16 ({name})")


if __name__ == "__main__":
    main()
