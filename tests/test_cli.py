"""The CLI on bad input: one line `patchkv: error: ...` on stderr, exit status 2 (usage) or 1, no traceback, and
nothing expensive (model loading, the unpatched baseline) before the checks."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import calibration_ids, make_model
from safetensors import SafetensorError

import patchkv
import patchkv.evaluate
import patchkv.report
import patchkv.step_scales
from patchkv import cli
from patchkv.configs import unpatched
from patchkv.records import Result

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "artifacts" / "reference-llama")
PRE = str(ROOT / "artifacts" / "reference-llama-bases" / "pre_rope.safetensors")


def run_main(argv, capsys):
    """(exit status, stdout, stderr) of `patchkv argv` run in this process."""
    try:
        cli.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, expected_code, *fragments):
    """One error line, the last thing on stderr (transformers' own progress bars may come before it)."""
    assert code == expected_code, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("patchkv: error: "), err
    assert sum("patchkv: error" in line for line in lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


class Forbidden(BaseException):
    """Not an `Exception`: the CLI's one-line reporting never catches it, so the test fails."""


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a model is loaded or an evaluation starts."""
    def forbidden(*a, **k):
        raise Forbidden("the expensive part started before the input was checked")

    monkeypatch.setattr(cli, "_load_model", forbidden)
    monkeypatch.setattr(patchkv.evaluate, "evaluate", forbidden)


@pytest.mark.parametrize("argv, fragment", [
    (["eval", "--model", MODEL, "--rank", "0"], "--rank: must be a positive integer"),
    (["eval", "--model", MODEL, "--rank", "-3"], "--rank: must be a positive integer"),
    (["eval", "--model", MODEL, "--rank", "x"], "--rank: expected a positive integer"),
    (["eval", "--model", MODEL, "--energy", "0"], "--energy: must be a fraction"),
    (["eval", "--model", MODEL, "--energy", "1.5"], "--energy: must be a fraction"),
    (["eval", "--model", MODEL, "--energy", "nan"], "--energy: must be a fraction"),
    (["eval", "--model", MODEL, "--rank", "8", "--energy", "0.9"], "not allowed with argument"),
    (["eval", "--model", MODEL, "--limit", "0"], "--limit: must be a positive integer"),
    (["eval", "--model", MODEL, "--chunk", "0"], "--chunk: must be a positive integer"),
    (["eval", "--model", MODEL, "--chunk", "4", "--streaming"], "not allowed with argument"),
    (["eval", "--model", MODEL, "--ranks", "8,0"], "--ranks: expected comma-separated positive integers"),
    (["eval", "--model", MODEL, "--top-k", "0"], "--top-k: must be a positive integer"),
    (["eval", "--model", MODEL, "--bits", "-1"], "--bits: must be a positive integer"),
    (["eval", "--model", MODEL, "--sink-tokens", "-1"], "--sink-tokens: must be >= 0"),
    (["eval", "--model", MODEL, "--dtype", "float8"], "--dtype: invalid choice"),
    (["eval", "--model", MODEL, "--method", "nope"], "Unknown method 'nope'"),
    (["eval", "--model", MODEL, "--method", "topk:k=0"], "k must be an integer >= 1"),
    (["eval", "--model", MODEL, "--method", "quantized:bits=x"], "bits must be an integer"),
    (["eval"], "--model"),
    (["calibrate", "--model", MODEL, "--out", "x", "--rank", "0"], "--rank: must be a positive integer"),
    (["calibrate", "--model", MODEL, "--out", "x", "--energy", "0"], "--energy: must be a fraction"),
    (["calibrate", "--model", MODEL, "--out", "x", "--rank", "4", "--max-tokens", "0"], "--max-tokens"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_bad_flag_values_are_refused_at_parse_time(capsys, no_model, argv, fragment):
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(code, err, 2, fragment)
    assert err.count("\n") == 1  # no usage block either


@pytest.mark.parametrize("argv, fragment", [
    (["eval", "--model", MODEL, "--tasks", "patchkv_shakespeare_ppl,bogus"], "Unknown task(s) ['bogus']"),
    (["eval", "--model", MODEL, "--tasks", ","], "--tasks"),
    (["eval", "--model", MODEL, "--sweep"], "--sweep needs at least one --artifact"),
    (["eval", "--model", MODEL, "--artifact", PRE, "--sweep", "--rank", "8"], "drop --rank"),
    (["eval", "--model", MODEL, "--top-k-rank", "4"], "--top-k-rank needs --top-k"),
    (["eval", "--model", MODEL, "--out", "o", "--name", "a/b"], "--name 'a/b'"),
])
def test_bad_flag_combinations_are_usage_errors(capsys, no_model, argv, fragment):
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(code, err, 2, fragment)
    assert err.count("\n") == 1  # no usage block either


def test_bad_artifacts_and_paths_fail_before_the_model_loads(tmp_path, capsys, no_model):
    corrupted = tmp_path / "bad.safetensors"
    data = bytearray(Path(PRE).read_bytes())
    data[-10] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    (tmp_path / "file").write_text("x")
    cases = [
        (["eval", "--model", MODEL, "--artifact", str(tmp_path / "missing.safetensors")], "does not exist"),
        (["eval", "--model", MODEL, "--artifact", str(corrupted)], "checksum"),
        (["eval", "--model", MODEL, "--artifact", PRE, "--rank", "65"], "head_dim=64"),
        (["eval", "--model", MODEL, "--artifact", PRE, "--bits", "100000"], "bits per head must be in"),
        (["eval", "--model", MODEL, "--artifact", PRE, "--top-k", "4", "--top-k-rank", "65"], "head_dim=64"),
        (["eval", "--model", MODEL, "--out", str(tmp_path / "file" / "sub")], "is a file"),
        (["eval", "--model", MODEL, "--out", str(tmp_path / "file")], "not a directory"),
        (["info", str(tmp_path / "nope")], "No artifact at"),
        (["info", str(corrupted)], "checksum"),
        (["info", PRE, "--sha256", "0" * 64], "expected sha256:"),
        (["info", PRE, "--sha256", "xyz"], "64 hex digits"),
        (["push", PRE, "me/x", "--eval-table", str(tmp_path / "none.md")], "No such file"),
        (["push", PRE, "not a repo id"], "not a valid Hub repo id"),
    ]
    for argv, fragment in cases:
        code, _, err = run_main(argv, capsys)
        assert_one_line_error(code, err, 1, fragment)


def test_incompatible_artifact_is_refused_before_the_baseline(tmp_path, capsys, monkeypatch):
    def forbidden(*a, **k):
        raise Forbidden("the unpatched baseline started before the compatibility check")

    monkeypatch.setattr(patchkv.evaluate, "evaluate", forbidden)
    other = patchkv.calibrate(make_model("llama"), calibration_ids(), rank=4, progress=False)
    file = other.save(tmp_path / "other.safetensors")
    code, _, err = run_main(["eval", "--model", MODEL, "--artifact", str(file), "--limit", "1"], capsys)
    assert_one_line_error(code, err, 1, "does not match this model", "num_hidden_layers: artifact has 2")


def test_missing_model_folder_and_gguf_file(tmp_path, capsys):
    code, _, err = run_main(["eval", "--model", str(tmp_path / "nope"), "--tasks", "patchkv_shakespeare_ppl"],
                            capsys)
    assert_one_line_error(code, err, 1, "no such model folder")
    code, _, err = run_main(["eval", "--model", MODEL, "--gguf-file", "absent.gguf"], capsys)
    assert_one_line_error(code, err, 1, "--gguf-file absent.gguf: no such file")


def test_gguf_file_is_passed_to_from_pretrained(tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "gguf-model"
    folder.mkdir()
    (folder / "model.Q4.gguf").write_bytes(b"GGUF")
    seen = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def fake(real):
        def load(path, **kwargs):
            seen.append((path, kwargs.pop("gguf_file", None)))
            return real(MODEL, **kwargs)  # stands in for the GGUF: the reference model
        return load

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake(real_model))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake(real_tok))
    rows = [(unpatched(), [Result(config="unpatched", task="patchkv_shakespeare_ppl", score=1.0, kv_bytes_per_token=0,
                                  compression=1.0)])]
    monkeypatch.setattr(patchkv.evaluate, "evaluate", lambda *a, **k: rows)
    code, out, err = run_main(["eval", "--model", str(folder), "--gguf-file", "model.Q4.gguf",
                               "--artifact", PRE, "--tasks", "patchkv_shakespeare_ppl", "--limit", "1"], capsys)
    assert code == 0, err
    assert seen == [(str(folder), "model.Q4.gguf")] * 2 and "unpatched" in out


def test_rank_flag_reaches_the_evaluation_and_outputs_are_written(tmp_path, capsys):
    """One real run, kept small: one task, one document."""
    code, out, err = run_main(["eval", "--model", MODEL, "--artifact", PRE, "--tasks", "patchkv_shakespeare_ppl",
                               "--limit", "1", "--rank", "8", "--chunk", "32", "--out", str(tmp_path / "new" / "dir"),
                               "--name", "t"], capsys)
    assert code == 0, err
    assert "pre_rope rank=8" in out and "7.96x" in out  # 6144 / (768 + 4 bytes of position) per token
    assert (tmp_path / "new" / "dir" / "t.csv").is_file() and (tmp_path / "new" / "dir" / "t.md").is_file()


def test_info_prints_the_file_sha256(capsys):
    import hashlib

    code, out, _ = run_main(["info", PRE], capsys)
    assert "layer bases: no" in out
    assert code == 0 and f"file sha256: sha256:{hashlib.sha256(Path(PRE).read_bytes()).hexdigest()}" in out
    code, _, err = run_main(["info", PRE, "--sha256", out.split("file sha256: ")[1].split()[0]], capsys)
    assert code == 0, err


def test_console_entry_point_prints_no_traceback(tmp_path):
    """The real process: python -m patchkv, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "patchkv", "info", str(tmp_path / "nope.safetensors")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, 1, "does not exist")
    assert proc.stderr.count("\n") == 1


# ----- one line for every failure: disk full, read-only or empty --out, unexpandable paths, junk, Ctrl-C -----


@pytest.fixture(scope="module")
def tiny_artifact():
    return patchkv.calibrate(make_model("llama"), calibration_ids(), rank=4, progress=False)


@pytest.fixture
def fake_calibration(monkeypatch, tiny_artifact):
    """`patchkv calibrate` on a tiny model without calibrating or fitting step scales: records that calibration ran
    and returns a tiny artifact."""
    calls = []

    def calibrate(*a, **k):
        calls.append(k)
        return tiny_artifact

    def bytes_tokenizer(text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: (make_model("llama"), bytes_tokenizer))
    monkeypatch.setattr(patchkv, "calibrate", calibrate)
    monkeypatch.setattr(patchkv.step_scales, "fit_step_scales", lambda model, artifact, *a, **k: artifact)
    return calls


def calibrate_argv(out):
    return ["calibrate", "--model", MODEL, "--data", __file__, "--rank", "4", "--out", out]


def test_calibrate_writes_where_out_says(tmp_path, capsys, fake_calibration, tiny_artifact):
    for out, file in ((tmp_path / "new" / "dir", tmp_path / "new" / "dir" / "patchkv.safetensors"),
                      (tmp_path / "a.safetensors", tmp_path / "a.safetensors")):
        code, stdout, err = run_main(calibrate_argv(str(out)), capsys)
        assert code == 0 and f"wrote {file}" in stdout, err
        assert patchkv.Artifact.load(file).metadata() == tiny_artifact.metadata()
    assert len(fake_calibration) == 2 and not fake_calibration[0]["layer_bases"]
    code, _, err = run_main([*calibrate_argv(str(tmp_path / "l.safetensors")), "--layer-bases"], capsys)
    assert code == 0 and fake_calibration[-1]["layer_bases"], err
    assert fake_calibration[-1]["retrieval_rows"] == 0  # off unless asked for
    code, _, err = run_main([*calibrate_argv(str(tmp_path / "r.safetensors")), "--retrieval-rows", "3",
                             "--retrieval-seq", "512"], capsys)
    assert code == 0 and fake_calibration[-1]["retrieval_rows"] == 3 and fake_calibration[-1]["retrieval_seq"] == 512


def test_step_grid_reaches_the_fit_and_a_fit_at_its_edge_says_so(tmp_path, capsys, fake_calibration, monkeypatch):
    grids, extends = [], []

    def fit(model, artifact, *a, bits, pool, grid, extend, **k):  # keys at the grid's lowest, values inside it
        grids.append(grid)
        extends.append(extend)
        out = copy.deepcopy(artifact)
        edges = patchkv.step_scales.grid_edges((grid[0], grid[1]), grid)
        out.calibration["step_scale_fits"] = [{"bits": bits, "pool": pool, "keys": grid[0], "values": grid[1],
                                               "grid": list(grid), "edges": edges}]
        return out

    monkeypatch.setattr(patchkv.step_scales, "fit_step_scales", fit)
    code, stdout, err = run_main(calibrate_argv(str(tmp_path / "a.safetensors")), capsys)
    assert code == 0 and grids == [patchkv.step_scales.GRID] * 3 and extends == [0] * 3, err
    assert "note: 4x's step scales sit at the edge of the grid tried (keys 1 (lowest))" in stdout
    assert "--step-grid 0.5,0.625,0.75,0.875,1,1.25,1.5,1.75 searches wider" in stdout
    code, stdout, err = run_main([*calibrate_argv(str(tmp_path / "b.safetensors")), "--budgets", "8x",
                                  "--step-grid", "1,0.5,0.75,0.5"], capsys)
    assert code == 0 and grids[-1] == (0.5, 0.75, 1.0), err
    assert "note: 8x's step scales sit at the edge of the grid tried (keys 0.5 (lowest))" in stdout
    code, _, err = run_main([*calibrate_argv(str(tmp_path / "e.safetensors")), "--budgets", "8x", "--step-extend", "2"],
                            capsys)
    assert code == 0 and extends[-1] == 2, err
    for bad in ("0,1", "1,x", "-1", "inf", ""):
        code, _, err = run_main([*calibrate_argv(str(tmp_path / "c.safetensors")), "--step-grid", bad], capsys)
        assert_one_line_error(code, err, 2, "expected comma-separated step multipliers > 0")


def test_retrieval_rows_are_refused_before_calibrating_when_they_cannot_be_measured(tmp_path, capsys,
                                                                                    fake_calibration):
    out = str(tmp_path / "r.safetensors")
    code, _, err = run_main([*calibrate_argv(out), "--retrieval-rows", "2", "--fisher-tokens", "0"], capsys)
    assert_one_line_error(code, err, 2, "--fisher-tokens 0 measures none")
    code, _, err = run_main([*calibrate_argv(out), "--retrieval-rows", "2", "--retrieval-seq", "1000000"], capsys)
    assert_one_line_error(code, err, 1, "reads 8,000,000 characters of the calibration text",
                          "pass more text or a smaller retrieval_seq")
    assert fake_calibration == []


def test_calibrate_refuses_to_overwrite_an_artifact_without_force(tmp_path, capsys, fake_calibration, tiny_artifact):
    """An existing artifact at --out (a file, or patchkv.safetensors in a folder) is refused before calibrating and
    left as it was; --force overwrites it."""
    for out, file in ((tmp_path / "a.safetensors", tmp_path / "a.safetensors"),
                      (tmp_path / "dir", tmp_path / "dir" / "patchkv.safetensors")):
        file.parent.mkdir(exist_ok=True)
        file.write_bytes(b"an earlier artifact")
        code, _, err = run_main(calibrate_argv(str(out)), capsys)
        assert_one_line_error(code, err, 1, f"--out {out}: {file} already exists; pass --force to overwrite it")
        assert file.read_bytes() == b"an earlier artifact" and fake_calibration == []
        code, stdout, err = run_main([*calibrate_argv(str(out)), "--force"], capsys)
        assert code == 0 and f"wrote {file}" in stdout, err
        assert patchkv.Artifact.load(file).metadata() == tiny_artifact.metadata()
        fake_calibration.clear()


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     SafetensorError("No space left on device (os error 28)")])
def test_disk_full_on_save_is_one_line(tmp_path, capsys, monkeypatch, fake_calibration, failure):
    def full(self, path):
        raise failure

    monkeypatch.setattr(patchkv.Artifact, "save", full)
    code, _, err = run_main(calibrate_argv(str(tmp_path / "out")), capsys)
    assert_one_line_error(code, err, 1, f"--out {tmp_path / 'out'}: could not write the artifact",
                          "No space left on device")


