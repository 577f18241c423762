"""Quick accuracy check on SmolLM2: token perplexity of one 1024-token prose window, fed `--chunk` tokens per
forward through the cache, unpatched vs DP codes (4 sinks, 32-token window) per-head and global pools.

    python evals/smollm2_window.py --chunk 32        # prints each config's perplexity and its change
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchkv

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"


@torch.no_grad()
def window_ppl(model, ids: torch.Tensor, chunk: int) -> float:
    cache, logprobs = None, []
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True)
        cache = out.cache
        logprobs.append(out.logits[0].float().log_softmax(-1))
    logprobs = torch.cat(logprobs)[:-1]
    return math.exp(-logprobs.gather(1, ids[0, 1:, None]).mean().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--bases", default=str(ROOT / "artifacts" / "smollm2-bases" / "pre_rope.safetensors"))
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16).eval()
    doc = json.loads((ROOT / "patchkv/tasks/data/prose_4k.jsonl").read_text().splitlines()[0])["text"]
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(doc, add_special_tokens=False)["input_ids"][:1023]]])
    base = window_ppl(model, ids, args.chunk)
    print(f"unpatched {base:.3f}")
    artifact = patchkv.Artifact.load(args.bases)
    for pool, bits in (("global", 256), ("head", 256), ("global", 128), ("head", 128), ("global", 64)):
        with patchkv.patched(model, artifact, [patchkv.SinksWindow(4, 32), patchkv.Quantized(bits, pool=pool)]):
            ppl = window_ppl(model, ids, args.chunk)
        print(f"{pool} {bits} bits/head: {ppl:.3f} ({100 * (ppl / base - 1):+.1f}%)", flush=True)


if __name__ == "__main__":
    main()
