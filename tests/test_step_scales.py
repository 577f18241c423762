"""Step scales (artifact format version 4, `patchkv.step_scales`): one set per budget, stored with typed budgets,
validated, read by `Quantized` for its own budget, fitted on the model's own loss through the cache; version 3
files (one set, its budget in the free-form summary) load as one budget or are refused."""

import copy
import re

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks
from test_global_pool import model, weighted  # noqa: F401 (the tiny Llama and its effect-weighted bases)
from test_reliability_artifact import edited_refusal, read, write

import patchkv
from patchkv.allocation import bit_allocation, step_scales_for
from patchkv.artifact import Artifact
from patchkv.errors import ArtifactError, InvalidArtifactError, PatchKVError
from patchkv.quantize import GAUSSIAN_STEP
from patchkv.step_scales import grid_edges, loss_vocabulary, restricted_head, token_loss, with_step_scales


@pytest.fixture(scope="module")
def fitted(model, weighted):
    return patchkv.fit_step_scales(model, weighted, calibration_ids(2, 40, seed=9), bits=12, pool="global",
                                   sink_tokens=2, window=4, grid=(1.0, 3.0), top=None, extend=0)


def test_version_4_round_trips_with_and_without_effect_weights(tmp_path, fitted):
    tensors, meta = read(fitted.save(tmp_path / "v4.safetensors"))
    assert meta["format_version"] == 4 and len(tensors) == 12
    assert meta["step_budgets"] == [{"bits": 12, "pool": "global"}] and tensors["keys.step_scales"].shape == (1, 2, 2)
    back = Artifact.load(tmp_path / "v4.safetensors")
    assert torch.equal(back.keys.step_scales, fitted.keys.step_scales.float())
    assert back.step_budgets == [(12, "global")]
    plain = copy.deepcopy(fitted)
    plain.keys.weights = plain.values.weights = None
    tensors, meta = read(plain.save(tmp_path / "v4plain.safetensors"))
    assert meta["format_version"] == 4 and len(tensors) == 10
    assert Artifact.load(tmp_path / "v4plain.safetensors").values.weights is None


def version_3(tmp_path, fitted, record):
    """A version 3 file as the previous format wrote it: scales [L, H], their budget in calibration["step_scales"]."""
    tensors, meta = read(fitted.save(tmp_path / "a.safetensors"))
    for kind in ("keys", "values"):
        tensors[f"{kind}.step_scales"] = tensors[f"{kind}.step_scales"][0].contiguous()
    meta["format_version"] = 3
    del meta["step_budgets"]
    meta["calibration"] = {**meta["calibration"], "step_scales": record}
    return write(tmp_path / "v3.safetensors", tensors, meta)


def test_version_3_loads_as_one_budget_and_junk_records_are_refused(tmp_path, fitted):
    back = Artifact.load(version_3(tmp_path, fitted, {"bits": 12, "pool": "global", "keys": 3.0}))
    assert back.step_budgets == [(12, "global")] and back.keys.step_scales.shape == (1, 2, 2)
    assert back.format_version == 4  # saved again, it is written at version 4
    for junk in ("x", None, [12], {"bits": "12", "pool": "global"}, {"pool": "global"}):
        with pytest.raises(ArtifactError, match=r"version 3: the budget of its step scales"):
            Artifact.load(version_3(tmp_path, fitted, junk))


