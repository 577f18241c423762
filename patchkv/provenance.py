"""Where a result came from: the commit (when patchkv runs from a git checkout), command, machine, versions, date.

Every result file patchkv or its benchmarks write names these (`patchkv report`'s report.md, the benchmarks'
`<file>.provenance.json` sidecars).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


CHECKOUT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


#: tracked files a change to which leaves a checkout clean: the results the benchmarks append to (a run's records
#: would make the next run's look run from changed code)
RESULTS = "evals/results"


def commit() -> str:
    """The checkout's short commit, with `+dirty` if tracked files other than `RESULTS` changed; "unknown" outside a
    git checkout."""
    head = _git("rev-parse", "--short", "HEAD")
    if head == "unknown":
        return head
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS}")
    return head + ("+dirty" if changed else "")


def machine() -> str:
    """CPU model name and core count."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def provenance() -> dict[str, object]:
    """{commit, command, machine, threads, patchkv, torch, transformers, date}."""
    import transformers

    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("patchkv")
    except PackageNotFoundError:
        ours = "unknown"
    program = sys.argv[0]  # a package run with -m (python -m evals ...), a script, or a console script (patchkv ...)
    if program.endswith("__main__.py"):
        command = [Path(sys.executable).name, "-m", Path(program).parent.name]
    elif program.endswith(".py"):
        command = [Path(sys.executable).name, program]
    else:
        command = [Path(program).name]
    return {"commit": commit(), "command": " ".join(command + sys.argv[1:]), "machine": machine(),
            "threads": torch.get_num_threads(), "patchkv": ours, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