def test_disk_full_in_the_real_save_is_one_line(tmp_path, capsys, monkeypatch, fake_calibration):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(patchkv.artifact.os, "fsync", full)
    code, _, err = run_main(calibrate_argv(str(tmp_path)), capsys)
    assert_one_line_error(code, err, 1, "No space left on device", str(tmp_path / "patchkv.safetensors"))
    assert list(tmp_path.iterdir()) == []


def test_calibrate_checks_out_before_calibrating(tmp_path, capsys, monkeypatch, fake_calibration):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    real_access = os.access  # root may write anywhere: make access(2) answer as for another user
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == read_only and mode & os.W_OK
                        else real_access(p, mode, **k))
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir" / "patchkv.safetensors").mkdir(parents=True)
    cases = [
        (str(read_only), 1, f"{read_only} is not writable"),
        (str(read_only / "sub" / "a.safetensors"), 1, f"{read_only} is not writable"),
        (str(tmp_path / "file"), 1, "exists and is not a directory"),
        (str(tmp_path / "file" / "a.safetensors"), 1, "exists and is not a directory"),
        (str(tmp_path / "dir"), 1, "is a directory"),
        ("~patchkv-no-such-user/x", 1, "~patchkv-no-such-user"),
        ("", 2, "--out ''"),
    ]
    for out, status, fragment in cases:
        code, _, err = run_main(calibrate_argv(out), capsys)
        assert_one_line_error(code, err, status, fragment)
    assert fake_calibration == []  # nothing was calibrated
    assert not (tmp_path / "patchkv.safetensors").exists() and not (read_only / "sub").exists()


