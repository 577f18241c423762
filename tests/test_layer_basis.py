"""Layer bases (artifact format version 5, `Quantized(basis="layer")`): one PCA per layer over its KV heads
concatenated, calibrated beside the per-head bases, stored and validated, and coded as one latent per token and
layer that every head reads, through the same cache, kernels and decode path as per-head codes."""

import copy

import pytest
import torch
from conftest import calibration_ids, fed_in_chunks
from test_fast_decode import check_decode
from test_global_pool import model  # noqa: F401 (the tiny Llama)
from test_reliability_artifact import edited_refusal, read

import patchkv
from patchkv.allocation import kv_bytes_per_token, layer_bit_allocation
from patchkv.fisher import effect_weights
from patchkv.artifact import Artifact
from patchkv.errors import ArtifactError
from patchkv.latent import LayerBasis
from patchkv.methods import parse_method
from patchkv.methods.quantized import LayerQuantizedCodec


@pytest.fixture(scope="module")
def layered(model):  # noqa: F811 (the tiny Llama of test_global_pool)
    return patchkv.calibrate(model, calibration_ids(8, 48), mode="pre_rope", rank=16, sink_tokens=2,
                             fisher_tokens=128, fisher_window=4, layer_bases=True, progress=False)


def test_each_heads_block_of_the_layer_covariance_is_that_heads_covariance(model, layered):
    plain = patchkv.calibrate(model, calibration_ids(8, 48), mode="pre_rope", rank=16, sink_tokens=2, progress=False)
    assert not plain.has_layer_bases and plain.format_version == 1
    assert layered.has_layer_bases and layered.format_version == 5
    heads, dim = layered.num_kv_heads, layered.head_dim
    for kind in ("keys", "values"):
        c = getattr(layered, kind)
        layer_cov = c.layer_eigenvectors.double() @ torch.diag_embed(c.layer_eigenvalues.double()) \
            @ c.layer_eigenvectors.double().mT                                              # [L, D, D]
        head_cov = c.eigenvectors.double() @ torch.diag_embed(c.eigenvalues.double()) @ c.eigenvectors.double().mT
        for h in range(heads):
            block = layer_cov[:, h * dim:(h + 1) * dim, h * dim:(h + 1) * dim]
            assert torch.allclose(block, head_cov[:, h], atol=1e-9 * head_cov.abs().max())
        assert torch.allclose(c.layer_mean.view(-1, heads, dim).double(), c.mean.double())
        assert torch.allclose(c.eigenvalues, getattr(plain, kind).eigenvalues, rtol=1e-6, atol=1e-12)


def test_version_5_round_trips_with_and_without_step_scales(tmp_path, layered):
    tensors, meta = read(layered.save(tmp_path / "v5.safetensors"))
    assert meta["format_version"] == 5 and "step_budgets" not in meta and len(tensors) == 18
    back = Artifact.load(tmp_path / "v5.safetensors")
    assert torch.equal(back.keys.layer_eigenvectors, layered.keys.layer_eigenvectors.float())
    scaled = patchkv.step_scales.with_step_scales(layered, 1.5, 2.0, bits=24,
                                            pool="global")
    tensors, meta = read(scaled.save(tmp_path / "v5s.safetensors"))
    assert meta["format_version"] == 5 and meta["step_budgets"] == [{"bits": 24, "pool": "global"}]
    assert len(tensors) == 20 and Artifact.load(tmp_path / "v5s.safetensors").step_budgets == [(24, "global")]
    plain = copy.deepcopy(layered)
    plain.keys.weights = plain.values.weights = plain.keys.layer_weights = plain.values.layer_weights = None
    tensors, meta = read(plain.save(tmp_path / "v5plain.safetensors"))
    assert meta["format_version"] == 5 and len(tensors) == 14
    assert Artifact.load(tmp_path / "v5plain.safetensors").keys.layer_weights is None


