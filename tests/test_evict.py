"""`Evict`: the coded tokens a score ranks lowest dropped as they leave the window, the rest coded.

At full rank a patched model with `Evict` computes what the unpatched model computes with each layer's dropped tokens
masked out of every query after the prefill (`without`, a reference built on the model's own attention function),
in every family and mode, on both attention paths (dense operands and decode steps), in every generation mode the
cache supports; the dropped tokens are the lowest scored; tokens leaving the window one at a time are ranked once a
block has gathered, each step then reading as the unpatched model without the tokens dropped before it; the bytes held
are the storage's and budgets pay for the bitmap; saved caches keep the bitmap and the pending count, and a damaged one
is refused.
"""

import json
from contextlib import contextmanager

import pytest
import torch
from conftest import calibration_ids, make_model
from safetensors import safe_open
from safetensors.torch import save_file
from test_fast_decode import check_decode
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import patchkv
from patchkv.budgets import Budget, bits_for_ratio, parse_budget, sixteen_bit_bytes
from patchkv.cache import KEPT, _append_bits, _pack_bits, unpack_bits
from patchkv.cache_file import FORMAT
from patchkv.methods import parse_method

TOL = 1e-4
EXACT = patchkv.SinksWindow(2, 3)


def full_rank(family="llama", mode="pre_rope"):
    model = make_model(family)
    dim = model.model.layers[0].self_attn.head_dim
    return model, patchkv.calibrate(model, calibration_ids(), mode=mode, rank=dim, progress=False)


def dropped(cache) -> dict[int, torch.Tensor]:
    """Each full-attention layer's dropped tokens, bool `[batch, seen]` over the sequence, from its bitmap."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if layer.evict is None:
            continue
        held = unpack_bits(layer.tensors[KEPT], layer.passed)
        gone = torch.zeros(held.shape[0], layer.cumulative_length, dtype=torch.bool)
        gone[:, layer.sink_len:layer.sink_len + layer.passed] = ~held
        out[i] = gone
    return out


@contextmanager
def without(gone: dict[int, torch.Tensor]):
    """The unpatched model's sdpa attention with layer i's tokens `gone[i]` `[batch, n]` masked out of every forward
    that follows the first (whose keys outnumber its queries)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def masked(module, query, key, value, attention_mask, **kwargs):
        drop = gone.get(module.layer_idx)
        if drop is not None and key.shape[2] > query.shape[2]:
            n = min(drop.shape[1], key.shape[2])
            bias = torch.zeros(key.shape[0], 1, query.shape[2], key.shape[2])
            bias[..., :n] = bias[..., :n].masked_fill(drop[:, None, None, :n], float("-inf"))
            if attention_mask is not None:
                mask = attention_mask[..., :key.shape[2]]
                bias = bias + (torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                               else mask.float())
            attention_mask = bias.to(query.dtype)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = masked
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def padded(batch=2, seq=40, seed=3):
    ids = calibration_ids(batch, seq, seed=seed)
    mask = torch.ones_like(ids)
    ids[-1, :5], mask[-1, :5] = 0, 0  # the last row left-padded
    return ids, mask


