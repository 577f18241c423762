"""Calibration text: the general-domain mix shipped with the package, text files and folders, `datasets` data.

    texts = read_texts(None)                 # the shipped mix (patchkv/data/general_mix.txt.gz)
    texts = read_texts("corpus")             # the Shakespeare training works (patchkv.corpus)
    texts = read_texts("notes/")             # every .txt file under a folder
    texts = read_texts("wikitext", column="text")   # a `datasets` name or a local dataset folder (offline)

The shipped mix alternates 8,000-character pieces of modern technical prose (the Python 3 documentation
sources, PSF License) and verse/drama (Shakespeare, public domain), 2.4 M characters; `evals/build_calibration_mix.py`
builds it. Calibrating on one domain costs keys and values several points of relative error on another
(`evals/results/research_figures.md`, figure 2), so the default mixes two.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from .corpus import shakespeare_train
from .hub import expand_user

DEFAULT = Path(__file__).with_name("data") / "general_mix.txt.gz"
DATASET_FILES = (".arrow", ".parquet", ".json", ".jsonl", ".csv")


def default_texts(piece: int = 65_536) -> list[str]:
    """The shipped general-domain mix, in pieces of `piece` characters (calibration tokenizes them lazily)."""
    with gzip.open(DEFAULT, "rt", encoding="utf-8") as f:
        text = f.read()
    return [text[i:i + piece] for i in range(0, len(text), piece)]


def read_texts(spec: str | None, column: str = "text", split: str = "train") -> list[str]:
    """Texts for calibration from `spec`: None -> the shipped mix; "corpus" -> the Shakespeare training works; a
    text file (any file that is not a dataset file); a folder of .txt files (recursively);
    a folder saved by `datasets` (`save_to_disk`) or holding dataset files (.parquet, .json, .jsonl, .csv,
    .arrow); otherwise a `datasets` name, loaded offline from the local cache. `column` names the text column of a
    dataset, `split` its split."""
    if spec is None:
        return default_texts()
    if spec == "corpus":
        return shakespeare_train()
    path = expand_user(spec, FileNotFoundError)
    if path.is_file():
        if path.suffix in DATASET_FILES:
            return _dataset(str(path), column, split, files=True)
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return _dataset(str(path), column, split, saved=True)
        files = sorted(path.rglob("*.txt"))
        if files:
            return [f.read_text(encoding="utf-8", errors="replace") for f in files]
        if any(f.suffix in DATASET_FILES for f in path.rglob("*")):
            return _dataset(str(path), column, split)
        raise FileNotFoundError(f"--data {spec}: the folder holds no .txt files and no dataset files "
                                f"({', '.join(DATASET_FILES)}).")
    if spec.startswith(("./", "../", "/", "~")):
        raise FileNotFoundError(f"--data {spec}: no such file or folder.")
    return _dataset(spec, column, split)


def _dataset(spec: str, column: str, split: str, files: bool = False, saved: bool = False) -> list[str]:
    """The `column` of a `datasets` dataset: a saved folder, data files, or a name in the local cache (offline)."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"--data {spec}: reading datasets needs the `datasets` package (pip install "
                          "'patchkv[eval]').") from e
    # the local cache only: asking an unreachable Hub costs five retries, about 25 s, before the same error
    was_offline, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
    try:
        if saved:
            data = datasets.load_from_disk(spec)
            data = data[split] if isinstance(data, datasets.DatasetDict) else data
        elif files:
            kind = {".jsonl": "json"}.get(Path(spec).suffix, Path(spec).suffix.lstrip("."))
            data = datasets.load_dataset(kind, data_files=spec, split=split)
        else:
            data = datasets.load_dataset(spec, split=split)
    except Exception as e:  # datasets raises many types: not cached, no such split, bad files
        raise FileNotFoundError(f"--data {spec}: could not load it as a dataset ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:200]}). Pass a .txt file or folder, a folder saved "
                                "with save_to_disk, or the name of a dataset in the local cache.") from e
    finally:
        datasets.config.HF_HUB_OFFLINE = was_offline
    if column not in data.column_names:
        raise ValueError(f"--data {spec}: no column {column!r} (columns: {', '.join(data.column_names)}); pass "
                         "--data-column.")
    return [t for t in data[column] if isinstance(t, str) and t.strip()]
