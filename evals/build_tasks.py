"""Build the local lm-eval task data from the corpus (deterministic; the outputs are committed).

    python evals/build_tasks.py

Writes patchkv/tasks/data/{shakespeare_heldout,milton,shakespeare_cloze}.jsonl. The Shakespeare files use
only the held-out works (patchkv.corpus.HELD_OUT), never seen in training or calibration.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from patchkv.corpus import milton, shakespeare_held_out

DATA = Path(__file__).resolve().parents[1] / "patchkv" / "tasks" / "data"


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


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    held = shakespeare_held_out()
    write("shakespeare_heldout", [{"text": t} for t in chunks(held)])
    write("milton", [{"text": t} for t in chunks(milton())[::3]])
    write("shakespeare_cloze", cloze(held))


if __name__ == "__main__":
    main()
