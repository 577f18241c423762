"""`python -m evals throughput` (evals/bench_throughput.py) on SmolLM2 at tiny contexts: every path and method ran in every round, the CSV has
its columns and rows, ratios are taken against the unpatched model and QuantizedCache of the same rounds, the
table reads the CSV, the provenance names the commit. No timing asserts."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("optimum.quanto")

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["path", "method", "context", "tokens", "seconds", "ratio_to_unpatched", "ratio_to_quantizedcache"]


@pytest.mark.parametrize("rounds", [pytest.param(1, id="short"), pytest.param(2, id="full", marks=pytest.mark.slow)])
def test_bench_throughput_smoke(tmp_path, rounds):
    assert (ROOT / ".models" / "SmolLM2-135M-Instruct").is_dir(), "run `bash scripts/setup.sh` first"
    run = [sys.executable, "-m", "evals", "throughput", "--context", "512", "--decode-contexts", "576",
           "--forward-methods", "unpatched,quanto-int4,8x", "--decode-methods", "unpatched,unpatched-eager,8x",
           "--calib-tokens", "512", "--rounds", str(rounds), "--out", str(tmp_path), "--name", "tp"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with open(tmp_path / "tp.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == FIELDS
    assert [(r["path"], r["method"], int(r["context"])) for r in rows] == [
        ("forward64", m, 512) for m in ("unpatched", "quanto-int4", "8x")] + [
        ("decode", m, 576) for m in ("unpatched", "unpatched-eager", "8x")] + [
        ("calibrate", m, 512) for m in ("forward", "calibrate", "calibrate+fisher")]
    for r in rows:
        assert float(r["seconds"]) > 0 and float(r["ratio_to_unpatched"]) > 0
    forward = {r["method"]: r for r in rows if r["path"] == "forward64"}
    assert float(forward["quanto-int4"]["ratio_to_quantizedcache"]) == 1.0
    assert float(forward["unpatched"]["ratio_to_unpatched"]) == 1.0  # the only unpatched attention in that group
    decode = {r["method"]: r for r in rows if r["path"] == "decode"}
    # against the faster unpatched attention of each round: neither unpatched one can be below it
    assert all(float(decode[m]["ratio_to_unpatched"]) >= 1.0 for m in ("unpatched", "unpatched-eager"))
    assert all(r["ratio_to_quantizedcache"] == "" for r in decode.values())  # no QuantizedCache in that group
    assert (tmp_path / "tp.png").stat().st_size > 0
    side = json.loads((tmp_path / "tp.csv.provenance.json").read_text())
    assert side["commit"] and side["command"].split()[1:4] == ["-m", "evals", "throughput"]
    table = subprocess.run([sys.executable, "-m", "evals", "throughput", "--table", "--out", str(tmp_path), "--name",
                            "tp"], capture_output=True, text=True, cwd=ROOT)
    assert table.stdout.count("\n| ") == len(rows)


def test_the_plot_draws_only_groups_measured_against_unpatched_attention(tmp_path):
    """A run without an unpatched method has no ratio to draw: no plot is left (an earlier one of its name removed);
    otherwise one panel per path and context that has ratios."""
    from evals.bench_throughput import plot

    path = tmp_path / "tp.png"
    row = {"path": "decode", "context": 8192, "tokens": 1, "seconds": 0.2, "ratio_to_quantizedcache": ""}
    plot([{**row, "method": "16x", "ratio_to_unpatched": 0.6},
          {**row, "method": "unpatched", "ratio_to_unpatched": 1.0}], path)
    assert path.stat().st_size > 0
    plot([{**row, "method": "16x", "ratio_to_unpatched": ""}], path)
    assert not path.exists()