@pytest.mark.parametrize("edit, fragment", [
    (lambda t, m: t.pop("values.layer_eigenvalues"), "missing ['values.layer_eigenvalues']"),
    (lambda t, m: m.update(format_version=4, step_budgets=[{"bits": 8, "pool": "head"}]), "unexpected"),
    (lambda t, m: t.update({"keys.layer_eigenvectors": t["keys.layer_eigenvectors"] * 1.5}), "not orthonormal"),
    (lambda t, m: t.update({"keys.layer_eigenvalues": t["keys.layer_eigenvalues"].flip(-1).contiguous()}),
     "sorted in descending order"),
    (lambda t, m: t.update({"values.layer_mean": t["values.layer_mean"][:, :5].contiguous()}), "has shape"),
    (lambda t, m: m.update(step_budgets=[{"bits": 8, "pool": "head"}]), "missing ['keys.step_scales'"),
    (lambda t, m: t.pop("keys.layer_weights"), "missing ['keys.layer_weights']"),
    (lambda t, m: t.update({"values.layer_weights": -t["values.layer_weights"] - 1}), "effect weights must be >= 0"),
])
def test_bad_layer_bases_are_refused(tmp_path, layered, edit, fragment):
    assert fragment in edited_refusal(tmp_path, layered, edit)


def test_layer_bases_for_keys_only_are_refused(layered):
    broken = copy.deepcopy(layered)
    broken.values.layer_mean = broken.values.layer_eigenvalues = broken.values.layer_eigenvectors = None
    broken.values.layer_weights = None
    with pytest.raises(ArtifactError, match="layer bases must be given for keys and values both"):
        broken.save("unused.safetensors")


def test_a_layer_basis_needs_layer_bases(model):
    plain = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=16, progress=False)
    with pytest.raises(ValueError, match="layer_bases=True"):
        patchkv.apply(model, plain, methods=[patchkv.Quantized(24, basis="layer")])
    assert not patchkv.is_patched(model)
    with pytest.raises(ValueError, match="basis must be one of"):
        patchkv.Quantized(24, basis="heads")
    assert parse_method("quantized:bits=24,pool=global,basis=layer") == patchkv.Quantized(24, "global", "layer")


def test_one_code_per_token_is_read_by_every_head():
    """Codes hold each layer component once; every head decodes its own rows of the basis from them."""
    torch.manual_seed(0)
    heads, dim = 3, 8
    width = heads * dim
    x = torch.randn(500, width, dtype=torch.float64) @ torch.randn(width, width, dtype=torch.float64)
    mean = x.mean(0)
    lam, vec = torch.linalg.eigh((x - mean).T @ (x - mean) / len(x))
    lam, vec = lam.flip(0), vec.flip(1)
    basis = LayerBasis(mean, vec, width, heads, 2, torch.float32)
    codec = LayerQuantizedCodec(basis, torch.full((width,), 8), lam)
    assert codec.width == width  # 8 bits per component, once, not once per head
    vectors = x[:7].float().view(1, 7, heads, dim).transpose(1, 2)
    stored = codec.encode(vectors)
    assert stored.shape == (1, 1, 7, width)
    back = basis.reconstruct(codec.decode(stored))
    assert (back - vectors).abs().max() < 0.02 * vectors.abs().max()
    rebuilt = patchkv.kernels.reference.reconstruct(stored.squeeze(1), codec.table, codec.rows, codec.kernel_mean,
                                                    None, None, None, 0, torch.float32)
    assert torch.allclose(rebuilt, back, atol=1e-4)


@pytest.mark.parametrize("pool", ["head", "global"])
def test_layer_codes_hold_exactly_their_bytes_and_approach_exact_at_full_rate(model, layered, pool):
    ids = calibration_ids(2, 40, seed=3)
    for bits in (12, 48):
        allocated = layer_bit_allocation(layered, bits, pool)
        assert sum(int(a.sum()) for a in allocated) <= bits * 2 * 2 * 2
        with patchkv.patched(model, layered, methods=[patchkv.Quantized(bits, pool, "layer")]):
            cache = model(ids, use_cache=True).cache
            coded = sum(int(layer.tensors["latent_keys"].numel() + layer.tensors["latent_values"].numel())
                        for layer in cache.layers) // (ids.shape[0] * ids.shape[1])
        assert coded == kv_bytes_per_token(layered, bits, pool, "layer")
    reference = fed_in_chunks(model, ids, 8)
    with patchkv.patched(model, layered, methods=[patchkv.Quantized(128, "head", "layer")]):
        full = fed_in_chunks(model, ids, 8)
    with patchkv.patched(model, layered, methods=[patchkv.Quantized(12, "head", "layer")]):
        coarse = fed_in_chunks(model, ids, 8)
    assert (full - reference).abs().max() < 0.02 * reference.abs().max()
    assert (coarse - reference).abs().max() > (full - reference).abs().max()