def test_full_rank_reads_as_the_unpatched_model_without_the_dropped_tokens(family, mode):
    """A prefill drops 30% of the 35 tokens leaving each full layer's window; a 4-token chunk (dense operands) and a
    decode step (`decode_attention`) then give the unpatched model's logits with those tokens masked, left padding
    included. Sliding-window layers drop none."""
    model, art = full_rank(family, mode)
    ids, mask = padded()
    steps = [(slice(0, 30), 30), (slice(30, 34), 34), (slice(34, 35), 35)]

    def run(cache=None):
        logits = []
        for part, end in steps:
            out = model(ids[:, part], attention_mask=mask[:, :end], cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            logits.append(out.logits)
        return logits, cache

    with patchkv.patched(model, art, [EXACT, patchkv.Evict(0.3, block=8)]):
        patched, cache = run()
        assert all(layer.evict is None if layer.is_sliding else layer.passed - layer.coded_len == 7
                   for layer in cache.layers)
    gone = dropped(cache)  # Mistral's tiny model: every layer sliding, none drops
    assert len(gone) == sum(not layer.is_sliding for layer in cache.layers)
    assert all(int(g.sum(1)[0]) == 7 for g in gone.values())
    with without(gone):
        reference, _ = run()
    for got, want in zip(patched, reference):
        assert (got - want).abs().max() < TOL


def test_dropped_tokens_are_the_lowest_scored_averaged_over_the_heads():
    """Post-RoPE (cache space is what the unpatched model caches): each layer drops the tokens whose score, averaged
    over its KV heads, is lowest (of equal scores the earlier), the same for every head."""
    model, art = full_rank(mode="post_rope")
    ids = calibration_ids(1, 40, seed=4)
    plain = model(ids, use_cache=True).past_key_values
    for scorer in ("novelty", "key_norm", "code_error"):
        method = patchkv.Evict(0.25, scorer, block=8)
        with patchkv.patched(model, art, [EXACT, patchkv.Quantized(40), method]):
            cache = model(ids, use_cache=True).cache
        for i, layer in enumerate(cache.layers):
            keys, values = plain.layers[i].keys[:, :, 2:37], plain.layers[i].values[:, :, 2:37]
            stored = (layer.patch.keys.encode(keys), layer.patch.values.encode(values))
            score = method.score_method.score(layer.patch, keys, values, stored).mean(1)
            lowest = score.sort(dim=1, stable=True).indices[:, :8].sort(1).values
            assert torch.equal(dropped(cache)[i][:, 2:37].nonzero()[:, 1], lowest[0])


def test_attention_mass_drops_what_the_last_queries_attend_to_least():
    """`Evict(scorer="attention_mass")`: the unpatched model's own attention weights (eager), renormalised over the
    tokens leaving the window and averaged over the last 32 queries, each KV head's query heads and then the KV heads,
    rank the tokens dropped (the lowest)."""
    model = make_model("llama", "eager")
    art = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=8, progress=False)
    ids = calibration_ids(1, 40, seed=4)
    weights = model(ids, output_attentions=True).attentions  # per layer [1, heads, 40, 40]
    method = patchkv.Evict(0.25, "attention_mass", block=8)
    with patchkv.patched(model, art, [EXACT, patchkv.Quantized(20), method]):
        cache = model(ids, use_cache=True).cache
    for i, w in enumerate(weights):
        seen = w[0, :, -32:, 2:37]  # the last 32 queries on the 35 tokens leaving the window
        score = (seen / seen.sum(-1, keepdim=True)).view(2, 2, 32, 35).mean((1, 2)).mean(0)  # [35]
        lowest = score.sort(stable=True).indices[:8].sort().values
        assert torch.equal(dropped(cache)[i][0, 2:37].nonzero()[:, 0], lowest)


def test_decode_steps_read_the_held_tokens_as_the_dense_path_does(family, mode, monkeypatch):
    """With codes (lossy) and left padding: a decode step over the held tokens (the mask's columns gathered) gives
    the logits of the model's attention function over the dense operands."""
    check_decode(family, "sdpa", mode, dict(sink_tokens=2, window=3, bits=40), monkeypatch,
                 extra=(patchkv.Evict(0.3, block=8),))


def test_chunks_under_a_block_and_decode_steps_drop_once_a_block_has_gathered():
    """Tokens leaving the window in groups under `block` (decode steps, short chunks) are coded as they leave and
    ranked together once `block` have gathered; each chunk of a chunked prefill of at least `block` drops its own
    lowest."""
    model, art = full_rank()
    ids = calibration_ids(1, 45, seed=5)
    with patchkv.patched(model, art, [EXACT, patchkv.Evict(0.25, block=8)]):
        small, big = patchkv.LatentCache(model), patchkv.LatentCache(model)
        for start in range(0, 45, 5):
            model(ids[:, start:start + 5], cache=small, use_cache=True)
        for start in range(0, 45, 15):
            model(ids[:, start:start + 15], cache=big, use_cache=True)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    # chunks of 5: every second chunk brings the gathered tokens to 10, of which 2 go
    assert all(layer.passed == 40 and layer.coded_len == 32 and layer.pending == 0 for layer in small.layers)
    # chunk 1: 10 leave (2 dropped), chunks 2 and 3: 15 each (3 dropped)
    assert all(layer.passed == 40 and layer.coded_len == 32 for layer in big.layers)
    # the prompt's 40 passed tokens lose 10; of the 11 generated tokens that left the window one at a time, the
    # first 8 were ranked together (2 dropped), the last 3 are pending
    assert all(layer.passed == 51 and layer.coded_len == 39 and layer.pending == 3
               for layer in out.past_key_values.layers)


