"""`evals/bench_decode.py` on the tiny reference model at a tiny context: every method ran in every round, the
CSVs have their rows and columns, the ratios are computed against the unpatched model. No timing asserts."""

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "evals" / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_smoke(tmp_path):
    bench = load()
    result = subprocess.run([sys.executable, str(ROOT / "evals" / "bench_decode.py"),
                             "--model", str(ROOT / "artifacts" / "reference-llama"),
                             "--bases", str(ROOT / "artifacts" / "reference-llama-bases"),
                             "--contexts", "48,80", "--rounds", "2", "--steps", "2", "--chunk", "32",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with open(tmp_path / "decode.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(bench.FIELDS)
    assert [(int(r["context"]), r["method"]) for r in rows] == [(c, m) for c in (48, 80) for m in bench.CONFIGS]
    for r in rows:
        assert float(r["step_ms_median"]) > 0 and float(r["ratio_q1"]) <= float(r["ratio_vs_unpatched"]) <= float(
            r["ratio_q3"])
        target = bench.CONFIGS[r["method"]].target
        assert r["target"] == ("" if target is None else str(target))
        assert r["target_met"] in (("",) if target is None else ("yes", "no"))
        if r["method"] == "unpatched":
            assert float(r["ratio_vs_unpatched"]) == 1.0 and float(r["kv_bytes_per_token"]) > 0
            full = float(r["kv_bytes_per_token"])
        elif r["method"] == "unpatched-eager":
            assert float(r["kv_bytes_per_token"]) == full and r["spec"] == "DynamicCache, eager"
        elif r["method"] in ("post-r16", "pre-r16"):  # rank 16 of head dim 64, plus the position track
            assert float(r["kv_bytes_per_token"]) < full / 3
    with open(tmp_path / "decode_rounds.csv", newline="") as f:
        timed = list(csv.DictReader(f))
    assert len(timed) == 2 * 2 * len(bench.CONFIGS) and all(len(r["step_ms"].split()) == 2 for r in timed)
    assert (tmp_path / "decode.png").stat().st_size > 0
