"""The prefix store's disk tier and its lossless stage on real blocks: how many bytes a spilled block takes with and
without DEFLATE, and what spilling and reading it back cost beside decoding it (results in evals/results/spill.csv).

    .venv/bin/python -m evals spill --out evals/results --threads 1       # a few minutes on 2 cores

SmolLM2-135M-Instruct in bfloat16, the store's codec (`patchkv.block_codec` on the pre-RoPE bases, the first 4
positions exact). Each held-out 4k document of the perplexity tasks (the first `--docs` of prose, Shakespeare,
Milton) is cut at `--prefix` tokens; its keys and values as an engine holds them (one forward) are coded block by
block (`--block` tokens, as the vLLM connector stores them) and put into a `PrefixStore` whose memory holds one
block, so every other block is spilled to a folder, once with the blocks written as they are and once with
`compress="deflate"`; every spilled block is then read back (checked bit-exact) by a store reopened on the folder
with room for all in memory, and decoded. Per budget and document: the bytes per token of the spilled blocks in memory
and in their files (headers included), DEFLATE's ratio, and per block the median milliseconds to spill, to read back
and to decode, timed side by side in one run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from patchkv.block_codec import BlockCodec, Rotations
from patchkv.prefix_store import PrefixStore, Spill, block_keys

from .bench_blocks import BUDGETS, DOMAINS, prefix_kv
from .suite import load_artifacts, load_smollm2, write_csv
from .tasks import TASKS
from .verbs import parse, parser


def timed_ms(action) -> tuple[object, float]:
    began = time.perf_counter()
    out = action()
    return out, 1000 * (time.perf_counter() - began)


def spill_round(blocks: dict[bytes, bytes], folder: Path, compress: str | None, level: int) -> dict:
    """`blocks` through a store that keeps one in memory and spills the rest -> the spilled keys, their files'
    bytes, medians of the milliseconds to put (each put spills the block before it) and to read back a spilled
    block."""
    largest = max(len(b) for b in blocks.values())
    spill = Spill(folder, 1 << 40, compress=compress, level=level)
    store = PrefixStore(largest, spill)
    puts = [timed_ms(lambda: store.put(key, data, len(data)))[1] for key, data in blocks.items()]
    spilled, disk_bytes = store.disk_keys(), store.disk_bytes
    # read back by a store reopened on the folder with room for every block in memory: a read spills nothing
    store = PrefixStore(sum(len(b) for b in blocks.values()), spill)
    if store.disk_keys() != spilled:
        raise AssertionError("the reopened store does not find the blocks spilled")
    reads = []
    for key in spilled:
        data, ms = timed_ms(lambda: store.get(key))
        if data != blocks[key]:
            raise AssertionError(f"a block read back from disk ({compress}) differs from the one spilled")
        reads.append(ms)
    return {"disk_bytes": disk_bytes, "spilled": spilled, "spill_ms": statistics.median(puts[1:]),
            "read_ms": statistics.median(reads)}


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    p = parser("spill", __doc__, threads=0)
    p.add_argument("--docs", type=int, default=1, help="documents of each domain")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--block", type=int, default=32, help="tokens per stored block")
    p.add_argument("--level", type=int, default=Spill.level, help="zlib level of the lossless stage")
    args = parse(p, argv)
    model, tokenizer = load_smollm2()
    artifact = load_artifacts()["pre_rope"]
    rotations = Rotations.from_model(model)
    full = 2 * 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * model.config.head_dim
    rows = []
    for domain in DOMAINS:
        for index in range(args.docs):
            text = TASKS[f"ppl_{domain}"].documents()[index]
            ids = ([tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"])[:args.prefix]
            layers = prefix_kv(model, torch.tensor([ids]))
            for budget in BUDGETS:
                codec = BlockCodec.from_budget(artifact, budget, rotations, block_tokens=args.block,
                                               prefix_tokens=args.prefix)
                keys = block_keys(codec.fingerprint, ids, args.block)
                positions = [torch.arange(i * args.block, (i + 1) * args.block) for i in range(len(keys))]
                blocks = {key: codec.encode([(k[p], v[p]) for k, v in layers], p) for key, p in zip(keys, positions)}
                decode = statistics.median(timed_ms(lambda: codec.decode(blocks[key], p))[1]
                                           for key, p in zip(keys, positions))
                with tempfile.TemporaryDirectory() as folder:
                    raw = spill_round(blocks, Path(folder) / "raw", None, args.level)
                    packed = spill_round(blocks, Path(folder) / "deflate", "deflate", args.level)
                # the spilled blocks: all but the one kept in memory
                tokens = len(raw["spilled"]) * args.block
                memory = sum(len(blocks[key]) for key in raw["spilled"]) / tokens
                rows.append({"budget": budget, "method": codec.method.spec(), "document": f"{domain}#{index}",
                             "block": args.block, "spilled_blocks": len(raw["spilled"]), "level": args.level,
                             "memory_bytes_per_token": round(memory, 1),
                             "file_bytes_per_token_raw": round(raw["disk_bytes"] / tokens, 1),
                             "file_bytes_per_token_deflate": round(packed["disk_bytes"] / tokens, 1),
                             "deflate_ratio": round(raw["disk_bytes"] / packed["disk_bytes"], 4),
                             "compression_vs_bf16_memory": round(full / memory, 3),
                             "compression_vs_bf16_deflate": round(full * tokens / packed["disk_bytes"], 3),
                             "spill_ms_raw": round(raw["spill_ms"], 3),
                             "spill_ms_deflate": round(packed["spill_ms"], 3),
                             "read_ms_raw": round(raw["read_ms"], 3), "read_ms_deflate": round(packed["read_ms"], 3),
                             "decode_ms": round(decode, 3)})
                print(rows[-1], flush=True)
    write_csv(rows, args.out / "spill.csv")


if __name__ == "__main__":
    main()