@pytest.mark.parametrize("scorer", ["novelty", "attention_mass"])
def test_decode_steps_drop_the_lowest_of_a_gathered_block_and_read_as_the_unpatched_model_without_them(mode, scorer):
    """A prefill, then one token per forward: every `block` tokens to leave the window are ranked from their codes
    and the lowest go, and each step reads what the unpatched model reads without the tokens dropped before it (at
    full rank the codes are exact). In post-RoPE mode (cache space is what the unpatched model caches) the dropped are
    the lowest by the score of the gathered tokens' keys and values, averaged over the KV heads."""
    model, art = full_rank(mode=mode)
    ids = calibration_ids(1, 55, seed=6)
    method = patchkv.Evict(0.25, scorer, block=20)  # Novelty ranks groups of more than 17 (its neighbours excluded)
    logits, gone = [], []
    with patchkv.patched(model, art, [EXACT, method]):
        cache = patchkv.LatentCache(model)
        model(ids[:, :30], cache=cache, use_cache=True)  # 25 leave the window: 6 dropped
        for i in range(30, 55):
            gone.append(dropped(cache))
            logits.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    # after the prefill, 25 tokens left one at a time: 20 ranked together (5 dropped), 5 pending
    assert all(layer.passed == 50 and layer.coded_len == 19 + 25 - 5 and layer.pending == 5 for layer in cache.layers)
    past = model(ids[:, :30], use_cache=True).past_key_values
    for step, i in enumerate(range(30, 55)):
        with without(gone[step]):
            want = model(ids[:, i:i + 1], past_key_values=past, use_cache=True).logits
        assert (logits[step] - want).abs().max() < TOL
    if mode == "post_rope" and scorer == "novelty":
        plain = model(ids, use_cache=True).past_key_values
        last = dropped(cache)
        gathered = slice(2 + 25, 2 + 25 + 20)  # the first 20 to leave one at a time
        for i, layer in enumerate(cache.layers):
            keys, values = plain.layers[i].keys[:, :, gathered], plain.layers[i].values[:, :, gathered]
            score = method.score_method.score(layer.patch, keys, values, None).mean(1)
            assert score.std() > 0
            lowest = score.sort(dim=1, stable=True).indices[:, :5].sort(1).values
            assert torch.equal(last[i][:, gathered].nonzero()[:, 1], lowest[0])


def test_decode_drops_beside_near_codes_and_salient_copies_and_through_save_load(tmp_path):
    """Decode-time drops beside `NearCodes` and a salience method: the gathered tokens are ranked in the near region,
    the salient copies of those dropped go and the others follow their tokens' new coded index, so each step reads
    within 0.01 of the unpatched model without the tokens dropped before it (8 bits a component); a cache saved with
    tokens pending and loaded drops the same tokens at the same step as the cache it was saved from; a file whose
    pending tokens the bitmap does not hold is refused."""
    model, art = full_rank()
    ids, mask = padded(seq=60, seed=9)
    methods = [EXACT, patchkv.Quantized(128), patchkv.NearCodes(tokens=12), patchkv.Evict(0.3, block=8),
               patchkv.KeyNorm(0.25)]
    logits, gone = [], []
    with patchkv.patched(model, art, methods):
        cache = model(ids[:, :40], attention_mask=mask[:, :40], use_cache=True).cache
        for i in range(40, 60):
            if i == 45:
                saved = patchkv.save_cache(cache, tmp_path / "c.safetensors")
            gone.append(dropped(cache))
            logits.append(model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=cache, use_cache=True).logits)
            for layer in cache.layers:
                assert bool((layer.tensors["salient_index"] < layer.coded_len).all())
        assert all(layer.coded_len == 35 - int(0.3 * 35) + 20 - 2 * 2 and layer.pending == 4 for layer in cache.layers)
        restored = patchkv.load_cache(model, saved.path)
        assert all(layer.pending == 5 for layer in restored.layers)
        for i in range(45, 60):
            again = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=restored, use_cache=True).logits
            assert torch.equal(again, logits[i - 40])
        with safe_open(str(saved.path), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()[FORMAT])
        meta["layers"][0]["pending"] = 40  # more than the layer has coded
        save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={FORMAT: json.dumps(meta)})
        with pytest.raises(patchkv.PatchKVError, match="layer 0 has 40 tokens pending"):
            patchkv.load_cache(model, tmp_path / "bad.safetensors")
    past = model(ids[:, :40], attention_mask=mask[:, :40], use_cache=True).past_key_values
    for step, i in enumerate(range(40, 60)):
        with without(gone[step]):
            want = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=past, use_cache=True).logits
        assert (logits[step] - want).abs().max() < 0.01


GENERATION = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, top_k=10, temperature=0.8),
              "beam": dict(do_sample=False, num_beams=3)}