@pytest.mark.parametrize("edit, fragment", [
    (lambda t, m: t.pop("values.step_scales"), "missing ['values.step_scales']"),
    (lambda t, m: m.update(format_version=2) or m.pop("step_budgets"), "unexpected ['keys.step_scales'"),
    (lambda t, m: m.pop("step_budgets"), "missing ['step_budgets']"),
    (lambda t, m: t.update({"keys.step_scales": torch.zeros_like(t["keys.step_scales"])}),
     "keys.step_scales at layer 0, head 0: step scales must be > 0"),
    (lambda t, m: t.update({"keys.step_scales": t["keys.step_scales"][:, :, :1].contiguous()}),
     "keys.step_scales has shape"),
    (lambda t, m: t.update({"values.step_scales": t["values.step_scales"] * float("nan")}), "NaN"),
    (lambda t, m: m.update(step_budgets=[{"bits": 12, "pool": "global"}, {"bits": 20, "pool": "global"}]),
     "has 1 budget(s), step_budgets lists 2"),
    (lambda t, m: m.update(step_budgets=[{"bits": 12, "pool": "global"}] * 2), "lists a budget twice"),
    (lambda t, m: m.update(step_budgets=[]), "non-empty list"),
    (lambda t, m: m.update(step_budgets=[{"bits": "12", "pool": "global"}]), "bits must be an integer"),
    (lambda t, m: m.update(step_budgets=[{"bits": 12, "pool": "layer"}]), "pool must be one of"),
    (lambda t, m: m.update(step_budgets=[{"bits": 12, "pool": "head", "x": 1}]), "exactly the fields 'bits' and 'pool'"),
    (lambda t, m: m.update(step_budgets=[{"bits": 0, "pool": "global"}]), "bits must be an integer in [1, "),
    (lambda t, m: m.update(step_budgets=[{"bits": 10_000, "pool": "global"}]), "bits must be an integer in [1, "),
    (lambda t, m: m.update(step_budgets=[{"bits": True, "pool": "global"}]), "bits must be an integer"),
    (lambda t, m: m.update(step_budgets=[{"bits": 12.0, "pool": "global"}]), "bits must be an integer"),
    (lambda t, m: m.update(step_budgets=["12/global"]), "exactly the fields 'bits' and 'pool'"),
    (lambda t, m: m.update(step_budgets={"bits": 12, "pool": "global"}), "non-empty list"),
    (lambda t, m: m.update(step_budgets=None), "non-empty list"),
])
def test_bad_step_scales_are_refused(tmp_path, fitted, edit, fragment):
    assert fragment in edited_refusal(tmp_path, fitted, edit)


def test_step_scales_for_keys_only_or_without_budgets_are_refused(fitted):
    keys_only = copy.deepcopy(fitted)
    keys_only.values.step_scales = None
    with pytest.raises(InvalidArtifactError, match="step scales must be given for keys and values both"):
        keys_only._validate()
    unbudgeted = copy.deepcopy(fitted)
    unbudgeted.step_budgets = None
    with pytest.raises(InvalidArtifactError, match="step scales come with step_budgets"):
        unbudgeted._validate()


def test_budgets_are_validated_in_memory_too(weighted):
    """An artifact built in memory gets the checks of `load`: step_budgets is a typed field, not a summary."""
    parts = {kind: copy.deepcopy(getattr(weighted, kind)) for kind in ("keys", "values")}
    for c in parts.values():
        c.step_scales = torch.ones((1, *c.ranks.shape))
    for budgets, fragment in (([(12, "layer")], "pool must be one of"), ([(0, "head")], "bits must be an integer"),
                              ([(12, "head"), (12, "head")], "lists a budget twice"), ([], "non-empty list"),
                              ([(12, "head"), (20, "head")], "has 1 budget(s), step_budgets lists 2")):
        with pytest.raises(InvalidArtifactError, match=re.escape(fragment)):
            Artifact(mode=weighted.mode, model=weighted.model, step_budgets=budgets, **parts)
    with pytest.raises(InvalidArtifactError, match="bits must be an integer"):
        with_step_scales(weighted, 1.0, 1.0, bits=-3, pool="head")


def test_the_summary_never_changes_the_codes(weighted):
    """Runtime reads typed fields only: a summary that names other step scales (the record a version 3 file kept)
    or holds junk gives the same codes as an empty one."""
    art = with_step_scales(weighted, 2.0, 3.0, bits=12, pool="global")
    misleading = copy.copy(art)
    misleading.calibration = {"step_scales": {"bits": 32, "pool": "head", "keys": 9.0, "values": 9.0},
                              "step_scale_fits": "junk", "rank_selection": None}
    for bits, pool in ((12, "global"), (32, "head")):
        ours, theirs = (patchkv.Quantized(bits, pool=pool).codecs(a, [2, 2], torch.float32) for a in (art, misleading))
        for pair, other in zip(ours, theirs):
            for codec, same in zip(pair, other):
                assert torch.equal(codec.quantizer.step, same.quantizer.step)