def test_the_layer_fisher_matrix_holds_the_heads_fisher_matrices_as_its_diagonal_blocks(model, layered):
    """Layer effect weights come from each layer's whole Fisher matrix (cross-head terms included), whose diagonal
    blocks are the per-head matrices the heads' weights come from."""
    from patchkv.adapters import adapter_for, attention_modules
    from patchkv.fisher import FisherCapture

    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    ids = calibration_ids(2, 24, seed=4)
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=2, window=4, layers=1) as fisher:
        for row in range(2):
            one = ids[row:row + 1]
            fisher.step(one, torch.ones_like(one), torch.arange(24)[None], torch.ones_like(one, dtype=torch.bool),
                        torch.device("cpu"))
    heads, dim = layered.num_kv_heads, layered.head_dim
    for h in range(heads):
        block = fisher.layer_keys[:, h * dim:(h + 1) * dim, h * dim:(h + 1) * dim]
        assert torch.allclose(block, fisher.keys[:, h], rtol=1e-10, atol=1e-14)
    assert fisher.layer_values.abs().sum() > 0
    c = layered.keys
    assert c.layer_weights.shape == c.layer_mean.shape and (c.layer_weights >= 0).all()
    w = effect_weights(fisher.layer_keys, c.layer_eigenvectors)
    assert w.shape == c.layer_weights.shape


@pytest.mark.parametrize("options", [dict(bits=40), dict(sink_tokens=2, window=3, bits=40)])
def test_decode_attention_on_layer_codes_equals_the_attention_over_dense_keys(mode, options, monkeypatch):
    check_decode("llama", "sdpa", mode, options, monkeypatch, layer=True)


def test_decode_attention_on_layer_codes_in_every_family(family, monkeypatch):
    check_decode(family, "sdpa", "pre_rope", dict(sink_tokens=2, window=3, bits=24), monkeypatch, layer=True)


def test_a_saved_cache_of_layer_codes_continues_exactly(tmp_path, model, layered):
    ids, more = calibration_ids(2, 40, seed=5), calibration_ids(2, 6, seed=6)
    with patchkv.patched(model, layered, [patchkv.SinksWindow(2, 4), patchkv.Quantized(24, "global", "layer")]):
        cache = model(ids[:, 20:], cache=model(ids[:, :20], use_cache=True).cache, use_cache=True).cache
        saved = patchkv.save_cache(cache, tmp_path / "prefix.safetensors")
        restored = patchkv.load_cache(model, saved.path)
        step = [model(more[:, i:i + 1], cache=c, use_cache=True).logits for c in (cache, restored) for i in range(1)]
        assert torch.equal(step[0], step[1])


def test_step_scales_fitted_for_layer_codes_score_the_layer_codes(model, layered):
    """`fit_step_scales(basis="layer")` tries the codes on the layer bases: its recorded loss is the model's own
    patched with `Quantized(basis="layer")` and the fitted scales, and not the per-head codes' loss."""
    ids = calibration_ids(2, 40, seed=9)
    fitted = patchkv.fit_step_scales(model, layered, ids, bits=24, pool="global", basis="layer", sink_tokens=2,
                                     window=4, grid=(1.0, 2.0), top=None, passes=2, extend=0)
    fit = fitted.calibration["step_scale_fits"][-1]
    assert (fit["bits"], fit["pool"], fit["basis"]) == (24, "global", "layer")
    best = (fit["keys"], fit["values"])
    losses = {}
    for basis in ("layer", "head"):
        methods = [patchkv.SinksWindow(2, 4), patchkv.Quantized(24, pool="global", basis=basis)]
        with patchkv.patched(model, fitted, methods):
            logprobs = fed_in_chunks(model, ids, fit["chunk"]).log_softmax(-1)[:, :-1]
        losses[basis] = -logprobs.gather(-1, ids[:, 1:, None]).mean().item()
    tried = {(k, v): nll for k, v, nll in fit["tried"]}
    assert losses["layer"] == pytest.approx(tried[best], abs=1e-5)
    assert losses["head"] != pytest.approx(tried[best], abs=1e-5)  # rounded to 1e-6 in the record
