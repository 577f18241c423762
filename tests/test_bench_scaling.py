"""`python -m evals scaling` (evals/bench_scaling.py) on SmolLM2 at tiny contexts: one context prefilled, one tiled,
batch 8, memory processes; the CSV's columns and rows, what was not run marked so, stages where each method has
them, the table and plot, the provenance. A tiled fill stores exactly the context asked. No timing asserts."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("optimum.quanto")

from evals import bench_scaling  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["unpatched", "unpatched-eager", "quanto-int4", "8x"]
NUMBERS = ("decode_s", "projections_s", "exact_s", "middle_s", "merge_s", "rest_s", "cache_bytes")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    assert (ROOT / ".models" / "SmolLM2-135M-Instruct").is_dir(), "run `bash scripts/setup.sh` first"
    out = tmp_path_factory.mktemp("scaling")
    command = [sys.executable, "-m", "evals", "scaling", "--methods", ",".join(METHODS), "--contexts", "512,1024",
               "--prefill-max", "512", "--source-tokens", "256", "--batch8-max", "512", "--chunk-max", "512",
               "--memory-contexts", "1024", "--memory-source", "128", "--repeats", "1", "--chunk-repeats", "1",
               "--threads", "1", "--out", str(out), "--name", "sc"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with open(out / "sc.csv", newline="") as f:
        return out, list(csv.DictReader(f))


def test_rows_and_how_they_were_filled(run):
    out, rows = run
    assert list(rows[0]) == list(bench_scaling.FIELDS)
    assert [(r["method"], int(r["context"]), int(r["batch"])) for r in rows] == \
        [(m, 512, b) for b in (1, 8) for m in METHODS] + [(m, 1024, 1) for m in METHODS]
    for r in rows:
        prefilled = int(r["context"]) == 512 and r["batch"] == "1"
        assert r["fill"] == ("prefill" if prefilled else "tiled from 256")
        # the eager model reads the cache sdpa's prefill filled: its own prefill is not run
        timed = prefilled and r["method"] != "unpatched-eager"
        assert (r["prefill_s"] != bench_scaling.NOT_RUN) == timed
        assert (r["chunk64_s"] != bench_scaling.NOT_RUN) == prefilled  # --chunk-max 512, batch 1 only
        assert all(float(r[k]) >= 0 for k in NUMBERS) and float(r["decode_s"]) > 0
        assert float(r["projections_s"]) > 0
        assert r["commit"] and r["command"].startswith("python -m evals scaling --methods")
        # against the faster unpatched attention of each round: neither unpatched one can be below it
        if r["method"] in bench_scaling.UNPATCHED:
            assert float(r["decode_ratio"]) >= 1.0
        coded = r["method"] == "8x"
        assert (float(r["middle_s"]) > 0) == coded and (float(r["merge_s"]) > 0) == coded
        measured = int(r["context"]) == 1024  # --memory-contexts 1024
        assert (r["process_peak_mib"] != "") == measured
        if measured:
            assert float(r["process_peak_mib"]) > 0
    by = {(r["method"], int(r["context"]), int(r["batch"])): int(r["cache_bytes"]) for r in rows}
    for context, batch in ((512, 1), (512, 8), (1024, 1)):
        assert by[("8x", context, batch)] < by[("quanto-int4", context, batch)] < by[("unpatched", context, batch)]
    assert by[("unpatched", 512, 8)] == 8 * by[("unpatched", 512, 1)]


def test_table_plot_provenance(run):
    out, rows = run
    assert (out / "sc.png").stat().st_size > 0
    side = json.loads((out / "sc.csv.provenance.json").read_text())
    assert side["commit"] and side["command"].split()[1:4] == ["-m", "evals", "scaling"]
    table = subprocess.run([sys.executable, "-m", "evals", "scaling", "--table", "--out", str(out), "--name", "sc"],
                           capture_output=True, text=True, cwd=ROOT)
    assert table.stdout.count("\n| ") == len(rows)


def test_tiled_fill_stores_the_context():
    """Every cache kind holds exactly `context` tokens after `fill` from a shorter source, at batch 1 and 8."""
    from evals.suite import load_artifacts, load_smollm2

    model, _ = load_smollm2()
    source = [(torch.randn(1, 3, 300, 64, dtype=torch.bfloat16), torch.randn(1, 3, 300, 64, dtype=torch.bfloat16))
              for _ in range(model.config.num_hidden_layers)]
    models = bench_scaling.method_models(model, load_artifacts(), METHODS, 1000)
    for name in METHODS:
        for batch in (1, 8):
            cache = bench_scaling.new_cache(name, models[name])
            bench_scaling.fill(cache, source, 1000, batch)
            assert cache.get_seq_length() == 1000, name
    layer = cache.layer(0)  # 8x: 4 sinks and a 32-token window exact, the rest coded
    assert (layer.sink_len, layer.middle_len, layer.window_len, layer.batch_size) == (4, 964, 32, 8)