def test_empty_and_unexpandable_paths_are_one_line(tmp_path, capsys, monkeypatch, tiny_artifact):
    def forbidden(*a, **k):
        raise Forbidden("the evaluation started")

    monkeypatch.setattr(patchkv.evaluate, "evaluate", forbidden)
    monkeypatch.chdir(tmp_path)
    tiny_artifact.save(".")  # what an empty string used to load
    for argv, status, fragment in [
        (["info", ""], 1, "empty string"),
        (["info", "~patchkv-no-such-user/x"], 1, "~patchkv-no-such-user"),
        (["eval", "--model", "~patchkv-no-such-user/m"], 1, "~patchkv-no-such-user"),  # _load_model refuses it
        (["eval", "--model", MODEL, "--out", ""], 2, "--out ''"),
        (["eval", "--model", MODEL, "--out", "~patchkv-no-such-user/o"], 1, "~patchkv-no-such-user"),
        (["eval", "--model", MODEL, "--artifact", ""], 1, "empty string"),
    ]:
        code, _, err = run_main(argv, capsys)
        assert_one_line_error(code, err, status, fragment)


def test_junk_in_the_free_form_calibration_is_never_read(tmp_path, capsys, monkeypatch):
    """Runtime reads typed fields only: junk in the free-form calibration summary of a version 4 artifact with step
    scales changes nothing (the evaluation starts); a version 3 file whose summary does not name its step scales'
    budget is refused at load, in one line."""
    from patchkv.artifact import Artifact, Components
    from test_reliability_artifact import read, write

    def reached(*a, **k):
        raise Forbidden("the evaluation started")

    monkeypatch.setattr(patchkv.evaluate, "evaluate", reached)
    art = Artifact.load(PRE)
    parts = {kind: Components(c.mean, c.eigenvalues, c.eigenvectors, c.ranks,
                              step_scales=torch.ones((1, *c.ranks.shape))) for kind, c in
             (("keys", art.keys), ("values", art.values))}
    junk = Artifact(mode=art.mode, model=art.model, calibration={"step_scales": "x"}, step_budgets=[(64, "head")],
                    **parts)
    file = junk.save(tmp_path / "junk.safetensors")
    with pytest.raises(Forbidden):
        cli.main(["eval", "--model", MODEL, "--artifact", str(file), "--bits", "64", "--tasks",
                  "patchkv_shakespeare_ppl", "--limit", "1"])
    tensors, meta = read(file)
    for kind in ("keys", "values"):
        tensors[f"{kind}.step_scales"] = tensors[f"{kind}.step_scales"][0].contiguous()
    meta["format_version"] = 3
    del meta["step_budgets"]
    old = write(tmp_path / "v3.safetensors", tensors, meta)
    code, _, err = run_main(["eval", "--model", MODEL, "--artifact", str(old), "--bits", "64",
                             "--tasks", "patchkv_shakespeare_ppl", "--limit", "1"], capsys)
    assert_one_line_error(code, err, 1, "the budget of its step scales")


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr(cli, "cmd_info", broken)
    code, _, err = run_main(["info", PRE], capsys)
    assert_one_line_error(code, err, 1, "KeyError: 'boom' (unexpected; PATCHKV_DEBUG=1")
    monkeypatch.setenv("PATCHKV_DEBUG", "1")
    with pytest.raises(KeyError, match="boom"):
        cli.main(["info", PRE])
    monkeypatch.undo()  # the real command: a PatchKVError, re-raised too
    monkeypatch.setenv("PATCHKV_DEBUG", "1")
    with pytest.raises(patchkv.ArtifactError, match="empty string"):
        cli.main(["info", ""])


