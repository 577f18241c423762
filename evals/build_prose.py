"""Build the modern-prose evaluation set and a disjoint calibration text from the Python documentation sources.

    apt-get install -y python3-doc        # Debian: /usr/share/doc/python3.X/html/_sources/**/*.rst.txt
    .venv/bin/python -m evals build-prose [--sources DIR]

Writes (deterministic; the outputs are committed):
  patchkv/tasks/data/prose_heldout.jsonl   lm-eval documents {"text": ...} from held-out files (~300 KB)
  evals/data/prose_calibration.txt         text of other, disjoint files (~1.4 MB) for calibration

The split is by whole source files: each file's place in the order of sha256(relative path) decides whether
it is held out, used for calibration or left out, so no file contributes to both. The texts are the
reStructuredText sources of the Python 3 documentation, Copyright (c) 2001-2023 Python Software Foundation,
distributed under the PSF License Agreement (https://docs.python.org/3/license.html); the derived files
carry that notice.
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path

from .suite import ROOT
from .verbs import parse, parser

HELDOUT = ROOT / "patchkv" / "tasks" / "data" / "prose_heldout.jsonl"
CALIBRATION = ROOT / "evals" / "data" / "prose_calibration.txt"
HELDOUT_BYTES = 300_000
CALIBRATION_BYTES = 1_400_000
NOTICE = ("Derived from the Python 3 documentation sources (Debian python3-doc), Copyright (c) 2001-2023 "
          "Python Software Foundation, PSF License Agreement: https://docs.python.org/3/license.html")
# changelogs and legal texts are lists, not prose
SKIP = ("whatsnew/changelog", "license", "copyright")


def find_sources() -> Path:
    hits = sorted(glob.glob("/usr/share/doc/python3*/html/_sources"))
    for hit in hits:
        if list(Path(hit).rglob("*.rst.txt")):
            return Path(hit)
    raise SystemExit("Python documentation sources not found: apt-get install -y python3-doc")


def paragraphs_chunks(text: str, max_chars: int = 3000) -> list[str]:
    """Split at blank lines into documents of at most ~max_chars (a longer paragraph stays whole)."""
    paras = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    out, cur = [], ""
    for p in paras:
        if cur and len(cur) + len(p) + 2 > max_chars:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{p}" if cur else p
    if cur:
        out.append(cur)
    return out


def main(argv: list[str] | None = None) -> None:
    p = parser("build-prose", __doc__, out=None, threads=None)
    p.add_argument("--sources", type=Path, default=None, help="the .rst.txt sources (default: python3-doc's)")
    args = parse(p, argv)
    src = args.sources or find_sources()
    files = [p for p in src.rglob("*.rst.txt") if not any(s in p.relative_to(src).as_posix() for s in SKIP)]
    files = [p for p in files if 2_000 <= p.stat().st_size <= 150_000]
    files.sort(key=lambda p: hashlib.sha256(p.relative_to(src).as_posix().encode()).hexdigest())
    held, calib, n_held, n_calib = [], [], 0, 0
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        size = len(text.encode())
        if n_held < HELDOUT_BYTES:
            held.append((p, text))
            n_held += size
        elif n_calib + size <= CALIBRATION_BYTES:
            calib.append((p, text))
            n_calib += size
    assert not {p for p, _ in held} & {p for p, _ in calib}
    docs = [c for _, text in held for c in paragraphs_chunks(text)]
    HELDOUT.parent.mkdir(parents=True, exist_ok=True)
    HELDOUT.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    CALIBRATION.parent.mkdir(parents=True, exist_ok=True)
    CALIBRATION.write_text(f"{NOTICE}\n\n" + "\n\n".join(text for _, text in calib), encoding="utf-8")
    (CALIBRATION.parent / "README.md").write_text(
        f"# evals/data\n\n`prose_calibration.txt` and `patchkv/tasks/data/prose_heldout.jsonl` are built by "
        f"`evals/build_prose.py`. {NOTICE}.\n\nHeld-out files ({len(held)}): "
        + ", ".join(p.relative_to(src).as_posix() for p, _ in held)
        + f"\n\nCalibration files: {len(calib)} others (disjoint).\n", encoding="utf-8")
    print(f"{HELDOUT}: {len(docs)} documents from {len(held)} files, {HELDOUT.stat().st_size} bytes")
    print(f"{CALIBRATION}: {len(calib)} files, {CALIBRATION.stat().st_size} bytes")


if __name__ == "__main__":
    main()
