"""Build the local lm-eval task data from the corpus (deterministic; the outputs are committed).

    python -m evals build-tasks

Writes patchkv/tasks/data/{shakespeare_heldout,milton,shakespeare_cloze}.jsonl. The Shakespeare files use
only the held-out works (patchkv.corpus.HELD_OUT), never seen in training or calibration.

With the SmolLM2 folder present (scripts/get_smollm2.py), also writes the 4k-context perplexity documents
{shakespeare,milton,prose}_4k.jsonl: consecutive documents of those files (prose: prose_heldout.jsonl, from
evals/build_prose.py) joined and cut to exactly 4095 SmolLM2 tokens each, so that every document is one
4096-token window (the prefix token + 4095 scored tokens) for `patchkv_*_ppl_4k`.
"""

from __future__ import annotations

import json
import random

from patchkv.corpus import milton, shakespeare_held_out

from .suite import ROOT, SMOLLM2
from .verbs import parse, parser

DATA = ROOT / "patchkv" / "tasks" / "data"
LONG_TOKENS = 4095


def chunks(texts: list[str], lines_per_chunk: int = 40) -> list[str]:
    out = []
    for text in texts:
        lines = [line for line in text.splitlines() if line.strip()]
        out += ["\n".join(lines[i:i + lines_per_chunk]) for i in range(0, len(lines), lines_per_chunk)]
    return out


def cloze(texts: list[str], n: int = 600, context_lines: int = 8, seed: int = 0) -> list[dict]:
    """Pick the true next line of verse or prose among four, the other three drawn from elsewhere."""
    rng = random.Random(seed)
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    candidates = [i for i in range(context_lines, len(lines)) if 20 <= len(lines[i]) <= 80]
    docs = []
    for i in rng.sample(candidates, n):
        true = lines[i]
        pool = [j for j in rng.sample(candidates, 64) if abs(len(lines[j]) - len(true)) <= 12 and lines[j] != true]
        distractors = [lines[j] for j in pool[:3]]
        if len(distractors) < 3:
            continue
        label = rng.randrange(4)
        choices = distractors[:label] + [true] + distractors[label:]
        docs.append({"context": "\n".join(lines[i - context_lines:i]) + "\n", "choices": choices, "label": label})
    return docs


def write(name: str, rows: list[dict]) -> None:
    path = DATA / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} documents")


def long_documents(texts: list[str], tokenizer, tokens: int = LONG_TOKENS) -> list[str]:
    """Join consecutive texts and cut the token stream into documents of exactly `tokens` tokens (the rest dropped)."""
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[i:i + tokens]) for i in range(0, len(ids) - tokens + 1, tokens)]


def main(argv: list[str] | None = None) -> None:
    parse(parser("build-tasks", __doc__, out=None, threads=None), argv)
    DATA.mkdir(parents=True, exist_ok=True)
    held = shakespeare_held_out()
    write("shakespeare_heldout", [{"text": t} for t in chunks(held)])
    write("milton", [{"text": t} for t in chunks(milton())[::3]])
    write("shakespeare_cloze", cloze(held))
    if SMOLLM2.is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
        for name in ("shakespeare_heldout", "milton", "prose_heldout"):
            texts = [json.loads(line)["text"] for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
            write(f"{name.split('_')[0]}_4k", [{"text": t} for t in long_documents(texts, tokenizer)])


if __name__ == "__main__":
    main()