def test_quantized_codes_read_the_scales_of_their_budget(model, weighted):
    """Scale 1 is the Gaussian-matched quantizer exactly; scale s multiplies every step of that kind by s."""
    methods = [patchkv.SinksWindow(2, 4), patchkv.Quantized(32)]
    ids = calibration_ids(1, 30, seed=3)
    key_bits, layer = bit_allocation(weighted, 32)[0], 1
    logits = {}
    for name, artifact in (("none", weighted), ("one", with_step_scales(weighted, 1.0, 1.0, bits=32, pool="head")),
                           ("wide", with_step_scales(weighted, 2.0, 1.0, bits=32, pool="head"))):
        with patchkv.patched(model, artifact, methods):
            patch = model.model.layers[layer].self_attn.patchkv
            logits[name] = fed_in_chunks(model, ids, 3)
            if name == "wide":
                quantizer = patch.keys.quantizer
                rank = quantizer.shape[1]
                bits = key_bits[layer][:, :rank].flatten()
                std = weighted.keys.eigenvalues[layer][:, :rank].flatten().sqrt()
                coded = bits > 0
                expected = 2.0 * torch.tensor([GAUSSIAN_STEP[int(b)] for b in bits[coded]]) * std[coded]
                assert coded.any() and torch.allclose(quantizer.step[coded], expected.float(), rtol=1e-5)
    assert torch.equal(logits["none"], logits["one"])
    assert not torch.allclose(logits["none"], logits["wide"])


def test_each_budget_reads_its_own_scales_the_nearest_of_its_pool_or_none(weighted):
    """Two budgets in one artifact: each `Quantized(bits, pool)` gets the set fitted for its budget, a budget in
    between the nearest of its pool (within a factor 1.5), the other pool or a far budget none."""
    art = with_step_scales(weighted, 2.0, 3.0, bits=32, pool="global")
    art = with_step_scales(art, 5.0, 7.0, bits=12, pool="global")
    art = with_step_scales(art, 1.5, 1.5, bits=32, pool="global")  # replaces the first set
    assert art.step_budgets == [(32, "global"), (12, "global")]
    assert float(step_scales_for(art, 32, "global")[0][0, 0]) == 1.5
    assert float(step_scales_for(art, 12, "global")[1][0, 0]) == 7.0
    assert float(step_scales_for(art, 14, "global")[0][0, 0]) == 5.0  # nearest: 12
    assert float(step_scales_for(art, 40, "global")[0][0, 0]) == 1.5  # nearest: 32
    assert step_scales_for(art, 32, "head") is None  # the other pool never
    assert step_scales_for(art, 64, "global") is None  # beyond the reach of any fit
    for bits, pool, scale in ((32, "global", 1.5), (12, "global", 5.0), (32, "head", None)):
        codec = patchkv.Quantized(bits, pool=pool).codecs(art, [2, 2], torch.float32)[0][0]
        plain = patchkv.Quantized(bits, pool=pool).codecs(weighted, [2, 2], torch.float32)[0][0]
        ratio = codec.quantizer.step[plain.quantizer.step > 0] / plain.quantizer.step[plain.quantizer.step > 0]
        assert torch.allclose(ratio, torch.full_like(ratio, scale or 1.0))


def test_fit_takes_the_scales_of_lowest_loss_and_records_them(model, fitted):
    fit = fitted.calibration["step_scale_fits"][-1]
    assert (fit["bits"], fit["pool"]) == (12, "global")
    tried = {(k, v): nll for k, v, nll in fit["tried"]}
    best = (fit["keys"], fit["values"])
    assert set(best) <= {1.0, 3.0} and (1.0, 1.0) in tried
    assert tried[best] == min(tried[c] for c in tried if c[1] == best[1] or c[0] == best[0])
    assert torch.equal(fitted.keys.step_scales, torch.full((1, 2, 2), best[0]))
    assert torch.equal(fitted.values.step_scales, torch.full((1, 2, 2), best[1]))
    # the recorded loss is the patched model's own, token by token through the cache (an independent count)
    ids = calibration_ids(2, 40, seed=9)
    with patchkv.patched(model, fitted, [patchkv.SinksWindow(2, 4), patchkv.Quantized(12, pool="global")]):
        logprobs = fed_in_chunks(model, ids, fit["chunk"]).log_softmax(-1)[:, :-1]
    nll = -logprobs.gather(-1, ids[:, 1:, None]).mean().item()
    assert nll == pytest.approx(tried[best], abs=1e-5)