def test_an_artifact_in_another_dtype_evaluates(tmp_path, capsys, monkeypatch):
    """The artifact's dtype is information: a bfloat16-recorded artifact runs on the float32 model (bases are cast
    at apply); the evaluation starts."""
    def reached(*a, **k):
        raise Forbidden("the evaluation started")

    monkeypatch.setattr(patchkv.evaluate, "evaluate", reached)
    half = patchkv.Artifact.load(PRE).to_dtype(torch.bfloat16).save(tmp_path / "bf16.safetensors")
    with pytest.raises(Forbidden):
        cli.main(["eval", "--model", MODEL, "--artifact", str(half), "--tasks", "patchkv_shakespeare_ppl",
                  "--limit", "1"])


class BytesTokenizer:
    """A stand-in tokenizer: one token per byte of the text, after a BOS token."""

    bos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


@pytest.fixture
def fake_report_model(monkeypatch):
    """`patchkv report` on the tiny Llama with a bytes tokenizer; scoring any text fails the test."""
    def forbidden(*a, **k):
        raise Forbidden("scoring started")

    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: (make_model("llama"), BytesTokenizer()))
    monkeypatch.setattr(patchkv.report, "token_nll", forbidden)


def test_report_refuses_texts_it_cannot_measure_and_an_empty_out(tmp_path, capsys, tiny_artifact,
                                                                 fake_report_model):
    """An empty text, one shorter than the context (bytes per token and perplexity would be measured below it),
    `--out ''` and `--basis layer` on an artifact without layer bases are one line each, before anything is
    scored."""
    art = str(tiny_artifact.save(tmp_path / "a.safetensors"))
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "short.txt").write_text("x" * 99)
    (tmp_path / "long.txt").write_text("x" * 999)
    report = ["report", "--model", MODEL, "--artifact", art, "--context", "512", "--budgets", "4x"]
    for argv, status, fragment in [
        ([*report, "--text", str(tmp_path / "empty.txt")], 1, f"--text {tmp_path / 'empty.txt'}: the text is empty"),
        ([*report, "--text", str(tmp_path / "short.txt")], 1,
         "text 'short' has 100 tokens, fewer than the context of 512 it is scored at; give a longer text or a "
         "smaller context (--context 100 or less)"),
        ([*report, "--out", ""], 2, "--out '': expected a folder"),
        ([*report, "--text", str(tmp_path / "long.txt"), "--basis", "layer"], 1,
         "basis='layer' codes on the artifact's layer bases, and this artifact has none"),
    ]:
        code, _, err = run_main(argv, capsys)
        assert_one_line_error(code, err, status, fragment)
    assert not (tmp_path / "report.md").exists()


