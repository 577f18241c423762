"""The GPU script at tiny sizes on CPU (`evals/gpu_check.sh --cpu-smoke`): every step ran, the GEMM and scaling CSVs
have their rows and columns. No timing asserts."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """`evals/gpu_check.sh --cpu-smoke`: the GPU script's steps at tiny sizes on CPU, its output folder."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "evals" / "gpu_check.sh"), "--cpu-smoke"], env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return out


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_gpu_check_smoke_ran_every_step(smoke):
    log = (smoke / "log.txt").read_text()
    assert "kernels ok" in log and log.count("== ") == 4
    assert sorted(p.name for p in smoke.iterdir()) == ["env.txt", "gemm.csv", "gemm.csv.provenance.json", "gemm.png",
                                                       "log.txt", "scaling.csv", "scaling.csv.provenance.json",
                                                       "scaling.png"]


def test_gemm_csv(smoke):
    """Head dims 1, 8, 64 and ranks 8, 32, as gpu_check.sh --cpu-smoke runs it."""
    got = rows(smoke / "gemm.csv")
    assert list(got[0]) == ["sweep", "op", "heads", "seq", "inner_dim", "hidden", "ms", "tflops", "efficiency",
                            "flops_per_byte", "dtype", "device", "threads", "conditions"]
    keys = {(r["sweep"], r["op"], int(r["inner_dim"])) for r in got}
    expected = {("head_dim", op, d) for op in ("qK", "pV") for d in (1, 8, 64)}
    expected |= {("latent_rank", op, r) for op in ("qK", "pV") for r in (8, 32)}
    assert keys == expected | {("peak", "square", 256)}
    for r in got:
        assert float(r["tflops"]) > 0 and float(r["efficiency"]) > 0
    assert (smoke / "gemm.png").stat().st_size > 0


def test_scaling_csv(smoke):
    """The scaling step's rows, as gpu_check.sh --cpu-smoke runs it: 512 tokens prefilled, batch 1, on CPU (batch 8
    on CPU: test_bench_scaling.py)."""
    got = rows(smoke / "scaling.csv")
    methods = ["unpatched", "unpatched-eager", *(["quanto-int4"] if _quanto() else []), "8x", "8x-top256"]
    assert [(r["method"], int(r["batch"])) for r in got] == [(m, 1) for m in methods]
    for r in got:
        assert r["device"] == "cpu" and int(r["context"]) == 512 and float(r["decode_s"]) > 0
        assert float(r["middle_s"]) > 0 if r["method"].startswith("8x") else float(r["middle_s"]) == 0


def _quanto() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True
