"""The C++ CPU kernels (`latent_cpu.cpp`), built once per machine and cached; None where they cannot be built.

`scripts/setup.sh` builds them (`cpu.build()`); otherwise the first use does (about half a
minute, with a compiler: gcc or clang and the Python headers). They are compiled for the machine that builds
them (`-march=native`), so the cache key includes the CPU's identity as well as the source, torch's version and
install, and the flags. `PATCHKV_CPU_KERNELS=0` disables them: the PyTorch references in `reference.py` run instead
(same results, several times slower on long caches).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("latent_cpu.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


def _cpu_identity() -> str:
    """What the build depends on besides the source: the CPU (model and instruction-set flags) and torch, by version
    and by where it is installed (each virtual environment builds its own: .venv and .venv-vllm, with the same torch,
    would otherwise rebuild over each other, a minute each time)."""
    parts = [platform.machine(), torch.__version__, str(Path(torch.__file__).parent), " ".join(FLAGS)]
    try:
        with open("/proc/cpuinfo") as f:
            parts += sorted({line for line in f if line.startswith(("model name", "flags", "Features"))})
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def enabled() -> bool:
    return os.environ.get("PATCHKV_CPU_KERNELS", "1") != "0"


@functools.cache
def extension() -> ModuleType | None:
    """The built module (`unpack`, `reconstruct`, `attend`, `encode`), or None (disabled, or the build
    failed: a warning says why, once)."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        key = hashlib.sha256(SOURCE.read_bytes() + _cpu_identity().encode()).hexdigest()[:16]

        return cpp_extension.load(name=f"patchkv_cpu_{key}", sources=[str(SOURCE)], extra_cflags=FLAGS,
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no headers, a sandbox without a writable cache: fall back
        warnings.warn(f"patchkv: the C++ CPU kernels could not be built ({type(error).__name__}: "
                      f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}); the slower PyTorch "
                      "path runs instead. Install a C++ compiler and the Python headers, or set "
                      "PATCHKV_CPU_KERNELS=0 to silence this.", RuntimeWarning, stacklevel=2)
        return None


def build() -> None:
    """Build now (`scripts/setup.sh` does, with `python -c "from patchkv.kernels import cpu; cpu.build()"`); exits with
    a message where they cannot be built."""
    import sys

    if extension() is None:
        sys.exit("patchkv: the C++ CPU kernels were not built" + ("" if enabled() else " (PATCHKV_CPU_KERNELS=0)"))
    print("patchkv: C++ CPU kernels ready")