@pytest.mark.parametrize("body, fragment", [
    ("", "the file holds no document"),
    ("\n  \n", "the file holds no document"),
    ('{"body": "prose"}\n', 'its first document has no "text" string (found the keys [\'body\'])'),
    ('{"text": 5}\n', 'its first document has no "text" string (found "text": 5)'),
    ('["prose"]\n', 'its first document has no "text" string (found ["prose"])'),
    ("{oops\n", "its first document is not JSON"),
])
def test_report_refuses_a_jsonl_without_a_text_in_one_line(tmp_path, capsys, no_model, body, fragment):
    """An empty .jsonl or one whose first document has no "text" string used to print IndexError/KeyError
    (unexpected); now one line that says what was expected, before the model loads."""
    file = tmp_path / "docs.jsonl"
    file.write_text(body)
    code, _, err = run_main(["report", "--model", MODEL, "--artifact", PRE, "--text", str(file)], capsys)
    assert_one_line_error(code, err, 1, f"--text {file}: {fragment}", 'expected lines of {"text": "..."}')


CTRL_C_DURING_IMPORT = """
import importlib.abc, os, runpy, signal, sys, time

MODULE = sys.argv[1]
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if the test runner ignores it


class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C while this module is imported
            time.sleep(5)
        return None


sys.meta_path.insert(0, CtrlC())
sys.argv = ["patchkv", "info", "nothing.safetensors"]
runpy.run_module("patchkv", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", ["patchkv.cli", "patchkv.tasks"])
def test_ctrl_c_during_start_up_imports_is_one_line(tmp_path, module):
    """A real SIGINT while `python -m patchkv` imports the CLI's modules (once `import patchkv` is done: its own
    imports run before any patchkv code can catch it)."""
    proc = subprocess.run([sys.executable, "-c", CTRL_C_DURING_IMPORT, module], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "patchkv: error: interrupted\n"


def test_step_top_restricts_the_loss_only_for_a_large_vocabulary():
    from types import SimpleNamespace

    from patchkv.cli import LARGE_VOCABULARY, _step_top
    from patchkv.step_scales import TOP

    small, large = (SimpleNamespace(config=SimpleNamespace(vocab_size=n)) for n in (49_152, 262_144))
    assert _step_top(None, small) is None and _step_top(None, large) == TOP and LARGE_VOCABULARY < 262_144
    assert _step_top(0, large) is None and _step_top(16, small) == 16
