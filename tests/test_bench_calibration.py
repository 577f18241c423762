"""`python -m evals calibration-cost` (evals/bench_calibration.py): the CLI it times is `patchkv calibrate` with every
default, in a process of its own; the forward beside it reads as many tokens, in the CLI's sequences; each run appends
a row with its provenance. The calibration itself is stubbed here (its minutes are the measurement). No timing asserts."""

import sys
from pathlib import Path

from evals import bench_calibration
from evals.suite import read_csv

MODEL = str(Path(__file__).resolve().parents[1] / "artifacts" / "reference-llama")


def test_it_reads_the_cli_defaults():
    assert bench_calibration.cli_defaults() == (16_384, 512)


def test_each_run_times_the_cli_as_a_user_runs_it_and_appends_a_row(tmp_path, monkeypatch):
    runs, read, run = [], [], bench_calibration.subprocess.run

    def calibrating(argv, **kwargs):  # the calibration recorded, not run; git and the like still run
        return runs.append(argv) if argv[1:4] == ["-m", "patchkv", "calibrate"] else run(argv, **kwargs)

    monkeypatch.setattr(bench_calibration.subprocess, "run", calibrating)
    monkeypatch.setattr(bench_calibration, "cli_defaults", lambda: (1024, 256))
    forward = bench_calibration.forward_seconds

    def counted(model, tokens, seq_len):
        read.append((tokens, seq_len))
        return forward(model, tokens, seq_len)

    monkeypatch.setattr(bench_calibration, "forward_seconds", counted)
    for _ in range(2):
        bench_calibration.main(["--model", MODEL, "--out", str(tmp_path)])
    assert [argv[:6] for argv in runs] == [[sys.executable, "-m", "patchkv", "calibrate", "--model", MODEL]] * 2
    assert [argv[6] for argv in runs] == ["--out"] * 2 and len(runs[0]) == 8  # every other option its default
    assert read == [(1024, 256)] * 2
    rows = read_csv(tmp_path / "calibration_cost.csv")
    assert [r["model"] for r in rows] == ["reference-llama"] * 2 and rows[0]["tokens"] == "1024"
    assert float(rows[0]["forward_tokens_per_s"]) > 0 and float(rows[0]["ratio"]) > 0
    assert (tmp_path / "calibration_cost.csv.provenance.json").is_file()
