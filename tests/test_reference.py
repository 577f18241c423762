"""The shipped reference model and its artifacts, the CLI, and lm-eval on a patched model."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import fed_in_chunks
from transformers import AutoModelForCausalLM, AutoTokenizer

import patchkv
from patchkv.allocation import kv_bytes_per_token
from patchkv.cli import main as cli
from patchkv.corpus import shakespeare_held_out

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "artifacts" / "reference-llama"
BASES = ROOT / "artifacts" / "reference-llama-bases"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = AutoModelForCausalLM.from_pretrained(REF, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(REF, local_files_only=True)


def held_out_windows(tokenizer, n=8, seq=256):
    ids = tokenizer(shakespeare_held_out()[0][20_000:120_000], add_special_tokens=False,
                    return_tensors="pt")["input_ids"][0]
    return ids[: n * seq].view(n, seq)


def token_perplexity(model, windows, chunk=None):
    """Token perplexity of `windows`; with `chunk`, fed that many tokens per forward through the cache (a patched
    model reads a forward's own tokens exact, so the later chunks read the earlier ones from the latents)."""
    with torch.no_grad():
        if chunk is None:
            return math.exp(model(windows, labels=windows).loss.item())
        logits = fed_in_chunks(model, windows, chunk)
        return math.exp(F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item())


def test_reference_model_is_trained_and_loads_offline(reference):
    model, tokenizer = reference
    assert model.config.model_type == "llama" and 5e6 <= model.num_parameters() <= 20e6
    report = json.loads((REF / "training.json").read_text())
    ppl = token_perplexity(model, held_out_windows(tokenizer))
    vocab = model.config.vocab_size
    assert ppl < vocab / 20, f"held-out perplexity {ppl:.1f}: the model is barely better than uniform ({vocab})"
    assert report["held_out_token_perplexity"] < vocab / 20
    text = tokenizer.decode(model.generate(**tokenizer("HAMLET.", return_tensors="pt"), max_new_tokens=12,
                                           do_sample=False)[0])
    assert text.startswith("HAMLET.") and len(text) > len("HAMLET.") + 10


@pytest.mark.parametrize("n, seq", [pytest.param(4, 128, id="short"),
                                    pytest.param(4, 256, id="full", marks=pytest.mark.slow)])
def test_shipped_artifacts_fit_the_reference_model(reference, n, seq):
    model, tokenizer = reference
    windows = held_out_windows(tokenizer, n=n, seq=seq)
    base = token_perplexity(model, windows)
    arts = {mode: patchkv.Artifact.load(BASES / f"{mode}.safetensors") for mode in ("pre_rope", "post_rope")}
    for mode, art in arts.items():
        assert art.mode == mode and "shakespeare" in art.calibration["source"]
        # full rank is lossless; 4x compression costs some perplexity but stays far from broken
        # (one token per forward: each reads the earlier ones from the latents, as in decoding)
        with patchkv.patched(model, art.with_ranks(rank=model.config.head_dim)):
            assert token_perplexity(model, windows, chunk=1) == pytest.approx(base, rel=1e-4)
        with patchkv.patched(model, art.with_ranks(rank=model.config.head_dim // 4)):
            assert base < token_perplexity(model, windows, chunk=1) < 2 * base
    # trained keys are more compressible before rotary embedding than after it
    pre, post = (arts[m].with_ranks(energy=0.9).keys.ranks.float().mean() for m in ("pre_rope", "post_rope"))
    assert pre < post


def test_calibrate_cli_on_corpus(tmp_path):
    cli(["calibrate", "--model", str(REF), "--data", "corpus", "--mode", "post_rope", "--energy", "0.9",
         "--max-tokens", "1024", "--seq-len", "256", "--budgets", "none", "--out", str(tmp_path / "bases")])
    art = patchkv.Artifact.load(tmp_path / "bases")
    assert art.mode == "post_rope" and art.calibration["tokens"] == 1024
    assert art.calibration["rank_selection"] == {"rank": None, "energy": 0.9}


@pytest.mark.parametrize("tasks, limit", [
    pytest.param("patchkv_shakespeare_ppl", "1", id="short"),
    pytest.param("patchkv_shakespeare_ppl,patchkv_shakespeare_cloze", "3", id="full", marks=pytest.mark.slow)])
def test_eval_cli_short_sweep_through_lm_eval(tmp_path, capsys, tasks, limit):
    head_dim = 64
    cli(["eval", "--model", str(REF), "--artifact", str(BASES / "pre_rope.safetensors"),
         "--artifact", str(BASES / "post_rope.safetensors"), "--sweep", "--ranks", f"8,{head_dim}",
         "--tasks", tasks, "--limit", limit, "--chunk", "8",
         "--out", str(tmp_path), "--name", "sweep"])  # 8 tokens per forward: later ones read the latents
    printed = capsys.readouterr().out
    assert "| unpatched |" in printed and "pre_rope rank=8" in printed and "post_rope rank=64" in printed
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [r["config"] for r in rows] == ["unpatched", "pre_rope rank=8", f"pre_rope rank={head_dim}",
                                           "post_rope rank=8", f"post_rope rank={head_dim}"]
    base = float(rows[0]["patchkv_shakespeare_ppl"])
    for row in rows[1:]:
        delta = float(row["delta_patchkv_shakespeare_ppl"])
        if row["budget"] == f"rank={head_dim}":  # lossless: lm-eval sees the same model
            # measured bytes include the cache's int32 position per token: 6144 / (6144 + 4)
            assert abs(delta) < 1e-3 * base and float(row["compression"]) == pytest.approx(6144 / 6148, abs=1e-4)
        else:  # lm-eval really ran the patched model: 8x compression moves perplexity
            assert delta > 1e-3 * base and float(row["compression"]) == pytest.approx(6144 / 772, abs=1e-4)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_streaming_lm_scores_through_the_cache(reference):
    from lm_eval.api.instance import Instance

    from patchkv.streaming import StreamingLM

    model, tokenizer = reference
    context, continuation = "HAMLET.\nTo be, or not to be, that is the question:\n", "Whether 'tis nobler in the mind"
    request = Instance("loglikelihood", doc={}, arguments=(context, continuation), idx=0)
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]

    def one_forward() -> float:
        with torch.no_grad():
            logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        return sum(logprobs[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))

    def decoded() -> float:  # the context in one forward, then the continuation one token per forward
        with torch.no_grad():
            out = model(torch.tensor([ctx]), use_cache=True)
            total = 0.0
            for i in range(len(ctx), len(whole)):
                total += out.logits[0, -1].float().log_softmax(-1)[whole[i]].item()
                out = model(torch.tensor([[whole[i]]]), cache=out.cache, use_cache=True)
        return total

    exact = one_forward()
    lm = StreamingLM(model, tokenizer)
    assert lm.loglikelihood([request], disable_tqdm=True)[0][0] == pytest.approx(exact, abs=1e-3)
    art = patchkv.Artifact.load(BASES / "pre_rope.safetensors")
    with patchkv.patched(model, art):  # plain latent cache: decoded tokens read the context from the latents
        lm = StreamingLM(model, tokenizer)
        streamed = lm.loglikelihood([request], disable_tqdm=True)[0][0]
        assert streamed == pytest.approx(decoded(), abs=1e-3) and abs(streamed - exact) > 1e-2
        assert one_forward() == pytest.approx(exact, abs=1e-3)  # a single forward reads its own tokens exact
        assert lm.kv_bytes_per_token == kv_bytes_per_token(art) + 4  # + the int32 true position of each token
    with patchkv.patched(model, art, sink_tokens=1, window=2):
        dense = StreamingLM(model, tokenizer).loglikelihood([request], disable_tqdm=True)[0][0]
    with patchkv.patched(model, art, sink_tokens=1, window=2, top_k=4, top_k_rank=4):
        assert one_forward() == pytest.approx(exact, abs=1e-3)  # a single forward never decodes: top-k does not act
        sparse = StreamingLM(model, tokenizer).loglikelihood([request], disable_tqdm=True)[0][0]
    assert abs(sparse - dense) > 1e-2
