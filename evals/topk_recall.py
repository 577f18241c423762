"""Recall of the true top-k tokens by `TopK`'s selection, pre-RoPE (latent scoring per chunk) and post-RoPE.

    nice -n 10 .venv/bin/python evals/topk_recall.py --out evals/results

SmolLM2-135M-Instruct (bfloat16) with its bases (`artifacts/smollm2-bases`), patched with rank-16 latents,
4 sinks, a 32-token window and `TopK(64, 8)`. For each of `--docs` prose documents (the lm-eval task data),
`--context` tokens are prefilled, then the next `--queries` tokens are decoded one at a time (teacher forced).
At every decode step and every layer, the selection is made by the library's own code, as the patched
attention makes it (`mode.approximate_scores` on the first `r` latent components, then `TopK(k, r).select`),
for several k and r; it is compared with the top-k by exact attention score over the latent middle:

- reference "cache": exact scores against the keys the cache holds (rank-16 latents, reconstructed; what
  dense attention over this cache would weigh): the error of the selection's approximate scoring alone;
- reference "original": exact scores against the keys before compression (what the unpatched layer would
  weigh, for the same query): compression and selection together.

Columns: recall_kv, share of the k tokens that `TopK.select` would pick from exact scores (per KV head, best
for any of its query heads) that it picks from approximate ones; recall_q, share of each query head's own
exact top-k that its KV head's selection holds; mass_chosen, share of a query head's softmax attention over
the middle carried by the selected tokens, and mass_oracle, the same for the exact selection (the ceiling).
Averages over every query, layer and head; recall_kv_worst_layer is the lowest per-layer average.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchkv
import patchkv.attention as attention
from patchkv.attention import _additive
from patchkv.cache import LatentLayer
from patchkv.modes import Visible

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("mode", "score_rank", "k", "reference", "recall_kv", "recall_q", "mass_chosen", "mass_oracle",
          "recall_kv_worst_layer", "queries", "layers", "middle_tokens")


class Recorder:
    """Wraps the patched attention's `_attend` and `LatentLayer.append` for the run: keeps every appended key
    (the original, before compression) and, at each decode step, scores the library's selections."""

    def __init__(self, ranks: list[int], ks: list[int]):
        self.ranks, self.ks = ranks, ks
        self.sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0] * 4)  # (rank, k, ref, layer) -> sums
        self.counts: dict[int, int] = defaultdict(int)  # layer -> decode queries seen
        self.middle = 0
        self._attend, self._append = attention._attend, LatentLayer.append

    def __enter__(self):
        recorder = self

        def append(layer, keys, values, positions, patch):
            layer.original_keys = keys if not hasattr(layer, "original_keys") else torch.cat(
                [layer.original_keys, keys], dim=2)
            return recorder._append(layer, keys, values, positions, patch)

        def attend(attn, lp, layer, q, cos, sin, mask, kwargs):
            selector = lp.patch.plan.selector
            if selector is not None and not layer.is_sliding and selector.applies(q.shape[2], layer.middle_len):
                with torch.no_grad():
                    recorder.measure(attn, lp, layer, q, cos, sin, mask)
            return recorder._attend(attn, lp, layer, q, cos, sin, mask, kwargs)

        attention._attend, LatentLayer.append = attend, append
        return self

    def __exit__(self, *exc):
        attention._attend, LatentLayer.append = self._attend, self._append

    def measure(self, attn, lp, layer, q, cos, sin, mask) -> None:
        mode, groups = lp.patch.mode, lp.keys.basis.query_groups
        regions, positions = layer.regions(q.shape[2])
        ns, nm, nr = (regions[f"{r}_keys"].shape[2] for r in ("sink", "latent", "recent"))
        sink_pos, middle_pos, recent_pos = positions.split([ns, nm, nr], dim=1)
        key_coeffs = lp.keys.decode(regions["latent_keys"])
        value_coeffs = lp.values.decode(regions["latent_values"])
        bias = 0 if mask is None else _additive(mask)[:, :, -1, ns:ns + nm]
        scaling = lp.patch.adapter.scaling(attn)

        def exact(seen: Visible, columns: slice) -> torch.Tensor:
            """The mode's own score operands (dot products = true scores), `[batch, heads, m]` over `columns`."""
            queries, keys = mode.score_operands(lp, q, cos, sin, seen)
            b, h, _, d = queries.shape
            keys = keys[:, :, columns]
            s = queries.view(b, h // groups, groups, d) @ keys.transpose(-1, -2)  # [b, kv_heads, groups, m]
            return s.reshape(b, h, -1).float() + bias

        dense = Visible(regions["sink_keys"], regions["sink_values"], regions["recent_keys"], regions["recent_values"],
                        key_coeffs, value_coeffs, sink_pos, middle_pos, recent_pos)
        # the original middle keys as the one exact region of a Visible: score_operands rotates them (pre-RoPE)
        original = layer.original_keys[:, :, ns:ns + nm]
        empty_k, empty_c = original[:, :, :0], key_coeffs[:, :, :0]
        as_exact = Visible(original, original, empty_k, empty_k, empty_c, empty_c, middle_pos, middle_pos[:, :0],
                           middle_pos[:, :0])
        references = {"cache": exact(dense, slice(ns, ns + nm)), "original": exact(as_exact, slice(0, nm))}
        approx = {r: mode.approximate_scores(lp, q, cos, sin, key_coeffs[..., :r], middle_pos) + bias
                  for r in self.ranks}
        b, h, m = references["cache"].shape
        for ref, scores in references.items():
            probs = (scores * scaling).softmax(-1)  # over the middle, per query head
            for k in self.ks:
                oracle = patchkv.TopK(k).select(scores, groups)  # [b, kv_heads, k]
                own = scores.topk(k, dim=-1).indices  # each query head's exact top-k
                oracle_mass = _per_query_head(oracle, groups, m).mul(probs).sum(-1).mean()
                for r, approx_scores in approx.items():
                    chosen = patchkv.TopK(k, r).select(approx_scores, groups)
                    picked = torch.zeros(b, h // groups, m, dtype=torch.bool).scatter_(2, chosen, True)
                    per_q = picked.repeat_interleave(groups, dim=1)
                    s = self.sums[(r, k, ref, lp.layer_idx)]
                    s[0] += picked.gather(2, oracle).float().mean().item()
                    s[1] += per_q.gather(2, own).float().mean().item()
                    s[2] += (per_q * probs).sum(-1).mean().item()
                    s[3] += oracle_mass.item()
        self.counts[lp.layer_idx] += 1
        self.middle += nm

    def rows(self, mode: str) -> list[dict]:
        layers = sorted(self.counts)
        out = []
        for r in self.ranks:
            for k in self.ks:
                for ref in ("cache", "original"):
                    per_layer = [[v / self.counts[i] for v in self.sums[(r, k, ref, i)]] for i in layers]
                    mean = [sum(x[j] for x in per_layer) / len(per_layer) for j in range(4)]
                    out.append({"mode": mode, "score_rank": r, "k": k, "reference": ref,
                                "recall_kv": round(mean[0], 4), "recall_q": round(mean[1], 4),
                                "mass_chosen": round(mean[2], 4), "mass_oracle": round(mean[3], 4),
                                "recall_kv_worst_layer": round(min(x[0] for x in per_layer), 4),
                                "queries": self.counts[layers[0]], "layers": len(layers),
                                "middle_tokens": round(self.middle / sum(self.counts.values()))})
        return out


def _per_query_head(selected: torch.Tensor, groups: int, m: int) -> torch.Tensor:
    """Indices `[b, kv_heads, k]` -> a 0/1 float mask `[b, heads, m]` (each query head sees its KV head's)."""
    b, kv, _ = selected.shape
    mask = torch.zeros(b, kv, m).scatter_(2, selected, 1.0)
    return mask.repeat_interleave(groups, dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--bases", default=str(ROOT / "artifacts" / "smollm2-bases"))
    p.add_argument("--data", default=str(ROOT / "patchkv" / "tasks" / "data" / "prose_4k.jsonl"))
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--queries", type=int, default=64, help="decode steps per document")
    p.add_argument("--ranks", default="4,8,16", help="score ranks r of TopK(k, r)")
    p.add_argument("--ks", default="32,64,128,256")
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens per forward")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=str(ROOT / "evals" / "results"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    need = args.context + args.queries
    docs = []
    for line in Path(args.data).read_text().splitlines():
        ids = tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
        if len(ids) + 1 >= need:
            docs.append(torch.tensor([[tokenizer.bos_token_id, *ids][:need]]))
        if len(docs) == args.docs:
            break
    if len(docs) < args.docs:
        p.error(f"only {len(docs)} documents of {args.data} have {need} tokens")
    ranks, ks = [int(r) for r in args.ranks.split(",")], [int(k) for k in args.ks.split(",")]
    rows = []
    for mode in ("pre_rope", "post_rope"):
        artifact = patchkv.Artifact.load(Path(args.bases) / f"{mode}.safetensors").to_dtype(dtype)
        methods = [patchkv.LowRank(16), patchkv.SinksWindow(4, 32), patchkv.TopK(64, 8)]
        with patchkv.patched(model, artifact, methods), Recorder(ranks, ks) as recorder, torch.no_grad():
            for ids in docs:
                cache = patchkv.LatentCache(model)
                for start in range(0, args.context, args.chunk):  # prefill: dense, nothing measured
                    model(input_ids=ids[:, start:min(start + args.chunk, args.context)], cache=cache, use_cache=True)
                for i in range(args.context, need):
                    model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
        for row in recorder.rows(mode):
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "topk_recall.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
