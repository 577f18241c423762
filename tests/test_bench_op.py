"""The GPU script and both benchmarks at tiny sizes on CPU (`evals/gpu_check.sh --cpu-smoke`): every step ran, the
CSVs have their rows and columns, stages sum to the total; and the operator benchmark's staged decode step
returns what the library's own `_attend` returns. No timing asserts."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "evals" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """`evals/gpu_check.sh --cpu-smoke`: the GPU script's steps at tiny sizes on CPU, its output folder."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "evals" / "gpu_check.sh"), "--cpu-smoke"], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return out


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_gpu_check_smoke_ran_every_step(smoke):
    log = (smoke / "log.txt").read_text()
    assert "kernels ok" in log and log.count("== ") == 4
    assert sorted(p.name for p in smoke.iterdir()) == ["attention_op.csv", "attention_op.png", "env.txt", "gemm.csv",
                                                      "gemm.png", "log.txt"]


def test_attention_op_csv(smoke):
    """Contexts 1024 and 2048, top-k 128, as gpu_check.sh --cpu-smoke runs it."""
    bench = load("bench_attention_op")
    got = rows(smoke / "attention_op.csv")
    assert list(got[0]) == list(bench.FIELDS)
    methods = list(bench.method_specs(32, 128, 16, 128))
    assert {(int(r["context"]), r["method"]) for r in got} == {(c, m) for c in (1024, 2048) for m in methods}
    for context in (1024, 2048):
        for method in methods:
            mine = [r for r in got if int(r["context"]) == context and r["method"] == method]
            total = [r for r in mine if r["stage"] == "total"]
            assert len(total) == 1 and mine[-1] is total[0]
            stages = [r["stage"] for r in mine[:-1]]
            assert stages and set(stages) <= set(bench.STAGES) and len(set(stages)) == len(stages)
            assert float(total[0]["ms"]) == pytest.approx(sum(float(r["ms"]) for r in mine[:-1]), abs=1e-3)
            assert int(total[0]["bytes_read"]) > 0 and float(total[0]["bandwidth_bound_ms"]) > 0
            if "top" in method:
                assert {"score", "select"} <= set(stages)
            if method == "sdpa":
                assert stages == ["attention"] and float(total[0]["ratio_vs_sdpa"]) == 1.0
    assert (smoke / "attention_op.png").stat().st_size > 0


@pytest.mark.parametrize("method", ["post-r32", "pre-r32", "pre-r32-top128", "post-r32-top128", "dp-pre-128bits"])
def test_staged_step_is_the_library_step(method):
    """The benchmark times what the library runs: its staged step returns `_attend`'s output."""
    from patchkv.attention import _attend

    bench = load("bench_attention_op")
    device = torch.device("cpu")
    layer = bench.Layer(bench.Shape(), device)
    lp, artifact = layer.patch(bench.method_specs(32, 128, 16, 128)[method])
    cache = layer.latent_cache(lp, artifact, 1024, chunk=512)
    cos, sin = layer.rope.at(torch.tensor([[1024]]), like=layer.q)
    with torch.no_grad():
        staged = bench.patchkv_step(layer, lp, cache, cos, sin, bench.Clock(device))
        library, _ = _attend(layer.attn, lp, cache, layer.q, cos, sin, None, {})
    assert staged.shape == library.shape == (1, 1, 32, 128)
    assert torch.equal(staged, library)


def test_gemm_csv(smoke):
    """Head dims 1, 8, 64 and ranks 8, 32, as gpu_check.sh --cpu-smoke runs it."""
    bench = load("bench_gemm")
    got = rows(smoke / "gemm.csv")
    assert list(got[0]) == list(bench.FIELDS)
    keys = {(r["sweep"], r["op"], int(r["inner_dim"])) for r in got}
    expected = {("head_dim", op, d) for op in ("qK", "pV") for d in (1, 8, 64)}
    expected |= {("latent_rank", op, r) for op in ("qK", "pV") for r in (8, 32)}
    assert keys == expected | {("peak", "square", 256)}
    for r in got:
        assert float(r["tflops"]) > 0 and float(r["efficiency"]) > 0
    assert (smoke / "gemm.png").stat().st_size > 0