def test_a_fit_records_its_grid_and_the_scales_at_either_end_of_it(fitted):
    fit = fitted.calibration["step_scale_fits"][-1]
    assert fit["grid"] == [1.0, 3.0]  # two multipliers: whichever wins sits at an end
    assert fit["edges"] == {kind: "lowest" if fit[kind] == 1.0 else "highest" for kind in ("keys", "values")}
    assert grid_edges((1.25, 0.5), (0.5, 1.0, 1.25)) == {"keys": "highest", "values": "lowest"}
    assert grid_edges((1.0, 1.25), (1.0, 1.25, 1.5)) == {"keys": "lowest"}
    assert grid_edges((1.25, 1.25), (1.0, 1.25, 1.5)) == {} and grid_edges((1.0, 1.0), (1.0,)) == {}


def test_a_fit_at_an_end_of_the_grid_searches_on_past_it_while_the_loss_falls(model, weighted):
    """A grid of steps far too wide (4 and 8 times the Gaussian-matched ones): both kinds win at its lowest end,
    and the search goes on down at the grid's ratio (2, 1, 0.5) while the loss falls, never more than `extend`."""
    ids = calibration_ids(2, 40, seed=9)
    grid = (4.0, 8.0)
    only = patchkv.fit_step_scales(model, weighted, ids, bits=12, pool="global", sink_tokens=2, window=4, grid=grid,
                                   top=None, passes=2, extend=0).calibration["step_scale_fits"][-1]
    assert (only["keys"], only["values"]) == (4.0, 4.0) and only["beyond"] == {}
    assert only["edges"] == {"keys": "lowest", "values": "lowest"}
    fit = patchkv.fit_step_scales(model, weighted, ids, bits=12, pool="global", sink_tokens=2, window=4, grid=grid,
                                  top=None, passes=2, extend=3).calibration["step_scale_fits"][-1]
    tried = {(k, v): nll for k, v, nll in fit["tried"]}
    assert fit["keys"] < 4.0 and fit["values"] < 4.0  # the loss fell past the grid for both
    for kind, i, line in (("keys", 0, lambda c: c[1] == 1.0), ("values", 1, lambda c: c[0] == fit["keys"])):
        beyond = fit["beyond"][kind]
        assert beyond == sorted([2.0, 1.0, 0.5][:len(beyond)])
        on_line = {c[i]: nll for c, nll in tried.items() if line(c)}
        assert set(on_line) == {*grid, *beyond}  # the grid, then one multiplier past its end at a time
        assert fit[kind] == min(on_line, key=on_line.get)
        walked = sorted(beyond, reverse=True)  # in the order tried: each one tried only if the one before it won
        for before, after in zip([4.0, *walked], walked):
            assert on_line[before] <= min(on_line[s] for s in on_line if s > before)
        if fit[kind] != min(beyond):  # stopped because the loss rose, not because `extend` ran out
            assert on_line[min(beyond)] >= on_line[fit[kind]]
        assert (kind in fit["edges"]) == (fit[kind] == min(beyond))
    with pytest.raises(ValueError, match="extend must be a non-negative integer"):
        patchkv.fit_step_scales(model, weighted, ids, bits=12, extend=-1)


