"""Stored blocks, pre-RoPE against post-RoPE: which bases a prefix store (`patchkv.block_codec`) should code on
(results in evals/results/block_codec.csv).

    .venv/bin/python -m evals blocks --out evals/results          # a few minutes on 2 cores

SmolLM2-135M-Instruct in bfloat16. Each held-out 4k document of the perplexity tasks (the first `--docs` of prose,
Shakespeare, Milton) is cut at `--prefix` tokens: the prefix's keys and values as an engine holds them (rotated keys,
bfloat16, from one forward) are stored block by block (`--block` tokens) with each budget on each artifact's bases
and decoded back, every token coded (a store keeps no exact sinks or window). The next `--continuation` tokens are
then scored reading the decoded prefix. Per budget, mode and document: the bytes per token stored (header included),
the keys' and values' squared error relative to their energy, and the continuation's perplexity against reading
the exact prefix.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from patchkv.block_codec import BlockCodec, Rotations

from .suite import load_artifacts, load_smollm2, write_csv
from .tasks import TASKS
from .verbs import parse, parser

BUDGETS = ("4x", "8x", "16x")
DOMAINS = ("prose", "shakespeare", "milton")


def prefix_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys (rotated) and values `[seq, kv_heads, head_dim]` of every layer after one forward over `ids` `[1, seq]`."""
    cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


def stored(codec: BlockCodec, layers: list[tuple[torch.Tensor, torch.Tensor]], block: int
           ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """`layers` through the codec block by block -> (the decoded layers, the bytes stored)."""
    seq = layers[0][0].shape[0]
    parts, size = [], 0
    for start in range(0, seq, block):
        positions = torch.arange(start, min(start + block, seq))
        data = codec.encode([(k[positions], v[positions]) for k, v in layers], positions)
        size += len(data)
        parts.append(codec.decode(data, positions))
    return [tuple(torch.cat([p[i][j] for p in parts]) for j in range(2)) for i in range(len(layers))], size


def continuation_nll(model, layers: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor) -> float:
    """Mean NLL of `ids` `[1, n]` (each predicted from those before it) read after a prefix held as `layers`."""
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), i)
    logits = model(ids, past_key_values=cache, use_cache=True).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()


def relative_error(decoded: list[tuple[torch.Tensor, torch.Tensor]], exact: list[tuple[torch.Tensor, torch.Tensor]],
                   which: int) -> float:
    err = sum(((d[which].float() - e[which].float()) ** 2).sum() for d, e in zip(decoded, exact))
    return float(err / sum((e[which].float() ** 2).sum() for e in exact))


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    p = parser("blocks", __doc__, threads=0)
    p.add_argument("--docs", type=int, default=2, help="documents of each domain")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--block", type=int, default=16, help="tokens per stored block")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifacts = load_artifacts()
    rotations = Rotations.from_model(model)
    codecs = {(budget, mode): BlockCodec.from_budget(artifact, budget, rotations, block_tokens=args.block,
                                                     prefix_tokens=args.prefix)
              for budget in BUDGETS for mode, artifact in artifacts.items()}
    full = 2 * 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * model.config.head_dim
    rows = []
    for domain in DOMAINS:
        for index in range(args.docs):
            text = TASKS[f"ppl_{domain}"].documents()[index]
            ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ids[: args.prefix + args.continuation]])
            exact = prefix_kv(model, ids[:, : args.prefix])
            # the continuation's first token is predicted from the prefix: score from the prefix's last token on
            tail = ids[:, args.prefix - 1:]
            trimmed = [(k[:-1], v[:-1]) for k, v in exact]
            reference = continuation_nll(model, trimmed, tail)
            for (budget, mode), codec in codecs.items():
                decoded, size = stored(codec, exact, args.block)
                nll = continuation_nll(model, [(k[:-1], v[:-1]) for k, v in decoded], tail)
                rows.append({"budget": budget, "mode": mode, "method": codec.method.spec(),
                             "document": f"{domain}#{index}", "prefix": args.prefix, "block": args.block,
                             "stored_bytes_per_token": round(size / args.prefix, 1),
                             "compression_vs_bf16": round(full * args.prefix / size, 3),
                             "key_relative_error": round(relative_error(decoded, exact, 0), 5),
                             "value_relative_error": round(relative_error(decoded, exact, 1), 5),
                             "ppl_exact": round(math.exp(reference), 3), "ppl_stored": round(math.exp(nll), 3),
                             "ppl_change_pct": round(100 * (math.exp(nll - reference) - 1), 2)})
                print(rows[-1])
    write_csv(rows, args.out / "block_codec.csv")


if __name__ == "__main__":
    main()
