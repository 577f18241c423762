"""Your own model in minutes: budgets, the shipped calibration text, `patchkv calibrate` with its defaults (effect
weights, per-budget step scales, the model's own dtype), `patchkv report`, and an artifact given by path."""

import copy
import gzip
import json

import pytest
import torch
from conftest import calibration_ids, make_model
from test_cli import MODEL, run_main
from test_global_pool import model, weighted  # noqa: F401 (the tiny Llama and its effect-weighted bases)

import patchkv
from patchkv.budgets import EXACT, Budget, bits_for_ratio, parse_budget, sixteen_bit_bytes
from patchkv.texts import DEFAULT, default_texts, read_texts


# ----- budgets ---------------------------------------------------------------------------------------------------
def test_parse_budget():
    assert parse_budget("8x") == Budget(ratio=8.0) and parse_budget(" 2.5X ") == Budget(ratio=2.5)
    assert parse_budget("119") == Budget(bits=119)
    for bad in ("1x", "0", "-3", "eight", "8y", ""):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


@pytest.mark.parametrize("ratio, pool", [(4, "global"), (8, "head"), (3, "head")])
def test_a_ratio_is_met_at_its_context_every_byte_counted(model, weighted, ratio, pool):
    """The cache measured after `context` tokens holds at most the 16-bit bytes / ratio per token, and one bit more
    per head would not fit."""
    context = 640
    bits = bits_for_ratio(weighted, ratio, pool=pool, context=context)
    methods = [patchkv.SinksWindow(*EXACT), patchkv.Quantized(bits, pool=pool)]
    ids = calibration_ids(1, context, seed=5)
    half = copy.deepcopy(model).to(torch.bfloat16)  # the exact sinks and window in 16 bits, as ratios are quoted
    with patchkv.patched(half, weighted, methods):
        cache = half(ids, use_cache=True).cache
        cache = half(ids[:, :1], cache=cache, use_cache=True).cache  # every token beyond the window encoded
    held = cache.nbytes() * context / (context + 1)
    assert held / context <= sixteen_bit_bytes(weighted) / ratio * 1.01
    assert bits_for_ratio(weighted, ratio * 0.9, pool=pool, context=context) >= bits
    with pytest.raises(ValueError, match="cannot be met"):
        bits_for_ratio(weighted, 40, pool=pool, context=40)


def test_budget_methods_pick_the_pool_the_artifact_supports(weighted):
    plain = patchkv.Artifact(mode=weighted.mode, model=weighted.model, calibration={},
                             keys=patchkv.artifact.Components(*(getattr(weighted.keys, n) for n in
                                                                ("mean", "eigenvalues", "eigenvectors", "ranks"))),
                             values=patchkv.artifact.Components(*(getattr(weighted.values, n) for n in
                                                                  ("mean", "eigenvalues", "eigenvectors", "ranks"))))
    assert parse_budget("4x").methods(weighted, 256)[-1].pool == "global"
    assert parse_budget("4x").methods(plain, 256)[-1].pool == "head"
    assert parse_budget("40").methods(plain, 256)[-1].bits == 40


@pytest.mark.parametrize("context, error, fragment", [
    (0, ValueError, "context must be at least 1 token"),
    (-5, ValueError, "context must be at least 1 token"),
    (None, TypeError, "context must be an integer number of tokens, e.g. 4096, got None"),
    (512.0, TypeError, "context must be an integer number of tokens"),
    (True, TypeError, "context must be an integer number of tokens"),
])
def test_budgets_refuse_a_context_that_is_not_a_positive_integer(weighted, context, error, fragment):
    """`context=0` used to raise ZeroDivisionError and `context=None` a bare TypeError, for ratios and bits alike."""
    for budget in ("8x", "40"):
        with pytest.raises(error, match=fragment):
            parse_budget(budget).methods(weighted, context)
    with pytest.raises(error, match=fragment):
        bits_for_ratio(weighted, 8, pool="head", context=context)


# ----- calibration text ------------------------------------------------------------------------------------------
def test_the_shipped_mix_is_small_and_mixes_prose_and_verse():
    assert DEFAULT.stat().st_size < 2_000_000
    text = "".join(default_texts())
    assert len(text) > 2_000_000 and "def " in text and "Enter" in text  # Python docs and Shakespeare