def test_a_restricted_loss_reads_the_targets_and_the_unpatched_top_tokens(model, weighted):
    ids = calibration_ids(2, 40, seed=9)
    with torch.no_grad():
        logits = fed_in_chunks(model, ids, 64)  # unpatched: every position's logits
    expected = torch.unique(torch.cat([ids.flatten(), logits.topk(5, dim=-1).indices.flatten()]))
    assert 5 < expected.numel() < 96 and torch.equal(loss_vocabulary(model, ids, 5, chunk=16), expected)
    assert loss_vocabulary(model, ids, 96) is None  # the whole vocabulary: nothing to restrict
    fit = patchkv.fit_step_scales(model, weighted, ids, bits=12, pool="global", sink_tokens=2, window=4,
                                  grid=(1.0, 3.0), top=5).calibration["step_scale_fits"][-1]
    assert fit["loss_vocabulary"] == {"top": 5, "tokens": expected.numel()}
    best = (fit["keys"], fit["values"])
    tried = {(k, v): nll for k, v, nll in fit["tried"]}
    fitted = with_step_scales(weighted, *best, bits=12, pool="global")
    with patchkv.patched(model, fitted, [patchkv.SinksWindow(2, 4), patchkv.Quantized(12, pool="global")]):
        restricted = fed_in_chunks(model, ids, fit["chunk"])[..., expected].log_softmax(-1)[:, :-1]
    targets = torch.searchsorted(expected, ids[:, 1:].contiguous())
    assert -restricted.gather(-1, targets[..., None]).mean().item() == pytest.approx(tried[best], abs=1e-5)
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)  # the model's own head is back


def test_restricted_head_puts_the_head_back_on_error(model):
    head = model.get_output_embeddings()
    with pytest.raises(RuntimeError, match="inside"):
        with restricted_head(model, torch.tensor([3, 7, 9])):
            assert model(calibration_ids(1, 5)).logits.shape[-1] == 3
            raise RuntimeError("inside")
    assert model.get_output_embeddings() is head


def test_token_loss_of_an_unpatched_model_is_its_cross_entropy(model):
    ids = calibration_ids(2, 20, seed=4)
    with torch.no_grad():
        expected = model(ids, labels=ids).loss.item()
    assert token_loss(model, ids, 7) == pytest.approx(expected, abs=1e-5)


def test_fit_refuses_a_patched_model_and_short_text(model, weighted):
    with pytest.raises(ValueError, match="seq > sink_tokens"):
        patchkv.fit_step_scales(model, weighted, calibration_ids(1, 6), bits=12, sink_tokens=2, window=4)
    with patchkv.patched(model, weighted):
        with pytest.raises(PatchKVError, match="patchkv.remove"):
            patchkv.fit_step_scales(model, weighted, calibration_ids(1, 40), bits=12)


def test_fitting_another_budget_adds_a_set_and_keeps_the_first(model, fitted):
    """Fitting the per-head pool after the global one: every trial reads its own scales, and both sets stay."""
    refit = patchkv.fit_step_scales(model, fitted, calibration_ids(2, 40, seed=9), bits=32, pool="head",
                                    sink_tokens=2, window=4, grid=(1.0, 3.0))
    losses = [nll for _, _, nll in refit.calibration["step_scale_fits"][-1]["tried"]]
    assert len(set(losses)) == len(losses)
    assert refit.step_budgets == [(12, "global"), (32, "head")]
    assert torch.equal(refit.keys.step_scales[0], fitted.keys.step_scales[0])
    assert [(f["bits"], f["pool"]) for f in refit.calibration["step_scale_fits"]] == [(12, "global"), (32, "head")]


def test_two_passes_search_the_keys_then_the_values_only(model, weighted):
    grid = (1.0, 2.0, 3.0)
    fit = patchkv.fit_step_scales(model, weighted, calibration_ids(2, 40, seed=9), bits=12, pool="global",
                                  sink_tokens=2, window=4, grid=grid, passes=2,
                                  extend=0).calibration["step_scale_fits"][-1]
    tried = {(k, v) for k, v, _ in fit["tried"]}
    keys = min(grid, key=lambda k: next(nll for a, b, nll in fit["tried"] if (a, b) == (k, 1.0)))
    assert tried == {(k, 1.0) for k in grid} | {(keys, v) for v in grid} and fit["keys"] == keys
    with pytest.raises(ValueError, match="passes"):
        patchkv.fit_step_scales(model, weighted, calibration_ids(2, 40), bits=12, passes=4)
    with pytest.raises(ValueError, match="top must be a positive integer"):
        patchkv.fit_step_scales(model, weighted, calibration_ids(2, 40), bits=12, top=0)