@pytest.mark.parametrize("gen", list(GENERATION))
@pytest.mark.parametrize("cache_kind", ["default", "latent_passed", "latent_offloaded"])
@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_generation_modes_equal_the_unpatched_model_without_the_dropped_tokens(mode, cache_kind, gen):
    """generate() at full rank, left padding, every cache kind and greedy, sampling and beam search (whose beams of
    one prompt drop the same tokens): the sequences and scores of the unpatched model with the dropped tokens
    masked."""
    model, art = full_rank(mode=mode)
    ids, mask = padded(seq=30, seed=21)
    kwargs = dict(attention_mask=mask, max_new_tokens=7, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, **GENERATION[gen])
    with patchkv.patched(model, art, [EXACT, patchkv.Evict(0.3, block=8)]):
        if cache_kind != "default":
            kwargs["cache"] = patchkv.LatentCache(model, offloading=cache_kind.endswith("offloaded"))
        torch.manual_seed(7)
        out = model.generate(ids, **kwargs)
    kwargs.pop("cache", None)
    with without(dropped(out.past_key_values)):
        torch.manual_seed(7)
        reference = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert max((a - b).nan_to_num(0, 0, 0).abs().max().item() for a, b in zip(out.scores, reference.scores)) < TOL


@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_assisted_decoding_and_crops_into_the_coded_tokens(mode):
    """Assisted and prompt-lookup decoding verify drafts and crop the cache back: the sequences of the unpatched
    model's own assisted decoding without the dropped tokens (the first forward holds the prompt and a draft, ranked
    together, so other tokens may go than under plain decoding; a block of 16 gathers no later group to rank). A crop
    past the window cuts the bitmap and the pending count with the coded tokens, and the next forward reads what the
    unpatched model reads over the tokens left, without the dropped ones."""
    model, art = full_rank(mode=mode)
    ids = calibration_ids(1, 30, seed=22)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assistant = make_model("llama", attn="eager", seed=3)  # eager: untouched by `without`, which masks sdpa
    runs = {"assisted": dict(assistant_model=assistant), "lookup": dict(prompt_lookup_num_tokens=3)}
    with patchkv.patched(model, art, [EXACT, patchkv.Evict(0.3, block=16)]):
        patched = {name: model.generate(ids, **extra, **kwargs) for name, extra in runs.items()}
        cache = patchkv.LatentCache(model)
        model(ids, cache=cache, use_cache=True)  # 25 tokens leave the window, 7 dropped
        model(ids[:, :3], cache=cache, use_cache=True)  # 3 more leave one forward later, pending
        assert all(layer.pending == 3 for layer in cache.layers)
        before = [unpack_bits(layer.tensors[KEPT], 28) for layer in cache.layers]
        cache.crop(-8)  # the window's 3 and 5 coded: the bitmap cut after 23 tokens
        for layer, bits in zip(cache.layers, before):
            assert layer.cumulative_length == 25 and layer.passed == 23 and layer.window_len == 0 and not layer.pending
            assert torch.equal(unpack_bits(layer.tensors[KEPT], 23), bits[:, :23])
            assert layer.coded_len == int(bits[:, :23].sum()) < 23
        nxt = calibration_ids(1, 2, seed=23)
        patched_logits = model(nxt, cache=cache, use_cache=True).logits
    with without(dropped(cache)):
        first = model(ids[:, :25], use_cache=True).past_key_values
        unpatched = model(nxt, past_key_values=first, use_cache=True).logits
    assert (patched_logits - unpatched).abs().max() < TOL
    for name, extra in runs.items():
        with without(dropped(patched[name].past_key_values)):
            reference = model.generate(ids, **extra, **kwargs)
        assert torch.equal(patched[name].sequences, reference.sequences)


