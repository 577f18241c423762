"""Achieved FLOP/s of attention's batched matmuls vs their small dimension: what narrow heads and latent ranks cost.

    nice -n 10 .venv/bin/python -m evals gemm --threads 1 --repeats 9 --out evals/results \
        --conditions "1 thread on 2 CPU cores shared with other jobs (load ~5), nice 10"

Two sweeps of the two batched matmuls of attention over `seq` queries and `seq` keys per head:
`qK`, scores = Q K^T, `[heads, seq, d] @ [heads, d, seq]` (inner dimension d), and `pV`, outputs = P V,
`[heads, seq, seq] @ [heads, seq, d]` (output width d); each is 2 * heads * seq^2 * d FLOPs.

- `head_dim`: `--heads` (512) heads of dimension d = hidden / heads for hidden / heads in 1 ... 64: a fixed
  hidden size cut into ever narrower heads;
- `latent_rank`: `--rank-heads` (32, Llama-3-8B's query heads) heads scoring and summing in a latent space
  of rank r = 8 ... 128 (post-RoPE latents: q U against coefficients, p against value coefficients).

`efficiency` is achieved FLOP/s over that of one large square matmul (`--square`) in the same run, the
`peak` row; `flops_per_byte` is the matmul's arithmetic intensity counting each operand and the output
once (about d for d << seq: below the machine's FLOP/byte ratio a matmul is bound by memory). Median of `--repeats` timed runs after warmup; on a shared CPU the timings carry its load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .suite import write_csv
from .verbs import parse, parser
FIELDS = ("sweep", "op", "heads", "seq", "inner_dim", "hidden", "ms", "tflops", "efficiency", "flops_per_byte",
          "dtype", "device", "threads", "conditions")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn()` (CUDA: events around each call)."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = 1000 * (time.perf_counter() - t0)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def attention_matmuls(heads: int, seq: int, dim: int, dtype: torch.dtype, device: torch.device
                      ) -> dict[str, Callable[[], torch.Tensor]]:
    """The two batched matmuls at one shape: "qK" `[heads, seq, dim] @ [heads, dim, seq]` and "pV"
    `[heads, seq, seq] @ [heads, seq, dim]`, on random operands allocated once."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(heads, seq, dim, generator=g, device=device, dtype=dtype) for _ in range(3))
    p = torch.rand(heads, seq, seq, generator=g, device=device, dtype=dtype)
    kt = k.transpose(1, 2)
    return {"qK": lambda: torch.bmm(q, kt), "pV": lambda: torch.bmm(p, v)}


def significant(x: float) -> float:
    """Four significant figures: a tiny GEMM on a slow CPU reads 0.00004 TFLOP/s, which fixed decimals round to 0."""
    return float(f"{x:.4g}")


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The peak square matmul, then both sweeps -> CSV rows."""
    common = {"dtype": str(dtype).removeprefix("torch."), "device": device.type, "threads": torch.get_num_threads(),
              "conditions": args.conditions}
    n = args.square
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    peak_ms = median_ms(lambda: a @ b, device, args.warmup, args.repeats)
    peak = 2 * n ** 3 / peak_ms / 1e9
    square_intensity = 2 * n ** 3 / (3 * n * n * a.element_size())
    del a, b
    rows = [{**common, "sweep": "peak", "op": "square", "heads": 1, "seq": n, "inner_dim": n, "hidden": n,
             "ms": significant(peak_ms), "tflops": significant(peak), "efficiency": 1.0,
             "flops_per_byte": round(square_intensity, 2)}]
    print(f"square {n}: {peak:.2f} TFLOP/s", flush=True)
    sweeps = [("head_dim", args.heads, d) for d in args.head_dims] + [("latent_rank", args.rank_heads, r)
                                                                      for r in args.ranks]
    for sweep, heads, dim in sweeps:
        for op, fn in attention_matmuls(heads, args.seq, dim, dtype, device).items():
            ms = median_ms(fn, device, args.warmup, args.repeats)
            flops = 2 * heads * args.seq ** 2 * dim
            tflops = flops / ms / 1e9
            moved = heads * (2 * args.seq * dim + args.seq ** 2) * torch.empty(0, dtype=dtype).element_size()
            rows.append({**common, "sweep": sweep, "op": op, "heads": heads, "seq": args.seq, "inner_dim": dim,
                         "hidden": heads * dim, "ms": significant(ms), "tflops": significant(tflops),
                         "efficiency": significant(tflops / peak), "flops_per_byte": round(flops / moved, 2)})
            print(f"{sweep:<11} {op} heads={heads} d={dim:<4} {ms:9.3f} ms {tflops:8.3f} TFLOP/s "
                  f"({100 * tflops / peak:.1f}% of square)", flush=True)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Efficiency vs the small dimension, one panel per sweep, one line per matmul."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    labels = {"head_dim": "head dim d = hidden / heads", "latent_rank": "latent rank r"}
    for ax, sweep in zip(axes, labels):
        for op in ("qK", "pV"):
            pts = [r for r in rows if r["sweep"] == sweep and r["op"] == op]
            ax.plot([r["inner_dim"] for r in pts], [r["efficiency"] for r in pts], marker="o", label=op)
        heads = next((r["heads"] for r in rows if r["sweep"] == sweep), "?")
        ax.set(xscale="log", xlabel=labels[sweep], title=f"{sweep} ({heads} heads)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("FLOP/s / large square matmul's")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    p = parser("gemm", __doc__, threads=0, name="gemm")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seq", type=int, default=None, help="queries = keys per head (default 512 CPU, 4096 CUDA)")
    p.add_argument("--heads", type=int, default=512)
    p.add_argument("--head-dims", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--rank-heads", type=int, default=32)
    p.add_argument("--ranks", type=ints, default=[8, 16, 24, 32, 48, 64, 96, 128])
    p.add_argument("--square", type=int, default=None, help="peak matmul size (default 2048 CPU, 8192 CUDA)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--conditions", default="", help="how the machine was shared, recorded in the CSV")
    args = parse(p, argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gpu = device.type == "cuda"
    args.seq = args.seq or (4096 if gpu else 512)
    args.square = args.square or (8192 if gpu else 2048)
    rows = run(args, device, dtype)
    write_csv(rows, args.out / f"{args.name}.csv", FIELDS)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} threads"
    plot(rows, args.out / f"{args.name}.png", f"Batched attention matmuls, {args.dtype}, seq {args.seq} ({name})")


if __name__ == "__main__":
    main()
