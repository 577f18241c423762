"""The measurement stack's shared pieces: the configurations (`patchkv.configs`) and how results are shown
(`patchkv.records`): tables, changes against a baseline, and plots a reader can read."""

import pytest

from patchkv import configs, records
from patchkv.budgets import Budget, parse_budget


def test_a_markdown_table_and_changes():
    assert records.markdown(["a", "b"], [[1, "x"], ["y", 2.5]]) == "| a | b |\n|---|---|\n| 1 | x |\n| y | 2.5 |"
    assert records.change(12.179, 11.855) == " (+2.7%)"
    assert records.change(9.0, 10.0, 2) == " (-10.00%)"
    assert records.difference(0.5, 0.625) == " (-0.125)"


def test_configurations_name_their_kind_and_family():
    assert (configs.unpatched().kind, configs.unpatched().patch({}, 4096)) == ("unpatched", None)
    quanto = configs.quantized_cache(2)
    assert (quanto.name, quanto.kind, quanto.family) == ("QuantizedCache quanto int2", "quantized_cache", "quantized_cache")
    coded = configs.budget(Budget(ratio=8), mode="post_rope")
    assert (coded.name, coded.kind) == ("patchkv 8x", "patchkv")
    with pytest.raises(ValueError, match="needs a post_rope artifact"):
        coded.patch({"pre_rope": None}, 4096)
    with pytest.raises(ValueError, match="no patchkv methods"):
        quanto.methods(None, 4096)
    assert configs.peer("kvpress KVzipPress r=0.9375").family == "kvpress KVzipPress"
    # one plot line per method family: a budget's family is what it keeps beside the codes, whatever its ratio
    families = {t: configs.budget(parse_budget(t)).family for t in ("8x", "16x", "8x+near", "16x+sinks:window=16,bits=8+near",
                                                                    "8x+near+novelty:bits=8")}
    assert families == {"8x": "patchkv", "16x": "patchkv", "8x+near": "patchkv+near",
                        "16x+sinks:window=16,bits=8+near": "patchkv+int8 window 16+near",
                        "8x+near+novelty:bits=8": "patchkv+near+novelty:bits=8"}


def test_the_suite_builds_its_configurations_with_the_library():
    from evals.suite import CONFIGS, config

    assert CONFIGS["quanto-int4"].note == configs.quantized_cache(4).note
    assert (CONFIGS["8x"].budget, CONFIGS["8x-layer"].family) == (Budget(ratio=8, pool="global"), "patchkv-layer")
    assert config("kvpress SnapKVPress r=0.5").kind == "peer"


def test_the_suite_names_every_artifact_its_configurations_ask_for_and_loads_none_until_asked():
    from evals.suite import CONFIGS, load_artifacts

    artifacts = load_artifacts()
    assert {c.mode for c in CONFIGS.values() if c.budget is not None} <= set(artifacts)
    assert CONFIGS["16x-span5"].mode == "pre_rope-span5" and CONFIGS["16x-span5"].budget.basis == "layer"
    assert "pre_rope-span15" in artifacts and "pre_rope-span7" not in artifacts and not artifacts.loaded
    assert CONFIGS["16x-post-span5"].mode == "post_rope-span5" and "post_rope-span5" in artifacts
    assert artifacts["pre_rope"].mode == "pre_rope" and list(artifacts.loaded) == ["pre_rope"]
    with pytest.raises(KeyError):
        artifacts["pre_rope-span7"]


def test_a_span_artifact_is_kept_by_span_and_mode(tmp_path, monkeypatch):
    """Built once into SPAN_BASES/S/{mode}.safetensors, then found there (not built again)."""
    from evals import suite

    monkeypatch.setattr(suite, "SPAN_BASES", tmp_path)
    for mode in ("pre_rope", "post_rope"):
        (tmp_path / "5").mkdir(exist_ok=True)
        (tmp_path / "5" / f"{mode}.safetensors").write_bytes(b"built")
        assert suite.span_artifact(5, mode=mode) == tmp_path / "5" / f"{mode}.safetensors"


def test_an_axis_is_logarithmic_only_where_values_span_a_decade():
    assert records.spans_decades([11.9, 169.7])
    assert not records.spans_decades([11.9, 65.2])
    assert not records.spans_decades([0.0, 99.0])  # a score of 0 has no place on a log axis


