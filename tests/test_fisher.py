"""Effect weights (patchkv.fisher): the captured Fisher matrices are the gradients of the model's own loss."""

import pytest
import torch

import patchkv
import patchkv.fisher
from patchkv.adapters import adapter_for, attention_modules
from patchkv.fisher import FisherCapture, effect_weights

from conftest import FAMILIES, calibration_ids, make_model

SEQ = 32  # longer than the tiny Mistral (12) and Gemma 3 (10) sliding windows


def _pre_rope_sources(attn, family):
    """(module, how to read [batch, kv_heads, seq, d] keys, values) from the model's own forward."""
    d, h = attn.head_dim, attn.config.num_key_value_heads
    heads = lambda x: x.view(*x.shape[:2], -1, d).transpose(1, 2)  # noqa: E731
    if family == "phi3":
        q_width = attn.config.num_attention_heads * d
        return [(attn.qkv_proj, lambda out: heads(out[..., q_width:q_width + h * d]),
                 lambda out: heads(out[..., q_width + h * d:]))]
    if family == "gemma3":  # k_norm runs on [batch, kv_heads, seq, d]
        return [(attn.k_norm, lambda out: out, None), (attn.v_proj, None, heads)]
    key_module = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj  # Qwen3's k_norm: [batch, seq, kv_heads, d]
    return [(key_module, lambda out: heads(out.flatten(2)), None), (attn.v_proj, None, heads)]


def _reference_fisher(model, family, ids, mode):
    """Sum over tokens of g g^T, g = d(summed loss) / d(cached key or value), by hooks on the unpatched forward."""
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    outputs = {}

    def keep(module, module_out):
        module_out.retain_grad()
        outputs[module] = module_out

    hooks = [m.register_forward_hook(lambda mod, a, out: keep(mod, out))
             for attn in modules for m, _, _ in _pre_rope_sources(attn, family)]
    loss = model(ids, labels=ids).loss * (ids.shape[1] - 1)
    loss.backward()
    for h in hooks:
        h.remove()
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    rotary = adapter.rotary_embedding(model)
    fk, fv = [], []
    for i, attn in enumerate(modules):
        sources = _pre_rope_sources(attn, family)
        gk = gv = None
        for module, read_k, read_v in sources:
            gk = read_k(outputs[module].grad) if read_k else gk
            gv = read_v(outputs[module].grad) if read_v else gv
        if mode == "post_rope":  # k_post = R_j k_pre with R_j orthogonal: d/dk_post = R_j d/dk_pre
            cos, sin = adapter.cos_sin(rotary, attn, gk, positions)
            gk = adapter.rotate(gk, cos, sin)
        fk.append(torch.einsum("hnd,hne->hde", gk[0].double(), gk[0].double()))
        fv.append(torch.einsum("hnd,hne->hde", gv[0].double(), gv[0].double()))
    return torch.stack(fk), torch.stack(fv), loss.item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fisher_equals_the_gradients_of_the_models_own_loss(family, mode):
    model = make_model(family, attn="eager")
    ids = calibration_ids(1, SEQ)
    ref_k, ref_v, ref_loss = _reference_fisher(model, family, ids, mode)
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    mask = torch.ones_like(ids)
    with FisherCapture(model, adapter, modules, mode=mode, sink_tokens=0, window=0) as fisher:
        loss = fisher.step(ids, mask, torch.arange(SEQ).unsqueeze(0), mask.bool(), torch.device("cpu"))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert fisher.count == SEQ
    for got, want in ((fisher.keys, ref_k), (fisher.values, ref_v)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * want.abs().max())
    assert all("forward" not in vars(m) for m in modules)  # the model's own forwards are back


def test_fisher_reads_through_the_librarys_attention_path(monkeypatch):
    """Every layer of a measured row runs `patchkv.attention.attention_forward` (no attention of its own), in float32
    over `[exact | perturbed]` keys and values."""
    model = make_model("llama")
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    calls = []
    path = patchkv.fisher.attention_forward
    monkeypatch.setattr(patchkv.fisher, "attention_forward", lambda attn, lp, layer, *a, **kw: calls.append(
        (attn.layer_idx, kw["compute_dtype"])) or path(attn, lp, layer, *a, **kw))
    ids, mask = calibration_ids(1, SEQ), torch.ones(1, SEQ, dtype=torch.long)
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=2, window=4) as fisher:
        fisher.step(ids, mask, torch.arange(SEQ).unsqueeze(0), mask.bool(), torch.device("cpu"))
    assert calls == [(i, torch.float32) for i in range(len(modules))]
    assert path is patchkv.attention.attention_forward


