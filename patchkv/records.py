"""Results as a reader sees them, one way for every measurement (`patchkv report`, `patchkv eval`, `python -m evals`):
a markdown table, a CSV, and changes against a baseline written alike.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def markdown(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table: the `head` cells, then one line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def change(value: float, base: float, digits: int = 1) -> str:
    """" (+2.7%)": `value`'s relative change against `base`."""
    return f" ({100 * (value / base - 1):+.{digits}f}%)"


def difference(value: float, base: float, digits: int = 3) -> str:
    """" (+0.012)": `value`'s absolute difference from `base` (for scores such as accuracies)."""
    return f" ({value - base:+.{digits}f})"


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    """`rows` under `header` to the CSV file `path`."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return Path(path)
