"""Reconstruction and attention-score error vs matrix size, per method, on the reference model's own K/V.

    python evals/bench_reconstruction.py --out evals/results

Keys, values and queries are collected from the reference model on held-out Shakespeare (bases were
calibrated on the training works). For each method and matrix size (elements of the key matrix, all
layers and KV heads) it reports the relative L2 error of rotated keys and of values, the mean absolute
error of attention logits q.k/sqrt(d) over causal (query, key) pairs, and encode+decode throughput.
It also writes the key error by position, which is why attention sinks are kept uncompressed.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchkv
from patchkv.adapters import adapter_for, attention_modules
from patchkv.corpus import shakespeare_held_out
from patchkv.latent import LatentBasis

ROOT = Path(__file__).resolve().parents[1]


def collect(model, tokenizer, tokens: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Per layer: pre-RoPE keys, rotated keys, values `[layers, kv_heads, n, d]`, rotated queries
    `[layers, heads, n, d]`, and each token's position in its window `[n]`."""
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    ids = tokenizer("\n\n".join(shakespeare_held_out()), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    n = min(tokens, ids.numel()) // seq_len
    windows = ids[: n * seq_len].view(n, seq_len)
    store: dict[str, list] = {k: [[] for _ in modules] for k in ("pre", "post", "values", "queries")}

    def hook(attn, args, kwargs):
        q, k, v = adapter.project_qkv(attn, kwargs["hidden_states"])
        cos, sin = kwargs["position_embeddings"]
        for key, x in (("pre", k), ("post", adapter.rotate(k, cos, sin)), ("values", v),
                       ("queries", adapter.rotate(q, cos, sin))):
            store[key][attn.layer_idx].append(x.transpose(0, 1).flatten(1, 2))  # [heads, batch * seq, d]

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    with torch.no_grad():
        for batch in windows.split(16):
            model(batch, use_cache=False)
    for h in hooks:
        h.remove()
    data = {k: torch.stack([torch.cat(chunks, 1) for chunks in v]) for k, v in store.items()}
    data["positions"] = torch.arange(seq_len).repeat(n)
    return data


def causal_pairs(positions: torch.Tensor, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """For each key token, a query token of the same window at the same or a later position."""
    offset = (torch.rand(positions.shape, generator=g) * (seq_len - positions)).long()
    return torch.arange(positions.numel()) + offset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "artifacts" / "reference-llama"))
    p.add_argument("--bases", default=str(ROOT / "artifacts" / "reference-llama-bases"))
    p.add_argument("--tokens", type=int, default=131_072)
    p.add_argument("--sizes", default="1e6,1e7,1e8", help="key-matrix elements (all layers and heads)")
    p.add_argument("--out", default=str(ROOT / "evals" / "results"))
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    seq_len = 256
    data = collect(model, tokenizer, args.tokens, seq_len)
    layers, heads, n_total, dim = data["pre"].shape
    groups = data["queries"].shape[1] // heads
    rotary = model.model.rotary_emb
    cos, sin = rotary(data["pre"][:1, :1, :seq_len], torch.arange(seq_len).unsqueeze(0))  # [1, seq, d]
    adapter = adapter_for(model)
    arts = {m: patchkv.Artifact.load(Path(args.bases) / f"{m}.safetensors") for m in ("pre_rope", "post_rope")}
    methods = [(f"pca-{m.split('_')[0]}-r{r}", m, {"rank": r}) for m in arts for r in (8, 16, 32)]
    methods += [(f"dp-{m.split('_')[0]}-{b}bits ({1024 // b}x vs fp16)", m, {"bits": b}) for m in arts
                for b in (64, 32)]
    g = torch.Generator().manual_seed(0)
    rows, by_position = [], []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        n = min(n_total, size // (layers * heads * dim))
        n -= n % seq_len
        pos = data["positions"][:n]
        query_of = causal_pairs(pos, seq_len, g)
        for name, mode, budget in methods:
            art = arts[mode]
            key_err = value_err = score_err = key_norm = value_norm = 0.0
            per_position = torch.zeros(seq_len, dtype=torch.float64)
            t0 = time.perf_counter()
            for layer in range(layers):
                ranks = art.with_ranks(rank=budget["rank"]).keys.ranks[layer] if "rank" in budget else None
                alloc = art.bit_allocation(budget["bits"]) if "bits" in budget else (None, None)
                bases = []
                for c, a in zip((art.keys, art.values), alloc):
                    r = ranks if ranks is not None else c.ranks[layer]
                    bases.append(LatentBasis(c.mean[layer], c.eigenvectors[layer], r, groups, torch.float32,
                                             bits=None if a is None else a[layer],
                                             eigenvalues=c.eigenvalues[layer]))
                kb, vb = bases
                source = data["pre" if mode == "pre_rope" else "post"][layer, :, :n].unsqueeze(0)
                keys = kb.decode(kb.unpack(kb.encode(source)))[0]
                if mode == "pre_rope":
                    keys = adapter.rotate(keys.unsqueeze(0), cos[:, pos], sin[:, pos])[0]
                values = vb.decode(vb.unpack(vb.encode(data["values"][layer, :, :n].unsqueeze(0))))[0]
                true_k, true_v = data["post"][layer, :, :n], data["values"][layer, :, :n]
                diff = keys - true_k  # [heads, n, d]
                key_err += diff.pow(2).sum().item()
                key_norm += true_k.pow(2).sum().item()
                value_err += (values - true_v).pow(2).sum().item()
                value_norm += true_v.pow(2).sum().item()
                q = data["queries"][layer, :, query_of]  # [q_heads, n, d]
                score_err += (q * diff.repeat_interleave(groups, 0)).sum(-1).abs().sum().item() / dim ** 0.5
                per_position += torch.zeros(seq_len, dtype=torch.float64).index_add_(
                    0, pos, (diff.pow(2).sum(-1).sum(0) / true_k.pow(2).sum(-1).sum(0)).double())
            seconds = time.perf_counter() - t0
            row = {"elements": layers * heads * n * dim, "method": name,
                   "key_rel_l2": round((key_err / key_norm) ** 0.5, 5),
                   "value_rel_l2": round((value_err / value_norm) ** 0.5, 5),
                   "mean_abs_logit_err": round(score_err / (layers * heads * groups * n), 5),
                   "seconds": round(seconds, 3), "elements_per_s": round(layers * heads * n * dim / seconds)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if size == max(int(float(s)) for s in args.sizes.split(",")) and "r16" in name:
                counts = torch.bincount(pos, minlength=seq_len).double() * layers
                for position in (0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 255):
                    by_position.append({"method": name, "position": position,
                                        "key_rel_sq_err": round(float(per_position[position] / counts[position]), 5)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for file, table in (("reconstruction.csv", rows), ("reconstruction_by_position.csv", by_position)):
        with open(out / file, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    plot(rows, out / "reconstruction.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == name]
        for ax, metric in zip(axes, ("key_rel_l2", "value_rel_l2", "mean_abs_logit_err")):
            ax.plot([r["elements"] for r in pts], [r[metric] for r in pts], marker="o", label=name)
            ax.set(xscale="log", yscale="log", xlabel="key matrix elements", ylabel=metric)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
