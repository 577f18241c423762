"""Results as a reader sees them, one way for every measurement (`patchkv report`, `patchkv eval`, `python -m evals`):
one record of what was measured (`Result`: a configuration on a task, or on one sample of it), a markdown table, a
CSV, changes against a baseline written alike, and a plot of points in panels with one line per method family, a log
axis where the values span a decade or more, and labels moved apart so none covers another.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(kw_only=True)
class Result:
    """One configuration (`config`, its name) measured on one task (`task`: a task's name, or a text's), at `context`
    tokens where the task has one (0: none): `score` is the task's headline metric (perplexity, an accuracy), or for
    one sample of a perplexity task (`index`) the sum of next-token negative log-likelihoods in nats over `count`
    tokens, so samples add up; `count` is what the score is over (tokens, samples, needles tried). The KV bytes per
    token its cache held after it and their compression against the 16-bit cache (nan where not measured); for a
    sample, the seconds it took; `prediction`, the text it decoded (an answer, a continuation).

    The fields from `config` to `prediction` are, in order, those of a suite's per-sample record
    (`python -m evals run`'s JSONL lines, `SAMPLE_FIELDS`)."""

    config: str
    task: str
    context: int = 0
    index: int = 0
    score: float
    count: int = 1
    kv_bytes_per_token: float
    seconds: float = 0.0
    prediction: str = ""
    compression: float = math.nan


#: what a per-sample record of the suite holds of a `Result`, in the order its JSONL lines have always held them
SAMPLE_FIELDS = ("config", "task", "context", "index", "score", "count", "kv_bytes_per_token", "seconds", "prediction")


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


@dataclass(frozen=True)
class Point:
    """One configuration's value in one panel: `family` names its line, `label` is written beside it, `error` is the
    half-width of its interval (0: none)."""

    panel: str
    family: str
    x: float
    y: float
    label: str = ""
    error: float = 0.0


#: a span of values (largest over smallest) from which an axis is drawn logarithmic
LOG_SPAN = 10.0
FONT = 7
#: panels to a row
COLUMNS = 3


def spans_decades(values: Iterable[float]) -> bool:
    """Whether positive `values` span `LOG_SPAN` or more (and so read better on a log axis)."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) >= LOG_SPAN


def plot(points: Sequence[Point], path: Path, *, xlabel: str, ylabel: str | Mapping[str, str],
         baselines: Mapping[str, float] | None = None, titles: Mapping[str, str] | None = None,
         columns: int = COLUMNS) -> Path | None:
    """One panel per `panel` (in order of appearance, `columns` to a row), one line per family joining its points by
    x, each family in one colour in every panel and named once in a legend beside the panels, each point labelled in
    its line's colour; a dashed line at each panel's unpatched baseline (`baselines`); `ylabel` one for all panels
    or one per panel. Written to `path` (PNG); None, with nothing written, where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError:
        return None
    panels = list(dict.fromkeys(p.panel for p in points))
    ylabels = {panel: ylabel if isinstance(ylabel, str) else ylabel[panel] for panel in panels}
    base = dict(baselines or {})
    families = list(dict.fromkeys(p.family for p in points))
    palette = plt.get_cmap("tab10" if len(families) <= 10 else "tab20").colors
    colours = {family: palette[i % len(palette)] for i, family in enumerate(families)}
    # one scale per quantity: x over every panel, y over the panels of one label
    xlog = spans_decades(p.x for p in points)
    ylog = {label: spans_decades([p.y for p in points if ylabels[p.panel] == label]
                                 + [v for panel, v in base.items() if ylabels.get(panel) == label])
            for label in set(ylabels.values())}
    rows, width = -(-len(panels) // columns), min(columns, len(panels))
    fig, axes = plt.subplots(rows, width, figsize=(5.5 * width, 4.2 * rows), squeeze=False)
    handles: dict[str, Any] = {}
    for ax, panel in zip(axes.flat, panels):
        here = [p for p in points if p.panel == panel]
        for family in dict.fromkeys(p.family for p in here):
            line = sorted((p for p in here if p.family == family), key=lambda p: p.x)
            handles[family] = ax.errorbar([p.x for p in line], [p.y for p in line], yerr=[p.error for p in line],
                                          marker="o", capsize=3 if any(p.error for p in line) else 0,
                                          linestyle="-" if len(line) > 1 else "none", label=family,
                                          color=colours[family])
        if panel in base:
            handles["unpatched"] = ax.axhline(base[panel], color="gray", linestyle="--", label="unpatched")
        ax.set_xscale("log" if xlog else "linear")
        ax.set_yscale("log" if ylog[ylabels[panel]] else "linear")
        for axis, log in ((ax.xaxis, xlog), (ax.yaxis, ylog[ylabels[panel]])):
            if log:  # ticks at 1, 2, 5 of each decade, written plainly
                axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel + (" (log)" if xlog else ""))
        ax.set_ylabel(ylabels[panel] + (" (log)" if ylog[ylabels[panel]] else ""))
        ax.set_title((titles or {}).get(panel, panel))
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=FONT + 1)
    fig.canvas.draw()  # the scales and limits the labels are placed by
    for ax, panel in zip(axes.flat, panels):
        _label(ax, [p for p in points if p.panel == panel], colours)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def _label(ax: Any, points: Sequence[Point], colours: Mapping[str, Any]) -> None:
    """Write each point's label beside it, in its family's colour (`colours`): above right where that covers neither
    a label already placed, nor another point's marker, else the first free place among below right,
    above left, below left, then further above or below (with a leader line); where none is free within the panel,
    the place covering the fewest. Measured on the drawn figure."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    placed: list[Any] = []
    radius = 4 * ax.figure.dpi / 72  # a default marker's, pixels
    markers = [(p, Bbox.from_bounds(*(ax.transData.transform((p.x, p.y)) - radius), 2 * radius, 2 * radius))
               for p in points]
    for p in sorted((p for p in points if p.label), key=lambda p: (p.y, p.x)):
        others = placed + [box for q, box in markers if q is not p]
        note = ax.annotate(p.label, (p.x, p.y), xytext=(0, 0), textcoords="offset points", fontsize=FONT)
        note.update_positions(renderer)
        box = Text.get_window_extent(note, renderer)  # the text alone, without a leader line; pixels
        w, h, gap = box.width, box.height, 3 * ax.figure.dpi / 72
        near = [(gap, gap), (gap, -gap - h), (-gap - w, gap), (-gap - w, -gap - h)]
        far = [(gap, sign * (gap + k * h)) for k in range(1, 6) for sign in (1, -1)]
        spots = [(dx, dy, box.translated(dx, dy)) for dx, dy in near + far]
        free = [s for s in spots if inside.contains(s[2].x0, s[2].y0) and inside.contains(s[2].x1, s[2].y1)]
        dx, dy, spot = min(free or spots, key=lambda s: sum(s[2].overlaps(other) for other in others))
        note.remove()
        leader = {"arrowstyle": "-", "color": "gray", "lw": 0.5} if (dx, dy) not in near else None
        ax.annotate(p.label, (p.x, p.y), xytext=(dx * 72 / ax.figure.dpi, dy * 72 / ax.figure.dpi),
                    textcoords="offset points", fontsize=FONT, arrowprops=leader, color=colours[p.family])
        placed.append(spot)
