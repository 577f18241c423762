"""Recall of the true top-k tokens by `TopK`'s selection, pre-RoPE (latent scoring per chunk) and post-RoPE.

    nice -n 10 .venv/bin/python evals/topk_recall.py --out evals/results

SmolLM2-135M-Instruct (bfloat16) with its bases (`artifacts/smollm2-bases`), patched with rank-16 latents,
4 sinks, a 32-token window and `TopK(64, 8)`. For each of `--docs` prose documents (the lm-eval task data),
`--context` tokens are prefilled, then the next `--queries` tokens are decoded one at a time (teacher forced).
At every decode step and every layer, the run observes the library's own attention path (it wraps
`patchkv.attention.select` and `LatentLayer.update_latent`, which then run unchanged) and makes the selection as
the patched attention makes it (`mode.approximate_scores` on the first `r` latent components, then
`TopK(k, r).select`), for several k and r; it is compared with the top-k by exact attention score over the latent
middle (`mode.middle_scores`, what the decode step itself computes):

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
from patchkv.modes import grouped_scores

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("mode", "score_rank", "k", "reference", "recall_kv", "recall_q", "mass_chosen", "mass_oracle",
          "recall_kv_worst_layer", "queries", "layers", "middle_tokens")


class Recorder:
    """Observes the library's own attention path for the run: `LatentLayer.update_latent` (keeps every key given to
    the cache, before compression) and `patchkv.attention.select` (the top-k step of a decode step, whose
    arguments it scores the selections on, with the library's own scoring), then lets both run unchanged."""

    def __init__(self, ranks: list[int], ks: list[int], scaling: float):
        self.ranks, self.ks, self.scaling = ranks, ks, scaling
        self.sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0] * 4)  # (rank, k, ref, layer) -> sums
        self.counts: dict[int, int] = defaultdict(int)  # layer -> decode queries seen
        self.middle = 0
        self._select, self._update = attention.select, LatentLayer.update_latent
        self.originals: dict[int, torch.Tensor] = {}  # layer -> every key given to it, [batch, kv_heads, n, d]

    def __enter__(self):
        recorder = self

        def update_latent(layer, keys, values, positions):
            before = recorder.originals.get(layer.patch.layer_idx)
            recorder.originals[layer.patch.layer_idx] = keys if before is None else torch.cat([before, keys], dim=2)
            return recorder._update(layer, keys, values, positions)

        def select(lp, q, seen, mask):
            with torch.no_grad():
                recorder.measure(lp, q, seen, mask)
            return recorder._select(lp, q, seen, mask)

        attention.select, LatentLayer.update_latent = select, update_latent
        return self

    def __exit__(self, *exc):
        attention.select, LatentLayer.update_latent = self._select, self._update

    def reset(self) -> None:
        """A new document: a new cache."""
        self.originals.clear()

    def measure(self, lp, q, seen, mask) -> None:
        mode, groups = lp.patch.mode, lp.keys.basis.query_groups
        ns, nm = seen.sink_keys.shape[2], seen.middle_len
        bias = 0 if mask is None else _additive(mask)[:, :, -1, ns:ns + nm]
        scaling = self.scaling
        b, h = q.shape[:2]
        qg = q.float().reshape(b, h // groups, groups, -1)
        original = mode.exact_keys(lp, self.originals[lp.layer_idx][:, :, ns:ns + nm].float(), seen.middle_positions)
        references = {"cache": mode.middle_scores(lp, seen, qg).reshape(b, h, nm) + bias,
                      "original": grouped_scores(qg, original).reshape(b, h, nm) + bias}
        coeffs = lp.keys.decode(seen.middle_keys.unsqueeze(1))
        approx = {r: mode.approximate_scores(lp, q, coeffs[..., :r], seen.middle_positions) + bias for r in self.ranks}
        m = nm
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
        with patchkv.patched(model, artifact, methods), Recorder(ranks, ks, model.model.layers[0].self_attn.scaling) as recorder, torch.no_grad():
            for ids in docs:
                recorder.reset()
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