def test_read_texts_takes_files_folders_and_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta")
    assert read_texts(str(tmp_path / "a.txt")) == ["alpha"]
    assert read_texts(str(tmp_path)) == ["alpha", "beta"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"body": t}) for t in ("one", "two")))
    assert read_texts(str(rows), column="body") == ["one", "two"]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["x", " ", "y"]}).save_to_disk(str(saved))
    assert read_texts(str(saved)) == ["x", "y"]
    with pytest.raises(ValueError, match="no column 'text'"):
        read_texts(str(rows))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_texts("./missing.txt")
    offline = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(FileNotFoundError, match="could not load it as a dataset.*OfflineModeIsEnabled"):
        read_texts("patchkv-no-such-dataset-name")  # the local cache only: the Hub is not asked
    assert datasets.config.HF_HUB_OFFLINE == offline  # as it was


# ----- the CLI: calibrate with defaults, then report ----------------------------------------------------------------
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """`patchkv calibrate` on the reference model with its defaults, shortened (tokens, budgets) for the test."""
    out = tmp_path_factory.mktemp("bases") / "ref.safetensors"
    from patchkv import cli

    cli.main(["calibrate", "--model", MODEL, "--out", str(out), "--max-tokens", "1024", "--fisher-tokens", "256",
              "--budgets", "4x,8x", "--context", "512", "--step-tokens", "256"])
    return out


def test_calibrate_defaults_give_a_ready_artifact(calibrated):
    art = patchkv.Artifact.load(calibrated)
    assert art.has_effect_weights and art.format_version == 4
    assert [p for _, p in art.step_budgets] == ["global", "global"] and len(art.step_budgets) == 2
    for budget in ("4x", "8x"):  # each budget at the context finds the scales fitted for it
        q = parse_budget(budget).quantized(art, 512)
        assert (q.bits, q.pool) in art.step_budgets
    assert art.calibration["sink_tokens"] == 4 and art.calibration["dtype"] == "float32"
    assert art.calibration["source"].startswith("patchkv general mix")
    assert art.keys.ranks.max() == art.head_dim // 4


def test_report_table_files_and_rows(calibrated, tmp_path, capsys):
    text = tmp_path / "mine.txt"
    with gzip.open(DEFAULT, "rt") as f:
        text.write_text(f.read()[-20_000:])
    code, out, err = run_main(["report", "--model", MODEL, "--artifact", str(calibrated), "--text", str(text),
                               "--budgets", "4x,8x", "--context", "512", "--chunk", "32", "--dtype", "bfloat16",
                               "--out", str(tmp_path / "r")], capsys)  # 16-bit, as ratios are quoted
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    names = [line.split(" | ")[0].strip("| ") for line in lines[1:]]
    assert names == ["unpatched", "QuantizedCache quanto int4", "QuantizedCache quanto int2", "patchkv 4x",
                     "patchkv 8x"]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[1:]}
    assert rows["unpatched"][2] == "1.00x"
    for name in ("patchkv 4x", "patchkv 8x"):  # measured compression, every byte counted, near the budget
        ratio = float(rows[name][2].rstrip("x"))
        assert float(name.split()[1].rstrip("x")) * 0.85 <= ratio <= float(name.split()[1].rstrip("x")) * 1.01
    for name in ("report.md", "report.csv", "report.png"):
        assert (tmp_path / "r" / name).stat().st_size > 0


def test_report_on_a_sliding_window_model_notes_what_quantizedcache_refuses(tmp_path):
    """QuantizedCache refuses sliding-window layers; patchkv's rows run."""
    from patchkv.report import report, table

    class Tokens:  # a stand-in tokenizer over the tiny vocabulary
        bos_token_id = 2

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + (ord(c) % 90) for c in text]}

        def decode(self, ids):
            return " ".join(map(str, ids))

    model = make_model("mistral")
    art = patchkv.calibrate(model, calibration_ids(8, 48), mode="pre_rope", rank=8, fisher_tokens=96,
                            fisher_window=4, progress=False)
    rows = report(model, Tokens(), art, [("t", "hello world " * 40)], budgets=[parse_budget("40")], context=200,
                  chunk=16, progress=lambda line: None)
    quanto = [r for r in rows if r.name.startswith("QuantizedCache")]
    assert quanto and all(r.note.startswith("not run") and not r.perplexity for r in quanto)
    assert rows[-1].perplexity["t"] > 0 and "—" in table(rows)


def test_apply_takes_a_path(calibrated):
    model = make_model("llama")
    from patchkv import cli

    reference = cli._load_model(MODEL, "auto")[0]
    with patchkv.patched(reference, str(calibrated)):
        assert patchkv.is_patched(reference)
    with pytest.raises(patchkv.ArtifactError):
        patchkv.apply(model, "./no-such-artifact.safetensors")
    assert not patchkv.is_patched(model)