def test_scored_tokens_choose_the_loss():
    """`scored` keeps only some predictions in the loss (an answer's tokens): the loss is theirs, and F is the Fisher
    of that loss (the reference: the model's own loss over the same targets)."""
    model = make_model("llama", attn="eager")
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    ids, mask = calibration_ids(1, SEQ), torch.ones(1, SEQ, dtype=torch.long)
    positions = torch.arange(SEQ).unsqueeze(0)
    answer = torch.zeros(1, SEQ, dtype=torch.bool)
    answer[0, -5:] = True
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=0, window=0) as fisher:
        loss = fisher.step(ids, mask, positions, mask.bool(), torch.device("cpu"), scored=answer)
    labels = ids.masked_fill(~answer, -100)
    want = model(ids, labels=labels).loss.item() * 5
    assert loss == pytest.approx(want, rel=1e-5)
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=0, window=0) as whole:
        whole.step(ids, mask, positions, mask.bool(), torch.device("cpu"))
    assert fisher.keys.abs().max() > 0
    assert not torch.allclose(fisher.keys, whole.keys)
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=0, window=0) as every:
        every.step(ids, mask, positions, mask.bool(), torch.device("cpu"), scored=mask.bool())
    assert torch.equal(every.keys, whole.keys) and torch.equal(every.values, whole.values)


def test_exact_pairs_carry_no_gradient():
    """Sinks are never compressed (their gradients are zero); a window as long as the sequence leaves nothing."""
    model = make_model("llama")
    adapter = adapter_for(model)
    modules = attention_modules(model, adapter)
    ids, mask = calibration_ids(1, SEQ), torch.ones(1, SEQ, dtype=torch.long)
    positions = torch.arange(SEQ).unsqueeze(0)
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=0, window=SEQ) as fisher:
        fisher.step(ids, mask, positions, mask.bool(), torch.device("cpu"))
    assert fisher.keys.abs().max() == 0 and fisher.values.abs().max() == 0
    sinks_only = torch.zeros(1, SEQ, dtype=torch.bool)
    sinks_only[0, :3] = True
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=3, window=4) as fisher:
        fisher.step(ids, mask, positions, sinks_only, torch.device("cpu"))
    assert fisher.keys.abs().max() == 0 and fisher.values.abs().max() == 0
    with FisherCapture(model, adapter, modules, mode="pre_rope", sink_tokens=3, window=4) as fisher:
        fisher.step(ids, mask, positions, ~sinks_only, torch.device("cpu"))
    assert fisher.keys.abs().max() > 0 and fisher.values.abs().max() > 0


def test_effect_weights_are_the_fisher_diagonal_on_the_basis():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)
    fisher = a @ a.mT
    basis = torch.linalg.qr(torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)).Q
    w = effect_weights(fisher, basis)
    expected = torch.diagonal(basis.mT @ fisher @ basis, dim1=-2, dim2=-1)
    assert torch.allclose(w, expected)
    assert torch.allclose(w.sum(-1), torch.diagonal(fisher, dim1=-2, dim2=-1).sum(-1))  # trace is basis-free


def test_calibrate_with_effect_weights_writes_format_2(tmp_path, mode):
    model = make_model("llama")
    ids = calibration_ids(8, 48)
    art = patchkv.calibrate(model, ids, mode=mode, rank=8, sink_tokens=2, fisher_tokens=64, fisher_window=8,
                            progress=False)
    assert art.format_version == 2 and art.has_effect_weights
    assert art.calibration["effect_weights"] == {"tokens": 4 * 46, "window": 8, "sink_tokens": 2}
    assert (art.keys.weights >= 0).all() and art.values.weights.sum() > 0
    plain = patchkv.calibrate(model, ids, mode=mode, rank=8, sink_tokens=2, progress=False)
    # the moments are the same with or without the gradient pass
    assert torch.allclose(plain.keys.eigenvalues, art.keys.eigenvalues, rtol=1e-6)
    assert plain.format_version == 1 and plain.keys.weights is None
    back = patchkv.Artifact.load(art.save(tmp_path / "a.safetensors"))
    assert back.format_version == 2 and torch.equal(back.keys.weights, art.keys.weights.float())