def test_bytes_are_the_storage_and_budgets_pay_for_the_bitmap(tmp_path):
    """The cache holds the kept tokens' codes and a bitmap of ceil(passed / 8) bytes per full layer and sequence;
    a budget with `Evict` gives the codes more bits from the dropped tokens' bytes and meets its ratio with the bitmap
    counted; save/load keeps the bitmap and the cache continues as before; a bitmap that disagrees with the regions
    is refused."""
    model = make_model("llama", dtype=torch.bfloat16)
    art = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=8, progress=False).to_dtype(torch.bfloat16)
    context = 400
    plain = Budget(ratio=4, pool="head").methods(art, context)
    evicting = Budget(ratio=4, pool="head", evict=patchkv.Evict(0.3)).methods(art, context)
    assert evicting[-1] == patchkv.Evict(0.3) and evicting[1].bits > plain[1].bits
    assert parse_budget("4x+evict").evict == patchkv.Evict() and str(parse_budget("4x+evict:fraction=0.2")) == \
        "4x+evict:fraction=0.2"
    ids = calibration_ids(1, context, seed=6)
    with patchkv.patched(model, art, evicting):
        cache = model(ids, use_cache=True).cache
        passed = context - 4 - 32
        for layer in cache.layers:
            assert layer.coded_len == passed - int(0.3 * passed) and layer.tensors[KEPT].nbytes == -(-passed // 8)
        assert cache.nbytes() == sum(t.nbytes for layer in cache.layers for t in layer.tensors.values()) + context * 4
        assert cache.nbytes() / context <= sixteen_bit_bytes(art) / 4
        saved = patchkv.save_cache(cache, tmp_path / "c.safetensors")
        restored = patchkv.load_cache(model, saved.path)
        assert restored.nbytes() == cache.nbytes()
        more = calibration_ids(1, 3, seed=7)
        expected = model(more, cache=cache, use_cache=True).logits
        assert torch.equal(model(more, cache=restored, use_cache=True).logits, expected)
        with safe_open(str(saved.path), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        bitmap = tensors[f"layers.0.{KEPT}"].clone()
        bitmap[0, 0, 0] ^= 1  # one more or one fewer token held than the middle holds
        save_file({**tensors, f"layers.0.{KEPT}": bitmap}, str(tmp_path / "bad.safetensors"), metadata=meta)
        with pytest.raises(patchkv.PatchKVError, match="layer 0's bitmap"):
            patchkv.load_cache(model, tmp_path / "bad.safetensors")
    assert FORMAT in meta
    high = bits_for_ratio(art, 4, pool="head", context=context, evict=patchkv.Evict(0.3))
    assert high == evicting[1].bits


def test_bits_pack_and_append_in_order():
    bits = torch.rand(2, 37) > 0.5
    assert torch.equal(unpack_bits(_pack_bits(bits), 37), bits)
    grown = _pack_bits(bits[:, :11])
    for start, end in ((11, 12), (12, 20), (20, 37)):
        grown = _append_bits(grown, start, bits[:, start:end])
    assert torch.equal(grown, _pack_bits(bits)) and grown.shape == (2, 1, 5, 1)


def test_methods_parse_and_refuse_what_does_not_fit():
    assert parse_method("evict:fraction=0.2,scorer=key_norm,block=32") == patchkv.Evict(0.2, "key_norm", 32)
    assert patchkv.Evict().spec() == "evict" and patchkv.Evict(0.2).spec() == "evict:fraction=0.2"
    for fraction in (0, 1, True):
        with pytest.raises(ValueError, match="fraction"):
            patchkv.Evict(fraction)
    with pytest.raises(ValueError, match="scorer must be one of novelty"):
        patchkv.Evict(scorer="random")
    with pytest.raises(ValueError, match="budget '4x\\+topk'"):
        parse_budget("4x+topk")
    with pytest.raises(ValueError, match="two evict methods"):
        parse_budget("4x+evict+evict")


def test_with_near_codes_and_salient_copies_the_coded_indices_stay_the_held_tokens():
    """Evict beside `NearCodes` and a salience method: the dropped tokens are gone before either sees them, so the
    salient copies point at held coded tokens and the near region holds the newest held ones. Near codes need
    `Quantized` codes: at 8 bits a component the logits are within 0.01 of the unpatched model's without the dropped
    tokens, and ten times farther from its logits with them."""
    model, art = full_rank()
    ids, mask = padded(seq=60, seed=8)
    methods = [EXACT, patchkv.Quantized(128), patchkv.NearCodes(tokens=12), patchkv.Evict(0.3, block=8),
               patchkv.Novelty(0.25)]
    with patchkv.patched(model, art, methods):
        cache = model(ids[:, :56], attention_mask=mask[:, :56], use_cache=True).cache
        patched = model(ids[:, 56:], attention_mask=mask, cache=cache, use_cache=True).logits
        for layer in cache.layers:
            assert layer.near_len == 12 and layer.coded_len == 51 - int(0.3 * 51) + 4  # the chunk's 4 kept
            assert bool((layer.tensors["salient_index"] < layer.coded_len).all())
    with without(dropped(cache)):
        first = model(ids[:, :56], attention_mask=mask[:, :56], use_cache=True).past_key_values
        reference = model(ids[:, 56:], attention_mask=mask, past_key_values=first).logits
    first = model(ids[:, :56], attention_mask=mask[:, :56], use_cache=True).past_key_values
    unmasked = model(ids[:, 56:], attention_mask=mask, past_key_values=first).logits
    assert (patched - reference).abs().max() < 0.01 < (patched - unmasked).abs().max()