def test_a_plot_draws_a_line_per_family_and_labels_that_do_not_overlap(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    # quanto int2 far above: the rest sit within a few percent of each other, where labels would pile up
    values = {("quantized_cache", 3.4): 12.1, ("quantized_cache", 5.9): 169.7, ("patchkv", 4.0): 11.9,
              ("patchkv", 4.1): 11.95, ("patchkv", 8.1): 12.2, ("patchkv", 16.1): 14.0}
    points = [records.Point("prose", family, x, y, f"{family} at {x}") for (family, x), y in values.items()]
    path = records.plot(points, tmp_path / "p.png", xlabel="compression", ylabel="perplexity",
                        baselines={"prose": 11.855})
    assert path.is_file()
    ax = figures[0].axes[0]
    assert ax.get_yscale() == "log" and ax.get_xscale() == "linear"
    legend = figures[0].legends[0]  # one legend beside the panels, each family named once
    assert sorted(text.get_text() for text in legend.get_texts()) == ["patchkv", "quantized_cache", "unpatched"]
    renderer = figures[0].canvas.get_renderer()
    for text in ax.texts:
        text.update_positions(renderer)
    boxes = [Text.get_window_extent(text, renderer) for text in ax.texts]  # the text alone, not its leader line
    assert len(boxes) == len(points)
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    # each label in its line's colour, and over no other point's marker
    colour = {bars.get_label(): bars.lines[0].get_color() for bars in ax.containers}
    assert [text.get_color() for text in ax.texts] == [colour[text.get_text().split(" at ")[0]] for text in ax.texts]
    centres = {p.label: ax.transData.transform((p.x, p.y)) for p in points}
    assert not [(text.get_text(), label) for text, box in zip(ax.texts, boxes) for label, (x, y) in centres.items()
                if label != text.get_text() and box.contains(x, y)]


def test_a_family_keeps_its_colour_in_every_panel_and_panels_wrap(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    # "b" first appears in the second panel, "a" is missing from it: colours follow the family, not the panel's order
    points = [records.Point("one", "a", 1.0, 1.0), records.Point("one", "b", 2.0, 2.0),
              records.Point("two", "b", 1.0, 1.0), records.Point("two", "c", 2.0, 2.0),
              *(records.Point(f"p{i}", "a", 1.0, 1.0) for i in range(3))]
    records.plot(points, tmp_path / "p.png", xlabel="x", ylabel="y")
    shown = [ax for ax in figures[0].axes if ax.get_visible()]
    assert len(shown) == 5 and len(figures[0].axes) == 6  # two rows of three, the last cell left empty
    colours = [{bars.get_label(): bars.lines[0].get_color() for bars in ax.containers} for ax in shown]
    assert colours[0]["b"] == colours[1]["b"] != colours[1]["c"]
    assert len({c["a"] for c in (colours[0], *colours[2:])}) == 1
    assert [t.get_text() for t in figures[0].legends[0].get_texts()] == ["a", "b", "c"]


def test_the_reference_models_dtype_is_bfloat16_unless_the_variable_names_another(monkeypatch, tmp_path):
    """`evals.suite.models_dtype`: PATCHKV_EVALS_DTYPE (the test suite sets float32) or bfloat16; anything else is
    refused with the choices; provenance records it."""
    import json

    import torch

    from evals.suite import models_dtype, write_provenance

    monkeypatch.delenv("PATCHKV_EVALS_DTYPE", raising=False)
    assert models_dtype() == torch.bfloat16
    monkeypatch.setenv("PATCHKV_EVALS_DTYPE", "float32")
    assert models_dtype() == torch.float32
    assert json.loads(write_provenance(tmp_path / "x.csv").read_text())["models_dtype"] == "float32"
    monkeypatch.setenv("PATCHKV_EVALS_DTYPE", "fp16")
    with pytest.raises(SystemExit, match="expected one of bfloat16, float32"):
        models_dtype()


def test_a_checkout_is_dirty_when_code_changes_not_when_a_run_appends_results(tmp_path, monkeypatch):
    import subprocess

    from patchkv import provenance

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "evals" / "results").mkdir(parents=True)
    (tmp_path / "evals" / "results" / "records.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    monkeypatch.setattr(provenance, "CHECKOUT", tmp_path)
    clean = provenance.commit()
    assert clean != "unknown" and not clean.endswith("+dirty")
    (tmp_path / "evals" / "results" / "records.jsonl").write_text("{}\n{}\n")
    assert provenance.commit() == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.commit() == clean + "+dirty"
